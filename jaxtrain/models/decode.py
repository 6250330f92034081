"""KV-cached decoding: `init_cache`, `prefill`, `decode_step` and `generate`.

The layers are the training model's own (`transformer.decoder_layer` with a cache): the same
projections, norms, RoPE or learned positions, per-layer sliding windows, soft-capping, sinks,
MLA and MoE layers (the expert FFN is per token). Only attention differs: each layer stores
the step's keys and values in its slice of the cache, and a decode step attends over the cache
(the xla attention with the cache position as the query offset).

The cache is a dict with the layer axis first (the same for scanned and unrolled layers):

    k [L,B,S,K,H], v [L,B,S,K,Hv]   compute dtype, or kv_quant_dtype when quantize_kvcache
    k_scale, v_scale                 only when quantized: [L,B,S,K,1] (kv_quant_axis dkv) or
                                     [L,B,S,1,1] (heads_and_dkv); see jaxtrain.quant.kvcache
    length []                        int32, positions filled so far
    linear                           hybrid models only: Gated DeltaNet layers' convolution
                                     inputs and recurrent states (linear_attention.init_cache)
    mamba                            the same for Mamba-2 layers (mamba.init_cache)
    conv                             LFM2's short-convolution layers' last inputs
    global                           Gemma 4 only: {k, v (, scales)} of the global layers,
                                     whose head count and width differ
    window, csa, hca                 DeepSeek-V4 only (no k, v): each layer's shared key=value
                                     head kv [B,S,H]; compressing layers also what their
                                     compressors pool, ckv/cgate [B,S,c,H] and on CSA layers
                                     the indexer's ikv/igate [B,S,2,Di] (compressed.py)

L counts the softmax-attention layers only (without Gemma 4's global ones), ``linear``'s
leading axis the Gated DeltaNet layers only and ``global``'s the global layers (each in layer
order): a hybrid keeps no keys and values for its linear layers.

S is the longest sequence the cache holds. MLA caches the expanded per-head keys and values
(K = N heads, H = qk_head_dim + qk_pos_emb_head_dim, Hv = v_head_dim), not the compressed
latent. Sliding windows keep the whole sequence and mask (no ring buffer). As in MaxText,
`prefill` attends over the prompt's own keys and values (unquantized, with the model's
attention_impl) and stores them; `decode_step` attends over the cache read back (dequantized),
its own tokens included.

Prompts of different lengths are left-padded to one length (:func:`left_pad`); ``pad`` [B]
(the padding tokens of each row) makes a row's positions start at 0 at its first real token
and keeps its padding out of every attention (segment 0 against the real tokens' 1), so each
row decodes as it would alone. DeepSeek-V4's layers store each token at the slot of its own
position (the padding nowhere), so its compression windows are the row's own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models import layers as L
from jaxtrain.models.linear_attention import init_cache as linear_cache
from jaxtrain.models.params import STACKS, layer_axes, layer_kinds
from jaxtrain.models.quant_state import attach as attach_quant_state
from jaxtrain.models.mamba import init_cache as mamba_cache
from jaxtrain.models.short_conv import init_cache as conv_cache
from jaxtrain.models import attn_res, hyper, per_layer
from jaxtrain.models.spec import (CONV_STACKS, CSA_STACKS, FFN_ONLY_STACKS, GLOBAL_STACKS,
                                  HCA_STACKS, KV_SHARED_STACKS, LINEAR_STACKS, MAMBA_STACK)
from jaxtrain.models.transformer import (RECURRENT, RESIDUAL, _periodic_runs, decoder_layer,
                                         embed_inputs, layer_context, logits_head,
                                         per_layer_slices, store_kinds)
from jaxtrain.parallel.sharding import constrain, gather_weights
from jaxtrain.quant.kvcache import KV_QUANT_DTYPES, dequantize_kv, quantize_kv, scale_shape


def init_cache(cfg, batch: int, max_len: int, *, dtype=None) -> dict:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens; keys and values in
    ``dtype`` (default: the compute dtype) unless ``cfg.quantize_kvcache`` stores them as
    ``cfg.kv_quant_dtype`` with scales in ``dtype``."""
    dt = jnp.dtype(dtype or cfg.compute_dtype)
    groups = [_group(kind, cfg) for kind in layer_kinds(cfg)]
    Hv = cfg.v_head_dim if cfg.multi_latent_attention else cfg.kv_channels
    cache = _kv_arrays(cfg, (groups.count("attn"), batch, max_len), cfg.num_kv_heads,
                       cfg.head_dim, Hv, dt)
    if cfg.dsa_index_heads:   # DeepSeek sparse attention: the indexer's keys per layer
        cache["index_k"] = jnp.zeros((groups.count("attn"), batch, max_len,
                                      cfg.dsa_index_head_dim), dt)
    if "global" in groups:   # Gemma 4's global layers: their own head count and width
        K, H = cfg.attention_shape(wide=True)
        cache["global"] = _kv_arrays(cfg, (groups.count("global"), batch, max_len), K, H, H,
                                     dt)
    if "linear" in groups:
        cache["linear"] = linear_cache(cfg, batch, dt)
    if "mamba" in groups:
        cache["mamba"] = mamba_cache(cfg, batch, dt)
    if "conv" in groups:
        cache["conv"] = conv_cache(cfg, batch, dt)
    for g in _COMPRESSED:
        if g in groups:
            cache[g] = _compressed_cache(cfg, g, (groups.count(g), batch, max_len), dt)
    cache["length"] = jnp.zeros((), jnp.int32)
    return cache


