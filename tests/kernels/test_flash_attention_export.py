"""The kernels lower through Pallas' Triton path for NVIDIA and AMD, forward and backward.

jax.export lowers for a platform without its device: every pallas_call is turned into
Triton IR here (power-of-two shapes, <= 3-D grid and the other Triton lowering rules are
enforced) and embedded as an XLA Triton custom call. Compiling that IR to PTX / HSACO
happens in XLA on the GPU, so these tests cannot see register or shared-memory limits.
"""
import jax
import jax.numpy as jnp
import pytest

from kernels.flash_attention import flash_attention, tuned_block_sizes

TRITON_CALL = "__gpu$xla.gpu.triton"

CONFIGS = {
    "gqa4_d80_window_sinks_segments_bf16": dict(
        dtype=jnp.bfloat16, T=200, S=200, Hq=8, Hkv=2, D=80,
        kwargs=dict(sliding_window=64, segments=True, sinks=True)),
    "pair_window_softcap_t_lt_s_fp32": dict(
        dtype=jnp.float32, T=96, S=160, Hq=4, Hkv=4, D=64,
        kwargs=dict(causal=False, sliding_window=(32, 8), logit_softcap=30.0)),
}


def _export(platform, config):
    B, T, S, Hq, Hkv, D = 2, config["T"], config["S"], config["Hq"], config["Hkv"], config["D"]
    dtype, kwargs = config["dtype"], dict(config["kwargs"])
    use_segments, use_sinks = kwargs.pop("segments", False), kwargs.pop("sinks", False)
    blocks = tuned_block_sizes(D, dtype, vendor=platform)

    def attend(q, k, v, ids, sinks):
        return flash_attention(q, k, v, segment_ids=ids if use_segments else None,
                               sinks=sinks if use_sinks else None, block_sizes=blocks,
                               interpret=False, **kwargs)

    def grads(q, k, v, ids, sinks):
        loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32) ** 2)
        return jax.grad(loss, (0, 1, 2, 4))(q, k, v, ids, sinks)

    args = (jax.ShapeDtypeStruct((B, T, Hq, D), dtype), jax.ShapeDtypeStruct((B, S, Hkv, D), dtype),
            jax.ShapeDtypeStruct((B, S, Hkv, D), dtype), jax.ShapeDtypeStruct((B, T), jnp.int32),
            jax.ShapeDtypeStruct((Hq,), jnp.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    export = lambda f: jax.export.export(jax.jit(f), platforms=[platform],
                                         disabled_checks=checks)(*args).mlir_module()
    return export(attend), export(grads), blocks


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_exports_triton_kernels(platform, name):
    forward, backward, blocks = _export(platform, CONFIGS[name])
    assert forward.count(TRITON_CALL) == 1
    assert backward.count(TRITON_CALL) == 3  # forward, dq, dk/dv
    for kernel in ("fwd", "dq", "dkv"):
        assert f'name = "flash_attention_{kernel}"' in backward
    launch = 'num_stages = {} : i32, num_warps = {} : i32'
    assert launch.format(blocks.num_stages, blocks.num_warps) in forward
    assert launch.format(blocks.num_stages_bwd, blocks.num_warps_bwd) in backward
