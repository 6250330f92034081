"""Compile the grouped GEMM kernels' Triton IR to GPU code without a GPU, per table entry.

jax.export stops at Triton IR (XLA compiles it on the device). When the `triton` package is
importable, this captures the IR Pallas emits for the cuda and rocm lowerings of the
forward and both gradient kernels, compiles it with Triton for sm_90 (cubin) and gfx942
(hsaco), and checks that shared memory fits and that registers do not spill. Skipped
without triton, which is not a project dependency.
"""
import importlib.util

import jax
import jax.numpy as jnp
import pytest

from kernels.grouped_gemm import grouped_matmul, tuned_tiling
from tests.kernels.kernel_helpers import TARGETS, spilled

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def _triton_modules(vendor, dtype):
    """{kernel name: generic-form Triton IR} of gmm, gmm_rhs_t and tgmm lowered for vendor."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = {}
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        ir = result.module.operation.get_asm(print_generic_op_form=True)
        modules[jaxpr.debug_info.func_name] = ir
        return result

    tiling = tuned_tiling(dtype, vendor=vendor)

    def loss(lhs, rhs, group_sizes):
        out = grouped_matmul(lhs, rhs, group_sizes, tiling=tiling, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    # k and n are not multiples of the tiles, so every load and store is masked.
    args = (jax.ShapeDtypeStruct((1000, 1000), dtype), jax.ShapeDtypeStruct((8, 1000, 700), dtype),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=(vendor,))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return modules, tiling


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("vendor", list(TARGETS))
def test_tuned_kernels_compile_without_spills(vendor, dtype, tmp_path):
    import triton
    from triton.backends.compiler import GPUTarget

    target, max_shared = TARGETS[vendor]
    modules, tiling = _triton_modules(vendor, dtype)
    assert set(modules) == {"grouped_gemm_gmm", "grouped_gemm_gmm_rhs_t", "grouped_gemm_tgmm"}
    for name, module in modules.items():
        num_warps, num_stages = tiling.launch(tgmm=name.endswith("tgmm"))
        path = tmp_path / f"{name}.ttir"
        path.write_text(module)
        kernel = triton.compile(str(path), target=GPUTarget(*target),
                                options={"num_warps": num_warps, "num_stages": num_stages})
        assert kernel.metadata.shared <= max_shared, (name, kernel.metadata.shared)
        assert not spilled(vendor, kernel, tmp_path), name
