"""Public entry point: argument checks, static config, and the custom VJP tying the kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.flash_attention.backward import backward
from kernels.flash_attention.common import LOG2E, Static
from kernels.flash_attention.forward import forward
from kernels.flash_attention.masking import make_band
from kernels.flash_attention.tuning import BlockSizes, tuned_block_sizes


def flash_attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
                    sinks=None, logit_softcap=None, scale=None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = False):
    """Fused attention of q [B,T,Hq,D] over k/v [B,S,Hkv,D] -> [B,T,Hq,D] in q's dtype.

    Query head n reads kv head n // (Hq // Hkv). With T < S queries are aligned at the end
    (query t sits at position t + S - T).
    causal: a query sees keys at or before its position.
    segment_ids: [B,T] ints when T == S, or (q_ids [B,T], kv_ids [B,S]); only equal ids
      attend to each other.
    sliding_window: int W: keys at most W - 1 before the query's position (with causal, the
      W most recent keys including its own; without, later keys stay visible, as in
      jaxtrain.models.attention); or (left, right): how many keys before / after the
      position are visible (None: no limit on that side).
    sinks: [Hq] learned logits, one extra softmax column per head with no value (taken as
      is: not scaled, not soft-capped); gradients flow to them.
    logit_softcap: c (a Python number); scaled scores s become c * tanh(s / c) before masking.
    scale: multiplies q.k (a Python number); default 1/sqrt(D).
    block_sizes: tiles and Triton launch parameters (default: `tuned_block_sizes`).
    interpret: run the Pallas interpreter (CPU); None means "when the default backend is cpu".
    Softmax and accumulation are fp32. Rows that see no key return zeros (sinks or not), with
    finite gradients.
    """
    cfg, q_ids, kv_ids = _static(q, k, v, causal, segment_ids, sliding_window, sinks,
                                 logit_softcap, scale, block_sizes, interpret)
    return _attention(cfg, q, k, v, q_ids, kv_ids, sinks)


def flash_attention_lse(q, k, v, *, causal=True, segment_ids=None, logit_softcap=None,
                        scale=None, block_sizes: BlockSizes | None = None,
                        interpret: bool | None = False):
    """(out [B,T,Hq,D] in q's dtype, lse [B,Hq,T] float32): :func:`flash_attention` (no window,
    no sinks) and the natural log-sum-exp of each row's scores, for merging blocks attended
    separately (context parallelism). A row that sees no key has out 0 and lse -1e30, which
    merges away. Both outputs are differentiable: the lse's cotangent g enters the backward
    as delta − g (d lse / d score = p)."""
    cfg, q_ids, kv_ids = _static(q, k, v, causal, segment_ids, None, None, logit_softcap,
                                 scale, block_sizes, interpret)
    return _attention_lse(cfg, q, k, v, q_ids, kv_ids)


def _static(q, k, v, causal, segment_ids, sliding_window, sinks, logit_softcap, scale,
            block_sizes, interpret):
    """The argument checks and the kernels' static config: (cfg, q_ids, kv_ids)."""
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, Hkv, D] for q {q.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    S, Hkv = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks shape {sinks.shape}, want ({Hq},)")
    q_ids, kv_ids = _segments(segment_ids, B, T, S)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    blocks = block_sizes or tuned_block_sizes(D, q.dtype)
    cfg = Static(
        band=make_band(causal, sliding_window, T, S),
        scale=float(D ** -0.5 if scale is None else scale),
        softcap=None if logit_softcap is None else float(logit_softcap),
        q_len=T, kv_len=S, head_dim=D, blocks=blocks.fit(T, S), interpret=bool(interpret))
    return cfg, q_ids, kv_ids


def _segments(segment_ids, B, T, S):
    """(q_ids [B,T], kv_ids [B,S]) as int32, or (None, None)."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_ids, kv_ids = segment_ids
    elif T != S:
        raise ValueError(f"one segment_ids array needs T == S (got {T}, {S}); pass a pair")
    else:
        q_ids = kv_ids = segment_ids
    if q_ids.shape != (B, T) or kv_ids.shape != (B, S):
        raise ValueError(f"segment ids {q_ids.shape}, {kv_ids.shape}; want {(B, T)}, {(B, S)}")
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_vjp(cfg, q, k, v, q_ids, kv_ids, sinks):
    return forward(cfg, q, k, v, q_ids, kv_ids, sinks)[0]


def _attention_fwd(cfg, q, k, v, q_ids, kv_ids, sinks):
    out, lse = forward(cfg, q, k, v, q_ids, kv_ids, sinks)
    return out, (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _attention_bwd(cfg, residuals, d_out):
    q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
    dq, dk, dv, dsinks = backward(cfg, q, k, v, q_ids, kv_ids, sinks, out, lse, d_out)
    return dq, dk, dv, None, None, dsinks


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)
_attention = jax.jit(_attention_vjp, static_argnums=0)

_NO_KEYS = -1e30   # the natural lse of a row that sees no key (the kernel writes +inf)


def _natural_lse(lse2):
    return jnp.where(jnp.isinf(lse2), _NO_KEYS, lse2 / LOG2E)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lse_vjp(cfg, q, k, v, q_ids, kv_ids):
    out, lse2 = forward(cfg, q, k, v, q_ids, kv_ids, None)
    return out, _natural_lse(lse2)


def _lse_fwd(cfg, q, k, v, q_ids, kv_ids):
    out, lse2 = forward(cfg, q, k, v, q_ids, kv_ids, None)
    return (out, _natural_lse(lse2)), (q, k, v, q_ids, kv_ids, out, lse2)


def _lse_bwd(cfg, residuals, cotangents):
    q, k, v, q_ids, kv_ids, out, lse2 = residuals
    d_out, d_lse = cotangents
    dq, dk, dv, _ = backward(cfg, q, k, v, q_ids, kv_ids, None, out, lse2, d_out,
                             d_lse=jnp.where(jnp.isinf(lse2), 0.0, d_lse))
    return dq, dk, dv, None, None


_lse_vjp.defvjp(_lse_fwd, _lse_bwd)
_attention_lse = jax.jit(_lse_vjp, static_argnums=0)
