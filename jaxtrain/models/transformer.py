"""The decoder stack: ``forward(params, tokens, cfg) -> logits``.

Layers run under ``jax.lax.scan`` over the stacked parameters when ``cfg.scan_layers``, else in
a Python loop; remat wraps a layer (or a group of layers, Megatron 'uniform') in
``jax.checkpoint`` with the policy of ``cfg.remat_policy`` (see ``remat.py``). Dense and MoE
layers live in two stacks (params.py); where they alternate, one scan step runs a repeating
block of both kinds (`_layer_blocks`), so a periodic pattern is still one scan.

Legend: B batch, T length, D hidden, V vocab, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import attn_res, compressed, dsa, hyper
from jaxtrain.models import layers as L
from jaxtrain.models import per_layer
from jaxtrain.models.attention import attention
from jaxtrain.models.attention import visible as attention_visible
from jaxtrain.models.linear_attention import linear_attention_block
from jaxtrain.models.mamba import mamba_block
from jaxtrain.models.short_conv import short_conv_block
from jaxtrain.models.mla import mla_qkv
from jaxtrain.models.moe import moe_block, moe_layer_ids
from jaxtrain.models.params import STACKS, layer_axes, layer_kinds
from jaxtrain.models.spec import (GLOBAL_SHARED_STACK, GLOBAL_STACKS, KV_SHARED_STACKS,
                                  mtp_layer_count)
from jaxtrain.models.quant_state import attach as attach_quant_state
from jaxtrain.models.remat import NO_REMAT, layer_plan
from jaxtrain.parallel import context as cp
from jaxtrain.parallel.sharding import active_layout, constrain, gather_weights

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


def _maybe_remat(fn, on: bool):
    """Megatron selective recompute of one module: ``fn`` (arrays only) under jax.checkpoint."""
    return jax.checkpoint(fn) if on else fn


def _need(rng, what):
    if rng is None:
        raise ValueError(f"{what} is on (deterministic=False, rate > 0) but no rng was given")
    return rng


def attention_block(p: dict, x, ctx: dict, layer_number, rng, cfg, cache=None):
    """Self-attention over x [B,T,D] -> (out [B,T,D] before the residual add, cache, extras).

    Decoding (decode.py) passes this layer's KV ``cache``: ``ctx['kv_cache'](cache, k, v)``
    stores the step's keys and values and returns (keys, values to attend over, new cache);
    otherwise the cache comes back None.

    KV sharing (Gemma 4 small): a layer whose ``ctx['shared_kv']`` holds (keys, values)
    attends over them instead of its own; with ``ctx['kv_role'] == 'store'`` the layer's
    cache (``{}`` in training) comes back with ``shared_kv``: the keys and values it attended
    over, for the sharing layers after it.

    DeepSeek sparse attention (``p`` has ``indexer``): each query attends to the keys the
    indexer selects (models/dsa.py); the extras hold the indexer's KL (``dsa``, training with
    ``dsa_loss_coeff``) and, with index sharing, the selection (``dsa_keep``) that the layers
    without an indexer after it attend with (their ``ctx['dsa_keep']``).
    """
    shared = ctx.get("shared_kv")
    lctx = _layer_rope(ctx, layer_number, cfg)
    q, k, v, scale, q_latent = project_qkv(p, x, lctx, cfg, shared)
    index_k = None   # decoding a DSA layer: the indexer's cached keys
    if shared is None and "kv_cache" in ctx:
        if cache and "index_k" in cache:
            cache = dict(cache)
            index_k = cache.pop("index_k")
        k, v, cache = ctx["kv_cache"](cache, k, v)
    gate = (L.dense(x, p["wg"], None, "btd,dnh->btnh", "query_gate_proj", cfg)
            if "wg" in p else None)
    keep, extras = ctx.get("dsa_keep"), {}
    if "indexer" in p:
        keep, kl, index_k = _sparse_selection(p["indexer"], x, q_latent, q, k, lctx,
                                              layer_number, cfg, scale, index_k)
        extras = {"dsa": kl, "dsa_keep": keep if cfg.dsa_shared_layers else None}
    out = attend_and_project(p, q, k, v, ctx, layer_number, rng, cfg, scale, gate, keep)
    if index_k is not None:
        cache = {**cache, "index_k": index_k}
    if ctx.get("kv_role") == "store":
        cache = {**cache, "shared_kv": (k, v)}
    return out, cache, {n: e for n, e in extras.items() if e is not None}


def _sparse_selection(p: dict, x, q_latent, q, k, ctx: dict, layer_number, cfg, scale,
                      index_k=None):
    """(keys kept [B,T,S] or None when every visible key is, the indexer's KL or None, the
    updated indexer key cache or None) of a DSA layer. The indexer reads detached inputs; its
    KL is computed in training only. Decoding passes the layer's cached indexer keys
    ``index_k`` [B,S,Di]; this step's are written at ``ctx['cache_start']``."""
    T, S = q.shape[1], k.shape[1]
    train = dsa.trains_indexer(cfg) and not ctx["deterministic"]
    if S <= cfg.dsa_index_topk and not train and index_k is None:
        return None, None, None
    iq, ik, w = dsa.index_qkw(p, jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent),
                              ctx.get("rope"), cfg)
    if index_k is not None:
        index_k = jax.lax.dynamic_update_slice_in_dim(index_k, ik.astype(index_k.dtype),
                                                      ctx["cache_start"], axis=1)
        if S == index_k.shape[1]:   # attending over the cache (else: only this step's keys)
            ik = index_k
    if S <= cfg.dsa_index_topk and not train:
        return None, None, index_k
    visible = jnp.broadcast_to(attention_visible(T, S, _layer_segments(ctx, layer_number, cfg),
                                                 ctx.get("q_offset")), (q.shape[0], T, S))
    scores = dsa.index_scores(iq, ik, w, cfg)
    keep = dsa.select(jax.lax.stop_gradient(scores), visible, cfg)
    kl = (dsa.indexer_kl(scores, q, k, visible, keep, scale, cfg.dsa_sparse_loss,
                         cfg.dsa_head_chunk) if train else None)
    return (None if S <= cfg.dsa_index_topk else keep), kl, index_k


