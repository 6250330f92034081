"""Core attention: the plain-jnp reference and the dispatch to fused kernels.

`dot_product_attention` is the "xla" implementation; `attention` runs the one a
`ModelConfig.attention_impl` names ("xla", "flash": our Pallas kernel, "cudnn": cuDNN through
`jax.nn.dot_product_attention`) with the same arguments and meaning.

Legend: B batch, T query length, S key length, N query heads, K kv heads, G = N/K query heads
per kv head (query head n = k*G + g, as in Megatron and HF), H head dim (of q and k), Hv value
head dim (= H except in multi-latent attention), W the wider of H and Hv.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.ops import dropout_keep, key_words

ATTENTION_IMPLS = ("xla", "flash", "cudnn")


def attention(q, k, v, *, impl: str = "xla", causal: bool = True, segment_ids=None,
              sliding_window=None, softcap: float | None = None, scale=None,
              softmax_fp32: bool = True, dropout_rate: float = 0.0, dropout_rng=None,
              sinks=None, block_sizes=None, q_offset=None, keep=None):
    """Attention of q [B,T,N,H] over k [B,S,K,H], v [B,S,K,Hv] -> [B,T,N,Hv] by ``impl``.

    Arguments mean what they mean for `dot_product_attention`. "flash" and "cudnn" take a
    Python-number ``scale`` and ``sliding_window``, always compute scores and softmax in float32
    (``softmax_fp32`` is read only by "xla") and have no dropout; "cudnn" has no ``sinks``. They
    need Hv == H, so a narrower v (or q/k) is zero-padded and the output sliced back. "flash"
    runs the Pallas interpreter when the default backend is the CPU; ``block_sizes`` (a
    `kernels.flash_attention.BlockSizes`) tunes it. "cudnn" receives segment ids as a dense
    [B,1,T,S] mask (cuDNN's packed layout is not reachable through `jax.nn`), so it costs
    O(B*T*S) memory when sequences are packed. ``q_offset`` (decoding over a KV cache) and
    ``keep`` (a boolean [B,T,S] of keys each query may see besides the other masks: DSA's
    selection) are "xla" only.
    """
    if impl == "xla":
        return dot_product_attention(
            q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
            softcap=softcap, scale=scale, softmax_fp32=softmax_fp32,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng, sinks=sinks, q_offset=q_offset,
            keep=keep)
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
    if q_offset is not None or keep is not None:
        raise ValueError(f"attention impl {impl!r} takes no q_offset (KV-cache decoding) or "
                         "keep mask (sparse attention); use 'xla'")
    if dropout_rate > 0.0:
        raise ValueError(f"attention impl {impl!r} has no attention dropout; use 'xla'")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    H, Hv = q.shape[-1], v.shape[-1]
    if H != Hv:   # equal widths for the kernels: zero columns change neither scores nor outputs
        W = max(H, Hv)
        pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, W - x.shape[-1])])  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
        out_BTNW = attention(q, k, v, impl=impl, causal=causal, segment_ids=segment_ids,
                             sliding_window=sliding_window, softcap=softcap, scale=scale,
                             sinks=sinks, block_sizes=block_sizes)
        return out_BTNW[..., :Hv]
    if impl == "flash":
        from kernels.flash_attention import flash_attention
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                               sliding_window=sliding_window, logit_softcap=softcap, scale=scale,
                               sinks=sinks, block_sizes=block_sizes, interpret=None)
    if sinks is not None:
        raise ValueError("cuDNN attention has no attention sinks; use 'flash' or 'xla'")
    if softcap:
        raise ValueError("cuDNN attention has no logit soft-capping; use 'flash' or 'xla'")
    mask_B1TS = None
    if segment_ids is not None:
        mask_B1TS = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    if sliding_window is not None and not causal:
        raise ValueError("cuDNN attention windows are causal only; use 'flash' or 'xla'")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask_B1TS, scale=scale, is_causal=causal,
                                        local_window_size=window, implementation="cudnn")


def dot_product_attention(q, k, v, *, causal: bool = True, segment_ids=None,
                          sliding_window=None, softcap: float | None = None,
                          scale: float | None = None, softmax_fp32: bool = True,
                          dropout_rate: float = 0.0, dropout_rng=None, sinks=None,
                          q_offset=None, keep=None):
    """Grouped-query attention: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] -> [B,T,N,Hv] in q's dtype.

    causal: key s is visible to query t only if s <= t (q and k aligned at the end when T < S).
    q_offset: the key position of query 0 (default S - T, aligned at the end); may be traced,
      e.g. the fill level of a KV cache whose later keys are not written yet (causal hides them).
    segment_ids: [B,T] ints (T == S), or a pair ([B,T] of the queries, [B,S] of the keys); a
      query sees only keys of the same segment (packing; left-padded rows when decoding).
    sliding_window: W; a query sees the W most recent keys including itself (t - s < W). W may
      be a traced scalar (a per-layer window inside a scan); W >= S means no limit.
    softcap: c; scores become c * tanh(scores / c) before masking.
    scale: multiplies q.k; default 1/sqrt(H).
    softmax_fp32: scores and softmax in float32; otherwise in q's dtype.
    dropout_rate/dropout_rng: dropout on the attention probabilities.
    sinks: [N] logits, one extra softmax column per head that has no value (gpt-oss); taken
      as is (not scaled, soft-capped or masked), so they only shrink the other probabilities.
    """
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    acc = jnp.float32 if softmax_fp32 else q.dtype
    q_BTKGH = q.reshape(B, T, K, G, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k,
                              preferred_element_type=acc) * jnp.asarray(scale, acc)
    if softcap:
        scores_BKGTS = jnp.tanh(scores_BKGTS / softcap) * softcap
    mask = _mask(T, S, causal, sliding_window, segment_ids, q_offset)   # broadcasts to BKGTS
    if keep is not None:
        keep_B11TS = keep[:, None, None]
        mask = keep_B11TS if mask is None else mask & keep_B11TS
    if mask is not None:
        scores_BKGTS = jnp.where(mask, scores_BKGTS, jnp.finfo(acc).min)
    if sinks is None:
        probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v.dtype)
    else:
        sink_BKGT1 = jnp.broadcast_to(sinks.astype(acc).reshape(K, G, 1, 1),
                                      scores_BKGTS.shape[:-1] + (1,))
        probs_BKGTS = jax.nn.softmax(jnp.concatenate([scores_BKGTS, sink_BKGT1], -1),
                                     axis=-1)[..., :-1].astype(v.dtype)
    if dropout_rate > 0.0:
        keep_BKGTS = dropout_keep(key_words(dropout_rng), dropout_rate, jnp.arange(B),
                                  jnp.arange(N), jnp.arange(S - T, S), jnp.arange(S)
                                  ).reshape(B, K, G, T, S)
        probs_BKGTS = jnp.where(keep_BKGTS, probs_BKGTS / (1.0 - dropout_rate),
                                0).astype(v.dtype)
    out_BTKGHv = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v, preferred_element_type=acc)
    return out_BTKGHv.reshape(B, T, N, Hv).astype(q.dtype)


def visible(T: int, S: int, segment_ids=None, q_offset=None, sliding_window=None):
    """Boolean [B|1,T,S]: the keys each query sees causally within its segment (and its
    window of the ``sliding_window`` most recent keys)."""
    return _mask(T, S, True, sliding_window, segment_ids, q_offset)[:, 0, 0]


def _mask(T, S, causal, sliding_window, segment_ids, q_offset=None):
    """Boolean [B|1, 1, 1, T, S] visibility mask, or None when everything is visible."""
    t_T1 = jnp.arange(T)[:, None] + (S - T if q_offset is None else q_offset)   # query's key pos.
    s_1S = jnp.arange(S)[None, :]
    mask_TS = None
    if causal:
        mask_TS = s_1S <= t_T1
    if sliding_window is not None:
        window_TS = t_T1 - s_1S < sliding_window
        mask_TS = window_TS if mask_TS is None else mask_TS & window_TS
    mask = None if mask_TS is None else mask_TS[None, None, None]
    if segment_ids is not None:
        q_BT, kv_BS = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
        same_B11TS = (q_BT[:, :, None] == kv_BS[:, None, :])[:, None, None]
        mask = same_B11TS if mask is None else mask & same_B11TS
    return mask
