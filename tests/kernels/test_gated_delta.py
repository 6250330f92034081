"""The gated delta rule: the chunked form against the token-by-token recurrence (forward and
backward, fp32 tight, bf16 loose), chunk lengths that do and do not divide the length, packed
segments against each sequence run alone, and the recurrence against transformers' own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gated_delta import reference

# jitted: eagerly, every small op of the scans dispatches on its own
chunked_gated_delta_rule = jax.jit(reference.chunked_gated_delta_rule,
                                   static_argnames=("chunk_size", "l2_qk"))
recurrent_gated_delta_rule = jax.jit(reference.recurrent_gated_delta_rule,
                                     static_argnames=("l2_qk",))

B, T, HK, HV, DK, DV = 2, 23, 2, 4, 8, 6


def _inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, HK, DK))
    k = rng.normal(size=(B, T, HK, DK))
    v = rng.normal(size=(B, T, HV, DV))
    g = -np.abs(rng.normal(size=(B, T, HV))) * 0.5
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, HV))))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v, g, beta))


SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] * 7, [4] * 2 + [5] * 21])


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


@pytest.mark.parametrize("chunk, segments", [
    pytest.param(1, True, marks=pytest.mark.slow), pytest.param(4, False, marks=pytest.mark.slow),
    (5, True), (64, True)])
def test_chunked_equals_recurrent(chunk, segments):
    args = _inputs()
    seg = SEGMENTS if segments else None
    o_ref, s_ref = recurrent_gated_delta_rule(*args, segment_ids=seg)
    o, s = chunked_gated_delta_rule(*args, segment_ids=seg, chunk_size=chunk)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


@pytest.mark.slow
def test_segments_restart_the_state():
    """Each packed sequence's outputs equal the recurrence over that sequence alone."""
    args = _inputs(1)
    o, _ = chunked_gated_delta_rule(*args, segment_ids=SEGMENTS, chunk_size=4)
    for b in range(B):
        for s in np.unique(SEGMENTS[b]):
            m = SEGMENTS[b] == s
            alone, _ = recurrent_gated_delta_rule(*(a[b:b + 1, m] for a in args))
            assert _rel(o[b:b + 1, m], alone) < 1e-5
    whole, _ = chunked_gated_delta_rule(*args, chunk_size=4)
    assert _rel(o, whole) > 1e-2   # without segments the sequences mix


@pytest.mark.slow
def test_initial_state_continues_a_sequence():
    """Running the first 10 tokens, then the rest from the returned state, equals one run."""
    args = _inputs(2)
    full, s_full = chunked_gated_delta_rule(*args, chunk_size=4)
    a, s = chunked_gated_delta_rule(*(x[:, :10] for x in args), chunk_size=4)
    b, s2 = chunked_gated_delta_rule(*(x[:, 10:] for x in args), chunk_size=4,
                                     initial_state=s)
    assert _rel(jnp.concatenate([a, b], 1), full) < 1e-5 and _rel(s2, s_full) < 1e-5


@pytest.mark.parametrize("chunk", [5])
def test_gradients_match_the_recurrence(chunk):
    args = _inputs(3)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, HV, DV)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] * w)

    ref = jax.grad(loss(lambda *a: recurrent_gated_delta_rule(*a, segment_ids=SEGMENTS)),
                   argnums=range(5))(*args)
    got = jax.grad(loss(lambda *a: chunked_gated_delta_rule(
        *a, segment_ids=SEGMENTS, chunk_size=chunk)), argnums=range(5))(*args)
    for g_ref, g in zip(ref, got):
        assert _rel(g, g_ref) < 1e-5


@pytest.mark.slow
def test_bf16_inputs_stay_close():
    args32 = _inputs(5)
    o_ref, _ = recurrent_gated_delta_rule(*args32)
    o, _ = chunked_gated_delta_rule(*(a.astype(jnp.bfloat16) for a in args32), chunk_size=8)
    assert o.dtype == jnp.bfloat16 and _rel(o, o_ref) < 3e-2


@pytest.mark.slow
def test_recurrence_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    args = _inputs(6)
    o, s = recurrent_gated_delta_rule(*args)
    o_t, s_t = hf.torch_recurrent_gated_delta_rule(
        *(torch.tensor(np.asarray(a)) for a in args), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    assert _rel(o, o_t.numpy()) < 1e-5 and _rel(s, s_t.numpy()) < 1e-5
