"""The grouped GEMM kernels lower through Pallas' Triton path for NVIDIA and AMD.

jax.export lowers for a platform without its device: each pallas_call becomes Triton IR
here (power-of-two loads, <= 3-D grid and the other Triton lowering rules are enforced)
embedded in an XLA Triton custom call. PTX / HSACO compilation happens in XLA on the GPU;
test_grouped_gemm_triton_compile.py covers it when the triton package is installed.
"""
import jax
import jax.numpy as jnp
import pytest

from kernels.grouped_gemm import grouped_matmul, transposed_grouped_matmul, tuned_tiling

TRITON_CALL = "__gpu$xla.gpu.triton"
LAUNCH = "num_stages = {} : i32, num_warps = {} : i32"


def _export(fn, platform, *args):
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return jax.export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_exports_forward_and_gradient_kernels(platform, dtype):
    tiling = tuned_tiling(dtype, vendor=platform)
    gmm = lambda a, b, s: grouped_matmul(a, b, s, tiling=tiling, interpret=False)
    loss = lambda a, b, s: jnp.sum(gmm(a, b, s).astype(jnp.float32) ** 2)
    # m, k, n deliberately not multiples of any tile.
    args = (jax.ShapeDtypeStruct((300, 200), dtype), jax.ShapeDtypeStruct((8, 200, 136), dtype),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    forward = _export(gmm, platform, *args)
    both = _export(jax.value_and_grad(loss, (0, 1)), platform, *args)
    assert forward.count(TRITON_CALL) == 1 and 'name = "grouped_gemm_gmm"' in forward
    assert both.count(TRITON_CALL) == 3
    for kernel in ("gmm", "gmm_rhs_t", "tgmm"):
        assert f'name = "grouped_gemm_{kernel}"' in both
    assert LAUNCH.format(tiling.num_stages, tiling.num_warps) in forward
    assert LAUNCH.format(*reversed(tiling.launch(tgmm=True))) in both


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_exports_transposed_form_with_gradients(platform):
    tiling = tuned_tiling(jnp.bfloat16, vendor=platform)
    tgmm = lambda a, b, s: transposed_grouped_matmul(a, b, s, tiling=tiling, interpret=False)
    loss = lambda a, b, s: jnp.sum(tgmm(a, b, s).astype(jnp.float32))
    args = (jax.ShapeDtypeStruct((300, 72), jnp.bfloat16),
            jax.ShapeDtypeStruct((300, 40), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
    both = _export(jax.value_and_grad(loss, (0, 1)), platform, *args)
    assert both.count(TRITON_CALL) == 3  # tgmm forward, two gmm for its gradients