def _kv_arrays(cfg, lead: tuple, K: int, H: int, Hv: int, dt) -> dict:
    """Zero keys [*lead, K, H] and values [*lead, K, Hv] (quantized: with their scales)."""
    shapes = {"k": (*lead, K, H), "v": (*lead, K, Hv)}
    if not cfg.quantize_kvcache:
        return {n: jnp.zeros(s, dt) for n, s in shapes.items()}
    int_dtype = KV_QUANT_DTYPES[cfg.kv_quant_dtype][0]
    cache = {n: jnp.zeros(s, int_dtype) for n, s in shapes.items()}
    cache.update({f"{n}_scale": jnp.zeros(scale_shape(s, cfg.kv_quant_axis), dt)
                  for n, s in shapes.items()})
    return cache


def _compressed_cache(cfg, group: str, lead: tuple, dt) -> dict:
    """DeepSeek-V4 layers' zero cache (module doc) for ``group`` window, csa or hca."""
    H = cfg.kv_channels
    cache = {"kv": jnp.zeros((*lead, H), dt)}
    if group != "window":
        halves = 2 if group == "csa" else 1
        cache.update(ckv=jnp.zeros((*lead, halves, H), dt), cgate=jnp.zeros((*lead, halves, H), dt))
    if group == "csa":
        Di = cfg.compress_index_head_dim
        cache.update(ikv=jnp.zeros((*lead, 2, Di), dt), igate=jnp.zeros((*lead, 2, Di), dt))
    return cache


def _store(cache: dict, k, v, start, cfg) -> dict:
    """One layer's cache with k, v [B,T,K,*] written at positions start..start+T-1."""
    if cfg.quantize_kvcache:
        (qk, sk), (qv, sv) = (quantize_kv(x, cfg.kv_quant_axis, cfg.kv_quant_dtype)
                              for x in (k, v))
        new = {"k": qk, "v": qv, "k_scale": sk, "v_scale": sv}
    else:
        new = {"k": k, "v": v}
    return {n: jax.lax.dynamic_update_slice_in_dim(c, new[n].astype(c.dtype), start, axis=1)
            for n, c in cache.items()}


def _load(cache: dict, cfg, dtype):
    """One layer's cached keys and values [B,S,K,*] in ``dtype``."""
    if not cfg.quantize_kvcache:
        return cache["k"].astype(dtype), cache["v"].astype(dtype)
    return tuple(dequantize_kv(cache[n], cache[f"{n}_scale"], cfg.kv_quant_dtype, dtype)
                 for n in ("k", "v"))


