"""Multi-latent attention (DeepSeek-V2/V3, Megatron's MLA): parameters and the q/k/v projections.

Queries come from x directly (``q_lora_rank`` None: ``wq``) or through a rank-Rq latent
(``wq_a``, a norm, ``wq_b``). Keys and values share one down projection ``wkv_a`` whose first
Rkv columns are the kv latent (normed, then projected up per head to the key part without
position, ``wk_b``, and the value, ``wv_b``) and whose last P columns are a single RoPE key head
that every head shares. Each q/k head is Hn + P wide ([no-RoPE part, RoPE part]); values are Hv.
RoPE rotates interleaved channel pairs of the P slice, as Megatron (which de-interleaves) and
HF's ``rope_interleave`` do. The latent norms exist with ``qk_layernorm`` (Megatron's layer spec;
DeepSeek checkpoints have them). Core attention and the output projection are the dense
model's (transformer.py), with the softmax scale ``ModelConfig.mla_softmax_scale``.

attn tree: wq [D,N,Hn+P] | wq_a [D,Rq], q_a_norm {scale [Rq]}, wq_b [Rq,N,Hn+P];
           wkv_a [D,Rkv+P], kv_a_norm {scale [Rkv]}, wk_b [Rkv,N,Hn], wv_b [Rkv,N,Hv];
           wo [N,Hv,D], bo [D] (add_bias_linear).

Legend: B batch, T length, D hidden, N heads, Rq/Rkv latent ranks, Hn = qk_head_dim,
P = qk_pos_emb_head_dim, Hv = v_head_dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models import layers as L
from jaxtrain.models.spec import ParamSpec, _linear_init, _norm, _zeros
from jaxtrain.parallel.sharding import constrain


def mla_specs(cfg) -> dict:
    """ParamSpecs of one layer's MLA attention (the ``attn`` subtree)."""
    D, N, dt = cfg.hidden_size, cfg.num_attention_heads, cfg.param_dtype
    Hq, Hn, Hv = cfg.head_dim, cfg.qk_head_dim, cfg.v_head_dim
    Rkv, P = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    heads = _linear_init(cfg, 0, (1, 2))
    spec: dict = {}
    if cfg.q_lora_rank is None:
        spec["wq"] = ParamSpec((D, N, Hq), dt, ("embed", "q_heads", "kv"), heads)
    else:
        Rq = cfg.q_lora_rank
        spec["wq_a"] = ParamSpec((D, Rq), dt, ("embed", "lora"), _linear_init(cfg, 0, 1))
        spec["wq_b"] = ParamSpec((Rq, N, Hq), dt, ("lora", "q_heads", "kv"), heads)
        if cfg.qk_layernorm:
            spec["q_a_norm"] = _norm(cfg, Rq)
    spec["wkv_a"] = ParamSpec((D, Rkv + P), dt, ("embed", "lora"), _linear_init(cfg, 0, 1))
    if cfg.qk_layernorm:
        spec["kv_a_norm"] = _norm(cfg, Rkv)
    spec["wk_b"] = ParamSpec((Rkv, N, Hn), dt, ("lora", "q_heads", "kv"), heads)
    spec["wv_b"] = ParamSpec((Rkv, N, Hv), dt, ("lora", "q_heads", "kv"), heads)
    spec["wo"] = ParamSpec((N, Hv, D), dt, ("q_heads", "kv", "embed"),
                           _linear_init(cfg, (0, 1), 2, output_layer=True))
    if cfg.add_bias_linear:
        spec["bo"] = ParamSpec((D,), dt, ("embed",), _zeros)
    return spec


def rope_pairs(x, cos, sin):
    """RoPE on interleaved pairs (2i, 2i+1) of x [B,T,n,P] with cos/sin [B,T,P/2].

    The rotated pairs come out as [first of each pair..., second of each pair...] (Megatron's
    and HF's layout); queries and keys share it, so attention scores are unchanged.
    """
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    c, s = cos[:, :, None], sin[:, :, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)


def mla_qkv(p: dict, x, ctx: dict, cfg):
    """(q [B,T,N,Hn+P], k [B,T,N,Hn+P], v [B,T,N,Hv], the query latent [B,T,Rq] or x without
    one) from x [B,T,D], RoPE applied (the latent is what the DSA indexer reads).

    The down projections are tagged ``mla_q``/``mla_kv``, the up projections ``query_proj``,
    ``key_proj`` and ``value_proj``; with ``mla_up_proj`` in ``recompute_modules`` the up
    projections, RoPE and concatenation are recomputed in the backward pass (Megatron).
    """
    Hn, Rkv = cfg.qk_head_dim, cfg.kv_lora_rank
    if "wq" in p:
        q_in = x
    else:
        q_in = L.dense(x, p["wq_a"], None, "btd,dr->btr", "mla_q", cfg)
        if "q_a_norm" in p:
            q_in = L.norm(p["q_a_norm"], q_in, cfg, eps=cfg.mla_latent_norm_epsilon)
    kv = L.dense(x, p["wkv_a"], None, "btd,dr->btr", "mla_kv", cfg)
    latent, k_pos = kv[..., :Rkv], kv[..., Rkv:]
    if "kv_a_norm" in p:
        latent = L.norm(p["kv_a_norm"], latent, cfg, eps=cfg.mla_latent_norm_epsilon)

    def up(p, q_in, latent, k_pos, cos, sin):
        q = L.dense(q_in, p["wq"] if "wq" in p else p["wq_b"], None,
                    "btd,dnh->btnh" if "wq" in p else "btr,rnh->btnh", "query_proj", cfg)
        k_nope = L.dense(latent, p["wk_b"], None, "btr,rnh->btnh", "key_proj", cfg)
        v = L.dense(latent, p["wv_b"], None, "btr,rnh->btnh", "value_proj", cfg)
        k_pos = k_pos[:, :, None, :]
        if cos is not None:   # mla_nope: both parts stay unrotated
            q = jnp.concatenate([q[..., :Hn], rope_pairs(q[..., Hn:], cos, sin)], -1)
            k_pos = rope_pairs(k_pos, cos, sin)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pos, k_nope.shape[:3] + k_pos.shape[3:])],
                            -1)
        return q, k, v

    weights = {n: p[n] for n in ("wq", "wq_b", "wk_b", "wv_b") if n in p}
    if "mla_up_proj" in cfg.recompute_modules:
        up = jax.checkpoint(up)
    rope = None if cfg.mla_nope else ctx.get("rope")
    q, k, v = up(weights, q_in, latent, k_pos, *(rope or (None, None)))
    q = constrain(q, "act_batch", "act_seq", "act_heads", "act_kv")
    k = constrain(k, "act_batch", "act_seq", "act_heads", "act_kv")
    v = constrain(v, "act_batch", "act_seq", "act_heads", "act_kv")
    return q, k, v, q_in