def project_qkv(p: dict, x, ctx: dict, cfg, shared=None):
    """(q [B,T,N,H], k [B,T,K,H], v [B,T,K,Hv], softmax scale, MLA's query latent or None)
    from x [B,T,D]: the projections, q/k norms and RoPE (MLA: `mla_qkv`, K = N). ``shared``
    (k, v): an earlier layer's keys and values, already normed and rotated (KV sharing); only
    q is projected."""
    if cfg.multi_latent_attention:
        q, k, v, q_latent = mla_qkv(p, x, ctx, cfg)
        return q, k, v, cfg.mla_softmax_scale, q_latent
    q = L.dense(x, p["wq"], p.get("bq"), "btd,dnh->btnh", "query_proj", cfg)
    q = constrain(q, "act_batch", "act_seq", "act_heads", "act_kv")
    rope = cfg.position_embedding_type == "rope"
    if shared is not None:
        k, v = shared
        if cfg.qk_layernorm:
            q = L.norm(p["q_norm"], q, cfg)
    else:
        k = L.dense(x, p["wk"], p.get("bk"), "btd,dkh->btkh", "key_proj", cfg)
        v = (L.dense(x, p["wv"], p.get("bv"), "btd,dkh->btkh", "value_proj", cfg) if "wv" in p
             else k)   # attention_k_eq_v (Gemma 4's global layers): the key projection serves
        k = constrain(k, "act_batch", "act_seq", "act_kv_heads", "act_kv")
        v = constrain(v, "act_batch", "act_seq", "act_kv_heads", "act_kv")
        if cfg.v_norm is not None:
            v = L.norm(p["v_norm"], v, cfg) if cfg.v_norm == "scaled" else L.l2_norm(
                v, cfg.norm_epsilon)
        q, k = _qk_norm(p, q, k, ctx, cfg)
        if rope:
            k = L.apply_rope(k, *ctx["rope"], cfg)
    if rope:
        q = L.apply_rope(q, *ctx["rope"], cfg)
    if cfg.attn_temperature_tuning and cfg.no_rope_layers is not None:
        q = _temperature(q, ctx, cfg)
    return q, k, v, (cfg.query_pre_attn_scalar or q.shape[-1]) ** -0.5, None


def _qk_norm(p: dict, q, k, ctx: dict, cfg):
    """The q/k norms (per head, or across heads as OLMo 2/3); with
    ``qk_norm_rope_layers_only`` the NoPE layers keep q and k as they are (Llama 4)."""
    if cfg.qk_layernorm and cfg.qk_norm_across_heads:   # OLMo 2/3: one norm over all heads
        nq = L.norm(p["q_norm"], q.reshape(*q.shape[:2], -1), cfg).reshape(q.shape)
        nk = L.norm(p["k_norm"], k.reshape(*k.shape[:2], -1), cfg).reshape(k.shape)
    elif cfg.qk_layernorm:
        nq, nk = L.norm(p["q_norm"], q, cfg), L.norm(p["k_norm"], k, cfg)
    elif cfg.qk_l2_norm:
        nq, nk = L.l2_norm(q, cfg.norm_epsilon), L.l2_norm(k, cfg.norm_epsilon)
    else:
        return q, k
    if cfg.qk_norm_rope_layers_only and "nope" in ctx:
        return jnp.where(ctx["nope"], q, nq), jnp.where(ctx["nope"], k, nk)
    return nq, nk


def _temperature(q, ctx: dict, cfg):
    """Llama 4's attention temperature on NoPE layers: q [B,T,N,H] times
    1 + scale * log(1 + floor((position + 1) / floor_scale)) of each token's position."""
    pos_BT = ctx["positions"].astype(jnp.float32)
    t_BT = 1.0 + cfg.attn_temperature_scale * jnp.log1p(
        jnp.floor((pos_BT + 1.0) / cfg.attn_temperature_floor_scale))
    scaled = (q.astype(jnp.float32) * t_BT[:, :, None, None]).astype(q.dtype)
    return jnp.where(ctx["nope"], scaled, q)


def _layer_rope(ctx: dict, layer_number, cfg) -> dict:
    """``ctx`` with the RoPE tables of this layer: with ``local_rotary_base`` the tables are
    (cos, sin, local cos, local sin) and the sliding-window layers take the local pair (with
    Gemma 4's global layers, ``ctx['stack']``: the global stacks take the first pair). A NoPE
    layer (``no_rope_layers``) takes the identity rotation (cos 1, sin 0) and ``ctx['nope']``
    says which it is (layer_number may be traced)."""
    rope = ctx.get("rope")
    if rope is None:
        return ctx
    if cfg.has_global_shape:   # Gemma 4: the stack says which pair (their widths differ)
        return {**ctx, "rope": rope[:2] if ctx.get("stack") in GLOBAL_STACKS else rope[2:]}
    if len(rope) == 4:
        local = jnp.asarray(cfg.sliding_window_layers or (True,) * cfg.num_layers)[
            layer_number - 1]
        rope = tuple(jnp.where(local, b, a) for a, b in zip(rope[:2], rope[2:]))
    if cfg.no_rope_layers is None:
        return {**ctx, "rope": rope}
    nope = jnp.asarray(cfg.no_rope_layers)[layer_number - 1]
    cos, sin = rope
    return {**ctx, "nope": nope, "rope": (jnp.where(nope, 1.0, cos), jnp.where(nope, 0.0, sin))}