def _check(cfg, tokens, cache):
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be [batch, length >= 1] ints, got shape {tokens.shape}")
    if tokens.shape[0] != cache["k"].shape[1]:
        raise ValueError(f"tokens have batch {tokens.shape[0]}, the cache "
                         f"{cache['k'].shape[1]}")
    quantized = "k_scale" in cache
    if quantized != cfg.quantize_kvcache or quantized and (
            cache["k"].dtype != KV_QUANT_DTYPES[cfg.kv_quant_dtype][0]
            or cache["k_scale"].shape != scale_shape(cache["k"].shape, cfg.kv_quant_axis)):
        raise ValueError("the cache does not follow the config's quantize_kvcache / "
                         "kv_quant_axis / kv_quant_dtype; build it with init_cache(cfg, ...)")


def left_pad(prompts, pad_id: int = 0):
    """(ids [B, P] int32, pad [B] int32): token lists of any lengths (each >= 1) right-aligned
    after ``pad`` padding tokens, P the longest."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or min(map(len, prompts)) < 1:
        raise ValueError("left_pad takes one or more prompts of at least one token")
    P = max(map(len, prompts))
    ids = jnp.asarray([[pad_id] * (P - len(p)) + p for p in prompts], jnp.int32)
    return ids, jnp.asarray([P - len(p) for p in prompts], jnp.int32)


def _run(params, tokens, cache, cfg, *, attend_cache: bool, quant_state=None, pad=None):
    """tokens [B,T] at positions cache['length']..+T-1 through every layer: (logits [B,V] of
    the last token, cache with the tokens' keys and values stored and the length advanced).
    ``pad`` [B]: left padding per row (see the module doc)."""
    _check(cfg, tokens, cache)
    B, T = tokens.shape
    start = cache["length"]
    at_BT = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    positions, segments = at_BT, None
    if pad is not None:
        pad_B1 = jnp.asarray(pad, jnp.int32)[:, None]
        positions = jnp.maximum(at_BT - pad_B1, 0)
        real_BT = (at_BT >= pad_B1).astype(jnp.int32)
        if attend_cache:
            S = cache["k"].shape[2]
            segments = (real_BT, (jnp.arange(S)[None, :] >= pad_B1).astype(jnp.int32))
        else:
            segments = real_BT
    x, rope = embed_inputs(params, tokens, positions, cfg)
    x = constrain(x, *RESIDUAL).astype(cfg.residual_dtype)

    def kv_cache(c, k, v):
        c = _store(c, k, v, start, cfg)
        return (*_load(c, cfg, k.dtype), c) if attend_cache else (k, v, c)

    ctx = {"segment_ids": segments, "deterministic": True, "rng": None, "rope": rope,
           "moe_state": None, "kv_cache": kv_cache, "positions": positions,
           "cache_start": start, "tokens": tokens, "hash_routes": params.get("hash_routes"),
           "attn_res_head": params.get("attn_res_head"),
           # DeepSeek-V4 stores each token at its position's slot (padding below 0)
           "cache_slots": at_BT if pad is None else at_BT - pad_B1, "padded": pad is not None}
    if cfg.per_layer_input_size:
        ctx["per_layer_inputs"] = per_layer.inputs(params, tokens, x, cfg)
    if attend_cache:
        ctx["q_offset"] = start
        kv_at = jnp.arange(cache["k"].shape[2], dtype=jnp.int32)[None]
        ctx["kv_positions"] = kv_at if pad is None else jnp.maximum(kv_at - pad_B1, 0)
    layers_cache = {n: a for n, a in cache.items() if n != "length"}
    x, layers_cache = cached_layers(params, hyper.expand(x, cfg), layers_cache, ctx, cfg,
                                    quant_state)
    last = hyper.contract(x[:, -1:], cfg, params.get("hc_head"))
    hidden = L.norm(params["final_norm"], last, cfg)
    logits = logits_head(params, hidden, cfg)[:, 0]
    return logits, {**layers_cache, "length": start + T}


def cached_layers(params, x, cache, ctx, cfg, quant_state, *, remat: bool = False):
    """Every layer over x with its cache slice: a scan over each periodic run of layer kinds
    (dense/MoE, softmax/linear attention) when ``cfg.scan_layers``, else a Python loop. The
    softmax layers take their slices of the keys and values, the linear layers of ``linear``.
    ``remat``: each layer under ``jax.checkpoint`` saving nothing (differentiated callers keep
    only the layers' inputs, not what a layer made of its cache slice). Returns (x, cache)."""
    attached = attach_quant_state(params, cfg, quant_state)
    stacks = {k: jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), attached[k])
              for k in STACKS if k in attached}
    axes = {k: layer_axes(cfg, k) for k in stacks}
    kinds = layer_kinds(cfg)
    stores = store_kinds(cfg)
    used = dict.fromkeys(stacks, 0)
    shared = {}
    by_group = {"attn": {n: a for n, a in cache.items() if n not in _GROUPS}}
    by_group.update({g: cache[g] for g in _GROUPS if g in cache})
    cache_used = dict.fromkeys(by_group, 0)
    pieces = {g: [] for g in by_group}
    B, T = x.shape[:2]
    S = by_group["attn"]["k"].shape[2] if "q_offset" in ctx else T
    sel = (jnp.zeros((B, T, S), bool)   # DSA index sharing: the last layer's selection
           if cfg.dsa_shared_layers and S > cfg.dsa_index_topk else None)
    sigs = list(zip(kinds, stores))
    runs = [(lo + off, period, reps) for lo, hi in attn_res.blocks(cfg, 0, cfg.num_layers)
            for off, period, reps in _periodic_runs(sigs[lo:hi])]
    summaries = None   # attention residuals' (attn_res.py): a run never crosses a block
    for off, period, reps in runs:
        summaries = attn_res.keep(summaries, x, off, cfg)
        sig = kinds[off:off + period]
        sig_stores = stores[off:off + period] if reps == 1 else (None,) * period
        ps = {}
        for k in stacks:
            c = sig.count(k)
            if c:
                lo, used[k] = used[k], used[k] + reps * c
                ps[k] = jax.tree.map(lambda a: a[lo:lo + reps * c].reshape(reps, c, *a.shape[1:]),
                                     stacks[k])
        groups = [_group(kind, cfg) for kind in sig]
        cs = {}
        for g in set(groups) - {None}:
            c = groups.count(g)
            lo, cache_used[g] = cache_used[g], cache_used[g] + reps * c
            cs[g] = jax.tree.map(lambda a: a[lo:lo + reps * c].reshape(reps, c, *a.shape[1:]),
                                 by_group[g])
        idx = jnp.arange(off, off + reps * period).reshape(reps, period)
        us = per_layer_slices(ctx, off, period, reps)

        def step(carry, xs, sig=sig, groups=groups, sig_stores=sig_stores, kv=dict(shared),
                 res=summaries):
            h, sel = carry
            pb, cb, ib, ub = xs
            cursor = dict.fromkeys(list(pb) + list(cb), 0)
            out = {g: [] for g in cb}
            stored = {}
            for j, (kind, g, store) in enumerate(zip(sig, groups, sig_stores)):
                p = jax.tree.map(lambda a, c=cursor[kind]: a[c], pb[kind])
                layer_cache = (None if g is None else
                               jax.tree.map(lambda a, c=cursor[g]: a[c], cb[g]))
                cursor[kind] += 1
                if g is not None:
                    cursor[g] += 1

                def call(p, h, layer_cache, i, u, kv, sel, kind=kind, g=g, store=store):
                    layer_cache = ({} if g is None else {g: layer_cache} if g in _STATES
                                   else layer_cache)
                    lctx = layer_context(ctx, kind, i, store, u, kv, cfg)
                    if sel is not None:
                        lctx = {**lctx, "dsa_keep": sel}
                    if res is not None:
                        lctx = {**lctx, "attn_res": res}
                    return decoder_layer(gather_weights(p, axes[kind]), h, i, lctx, cfg,
                                         cache=layer_cache)

                if remat:
                    call = jax.checkpoint(call, policy=jax.checkpoint_policies.nothing_saveable)
                h, stats, c = call(p, h, layer_cache, ib[j], None if ub is None else ub[j], kv,
                                   sel)
                if stats and stats.get("dsa_keep") is not None:
                    sel = stats["dsa_keep"]
                if store:
                    c = dict(c)
                    stored[store] = c.pop("shared_kv")
                if g is not None:
                    out[g].append(c[g] if g in _STATES else c)
            return (h, sel), ({g: jax.tree.map(lambda *a: jnp.stack(a), *cs_)
                               for g, cs_ in out.items()}, stored)

        if cfg.scan_layers:
            (x, sel), (ys, stored) = jax.lax.scan(step, (x, sel), (ps, cs, idx, us))
        else:
            outs = []
            for r in range(reps):
                (x, sel), (y, new) = step((x, sel),
                                          jax.tree.map(lambda a: a[r], (ps, cs, idx, us)))
                outs.append(y)
                stored = jax.tree.map(lambda a: a[None], new)
            ys = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        shared.update(jax.tree.map(lambda a: a[0], stored))   # storing runs run once
        for g, y in ys.items():
            pieces[g].append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), y))
    if summaries is not None:
        x = attn_res.mix(ctx["attn_res_head"], summaries, x, cfg)
    out = {g: jax.tree.map(lambda *a: jnp.concatenate(a), *ps) if ps else by_group[g]
           for g, ps in pieces.items()}
    return x, {**out["attn"], **{g: out[g] for g in _GROUPS if g in cache}}


