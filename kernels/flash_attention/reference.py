"""Plain-jnp attention with every feature of the kernel: the truth the kernel is tested against.

It materializes the [T, S] score matrix, so it is for tests and small shapes only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
                        sinks=None, logit_softcap=None, scale=None, block_sizes=None,
                        interpret=False):
    """Attention of q [B,T,Hq,D] over k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q's dtype.

    Same signature and meaning as `flash_attention` (block_sizes and interpret are accepted
    and ignored). Scores and softmax are fp32; probabilities are cast to v's dtype before
    the value product, as the kernel does. Rows with no visible key return zeros.
    """
    del block_sizes, interpret
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    s = jnp.where(_visibility(T, S, causal, segment_ids, sliding_window), s, -jnp.inf)
    row_max = jnp.max(s, axis=-1)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, Hkv, G, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(s - row_max[..., None])
    denom = jnp.sum(e, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    p = e / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def _visibility(T, S, causal, segment_ids, sliding_window):
    """Boolean [B|1, 1, 1, T, S]: may query t (at position t + S - T) attend to key s."""
    t = jnp.arange(T)[:, None] + (S - T)
    s = jnp.arange(S)[None, :]
    mask = jnp.ones((T, S), bool)
    if causal:
        mask &= s <= t
    if isinstance(sliding_window, tuple):
        left, right = sliding_window
        if left is not None:
            mask &= s >= t - left
        if right is not None:
            mask &= s <= t + right
    elif sliding_window is not None:
        mask &= t - s < sliding_window
    mask = mask[None, None, None]
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
        mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]
    return mask
