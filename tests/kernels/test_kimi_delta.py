"""Kimi Delta Attention's rule (a decay per key channel) in kernels/gated_delta: the chunked
form against the token-by-token recurrence (forward and backward, fp32 tight, bf16 loose),
chunks that do and do not divide the length and span the inner blocks, packed segments, decays
strong enough that any positive exponent would overflow, and the recurrence against
transformers' own (Kimi Linear)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gated_delta import reference
from tests.kernels.test_gated_delta import SEGMENTS, _rel

chunked = jax.jit(reference.chunked_gated_delta_rule, static_argnames=("chunk_size",))
recurrent = jax.jit(reference.recurrent_gated_delta_rule)

B, T, H, DK, DV = 2, 23, 3, 8, 6


def _inputs(seed=0, strength=0.5, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, T, H, DK)) for _ in range(2))
    v = rng.normal(size=(B, T, H, DV))
    g = -np.abs(rng.normal(size=(B, T, H, DK))) * strength   # one log decay per key channel
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v, g, beta))


@pytest.mark.parametrize("chunk, segments", [(5, True), (16, False), (32, True),
                                             pytest.param(64, True, marks=pytest.mark.slow)])
def test_chunked_equals_recurrent(chunk, segments):
    """Chunks of 32 and 64 span several 16-token blocks of the within-chunk scores."""
    args = _inputs()
    seg = SEGMENTS if segments else None
    o_ref, s_ref = recurrent(*args, segment_ids=seg)
    o, s = chunked(*args, segment_ids=seg, chunk_size=chunk)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


def test_strong_decays_stay_finite():
    """Log decays of ~-40 per token: a chunk of 32 spans ~-1300, beyond float32's exponent
    range; every exponent formed is <= 0, so the chunked form still equals the recurrence."""
    args = _inputs(1, strength=40.0)
    o_ref, _ = recurrent(*args, segment_ids=SEGMENTS)
    o, _ = chunked(*args, segment_ids=SEGMENTS, chunk_size=32)
    assert bool(jnp.isfinite(o).all()) and _rel(o, o_ref) < 1e-5


def test_gradients_match_the_recurrence():
    args = _inputs(3)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, H, DV)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] * w)

    ref = jax.grad(loss(lambda *a: recurrent(*a, segment_ids=SEGMENTS)), argnums=range(5))(*args)
    got = jax.grad(loss(lambda *a: chunked(*a, segment_ids=SEGMENTS, chunk_size=16)),
                   argnums=range(5))(*args)
    for g_ref, g in zip(ref, got):
        assert g.shape == g_ref.shape and _rel(g, g_ref) < 1e-5


def test_per_channel_decay_differs_from_per_head():
    """The same decay on every channel is the per-head rule; channel decays are another."""
    q, k, v, g, beta = _inputs(5)
    head = g[..., 0]
    o_head, _ = chunked(q, k, v, head, beta, chunk_size=8)
    o_same, _ = chunked(q, k, v, jnp.broadcast_to(head[..., None], g.shape), beta, chunk_size=8)
    o_chan, _ = chunked(q, k, v, g, beta, chunk_size=8)
    assert _rel(o_same, o_head) < 1e-5 and _rel(o_chan, o_head) > 1e-2


@pytest.mark.slow
def test_bf16_inputs_stay_close():
    args32 = _inputs(6)
    o_ref, _ = recurrent(*args32)
    o, _ = chunked(*(a.astype(jnp.bfloat16) for a in args32), chunk_size=16)
    assert o.dtype == jnp.bfloat16 and _rel(o, o_ref) < 3e-2


def test_recurrence_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta = _inputs(7)
    o, s = recurrent(q, k, v, g, beta)
    o_t, s_t = hf.recurrent_kimi_delta_attention(
        *(torch.tensor(np.asarray(a)) for a in (q, k, v, g, beta)), initial_state=None,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _rel(o, o_t.numpy()) < 1e-5 and _rel(s, s_t.numpy()) < 1e-5
