"""Compile the kernels' Triton IR to GPU code without a GPU, for every tuning-table entry.

jax.export stops at Triton IR (XLA compiles it on the device). When the `triton` package is
importable, this goes on: it captures the IR Pallas emits for the cuda and rocm lowerings and
compiles it with Triton for sm_90 (cubin) and gfx942 (hsaco), then checks that shared memory
fits and that registers do not spill, with every masking feature on (the worst case for
register pressure). Skipped without triton, which is not a project dependency.
"""
import importlib.util

import jax
import jax.numpy as jnp
import pytest

from kernels.flash_attention import flash_attention, tuned_block_sizes
from tests.kernels.kernel_helpers import TARGETS, spilled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def _triton_modules(vendor, head_dim, dtype):
    """Generic-form Triton IR of the fwd, dq and dk/dv kernels, as lowered for vendor."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(print_generic_op_form=True))
        return result

    blocks = tuned_block_sizes(head_dim, dtype, vendor=vendor)

    def loss(q, k, v, ids, sinks):
        out = flash_attention(q, k, v, segment_ids=ids, sinks=sinks, sliding_window=(300, 10),
                              logit_softcap=30.0, block_sizes=blocks, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((2, 1000, 8, head_dim), dtype),
            *[jax.ShapeDtypeStruct((2, 1000, 2, head_dim), dtype)] * 2,
            jax.ShapeDtypeStruct((2, 1000), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.float32))
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(jax.grad(loss, (0, 1, 2, 4))).trace(*args).lower(lowering_platforms=(vendor,))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    launches = [(blocks.num_warps, blocks.num_stages)] + [
        (blocks.num_warps_bwd, blocks.num_stages_bwd)] * 2
    return list(zip(["fwd", "dq", "dkv"], modules, launches))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("vendor", list(TARGETS))
def test_tuned_kernels_compile_without_spills(vendor, head_dim, dtype, tmp_path):
    import triton
    from triton.backends.compiler import GPUTarget

    target, max_shared = TARGETS[vendor]
    for name, module, (num_warps, num_stages) in _triton_modules(vendor, head_dim, dtype):
        path = tmp_path / f"{name}.ttir"
        path.write_text(module)
        kernel = triton.compile(str(path), target=GPUTarget(*target),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        assert kernel.metadata.shared <= max_shared, (name, kernel.metadata.shared)
        assert not spilled(vendor, kernel, tmp_path), name