_COMPRESSED = ("window", "csa", "hca")   # DeepSeek-V4's layers, by compression
# cache entries of their own beside attention's
_GROUPS = ("linear", "global", "mamba", "conv", *_COMPRESSED)
_STATES = tuple(n for n, _, _ in RECURRENT)   # a state per layer, not keys and values


def _group(kind: str, cfg) -> str | None:
    """The cache group of a layer stack: Gated DeltaNet and Mamba layers keep their own
    states, Gemma 4's global layers keys and values of their own shape, DeepSeek-V4's layers
    what their compression reads; a hybrid model's FFN layers keep nothing (None)."""
    if cfg.compress_ratios is not None:
        return "csa" if kind in CSA_STACKS else "hca" if kind in HCA_STACKS else "window"
    if kind in FFN_ONLY_STACKS + KV_SHARED_STACKS:
        return None
    if kind == MAMBA_STACK:
        return "mamba"
    if kind in CONV_STACKS:
        return "conv"
    return "linear" if kind in LINEAR_STACKS else "global" if kind in GLOBAL_STACKS else "attn"


def prefill(params, cfg, tokens, cache, *, quant_state=None, pad=None):
    """Run the prompt tokens [B,T] into an empty ``cache``: (logits [B,V] float32 of the last
    token, the filled cache). Attention is over the prompt itself (``cfg.attention_impl``).
    ``pad`` [B]: the left padding of each row (:func:`left_pad`)."""
    return _run(params, tokens, cache, cfg, attend_cache=False, quant_state=quant_state,
                pad=pad)