def attend_and_project(p: dict, q, k, v, ctx: dict, layer_number, rng, cfg, scale, gate=None,
                       keep=None):
    """Core attention (this layer's window, the sinks in ``p``) and the output projection.
    ``ctx['q_offset']`` (decoding: the cache position of q's first token) selects the xla
    attention with that offset. ``gate`` [B,T,N,H] (attention_output_gate): the attention
    output is multiplied by its sigmoid before the projection. ``keep`` [B,T,S]: the keys each
    query may see (DSA's selection; the xla attention)."""
    q_offset = ctx.get("q_offset")
    impl = cfg.attention_impl if q_offset is None and keep is None else "xla"
    # Query-key layer scaling guards fp16 scores from overflow; the fused kernels accumulate
    # q.k in fp32 with a static scale, so only the xla path needs it (same math either way).
    if cfg.apply_query_key_layer_scaling and impl == "xla":
        q = q / layer_number.astype(q.dtype)
        scale = scale * layer_number.astype(jnp.float32)
    drop = not ctx["deterministic"] and cfg.attention_dropout > 0
    drop_rng = _need(rng, "attention dropout") if drop else None

    layout = active_layout()
    ring = q_offset is None and cp.model_layout(cfg) is not None

    segments = _layer_segments(ctx, layer_number, cfg)

    def attend(q, k, v, sinks):
        def run(window):
            if ring:   # context parallelism: the sequence split over the mesh's context axis
                return _context_parallel(layout, q, k, v, ctx, segments, layer_number, sinks,
                                         window, cfg, scale, drop_rng)
            return attention(
                q, k, v, impl=impl, causal=True, segment_ids=segments,
                sliding_window=window, softcap=cfg.attn_logit_softcapping, scale=scale,
                softmax_fp32=cfg.attention_softmax_in_fp32,
                dropout_rate=cfg.attention_dropout if drop else 0.0,
                dropout_rng=drop_rng,
                sinks=sinks, block_sizes=cfg.flash_block_sizes, q_offset=q_offset, keep=keep)

        return _with_layer_window(run, layer_number - 1, k.shape[1], cfg, impl)

    attend = _maybe_remat(attend, "core_attn" in cfg.recompute_modules)
    out = checkpoint_name(attend(q, k, v, p.get("sinks")), "context")
    out = constrain(out, "act_batch", "act_seq", "act_heads", "act_kv")
    if gate is not None:
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
               ).astype(out.dtype)
    return L.dense(out, p["wo"], p.get("bo"), "btnh,nhd->btd", "out_proj", cfg)


