"""flash_attention_lse: the kernel's output and natural log-sum-exp against the XLA block
attention of context parallelism (jaxtrain.parallel.context.block_attention), forward and
backward with both outputs used, causal and not, with segments (rows that see no key) and
soft-capping (fp32, Pallas interpret mode here, the Triton kernel on a GPU backend)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.parallel.context import block_attention
from kernels.flash_attention import BlockSizes, flash_attention_lse

B, T, S, N, K, H = 2, 32, 32, 4, 2, 16


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)).astype(np.float32))
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)).astype(np.float32)) for _ in range(2))
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), 1))
    k_seg = jnp.asarray(np.sort(rng.integers(1, 4, size=(B, S)), 1))   # segment 0: no keys
    return q, k, v, q_seg, k_seg


@pytest.mark.parametrize("causal, segments, softcap", [
    (True, False, None), (False, False, None), (True, True, None), (False, True, 5.0)])
@pytest.mark.slow
def test_out_and_lse_and_their_gradients_match_the_xla_block(causal, segments, softcap):
    q, k, v, q_seg, k_seg = _inputs()
    w_out = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, N, H)).astype(np.float32))
    w_lse = jnp.asarray(np.random.default_rng(2).normal(size=(B, N, T)).astype(np.float32))
    seg = (q_seg, k_seg) if segments else None
    pos_q = jnp.broadcast_to(jnp.arange(T) + S - T, (B, T))
    pos_k = jnp.broadcast_to(jnp.arange(S), (B, S))

    def kernel(q, k, v):
        return flash_attention_lse(q, k, v, causal=causal, segment_ids=seg, logit_softcap=softcap,
                                   block_sizes=BlockSizes(16, 16), interpret=None)

    def xla(q, k, v):
        return block_attention(q, k, v, pos_q, pos_k, q_seg if segments else None,
                               k_seg if segments else None, causal=causal, softcap=softcap)

    def seen(lse):   # [B,T,N,1]: rows that see a key (the others merge away by their lse)
        return (lse > -1e29).transpose(0, 2, 1)[..., None]

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return (jnp.sum(jnp.where(seen(lse), out, 0.0) * w_out)
                    + jnp.sum(jnp.where(lse > -1e29, lse, 0.0) * w_lse))
        return f

    got, want = kernel(q, k, v), xla(q, k, v)
    np.testing.assert_allclose(np.asarray(jnp.where(seen(got[1]), got[0], 0.0)),
                               np.asarray(jnp.where(seen(want[1]), want[0], 0.0)),
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)
    if segments:
        assert bool(jnp.any(got[1] <= -1e29))   # some rows see nothing: out 0
        assert float(jnp.max(jnp.abs(jnp.where(seen(got[1]), 0.0, got[0])))) == 0.0
    g_got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    g_want = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