def decode_step(params, cfg, tokens, cache, *, quant_state=None, pad=None):
    """Append tokens [B,T] (usually T = 1) after the cached ones, attending over the cache:
    (logits [B,V] float32 of the last token, the extended cache). The cache must have room
    for them (the length is traced: a write past the end would be clamped, not refused).
    ``pad``: the rows' left padding, as given to :func:`prefill`."""
    return _run(params, tokens, cache, cfg, attend_cache=True, quant_state=quant_state, pad=pad)


def generate(params, cfg, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             key=None, eos_id=None, quant_state=None, return_logits: bool = False,
             pad=None, return_logprobs: bool = False):
    """``max_new_tokens`` tokens [B, max_new_tokens] continuing prompt_ids [B,P], under jit.

    Ragged prompts: ``prompt_ids, pad = left_pad(prompts)`` and ``pad=pad``; each row then
    continues as it would alone (one compile per padded shape).

    temperature 0 picks the most likely token (greedy); above 0 samples from
    softmax(logits / temperature) with PRNG ``key``. ``eos_id``: a stop token, or several
    (end of turn, the tokenizer's and the generation config's eos); a row that produced one
    keeps producing the first. ``return_logits`` also returns each step's float32 logits
    [B, max_new_tokens, V] (the distribution each new token was picked from);
    ``return_logprobs`` returns each picked token's float32 log-probability [B, max_new_tokens]
    under softmax(logits / temperature) (the rollout policy; greedy: temperature 1). The cache
    follows ``cfg.quantize_kvcache`` / ``kv_quant_axis`` / ``kv_quant_dtype``.
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be [batch, length >= 1] ints, got shape "
                         f"{prompt_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key")
    total = prompt_ids.shape[1] + max_new_tokens - 1
    if cfg.position_embedding_type == "learned_absolute" and total > cfg.max_position_embeddings:
        raise ValueError(f"learned position embeddings reach {cfg.max_position_embeddings} "
                         f"positions; prompt + max_new_tokens - 1 = {total}")
    if key is None:
        key = jax.random.key(0)
    if pad is not None:
        pad = jnp.asarray(pad, jnp.int32)
        if pad.shape != prompt_ids.shape[:1]:
            raise ValueError(f"pad must be [batch] = [{prompt_ids.shape[0]}], got {pad.shape}")
    stops = [int(i) for i in np.atleast_1d(np.asarray(eos_id if eos_id is not None else []))]
    tokens, logprobs, logits = _generate(
        params, prompt_ids, key, jnp.float32(temperature), jnp.asarray(stops or [-1], jnp.int32),
        quant_state, pad, cfg=cfg, n=max_new_tokens, keep_logits=return_logits)
    out = (tokens, *([logits] if return_logits else []), *([logprobs] if return_logprobs else []))
    return out if len(out) > 1 else tokens


def _picker(temperature, eos_id):
    """pick(logits [B,V], key, done [B]) -> (token, its log-prob, done): greedy or sampled at
    ``temperature``, a finished row repeating the first stop id."""
    inv_t = 1.0 / jnp.where(temperature > 0, temperature, 1.0)

    def pick(logits, k, done):
        scaled = logits.astype(jnp.float32) * inv_t
        sampled = jax.random.categorical(k, scaled, -1)
        tok = jnp.where(temperature > 0, sampled, jnp.argmax(logits, -1)).astype(jnp.int32)
        tok = jnp.where(done, eos_id[0], tok)
        lp = jnp.take_along_axis(jax.nn.log_softmax(scaled, -1), tok[:, None], 1)[:, 0]
        stop = jnp.any((tok[:, None] == eos_id[None, :]) & (eos_id[None, :] >= 0), -1)
        return tok, lp, done | stop

    return pick


@functools.partial(jax.jit, static_argnames=("cfg", "n", "keep_logits"))
def _generate(params, prompt_ids, key, temperature, eos_id, quant_state, pad, *, cfg, n,
              keep_logits):
    """`generate` under jit: (tokens, their log-probs, the logits or None); temperature and the
    stop ids eos_id [K] (-1: none) are traced, so changing them does not recompile (another
    number of stop ids does)."""
    B, P = prompt_ids.shape
    cache = init_cache(cfg, B, P + n - 1)
    keys = jax.random.split(key, n)
    pick = _picker(temperature, eos_id)
    logits, cache = prefill(params, cfg, prompt_ids, cache, quant_state=quant_state, pad=pad)
    first, first_lp, done = pick(logits, keys[0], jnp.zeros((B,), bool))

    def body(carry, k):
        tok, cache, done = carry
        logits, cache = decode_step(params, cfg, tok[:, None], cache, quant_state=quant_state,
                                    pad=pad)
        nxt, lp, done = pick(logits, k, done)
        return (nxt, cache, done), (nxt, lp, logits if keep_logits else None)

    _, (toks, lps, step_logits) = jax.lax.scan(body, (first, cache, done), keys[1:])
    tokens = jnp.concatenate([first[:, None], toks.T], 1)
    logprobs = jnp.concatenate([first_lp[:, None], lps.T], 1)
    all_logits = (jnp.concatenate([logits[:, None], jnp.moveaxis(step_logits, 0, 1)], 1)
                  if keep_logits else None)
    return tokens, logprobs, all_logits
