"""Reference dot-product attention in plain jnp; fused kernels implement the same signature.

Legend: B batch, T query length, S key length, N query heads, K kv heads, G = N/K query heads
per kv head (query head n = k*G + g, as in Megatron and HF), H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_product_attention(q, k, v, *, causal: bool = True, segment_ids=None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          scale: float | None = None, softmax_fp32: bool = True,
                          dropout_rate: float = 0.0, dropout_rng=None):
    """Grouped-query attention: q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H] in q's dtype.

    causal: key s is visible to query t only if s <= t (q and k aligned at the end when T < S).
    segment_ids: [B,T] ints (T == S); a query sees only keys of the same segment (packing).
    sliding_window: W; a query sees the W most recent keys including itself (t - s < W).
    softcap: c; scores become c * tanh(scores / c) before masking.
    scale: multiplies q.k; default 1/sqrt(H).
    softmax_fp32: scores and softmax in float32; otherwise in q's dtype.
    dropout_rate/dropout_rng: dropout on the attention probabilities.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = H ** -0.5 if scale is None else scale
    acc = jnp.float32 if softmax_fp32 else q.dtype
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=acc) * jnp.asarray(scale, acc)
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    mask = _mask(T, S, causal, sliding_window, segment_ids)
    if mask is not None:
        s = jnp.where(mask, s, jnp.finfo(acc).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=acc)
    return out.reshape(B, T, N, H).astype(q.dtype)


def _mask(T, S, causal, sliding_window, segment_ids):
    """Boolean [B|1, 1, 1, T, S] visibility mask, or None when everything is visible."""
    t = jnp.arange(T)[:, None] + (S - T)
    s = jnp.arange(S)[None, :]
    mask = None
    if causal:
        mask = s <= t
    if sliding_window is not None:
        window = t - s < sliding_window
        mask = window if mask is None else mask & window
    if mask is not None:
        mask = mask[None, None, None]
    if segment_ids is not None:
        same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    return mask