def _layer_segments(ctx: dict, layer_number, cfg):
    """The segment ids this layer's attention masks with: the packing's, refined on chunked
    layers (``attention_chunk_size``: every RoPE layer) so that a query sees only the keys of
    its own chunk of positions: id = segment * chunks + position // chunk, where chunks bounds
    the chunks of a sequence (the kernels and context parallelism take segment ids as they
    are). Decoding passes (query, key) ids and ``ctx['kv_positions']``."""
    segments = ctx["segment_ids"]
    C = cfg.attention_chunk_size
    if C is None:
        return segments
    span = cfg.max_position_embeddings // C + 2

    def refine(seg, pos):
        seg = jnp.zeros(pos.shape, jnp.int32) if seg is None else seg.astype(jnp.int32)
        return seg * span + jnp.minimum(pos // C, span - 1).astype(jnp.int32)

    if "kv_positions" in ctx:
        q_seg, kv_seg = segments if isinstance(segments, tuple) else (segments, segments)
        chunked = (refine(q_seg, ctx["positions"]), refine(kv_seg, ctx["kv_positions"]))
        plain = tuple(jnp.zeros(c.shape, jnp.int32) if s is None else s
                      for s, c in zip((q_seg, kv_seg), chunked))
    else:
        chunked = refine(segments, ctx["positions"])
        plain = jnp.zeros_like(chunked) if segments is None else segments
    if cfg.no_rope_layers is None:
        return chunked
    nope = jnp.asarray(cfg.no_rope_layers)[layer_number - 1]
    return jax.tree.map(lambda c, p: jnp.where(nope, p, c), chunked, plain)


def _context_parallel(layout, q, k, v, ctx: dict, segments, layer_number, sinks, window, cfg,
                      scale, dropout_rng=None):
    """Context-parallel attention (jaxtrain.parallel.context) with this layer's exchange: one
    ``cp_comm_type`` for every layer, or a ``lax.switch`` on the layer over a per-layer list.
    ``ctx['token_index']``: the tokens' indices in the sequence (the reordered layout's). With
    ``attention_impl: flash`` the ring attends its blocks with the flash kernel.
    ``dropout_rng``: the layer's key when attention dropout runs (the unsplit mask)."""
    index = ctx.get("token_index")
    if index is None:
        index = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
    kinds = cfg.cp_comm_type if isinstance(cfg.cp_comm_type, tuple) else (cfg.cp_comm_type,)
    names = sorted(set(kinds))
    balanced = ctx.get("token_layout") == "dual_chunk_swap"
    kernel = (dict(block_sizes=cfg.flash_block_sizes, interpret=None)
              if cfg.attention_impl == "flash" else None)

    def one(kind):
        return lambda: cp.sharded_attention(
            layout, kind, q, k, v, index, segments, sinks, window,
            softcap=cfg.attn_logit_softcapping, scale=scale, balanced=balanced,
            inner=cfg.cp_a2a_size if kind == "a2a+p2p" else None, kernel=kernel,
            dropout_rate=cfg.attention_dropout if dropout_rng is not None else 0.0,
            dropout_rng=dropout_rng)

    if len(names) == 1:
        return one(names[0])()
    which = jnp.asarray([names.index(kd) for kd in kinds])[layer_number - 1]
    return jax.lax.switch(which, [one(kd) for kd in names])


def _with_layer_window(run, i, kv_len: int, cfg, impl: str):
    """``run(window)`` with 0-based layer i's sliding window; i may be traced (scanned layers).

    With per-layer windows (``sliding_window_layers``) the xla path masks with a traced window
    (a window of kv_len hides nothing); the kernels take static windows, so they branch between
    the windowed and the full variant with ``lax.cond`` (one runs per layer).
    """
    if cfg.sliding_window_layers is None:
        return run(cfg.sliding_window)
    on = jnp.asarray(cfg.sliding_window_layers)[i]
    if impl == "xla":
        return run(jnp.where(on, cfg.sliding_window, kv_len))
    return jax.lax.cond(on, lambda: run(cfg.sliding_window), lambda: run(None))


def decoder_layer(p: dict, x, i, ctx: dict, cfg, cache=None):
    """One pre-norm layer on the residual stream x [B,T,D] (with hyper-connections the streams
    [B,T,n,D], models/hyper.py); i is the 0-based layer index.
    An MoE layer (``p`` has ``moe`` for ``mlp``) returns (x, router statistics); a DSA layer
    adds `attention_block`'s extras to them (its KL under ``dsa``, its selection under
    ``dsa_keep``). With a KV ``cache`` (decoding; see
    `attention_block`) it returns (x, statistics or None, new cache)."""
    if cfg.attn_res_block_size:
        return _attn_res_layer(p, x, i, ctx, cfg, cache)
    streams = cfg.hc_streams > 1
    layer_input = ("act_batch", "act_layer_seq", "act_embed")   # what full recompute saves
    if streams:
        layer_input = (*layer_input[:2], None, layer_input[2])
    x = checkpoint_name(constrain(x, *layer_input), "decoder_layer_input")
    x_in = x   # what a parallel-residual MLP reads (GPT-NeoX)
    rng = jax.random.fold_in(ctx["rng"], i) if ctx["rng"] is not None else None
    sub = (lambda n: jax.random.fold_in(rng, n)) if rng is not None else (lambda n: None)
    det = ctx["deterministic"]
    norm = _maybe_remat(lambda q, y: L.norm(q, y, cfg), "layernorm" in cfg.recompute_modules)
    mlp = _maybe_remat(lambda q, y: L.mlp(q, y, cfg), "mlp" in cfg.recompute_modules)
    collapse = _maybe_remat(lambda q, y: hyper.collapse(q, y, cfg), "mhc" in cfg.recompute_modules)

    def add(x, half, branch, resid):
        """The residual add of a half: onto ``resid``, or into the streams x by its mHC."""
        if streams:
            return hyper.merge(half, x, branch).astype(cfg.residual_dtype)
        return (resid + branch).astype(cfg.residual_dtype)

    extras, stats = {}, None
    serial = bool(cfg.attention_output_dim)
    if serial:   # MaxText's qwen3_custom_moe: attention into the MoE layer, one residual add
        a, _, cache, extras = _mixer_half(p, x, i, ctx, cfg, cache, norm, sub, det)
        with jax.named_scope("mlp"):
            m, stats = _moe(p["moe"], norm(p["mlp_norm"], a), a, i, ctx, sub(4), cfg)
            if "up_proj" in p:
                m = L.dense(m, p["up_proj"]["w"], None, "bta,ad->btd", "mlp_up", cfg)
        x = (x + L.dropout(constrain(m, *RESIDUAL), cfg.hidden_dropout, sub(3), det)
             ).astype(cfg.residual_dtype)
    elif "attn" in p or any(key in p for _, key, _ in RECURRENT):
        u, half = collapse(p["attn_hc"], x) if streams else (x, None)
        a, resid, cache, extras = _mixer_half(p, u, i, ctx, cfg, cache, norm, sub, det)
        x = add(x, half, a, resid)
    if not serial and ("mlp" in p or "moe" in p):
        u, half = collapse(p["mlp_hc"], x) if streams else (x_in if cfg.parallel_residual
                                                              else x, None)
        if cfg.parallel_shared_norm:   # the attention's normed input (GPT-J, PaLM)
            h = norm(p["attn_norm"], u)
        else:
            h = norm(p["mlp_norm"], u) if cfg.pre_norm else u
        with jax.named_scope("mlp"):
            if "moe" in p:
                m, stats = _moe(p["moe"], h, u if streams else x, i, ctx, sub(4), cfg)
            else:
                m = mlp(p["mlp"], h)
        if cfg.post_mlp_norm:
            m = norm(p["post_mlp_norm"], m)
        if cfg.residual_multiplier != 1.0:
            m = m * jnp.asarray(cfg.residual_multiplier, m.dtype)
        resid = h if cfg.apply_residual_connection_post_layernorm else x
        m = L.dropout(constrain(m, *RESIDUAL), cfg.hidden_dropout, sub(3), det)
        x = add(x, half, m, resid)
    if "ple_gate" in p:   # Gemma 4 small: this layer's per-layer input
        x = per_layer.block(p, x, ctx["per_layer_input"], cfg)
    out = x
    if "layer_scalar" in p:   # Gemma 4: a checkpoint constant, so no gradient reaches it
        out = out * jax.lax.stop_gradient(p["layer_scalar"]).astype(out.dtype)
    out = constrain(out, *(hyper.STREAMS if streams else RESIDUAL))
    if extras:
        stats = {**(stats or {}), **extras}
    if cache is not None:
        return out, stats, cache
    return out if stats is None else (out, stats)


def _attn_res_layer(p: dict, x, i, ctx: dict, cfg, cache=None):
    """`decoder_layer` with attention residuals (models/attn_res.py): x [B,T,D] is the running
    sum, ``ctx['attn_res']`` [B,T,n,D] the summaries so far (x among them when layer i opens a
    block, whose sum then restarts); each half reads its mix and adds to the sum."""
    x = checkpoint_name(constrain(x, "act_batch", "act_layer_seq", "act_embed"),
                        "decoder_layer_input")
    rng = jax.random.fold_in(ctx["rng"], i) if ctx["rng"] is not None else None
    sub = (lambda n: jax.random.fold_in(rng, n)) if rng is not None else (lambda n: None)
    det = ctx["deterministic"]
    norm = _maybe_remat(lambda q, y: L.norm(q, y, cfg), "layernorm" in cfg.recompute_modules)
    summaries, opens = ctx["attn_res"], attn_res.starts_block(i, cfg)
    u = attn_res.mix(p["attn_res"], summaries, x, cfg, use_current=~opens)
    ps = jnp.where(opens, jnp.zeros((), x.dtype), x)
    a, _, cache, extras = _mixer_half(p, u, i, ctx, cfg, cache, norm, sub, det)
    ps = (ps + a).astype(cfg.residual_dtype)
    u = attn_res.mix(p["mlp_res"], summaries, ps, cfg)
    h = norm(p["mlp_norm"], u)
    stats = None
    with jax.named_scope("mlp"):
        if "moe" in p:
            m, stats = _moe(p["moe"], h, u, i, ctx, sub(4), cfg)
        else:
            m = _maybe_remat(lambda q, y: L.mlp(q, y, cfg), "mlp" in cfg.recompute_modules)(
                p["mlp"], h)
    m = L.dropout(constrain(m, *RESIDUAL), cfg.hidden_dropout, sub(3), det)
    out = constrain((ps + m).astype(cfg.residual_dtype), *RESIDUAL)
    if extras:
        stats = {**(stats or {}), **extras}
    if cache is not None:
        return out, stats, cache
    return out if stats is None else (out, stats)


# Token mixers that carry a state instead of keys and values: (cache group, parameter key,
# block), the cache group being their entry in a decoding cache (decode.py)
RECURRENT = (("linear", "linear_attn", linear_attention_block), ("mamba", "mamba", mamba_block),
             ("conv", "short_conv", short_conv_block))


def _mixer_half(p: dict, x, i, ctx: dict, cfg, cache, norm, sub, det):
    """The token-mixing half of layer i (softmax attention, Gated DeltaNet, Mamba or a short
    convolution) on its input x [B,T,D], with its norms: (its output after dropout, what that
    is added to, cache, `attention_block`'s extras)."""
    h = norm(p["attn_norm"], x) if cfg.pre_norm else x
    extras = {}
    recurrent = [(n, key, block) for n, key, block in RECURRENT if key in p]
    if recurrent:
        (name, key, block), = recurrent
        with jax.named_scope(key):
            a = _in_natural_order(block, p[key], h, ctx, cfg,
                                  None if cache is None else cache[name])
        if cache is not None:
            a, state = a
            cache = {**cache, name: state}
    elif cfg.compress_ratios is not None:   # DeepSeek-V4 (compressed.py)
        with jax.named_scope("attention"):
            a, extras, cache = _in_natural_order(compressed.attention_block, p["attn"], h, ctx,
                                                 cfg, cache)
    else:
        with jax.named_scope("attention"):
            kv = (None if cache is None else
                  {n: c for n, c in cache.items() if n not in [r[0] for r in RECURRENT]})
            a, kv, extras = attention_block(p["attn"], h, ctx, i + 1, sub(1), cfg, kv)
        if cache is not None:
            cache = {**cache, **kv}
    if cfg.post_attention_norm:
        a = norm(p["post_attn_norm"], a)
    if cfg.residual_multiplier != 1.0:   # Granite
        a = a * jnp.asarray(cfg.residual_multiplier, a.dtype)
    resid = h if cfg.apply_residual_connection_post_layernorm else x
    return (L.dropout(constrain(a, *RESIDUAL), cfg.hidden_dropout, sub(2), det), resid, cache,
            extras)


def _in_natural_order(block, p: dict, h, ctx: dict, cfg, cache):
    """A mixer that runs along the sequence in its natural order (Gated DeltaNet, Mamba, short
    convolutions; DeepSeek-V4's compressed attention, whose windows are token ranges): under
    context parallelism's token reordering its input, segments, positions and RoPE tables are
    put back in order around it (XLA moves the tokens between the context shards; the mixer
    sees the whole sequence)."""
    lay = ctx.get("reordered")
    if lay is None or cache is not None:
        return block(p, h, ctx, cfg, cache)
    natural = dict(ctx)
    for key in ("segment_ids", "positions", "rope"):
        if ctx.get(key) is not None:
            natural[key] = jax.tree.map(lay.undo, ctx[key])
    out = block(p, lay.undo(h), natural, cfg, None)
    if isinstance(out, tuple):   # (output, extras): the extras are per layer, not per token
        return (lay.apply(out[0]), *out[1:])
    return lay.apply(out)


def _moe(p: dict, h, x, i, ctx: dict, rng, cfg):
    """Layer i's MoE block on h, the normed residual stream x (recomputed whole with recompute
    module 'moe'): (output, stats). ``ctx['moe_state']`` carries global_aux_loss's counts from
    earlier microbatches. With ``moe.branch_norms`` (Gemma 4) the shared expert takes h and the
    routed experts their own norm of x; each branch's output is normed before the sum."""
    state = ctx.get("moe_state")
    prev = steps = None
    if state is not None:   # the row of layer i (an MTP layer's after the decoder's)
        rows = dict(map(reversed, enumerate(moe_layer_ids(cfg))))
        row = jnp.asarray([rows.get(j, 0) for j in range(cfg.num_layers + mtp_layer_count(cfg))])
        prev, steps = state["aux_counts"][row[i]], state["steps"]
    train = not ctx["deterministic"]
    fixed = on = None
    if cfg.moe.hash_layers:   # DeepSeek-V4: the first layers' experts by token id
        first = cfg.moe.hash_layers
        table = ctx["hash_routes"][jnp.minimum(i, first - 1)]
        experts = jnp.take(jax.lax.stop_gradient(table), ctx["tokens"], axis=0)
        on = jnp.asarray(i < first)
        fixed = jnp.where(on, experts.astype(jnp.int32), -1)

    def block(p, h, x, rng, prev, steps, fixed, on):
        if not cfg.moe.branch_norms:
            return moe_block(p, h, cfg, train=train, rng=rng, prev_aux_counts=prev,
                             prev_steps=steps, hash_experts=fixed, hashed=on)
        routed = {"router": p["router"], "experts": p["experts"]}
        xr = None
        if cfg.moe.router_input_norm:   # Gemma 4: unscaled RMS norm, learned scale, D^-0.5
            xr = (L.l2_norm(x, cfg.norm_epsilon).astype(jnp.float32)
                  * p["router"]["scale"].astype(jnp.float32) * cfg.hidden_size ** -0.5
                  ).astype(cfg.compute_dtype)
        y, stats = moe_block(routed, L.norm(p["experts_norm"], x, cfg), cfg, train=train,
                             rng=rng, prev_aux_counts=prev, prev_steps=steps, router_input=xr)
        shared = L.norm(p["shared_post_norm"], L.mlp(p["shared"], h, cfg), cfg)
        return L.norm(p["experts_post_norm"], y, cfg) + shared, stats

    return _maybe_remat(block, "moe" in cfg.recompute_modules)(p, h, x, rng, prev, steps,
                                                               fixed, on)


class _Block(NamedTuple):
    """Layers [start, start + reps*units*group) scanned ``reps`` times; each scan step runs
    ``units`` remat units of ``group`` layers (one jax.checkpoint each, under ``policy``)."""

    start: int
    reps: int
    units: int
    group: int
    policy: object


def _periodic_runs(sigs: list) -> list[tuple[int, int, int]]:
    """(offset, period, repeats) pieces covering ``sigs`` with the fewest pieces: runs of equal
    signatures, or one periodic stretch (e.g. dense/MoE alternating) followed by runs."""
    def runs(lo):
        out = []
        for j in range(lo, len(sigs)):
            if out and sigs[out[-1][0]] == sigs[j]:
                out[-1] = (out[-1][0], 1, out[-1][2] + 1)
            else:
                out.append((j, 1, 1))
        return out

    best = runs(0)
    n = len(sigs)
    for q in range(2, n // 2 + 1):
        r = n // q
        if all(sigs[j] == sigs[j % q] for j in range(r * q)):
            plan = [(0, q, r)] + runs(r * q)
            if len(plan) < len(best):
                best = plan
    return best


def _layer_blocks(cfg, lo: int = 0, hi: int | None = None) -> list[_Block]:
    """The remat plan (`layer_plan`) of layers [lo, hi) cut into scannable blocks: within a
    block every scan step sees the same sequence of layer kinds (dense or MoE), so one traced
    body serves it. A layer whose keys and values later layers share (KV sharing's 'store')
    is a signature of its own, so its block runs once (``reps`` 1) and hands them on."""
    sigs = tuple(zip(layer_kinds(cfg), store_kinds(cfg)))
    blocks = []
    for seg in _res_cut(layer_plan(cfg, lo, hi), cfg):
        g = seg.group
        units = [sigs[a:a + g] for a in range(seg.start, seg.stop, g)]
        for off, q, r in _periodic_runs(units):
            blocks.append(_Block(seg.start + off * g, r, q, g, seg.policy))
    return blocks


def _res_cut(segments, cfg):
    """The remat segments cut at attention residuals' block boundaries (attn_res.blocks), a
    group of rematerialised layers then the largest that divides its piece."""
    out = []
    for seg in segments:
        for a, b in attn_res.blocks(cfg, seg.start, seg.stop):
            out.append(seg._replace(start=a, stop=b, group=math.gcd(seg.group, b - a)))
    return out


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees) if trees else None


def shared_kv(shared: dict, kind: str, i, cfg):
    """The (keys, values) KV-sharing layer i of stack ``kind`` attends over, from ``shared``
    ({'sliding' / 'global': (k, v)} of the storing layers); i may be traced."""
    if kind == GLOBAL_SHARED_STACK:
        return shared["global"]
    if cfg.has_global_shape or len(shared) == 1:
        return shared["sliding" if cfg.has_global_shape else next(iter(shared))]
    on = jnp.asarray([cfg.kv_kind(j) == "global" for j in range(cfg.num_layers)])[i]
    return jax.tree.map(lambda g, w: jnp.where(on, g, w), shared["global"], shared["sliding"])


def store_kinds(cfg) -> tuple[str | None, ...]:
    """Per layer: the kind ('sliding' / 'global') of the keys and values it stores for KV
    sharing, or None."""
    return tuple(cfg.kv_kind(i) if r == "store" else None for i, r in enumerate(cfg.kv_roles))


def layer_context(ctx: dict, kind: str, i, store, per_layer_input, shared: dict, cfg) -> dict:
    """``ctx`` for layer i of stack ``kind``: its stack, its per-layer input (Gemma 4 small)
    and its part in KV sharing (``store``: it stores its keys and values; a sharing stack:
    the shared keys and values it reads)."""
    out = {**ctx, "stack": kind}
    if per_layer_input is not None:
        out["per_layer_input"] = per_layer_input
    if store:
        out["kv_role"] = "store"
    if kind in KV_SHARED_STACKS:
        out["shared_kv"] = shared_kv(shared, kind, i, cfg)
    return out


def per_layer_slices(ctx: dict, start, count: int, reps: int):
    """The per-layer inputs of layers start..start+reps*count-1 as [reps, count, B,T,P]
    (None without them); start may be traced."""
    u = ctx.get("per_layer_inputs")
    if u is None:
        return None
    u = jnp.moveaxis(jax.lax.dynamic_slice_in_dim(u, start, reps * count, axis=2), 2, 0)
    return u.reshape(reps, count, *u.shape[1:])


def _run_layers(stacks: dict, x, ctx: dict, cfg, layers: tuple[int, int] | None = None,
                shift=0):
    """The layers over x, block by block of `_layer_blocks`; ``stacks`` maps each stack
    ('layers', 'moe_layers') to its parameters with the layer axis first. Returns (x, stats):
    the MoE layers' statistics stacked in MoE-layer order (None without MoE layers).

    ``layers`` (lo, hi): only those layers (a pipeline stage; ``stacks`` then hold just
    theirs, in order); ``shift`` (may be traced) is added to every layer index, so stages of the
    same shape share one traced body. The keys and values of KV sharing's storing layers
    (their blocks run once) reach the sharing layers after them as arguments of their blocks.
    In training with DSA indexer loss the stats carry ``dsa``: the indexers' KL summed over
    the layers (models/dsa.py)."""
    kinds = layer_kinds(cfg)
    stores = store_kinds(cfg)
    axes = {k: layer_axes(cfg, k) for k in stacks}
    used = dict.fromkeys(stacks, 0)
    collected = []
    shared = {}
    kl_total = jnp.float32(0.0)   # the DSA indexers' KL summed over the layers
    lo_layer = (layers or (0, None))[0]
    summaries = None   # attention residuals' (attn_res.py)
    if layers is not None and cfg.attn_res_block_size:   # a pipeline stage: the folded state
        x, summaries = attn_res.unfold(x, lo_layer, cfg)
    sel = _shared_selection(x, cfg, lo_layer)   # DSA index sharing: the last selection

    def layer(kind, p, h, i, store, u, kv, sel, res):
        with jax.named_scope("decoder_layer"):
            lctx = layer_context(ctx, kind, i, store, u, kv, cfg)
            if sel is not None:
                lctx = {**lctx, "dsa_keep": sel}
            if res is not None:
                lctx = {**lctx, "attn_res": res}
            out = decoder_layer(gather_weights(p, axes[kind]), h, i, lctx, cfg,
                                cache={} if store else None)
        if store:
            h, s, cache = out
            return h, s, {store: cache["shared_kv"]}
        return (*out, {}) if isinstance(out, tuple) else (out, None, {})

    def unit(unit_kinds, unit_stores, ps, h, ids, us, kv, sel, res):
        stats, stored, kl = [], {}, jnp.float32(0.0)
        for j, (kind, p) in enumerate(zip(unit_kinds, ps)):
            h, s, new = layer(kind, p, h, ids[j], unit_stores[j], None if us is None else us[j],
                              kv, sel, res)
            s, layer_kl = dsa.pop(s)
            s, keep = dsa.pop(s, "dsa_keep")
            kl = kl if layer_kl is None else kl + layer_kl
            sel = sel if keep is None else keep
            stats += [] if s is None else [s]
            stored.update(new)
        return h, stats, kl, stored, sel

    for blk in _layer_blocks(cfg, *(layers or (0, None))):
        size = blk.units * blk.group
        sig = kinds[blk.start:blk.start + size]
        sig_stores = tuple(stores[blk.start:blk.start + size] if blk.reps == 1
                           else (None,) * size)
        params = {}
        for k in stacks:
            c = sig.count(k)
            if c:
                lo, used[k] = used[k], used[k] + blk.reps * c
                params[k] = jax.tree.map(
                    lambda a: a[lo:lo + blk.reps * c].reshape(blk.reps, c, *a.shape[1:]),
                    stacks[k])
        idx = jnp.arange(blk.start, blk.start + blk.reps * size).reshape(blk.reps, size) + shift
        us = per_layer_slices(ctx, blk.start + shift, size, blk.reps)
        summaries = attn_res.keep(summaries, x, blk.start, cfg)

        def step(carry, xs, sig=sig, sig_stores=sig_stores, blk=blk, kv=dict(shared),
                 res=summaries):
            h, sel = carry
            pb, ib, ub = xs
            cursor = dict.fromkeys(pb, 0)
            stats, stored, kl = [], {}, jnp.float32(0.0)
            for u in range(blk.units):
                part = slice(u * blk.group, (u + 1) * blk.group)
                ps = []
                for kind in sig[part]:
                    ps.append(jax.tree.map(lambda a, c=cursor[kind]: a[c], pb[kind]))
                    cursor[kind] += 1
                fn = functools.partial(unit, sig[part], sig_stores[part])
                if blk.policy is not NO_REMAT:
                    fn = jax.checkpoint(fn, policy=blk.policy, prevent_cse=not cfg.scan_layers)
                h, s, unit_kl, new, sel = fn(ps, h, ib[part], None if ub is None else ub[part],
                                             kv, sel, res)
                stats += s
                kl = kl + unit_kl
                stored.update(new)
            return (h, sel), (_stack(stats), kl, stored)

        if cfg.scan_layers:
            (x, sel), (ys, kls, stored) = jax.lax.scan(step, (x, sel), (params, idx, us))
        else:
            outs, kls, stored = [], [], {}
            for r in range(blk.reps):
                (x, sel), (y, kl, new) = step((x, sel),
                                              jax.tree.map(lambda a: a[r], (params, idx, us)))
                outs.append(y)
                kls.append(kl)
                stored = jax.tree.map(lambda a: a[None], new)
            ys = _stack(outs) if outs[0] is not None else None
        shared.update(jax.tree.map(lambda a: a[0], stored))   # storing blocks run once
        kl_total = kl_total + jnp.sum(jnp.asarray(kls))
        if ys is not None:
            collected.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys))
    stats = jax.tree.map(lambda *a: jnp.concatenate(a), *collected) if collected else None
    if layers is not None and cfg.attn_res_block_size:   # to the next stage, or the head
        x = attn_res.fold(x, summaries, cfg)
    elif summaries is not None:   # the head's mix of the summaries and the last running sum
        x = attn_res.mix(ctx["attn_res_head"], summaries, x, cfg)
    if dsa.trains_indexer(cfg) and not ctx["deterministic"]:
        stats = {**(stats or {}), "dsa": kl_total}
    return x, stats


