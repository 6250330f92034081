"""Flash attention kernel against the jnp reference: forward output and every gradient.

The kernel runs with interpret=None, so on CPU this is Pallas interpret mode and on a GPU
backend (JAX_PLATFORMS=cuda or rocm) the same tests exercise the real Triton kernels.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import run_fast

from kernels.flash_attention import BlockSizes, flash_attention, reference_attention


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    T: int = 40
    S: int = 40
    Hq: int = 4
    Hkv: int = 2
    D: int = 32
    causal: bool = True
    window: object = None
    segments: str | None = None  # "shared": one [B,T] array; "pair": separate q/kv ids
    sinks: bool = False
    softcap: float | None = None
    blocks: BlockSizes = BlockSizes(16, 16)


CASES = {
    "causal_gqa2_ragged": Case(),
    "full_mha_d64": Case(T=64, S=64, Hq=2, Hkv=2, D=64, causal=False,
                         blocks=BlockSizes(32, 16, block_q_dkv=16, block_k_dkv=32)),
    "causal_t_lt_s_gqa4_d80": Case(T=24, S=56, Hq=4, Hkv=1, D=80),
    "noncausal_window_int_segments_sinks": Case(T=48, S=48, causal=False, window=7,
                                                segments="shared", sinks=True),
    "window_pair_softcap_qkv_ids_gqa8": Case(T=30, S=44, Hq=8, Hkv=1, causal=False,
                                            window=(5, 3), segments="pair", softcap=3.0),
    "right_window_only_segments_d128": Case(B=2, T=33, S=33, Hq=2, Hkv=1, D=128,
                                            causal=False, window=(None, 4), segments="shared"),
    "everything_gqa4_d64": Case(B=2, T=50, S=50, Hq=8, Hkv=2, D=64, window=9,
                                segments="shared", sinks=True, softcap=5.0,
                                blocks=BlockSizes(16, 32, block_q_dq=32, block_k_dq=16)),
    "empty_rows_t_gt_s_mha": Case(T=40, S=24, Hq=2, Hkv=2, D=16),
}


def _inputs(case: Case, dtype, seed=0):
    """q, k, v, output cotangent, sinks (or None) and segment ids (or None) for a case."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = normal(case.B, case.T, case.Hq, case.D).astype(dtype)
    k = normal(case.B, case.S, case.Hkv, case.D).astype(dtype)
    v = normal(case.B, case.S, case.Hkv, case.D).astype(dtype)
    cot = normal(case.B, case.T, case.Hq, case.D).astype(dtype)
    sinks = normal(case.Hq) if case.sinks else None
    ids = None
    if case.segments == "shared":
        ids = _packed_ids(case.B, case.T, [0.3, 0.75])
    elif case.segments == "pair":
        ids = (_packed_ids(case.B, case.T, [0.5]), _packed_ids(case.B, case.S, [0.2, 0.6]))
    return q, k, v, cot, sinks, ids


def _packed_ids(B, n, cuts):
    """Sorted document ids with boundaries at the given fractions (shifted per batch row)."""
    pos = np.arange(n)[None, :] + 3 * np.arange(B)[:, None]
    return jnp.asarray(sum((pos >= int(c * n)) for c in cuts), jnp.int32)


def _forward_and_grads(fn, case: Case, q, k, v, cot, sinks, ids):
    kwargs = dict(causal=case.causal, sliding_window=case.window, logit_softcap=case.softcap,
                  segment_ids=ids)

    def run(q, k, v, sinks):
        out, vjp = jax.vjp(lambda *a: fn(*a[:3], sinks=a[3], **kwargs), q, k, v, sinks)
        return out, vjp(cot)

    return run_fast(run, q, k, v, sinks)


def _kernel(case: Case):
    """interpret=None: the Pallas interpreter here, the real Triton kernel on a GPU backend."""
    return lambda *a, **kw: flash_attention(*a, block_sizes=case.blocks, interpret=None, **kw)


SLOW_CASES = {"causal_gqa2_d64"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in names]


@pytest.mark.parametrize("name", _params(CASES))
def test_fp32_matches_reference(name):
    case = CASES[name]
    q, k, v, cot, sinks, ids = _inputs(case, jnp.float32)
    out, grads = _forward_and_grads(_kernel(case), case, q, k, v, cot, sinks, ids)
    ref_out, ref_grads = _forward_and_grads(reference_attention, case, q, k, v, cot, sinks, ids)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for label, got, want in zip(["dq", "dk", "dv", "dsinks"], grads, ref_grads):
        if want is None:
            assert got is None
            continue
        assert np.all(np.isfinite(got)), label
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=label)
    if case.causal and case.T > case.S:
        # The first T - S queries sit before every key: exact zeros, zero gradient.
        np.testing.assert_array_equal(out[:, :case.T - case.S], 0.0)
        np.testing.assert_array_equal(grads[0][:, :case.T - case.S], 0.0)


BF16_CASES = {
    "causal_gqa2_d64": Case(T=48, S=48, Hq=4, Hkv=2, D=64),
    "everything_t_lt_s": Case(T=40, S=56, Hq=4, Hkv=1, D=32, window=(20, 2), sinks=True,
                              softcap=4.0, segments="pair"),
}


@pytest.mark.parametrize("name", _params(BF16_CASES))
def test_bf16_close_to_fp32_reference(name):
    """bf16 inputs, fp32 accumulation: within 2e-2 of the scale of each fp32 result."""
    case = BF16_CASES[name]
    q, k, v, cot, sinks, ids = _inputs(case, jnp.bfloat16)
    out, grads = _forward_and_grads(_kernel(case), case, q, k, v, cot, sinks, ids)
    as32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_grads = _forward_and_grads(reference_attention, case, as32(q), as32(k), as32(v),
                                            as32(cot), sinks, ids)
    assert out.dtype == jnp.bfloat16
    for label, got, want in zip(["out", "dq", "dk", "dv", "dsinks"], (out, *grads),
                                (ref_out, *ref_grads)):
        if want is None:
            continue
        err = np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want)))
        assert err <= 2e-2 * max(1.0, float(np.max(np.abs(want)))), (label, err)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=0), "must be >= 1"),
    (dict(sliding_window=(1, -1)), ">= 0"),
    (dict(sinks=jnp.zeros(3)), "sinks shape"),
    (dict(segment_ids=jnp.zeros((1, 9), jnp.int32)), "segment ids"),
])
def test_bad_arguments_raise(kwargs, message):
    q = jnp.zeros((1, 16, 2, 16))
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q[:, :, :1], q[:, :, :1], interpret=True, **kwargs)


def test_gqa_head_ratio_must_divide():
    q = jnp.zeros((1, 16, 3, 16))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, q[:, :, :2], q[:, :, :2], interpret=True)
