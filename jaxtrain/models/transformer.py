"""The decoder stack: ``forward(params, tokens, cfg) -> logits``.

Layers run under ``jax.lax.scan`` over the stacked parameters when ``cfg.scan_layers``, else in
a Python loop; remat wraps a layer (or a group of layers, Megatron 'uniform') in
``jax.checkpoint`` with the policy of ``cfg.remat_policy`` (see ``remat.py``).

Legend: B batch, T length, D hidden, V vocab, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import layers as L
from jaxtrain.models.attention import attention
from jaxtrain.models.params import layer_axes
from jaxtrain.models.remat import NO_REMAT, layer_plan
from jaxtrain.parallel.sharding import constrain, gather_weights

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


def _maybe_remat(fn, on: bool):
    """Megatron selective recompute of one module: ``fn`` (arrays only) under jax.checkpoint."""
    return jax.checkpoint(fn) if on else fn


def _need(rng, what):
    if rng is None:
        raise ValueError(f"{what} is on (deterministic=False, rate > 0) but no rng was given")
    return rng


def attention_block(p: dict, x, ctx: dict, layer_number, rng, cfg):
    """Self-attention over x [B,T,D] -> [B,T,D] (before the residual add)."""
    q = L.dense(x, p["wq"], p.get("bq"), "btd,dnh->btnh", "query_proj", cfg)
    k = L.dense(x, p["wk"], p.get("bk"), "btd,dkh->btkh", "key_proj", cfg)
    v = L.dense(x, p["wv"], p.get("bv"), "btd,dkh->btkh", "value_proj", cfg)
    q = constrain(q, "act_batch", "act_seq", "act_heads", "act_kv")
    k = constrain(k, "act_batch", "act_seq", "act_kv_heads", "act_kv")
    v = constrain(v, "act_batch", "act_seq", "act_kv_heads", "act_kv")
    if cfg.qk_layernorm:
        q, k = L.norm(p["q_norm"], q, cfg), L.norm(p["k_norm"], k, cfg)
    elif cfg.qk_l2_norm:
        q, k = L.l2_norm(q, cfg.norm_epsilon), L.l2_norm(k, cfg.norm_epsilon)
    if cfg.position_embedding_type == "rope":
        q, k = L.apply_rope(q, *ctx["rope"], cfg), L.apply_rope(k, *ctx["rope"], cfg)
    scale = cfg.head_dim ** -0.5
    # Query-key layer scaling guards fp16 scores from overflow; the fused kernels accumulate
    # q.k in fp32 with a static scale, so only the xla path needs it (same math either way).
    if cfg.apply_query_key_layer_scaling and cfg.attention_impl == "xla":
        q = q / layer_number.astype(q.dtype)
        scale = scale * layer_number.astype(jnp.float32)
    drop = not ctx["deterministic"] and cfg.attention_dropout > 0

    def attend(q, k, v):
        return attention(
            q, k, v, impl=cfg.attention_impl, causal=True, segment_ids=ctx["segment_ids"],
            sliding_window=cfg.sliding_window, softcap=cfg.attn_logit_softcapping, scale=scale,
            softmax_fp32=cfg.attention_softmax_in_fp32,
            dropout_rate=cfg.attention_dropout if drop else 0.0,
            dropout_rng=_need(rng, "attention dropout") if drop else None,
            block_sizes=cfg.flash_block_sizes)

    out = checkpoint_name(_maybe_remat(attend, "core_attn" in cfg.recompute_modules)(q, k, v),
                          "context")
    out = constrain(out, "act_batch", "act_seq", "act_heads", "act_kv")
    return L.dense(out, p["wo"], p.get("bo"), "btnh,nhd->btd", "out_proj", cfg)


def decoder_layer(p: dict, x, i, ctx: dict, cfg):
    """One pre-norm layer on the residual stream x [B,T,D]; i is the 0-based layer index."""
    x = checkpoint_name(constrain(x, "act_batch", "act_layer_seq", "act_embed"),
                        "decoder_layer_input")
    rng = jax.random.fold_in(ctx["rng"], i) if ctx["rng"] is not None else None
    sub = (lambda n: jax.random.fold_in(rng, n)) if rng is not None else (lambda n: None)
    det = ctx["deterministic"]
    norm = _maybe_remat(lambda q, y: L.norm(q, y, cfg), "layernorm" in cfg.recompute_modules)
    mlp = _maybe_remat(lambda q, y: L.mlp(q, y, cfg), "mlp" in cfg.recompute_modules)

    h = norm(p["attn_norm"], x)
    a = attention_block(p["attn"], h, ctx, i + 1, sub(1), cfg)
    resid = h if cfg.apply_residual_connection_post_layernorm else x
    x = (resid + L.dropout(constrain(a, *RESIDUAL), cfg.hidden_dropout, sub(2), det)
         ).astype(cfg.residual_dtype)

    h = norm(p["mlp_norm"], x)
    m = mlp(p["mlp"], h)
    resid = h if cfg.apply_residual_connection_post_layernorm else x
    m = constrain(m, *RESIDUAL)
    return constrain((resid + L.dropout(m, cfg.hidden_dropout, sub(3), det)
                      ).astype(cfg.residual_dtype), *RESIDUAL)


def _run_layers(stacked: dict, x, ctx: dict, cfg):
    """All layers over x, segment by segment of the remat plan; ``stacked`` has L on axis 0."""
    axes = layer_axes(cfg)

    def body(p, h, i):
        return decoder_layer(gather_weights(p, axes), h, i, ctx, cfg)

    def run(fn, p, idx, h):
        """fn(p_j, h, idx_j) for each j along the leading axis of p and idx."""
        if cfg.scan_layers:
            return jax.lax.scan(lambda c, pi: (fn(pi[0], c, pi[1]), None), h, (p, idx))[0]
        for j in range(idx.shape[0]):
            h = fn(jax.tree.map(lambda a: a[j], p), h, idx[j])
        return h

    for seg in layer_plan(cfg):
        p = jax.tree.map(lambda a: a[seg.start:seg.stop], stacked)
        idx = jnp.arange(seg.start, seg.stop)
        if seg.policy is NO_REMAT:
            x = run(body, p, idx, x)
            continue
        remat = functools.partial(jax.checkpoint, policy=seg.policy,
                                  prevent_cse=not cfg.scan_layers)
        if seg.group == 1:
            x = run(remat(body), p, idx, x)
            continue
        n = (seg.stop - seg.start) // seg.group
        p, idx = jax.tree.map(lambda a: a.reshape(n, seg.group, *a.shape[1:]), (p, idx))
        x = run(remat(lambda pg, h, ig: run(body, pg, ig, h)), p, idx, x)
    return x


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
    logits = constrain(logits, "act_batch", "act_seq", "act_vocab")
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits


def forward(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
            deterministic: bool = True, rngs=None):
    """Logits [B,T,V] (float32) for int tokens [B,T].

    positions: [B,T] ints (default 0..T-1), for RoPE and learned position embeddings.
    segment_ids: [B,T] ints; tokens attend only within their segment (packed documents).
    deterministic: False turns dropout on; then ``rngs`` is a PRNG key.
    """
    hidden = hidden_states(params, tokens, cfg, positions=positions, segment_ids=segment_ids,
                           deterministic=deterministic, rngs=rngs)
    return logits_head(params, hidden, cfg)


def hidden_states(params: dict, tokens, cfg, *, positions=None, segment_ids=None,
                  deterministic: bool = True, rngs=None):
    """The final-normed hidden states [B,T,D] that ``logits_head`` turns into logits (the
    loss can then run the output layer chunk by chunk). Arguments as :func:`forward`."""
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = embed(params, tokens, cfg)
    if cfg.position_embedding_type == "learned_absolute":
        x = x + jnp.take(params["position_embedding"].astype(x.dtype), positions, axis=0)
    ctx = {
        "segment_ids": segment_ids,
        "deterministic": deterministic,
        "rng": rngs,
        "rope": L.rope_tables(positions, cfg) if cfg.position_embedding_type == "rope" else None,
    }
    emb_rng = jax.random.fold_in(rngs, cfg.num_layers) if rngs is not None else None
    x = L.dropout(constrain(x, *RESIDUAL), cfg.hidden_dropout, emb_rng, deterministic
                  ).astype(cfg.residual_dtype)
    stacked = jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), params["layers"])
    x = _run_layers(stacked, x, ctx, cfg)
    return L.norm(params["final_norm"], x, cfg)