def _shared_selection(x, cfg, first: int):
    """The initial selection [B,T,T] (False) that DSA index sharing carries from layer to layer
    when keys are selected (T > dsa_index_topk), else None; a layer range must start with a
    layer that computes its own (a pipeline stage: stages.plan checks)."""
    shared = cfg.dsa_shared_layers
    if not shared or x.shape[1] <= cfg.dsa_index_topk:
        return None
    if shared[first]:
        raise ValueError(f"layer {first + 1} reuses an earlier layer's DSA selection, and its "
                         "layer range starts there")
    B, T = x.shape[:2]
    return jnp.zeros((B, T, T), bool)


def embed(params: dict, tokens, cfg):
    """Token embeddings [B,T,D]: a gather, or one_hot @ E with ``use_iota_embed``."""
    table = params["embedding"].astype(cfg.compute_dtype)
    if cfg.use_iota_embed:
        one_hot = (tokens[..., None] == jnp.arange(cfg.vocab_size)).astype(table.dtype)
        return jnp.einsum("btv,vd->btd", one_hot, table)
    return jnp.take(table, tokens, axis=0)


def logits_head(params: dict, x, cfg):
    """Final-norm output [B,T,D] -> float32 logits [B,T,V] (tied: the embedding transposed)."""
    dt = jnp.float32 if cfg.logits_dot_in_fp32 else cfg.compute_dtype
    if cfg.untie_embeddings_and_output_weights:
        logits = jnp.einsum("btd,dv->btv", x.astype(dt), params["output"].astype(dt),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("btd,vd->btv", x.astype(dt), params["embedding"].astype(dt),
                            preferred_element_type=jnp.float32)
        if cfg.normalize_embedding_logits:
            logits = logits / jnp.float32(cfg.hidden_size ** 0.5)
    logits = constrain(logits, "act_batch", "act_seq", "act_vocab")
    if cfg.logits_scaling != 1.0:   # Granite
        logits = logits / jnp.float32(cfg.logits_scaling)
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits


def embed_inputs(params: dict, tokens, positions, cfg):
    """(x [B,T,D]: token plus learned position embeddings, RoPE (cos, sin) tables or None) for
    tokens and positions [B,T]. With ``local_rotary_base`` the tables are (cos, sin, local cos,
    local sin); each layer takes its pair (`_layer_rope`)."""
    with jax.named_scope("embed"):
        x = embed(params, tokens, cfg)
    if cfg.embedding_multiplier is not None:   # Gemma: the multiplier in the compute dtype
        x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
    if cfg.position_embedding_type == "learned_absolute":
        x = x + jnp.take(params["position_embedding"].astype(x.dtype), positions, axis=0)
    return x, _rope_tables(positions, cfg)


def _rope_tables(positions, cfg):
    if cfg.compress_ratios is not None:   # DeepSeek-V4: (plain pair, compressed layers' pair)
        return compressed.rope_tables(positions, cfg)
    if cfg.has_global_shape:   # Gemma 4: (global pair, sliding-window pair), unlike widths
        local = (L.local_rope_tables if cfg.local_rotary_base is not None else L.rope_tables)
        return (*L.global_rope_tables(positions, cfg), *local(positions, cfg))
    # MLA rotates whatever position_embedding_type says (Megatron), unless mla_nope
    rope = (L.rope_tables(positions, cfg) if cfg.position_embedding_type == "rope"
            or cfg.multi_latent_attention and not cfg.mla_nope else None)
    if rope is not None and cfg.local_rotary_base is not None:
        rope = (*rope, *L.local_rope_tables(positions, cfg))
    return rope


def forward(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
            deterministic: bool = True, rng=None, quant_state=None):
    """Logits [B,T,V] (float32) for int tokens [B,T].

    positions: [B,T] ints (default 0..T-1), for RoPE and learned position embeddings.
    segment_ids: [B,T] ints; tokens attend only within their segment (packed documents).
    deterministic: False turns dropout on; then ``rng`` is a PRNG key.
    quant_state: the delayed-scaling state (``TrainState.quant_state``; see
    jaxtrain.models.quant_state).
    """
    hidden = hidden_states(params, tokens, cfg, positions=positions, segment_ids=segment_ids,
                           deterministic=deterministic, rng=rng, quant_state=quant_state)
    return logits_head(params, hidden, cfg)


def layer_inputs(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
                 deterministic: bool = True, rng=None, moe_state=None,
                 embed_noise: float = 0.0, with_embedding: bool = True):
    """(x, ctx): the residual stream [B,T,D] ([B,T,n,D] with hyper-connections) entering the
    first layer (None without
    ``with_embedding``: a pipeline stage after the first) and the context every layer reads
    (RoPE tables, segments, dropout, context parallelism's token order). Arguments as
    :func:`hidden_states`."""
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = {"deterministic": deterministic, "rng": rng, "moe_state": moe_state}
    lay = cp.model_layout(cfg)
    if lay is not None and lay.reorder is not None:
        # context parallelism's token order: tokens, positions and segments move together, the
        # attention masks by the tokens' indices, and the hidden states come back in order
        index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        tokens, positions, index = lay.apply(tokens), lay.apply(positions), lay.apply(index)
        segment_ids = None if segment_ids is None else lay.apply(segment_ids)
        ctx.update(token_index=index, token_layout=lay.reorder, reordered=lay)
    ctx.update(tokens=tokens, hash_routes=(params or {}).get("hash_routes"),
               attn_res_head=(params or {}).get("attn_res_head"))
    if not with_embedding:
        ctx.update(segment_ids=segment_ids, positions=positions,
                   rope=_rope_tables(positions, cfg))
        return None, ctx
    x, rope = embed_inputs(params, tokens, positions, cfg)
    ctx.update(segment_ids=segment_ids, positions=positions, rope=rope)
    if cfg.per_layer_input_size:   # Gemma 4 small: from the embeddings before any noise
        ctx["per_layer_inputs"] = per_layer.inputs(params, tokens, x, cfg)
    if embed_noise and not deterministic:
        signs = jax.random.rademacher(
            jax.random.fold_in(_need(rng, "embedding noise"), cfg.num_layers + 1), x.shape,
            x.dtype)
        if "token_layout" in ctx:   # the same noise per token as in natural order
            signs = lay.apply(signs)
        x = x + signs * jnp.asarray(embed_noise / (T * cfg.hidden_size) ** 0.5, x.dtype)
    emb_rng = jax.random.fold_in(rng, cfg.num_layers) if rng is not None else None
    x = L.dropout(constrain(x, *RESIDUAL), cfg.hidden_dropout, emb_rng, deterministic
                  ).astype(cfg.residual_dtype)
    return hyper.expand(x, cfg), ctx


def layer_stacks(params: dict, cfg) -> dict:
    """The layer stacks of ``params`` ('layers', 'moe_layers') with the layer axis first."""
    return {k: jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), params[k])
            for k in STACKS if k in params}


