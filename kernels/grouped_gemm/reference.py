"""Plain-XLA references the kernels are tested against."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels.grouped_gemm.groups import group_bounds


def reference_grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None, **_):
    """`lax.ragged_dot` itself (extra keyword arguments such as tiling are ignored)."""
    return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def reference_transposed_grouped_matmul(lhs, grad, group_sizes, *, preferred_element_type=None,
                                        **_):
    """[g,k,n] per-group lhs.T @ grad through a dense [g,m] row mask (O(g) work; tests only)."""
    starts, ends = group_bounds(group_sizes, lhs.shape[0])
    rows = jnp.arange(lhs.shape[0])
    mask = (rows >= starts[:, None]) & (rows < ends[:, None])
    out_dtype = preferred_element_type or jnp.promote_types(lhs.dtype, grad.dtype)
    masked = jnp.where(mask[:, :, None], lhs[None], 0).astype(lhs.dtype)
    out = jnp.einsum("gmk,mn->gkn", masked, grad, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)
