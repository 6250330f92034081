"""Attention residuals (Kimi K3; Primus's ``attn_res_block_size`` N): the residual stream
replaced by learned softmax mixes over summaries kept every N layers.

The state entering layer i is the running sum ``ps`` of the sublayer outputs since the last
summary and the summaries C so far. Layers 0, N, 2N, ... first turn ``ps`` into a summary (C
gains it; the first is the embedding) and start a new sum. Every sublayer reads a mix of the
candidates C and ps (the first layer of a block: C alone, its sum being empty) instead of the
stream, and adds its output to ps:

    mix(v_1..v_n) = sum_j softmax_j(rmsnorm(v_j) . (w_norm * w_proj)) v_j        (float32)

After the last layer the head's mix of C and ps goes to the final norm. The scores read the
normed candidates, the mix the raw ones. A layer holds two mixers, ``attn_res`` and
``mlp_res`` ({norm [D], proj [D]}); the model one more, ``attn_res_head``. (Primus builds no
pre-attention mixer on layer 0, whose mix is of the embedding alone; there it is a
parameter that nothing reads.)

C grows at block boundaries only, so the layer loops run block by block (:func:`blocks`) with
C a constant of each block's scan and only ps carried from layer to layer.

Between pipeline stages the state travels as one tensor [B,T,1+n_max,D] (:func:`fold`): ps
first, then the summaries, zero-padded to the most there can be (as Primus folds it). How many
are live on entry to a layer is a function of its index (:func:`count_before`), so no count
travels with it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.spec import ParamSpec, _ones


def mixer_specs(cfg) -> dict:
    """One mixer: the RMS norm's weight (ones) and the scoring projection (N(0, std))."""
    D, dt = cfg.hidden_size, cfg.param_dtype
    return {"norm": ParamSpec((D,), dt, ("norm",), _ones),
            "proj": ParamSpec((D,), dt, ("norm",),
                              jax.nn.initializers.normal(cfg.init_method_std))}


def layer_specs(cfg) -> dict:
    """A layer's two mixers (none without attention residuals)."""
    if not cfg.attn_res_block_size:
        return {}
    return {"attn_res": mixer_specs(cfg), "mlp_res": mixer_specs(cfg)}


def mix(p: dict, summaries, current, cfg, use_current=True):
    """The mix of the summaries [B,T,n,D] and ``current`` [B,T,D] (left out where
    ``use_current`` is False; may be traced), in current's dtype."""
    v = jnp.concatenate([summaries, current[:, :, None]], 2).astype(jnp.float32)
    k = v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + cfg.norm_epsilon)
    w = p["norm"].astype(jnp.float32) * p["proj"].astype(jnp.float32)
    scores = jnp.einsum("btnd,d->btn", k, w)
    n = v.shape[2]
    live = jnp.where(jnp.arange(n) < n - 1, True, jnp.asarray(use_current))
    scores = jnp.where(live, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, -1)
    return jnp.einsum("btn,btnd->btd", probs, v).astype(current.dtype)


def starts_block(i, cfg):
    """Whether layer i (may be traced) opens a block: its running sum becomes a summary."""
    return i % cfg.attn_res_block_size == 0


def blocks(cfg, lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at the block boundaries (one piece without attention residuals)."""
    N = cfg.attn_res_block_size
    if not N:
        return [(lo, hi)]
    cuts = sorted({lo, hi, *range((lo // N + 1) * N, hi, N)})
    return list(zip(cuts[:-1], cuts[1:]))


def keep(summaries, x, start: int, cfg):
    """The summaries entering layer ``start``: x [B,T,D] added when the layer opens a block
    (``summaries`` None: none yet)."""
    if not cfg.attn_res_block_size or start % cfg.attn_res_block_size:
        return summaries
    new = x[:, :, None]
    return new if summaries is None else jnp.concatenate([summaries, new], 2)


def mixing_flops(cfg) -> float:
    """Forward FLOPs per token of every mix (7 D per candidate: its norm, score and share of
    the weighted sum); 0 without attention residuals."""
    N, L = cfg.attn_res_block_size, cfg.num_layers
    if not N:
        return 0.0
    candidates = -(-L // N) + 1   # the head's
    for i in range(L):
        kept = i // N + 1
        candidates += kept + (i % N != 0) + kept + 1
    return 7.0 * cfg.hidden_size * candidates


def count_before(i: int, cfg) -> int:
    """How many summaries exist on entry to layer i (before it adds its own): the layers
    0, N, 2N, ... below i."""
    return -(-i // cfg.attn_res_block_size)


def width(cfg) -> int:
    """Slots of the folded state: the running sum and every summary the model keeps."""
    return 1 + count_before(cfg.num_layers, cfg)


def fold(x, summaries, cfg):
    """The running sum x [B,T,D] and the summaries [B,T,n,D] (or None) as one
    [B,T,:func:`width`,D] tensor, the unused slots zero."""
    parts = [x[:, :, None]] + ([] if summaries is None else [summaries.astype(x.dtype)])
    n = 1 + (0 if summaries is None else summaries.shape[2])
    pad = jnp.zeros((*x.shape[:2], width(cfg) - n, x.shape[-1]), x.dtype)
    return jnp.concatenate([*parts, pad], 2)


def unfold(state, i: int, cfg):
    """(running sum [B,T,D], summaries [B,T,n,D] or None) of a :func:`fold`-ed state entering
    layer i."""
    n = count_before(i, cfg)
    return state[:, :, 0], (state[:, :, 1:1 + n] if n else None)