def final_hidden(params: dict, x, ctx: dict, cfg):
    """The last layer's output x (its streams contracted, with hyper-connections; a last
    pipeline stage's folded attention-residual state mixed by the head) normed by the final
    norm, in the tokens' natural order."""
    if cfg.attn_res_block_size and x.ndim == 4:
        ps, summaries = attn_res.unfold(x, cfg.num_layers, cfg)
        x = attn_res.mix(params["attn_res_head"], summaries, ps, cfg)
    with jax.named_scope("final_norm"):
        hidden = L.norm(params["final_norm"], hyper.contract(x, cfg, params.get("hc_head")),
                        cfg)
    lay = ctx.get("reordered")
    return hidden if lay is None else lay.undo(hidden)


def hidden_states(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
                  deterministic: bool = True, rng=None, quant_state=None, moe_state=None,
                  with_moe_stats: bool = False, embed_noise: float = 0.0):
    """The final-normed hidden states [B,T,D] that ``logits_head`` turns into logits (the
    loss can then run the output layer chunk by chunk). Arguments as :func:`forward`.

    ``embed_noise`` alpha > 0 (pgs sym_noise; only when not ``deterministic``, then ``rng`` is
    a key): adds ±alpha/sqrt(T·D) to every input-embedding element, each sign a fair coin.

    ``with_moe_stats`` returns (hidden, stats): the MoE layers' router statistics stacked
    over MoE layers (``moe.route``; None without MoE). ``moe_state`` = {aux_counts
    [L_moe, E], steps}: global_aux_loss's counts summed over the step's earlier microbatches.
    """
    hidden, stats, _ = decoder(params, tokens, cfg, positions=positions,
                               segment_ids=segment_ids, deterministic=deterministic, rng=rng,
                               quant_state=quant_state, moe_state=moe_state,
                               embed_noise=embed_noise)
    return (hidden, stats) if with_moe_stats else hidden


def decoder(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
            deterministic: bool = True, rng=None, quant_state=None, moe_state=None,
            embed_noise: float = 0.0):
    """(final-normed hidden states [B,T,D], the MoE statistics or None, the layers' context):
    :func:`hidden_states` with the context the layers read (what the multi-token-prediction
    modules after the decoder read too, jaxtrain.models.mtp)."""
    x, ctx = layer_inputs(params, tokens, cfg, positions=positions, segment_ids=segment_ids,
                          deterministic=deterministic, rng=rng, moe_state=moe_state,
                          embed_noise=embed_noise)
    attached = attach_quant_state(params, cfg, quant_state)
    x, stats = _run_layers(layer_stacks(attached, cfg), x, ctx, cfg)
    return final_hidden(params, x, ctx, cfg), stats, ctx
