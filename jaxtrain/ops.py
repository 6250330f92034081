"""Array operations below both the models and the quantized matmuls.

:func:`grouped_matmul` is the MoE experts' grouped GEMM: the experts call it directly, and
``jaxtrain.quant`` calls it for the layers that stay unquantized and inside the quantized
grouped GEMM's backward pass. Neither package imports the other for it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs, rhs, group_sizes, *, kernel: bool = False):
    """``lax.ragged_dot`` semantics: rows of lhs [M, K] in consecutive groups of
    ``group_sizes`` [G] times rhs [G, K, N]; rows past the groups give zeros. ``kernel`` takes
    the Pallas grouped GEMM (``kernels.grouped_gemm``, Megatron's moe_grouped_gemm)."""
    if kernel:
        # Pallas and its Triton lowering load only when the kernel is selected
        from kernels.grouped_gemm import grouped_matmul as pallas_grouped_matmul
        return pallas_grouped_matmul(lhs, rhs, group_sizes)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
