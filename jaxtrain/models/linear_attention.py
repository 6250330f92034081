"""Gated DeltaNet token mixing (Qwen3-Next, Qwen3.5; Megatron's experimental_attention_variant
gdn): the linear-attention layers of hybrid models, in place of softmax attention.

    q, k, v = silu(causal_conv(x W_q|k|v))        short depthwise convolution over time
                                                  (linear_short_conv False: silu(x W) alone)
    beta = sigmoid(x W_b),  g = -exp(A_log) * softplus(x W_a + dt_bias)     per value head
    o = gated_delta_rule(q, k, v, g, beta)        kernels/gated_delta (state reset per segment)
    out = (rmsnorm(o) * w_norm * silu(x W_z)) W_o

Parameters (one layer; H_k key heads of width D_k, H_v value heads of width D_v, W the
convolution width): wq, wk [D,H_k,D_k]; wv, wz [D,H_v,D_v]; wb, wa [D,H_v]; conv_q, conv_k
[W,H_k,D_k], conv_v [W,H_v,D_v] (tap W-1 multiplies the current token); A_log, dt_bias [H_v]
(float32); norm {scale [D_v]} (a plain weight, also under apply_layernorm_1p); wo [H_v,D_v,D].
Heads split over the tensor axis like attention heads (a value head's key head is on the same
shard, since H_v/H_k value heads follow each key head).

Kimi Delta Attention (``linear_attention_kind`` kda; Kimi Linear, FLA's KDA): the same layer
with a decay per key channel from a low-rank projection and an output gate from another, the
gated norm taking sigmoid(gate) (H = H_v heads, key heads repeated to them):

    g = -exp(A_log) * softplus((x W_fa) W_fb + dt_bias)     [H, D_k] per token
    out = (rmsnorm(o) * w_norm * sigmoid((x W_ga) W_gb + b_gb)) W_o

Its parameters replace wz/wa with wf_a [D,R], wf_b [R,H,D_k] (R = ``kda_decay_rank``, by
default D_k as in Kimi Linear; FLA and Primus's hybrid KDA use D_v), wg_a [D,D_v], wg_b
[D_v,H,D_v] with bg_b [H,D_v] under ``kda_gate_bias`` (FLA's), and dt_bias is [H,D_k].
Kimi K3's KDA bounds the decay and gates the output through one full-rank projection wg
[D,H,D_v] (``kda_full_rank_gate``):

    g = lb * sigmoid(exp(A_log) * ((x W_fa) W_fb + dt_bias))     lb = kda_gate_lower_bound

Decoding carries per layer the last W-1 convolution inputs and the recurrent state
[B,H_v,D_k,D_v] instead of keys and values (:func:`init_cache`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models import layers as L
from jaxtrain.models.spec import (LINEAR_STACKS, ParamSpec, _linear_init, _ones, _zeros,
                                  layer_kinds)
from jaxtrain.parallel.sharding import constrain
from kernels.gated_delta import chunk_scan, chunked_gated_delta_rule
from kernels.gated_delta.reference import sequence_numbers


def _a_log_init(key, shape, dtype):
    """log(A) with A uniform in [1, 16] (the Gated DeltaNet / Mamba-2 initialisation)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype):
    """softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]: the initial step sizes."""
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(1e-3), np.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _conv_init(key, shape, dtype):
    """PyTorch's Conv1d default for a depthwise kernel: uniform(+-1/sqrt(W))."""
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def linear_attention_specs(cfg) -> dict:
    """The :class:`ParamSpec` tree of one Gated DeltaNet mixer (module docstring)."""
    D, dt = cfg.hidden_size, cfg.param_dtype
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    W = cfg.linear_conv_kernel_dim
    proj = lambda *s: ParamSpec((D, *s), dt, ("embed", "q_heads", "kv")[:len(s) + 1],  # noqa
                                _linear_init(cfg, 0, tuple(range(1, len(s) + 1))))
    conv = lambda H, Dh: ParamSpec((W, H, Dh), dt, (None, "q_heads", "kv"), _conv_init)  # noqa
    convs = ({"conv_q": conv(Hk, Dk), "conv_k": conv(Hk, Dk), "conv_v": conv(Hv, Dv)}
             if cfg.linear_short_conv else {})
    tree = {
        "wq": proj(Hk, Dk), "wk": proj(Hk, Dk), "wv": proj(Hv, Dv), "wz": proj(Hv, Dv),
        "wb": proj(Hv), "wa": proj(Hv), **convs,
        "A_log": ParamSpec((Hv,), jnp.float32, ("q_heads",), _a_log_init),
        "dt_bias": ParamSpec((Hv,), jnp.float32, ("q_heads",), _dt_bias_init),
        "norm": {"scale": ParamSpec((Dv,), dt, ("norm",), _ones)},
        "wo": ParamSpec((Hv, Dv, D), dt, ("q_heads", "kv", "embed"),
                        _linear_init(cfg, (0, 1), 2, output_layer=True)),
    }
    if cfg.linear_attention_kind != "kda":
        return tree
    del tree["wz"], tree["wa"]
    low = lambda R: ParamSpec((D, R), dt, ("embed", None), _linear_init(cfg, 0, 1))  # noqa
    up = lambda R, Dh: ParamSpec((R, Hv, Dh), dt, (None, "q_heads", "kv"),  # noqa: E731
                                 _linear_init(cfg, 0, (1, 2)))
    gate = ({"wg": proj(Hv, Dv)} if cfg.kda_full_rank_gate
            else {"wg_a": low(Dv), "wg_b": up(Dv, Dv)})
    if cfg.kda_gate_bias:
        gate["bg_b"] = ParamSpec((Hv, Dv), dt, ("q_heads", "kv"), _zeros)
    if cfg.kda_gate_lower_bound is not None:   # Kimi K3 starts every head's rate at 1
        tree["A_log"] = ParamSpec((Hv,), jnp.float32, ("q_heads",), _zeros)
    R = cfg.kda_decay_rank or Dk
    return {**tree, "wf_a": low(R), "wf_b": up(R, Dk), **gate,
            "dt_bias": ParamSpec((Hv, Dk), jnp.float32, ("q_heads", "kv"), _dt_bias_init)}


def causal_conv(x, w, seq=None, state=None, bias=None):
    """Depthwise causal convolution of x [B,T,H,Dh] with w [W,H,Dh] (plus ``bias`` [H,Dh]),
    then silu.

    ``seq`` [B,T] (sequence numbers, see :func:`sequence_numbers`): a tap reaching into an
    earlier sequence reads zero. ``state`` [B,W-1,H,Dh]: the inputs before x (decoding).
    Returns (y [B,T,H,Dh], the last W-1 inputs) in x's dtype."""
    W, T = w.shape[0], x.shape[1]
    if state is None:
        state = jnp.zeros((x.shape[0], W - 1, *x.shape[2:]), x.dtype)
    full = jnp.concatenate([state.astype(x.dtype), x], 1)
    seq_full = None if seq is None else jnp.concatenate(
        [jnp.broadcast_to(seq[:, :1], (seq.shape[0], W - 1)), seq], 1)
    y = jnp.zeros(x.shape, jnp.float32)
    for s in range(W):   # shift s: the input s tokens back, weighted by tap W-1-s
        xs = jax.lax.dynamic_slice_in_dim(full, W - 1 - s, T, 1).astype(jnp.float32)
        if seq is not None:
            same = jax.lax.dynamic_slice_in_dim(seq_full, W - 1 - s, T, 1) == seq
            xs = jnp.where(same[..., None, None], xs, 0.0)
        y = y + xs * w[W - 1 - s].astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jax.nn.silu(y).astype(x.dtype), full[:, T:]


def gated_norm(p: dict, o, z, cfg):
    """RMSNorm of o [...,D_v] (float32, the plain weight) times silu(z) (Gated DeltaNet, which
    rounds the normed o to o's dtype first) or sigmoid(z) (KDA, all float32), in the compute
    dtype."""
    o32 = o.astype(jnp.float32)
    y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + cfg.norm_epsilon)
    kda = cfg.linear_attention_kind == "kda"
    if not kda:
        y = y.astype(o.dtype).astype(jnp.float32)
    y = p["scale"].astype(jnp.float32) * y
    gate = jax.nn.sigmoid if kda else jax.nn.silu
    return (y * gate(z.astype(jnp.float32))).astype(cfg.compute_dtype)


def recurrent_inputs(x, ctx: dict, cache):
    """(x, the tokens' segment ids, their sequence numbers or None) for a layer that carries a
    state (Gated DeltaNet, Mamba, short convolution): decoding (``cache`` given) passes the
    new tokens' and the cache's segments, and its left-padded rows' padding (segment 0) is
    zeroed so that it leaves no trace in the state."""
    B, T, _ = x.shape
    seg = ctx.get("segment_ids")
    if isinstance(seg, tuple):
        seg = seg[0]
    seq = sequence_numbers(seg, T, B)
    if seq is not None and cache is not None:
        x = jnp.where((seg != 0)[..., None], x, jnp.zeros((), x.dtype))
    return x, seg, seq


def linear_attention_block(p: dict, x, ctx: dict, cfg, cache=None):
    """Gated DeltaNet over x [B,T,D] -> [B,T,D] (before the residual add). With a decoding
    ``cache`` ({conv_q, conv_k, conv_v, state}: this layer's slice of :func:`init_cache`) the
    tokens continue the cached sequence and the result is (out, new cache)."""
    B, T, _ = x.shape
    x, seg, seq = recurrent_inputs(x, ctx, cache)
    names = ("query_proj", "key_proj", "value_proj")
    q, k, v = (L.dense(x, p[w], None, "btd,dhk->bthk", n, cfg)
               for w, n in zip(("wq", "wk", "wv"), names))
    kda = cfg.linear_attention_kind == "kda"
    if kda:   # low-rank projections of the output gate and of the per-channel decay
        z = (L.dense(x, p["wg"], None, "btd,dhk->bthk", "linear_gate_proj", cfg) if "wg" in p
             else _low_rank(x, p["wg_a"], p["wg_b"], "linear_gate_proj", cfg))
        if "bg_b" in p:
            z = z + p["bg_b"].astype(z.dtype)
        a = _low_rank(x, p["wf_a"], p["wf_b"], "linear_decay_proj", cfg).astype(jnp.float32)
    else:
        z = L.dense(x, p["wz"], None, "btd,dhk->bthk", "linear_gate_proj", cfg)
        a = L.dense(x, p["wa"], None, "btd,dh->bth", "linear_decay_proj", cfg
                    ).astype(jnp.float32)
    b = L.dense(x, p["wb"], None, "btd,dh->bth", "linear_beta_proj", cfg).astype(jnp.float32)
    q, k, v, z = (constrain(t, "act_batch", "act_seq", "act_heads", "act_kv")
                  for t in (q, k, v, z))
    conv_state = {} if cache is None else cache
    if cfg.linear_short_conv:
        (q, sq), (k, sk), (v, sv) = (
            causal_conv(t, p["conv_" + n], seq, conv_state.get("conv_" + n))
            for t, n in zip((q, k, v), "qkv"))
    else:   # Primus's use_short_conv false: SiLU alone, nothing to carry
        q, k, v = (jax.nn.silu(t.astype(jnp.float32)).astype(t.dtype) for t in (q, k, v))
    beta = jax.nn.sigmoid(b)
    g = log_decay(a, p["A_log"], p["dt_bias"], cfg)
    o, state = chunked_gated_delta_rule(
        q, k, v, g, beta, segment_ids=seg, chunk_size=cfg.linear_chunk_size,
        initial_state=None if cache is None else cache["state"], l2_qk=cfg.linear_qk_l2_norm,
        scan=chunk_scan if cfg.linear_attention_impl == "pallas" else None)
    o = constrain(gated_norm(p["norm"], o, z, cfg), "act_batch", "act_seq", "act_heads",
                  "act_kv")
    out = L.dense(o, p["wo"], None, "bthk,hkd->btd", "out_proj", cfg)
    if cache is None:
        return out
    if not cfg.linear_short_conv:
        return out, {"state": state}
    sq, sk, sv = last_sequence_inputs((sq, sk, sv), seq)
    return out, {"conv_q": sq, "conv_k": sk, "conv_v": sv, "state": state}


def log_decay(a, A_log, dt_bias, cfg):
    """The log-decay g from the decay projection a ([B,T,H] per head, KDA [B,T,H,D_k] per key
    channel): -exp(A_log) * softplus(a + dt_bias), or Kimi K3's bounded
    lb * sigmoid(exp(A_log) * (a + dt_bias)) in (lb, 0), in float32."""
    rate = jnp.exp(A_log.astype(jnp.float32))
    if a.ndim == 4:
        rate = rate[:, None]
    a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    if cfg.kda_gate_lower_bound is not None:
        return cfg.kda_gate_lower_bound * jax.nn.sigmoid(rate * a)
    return -rate * jax.nn.softplus(a)


def _low_rank(x, w_a, w_b, name: str, cfg):
    """(x W_a) W_b: [B,T,D] -> [B,T,H,D_h] through a narrow bottleneck (KDA's gates)."""
    h = L.dense(x, w_a, None, "btd,dr->btr", name + "_a", cfg)
    return L.dense(h, w_b, None, "btr,rhk->bthk", name, cfg)


def last_sequence_inputs(states, seq):
    """The convolution states [B,W-1,...] (the last W-1 inputs) with the inputs of sequences
    before the last one zeroed: a decoding row continues only its last sequence. ``seq``
    [B,T]: the new tokens' sequence numbers (None: one sequence)."""
    if seq is None:
        return states
    B, T = seq.shape
    W1 = states[0].shape[1]
    old = jnp.broadcast_to(seq[:, :1] == seq[:, -1:], (B, max(W1 - T, 0)))
    keep = jnp.concatenate([old, (seq == seq[:, -1:])[:, -W1:]], 1)
    keep = keep.reshape(*keep.shape, *(1,) * (states[0].ndim - 2))
    return tuple(jnp.where(keep, s_, jnp.zeros((), s_.dtype)) for s_ in states)


def init_cache(cfg, batch: int, dtype) -> dict:
    """Empty decoding state of the Gated DeltaNet layers ([L_linear, ...], in layer order)."""
    Lyr = sum(k in LINEAR_STACKS for k in layer_kinds(cfg))
    W = cfg.linear_conv_kernel_dim
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    state = {"state": jnp.zeros((Lyr, batch, Hv, Dk, Dv), jnp.float32)}
    if not cfg.linear_short_conv:
        return state
    return {"conv_q": jnp.zeros((Lyr, batch, W - 1, Hk, Dk), dtype),
            "conv_k": jnp.zeros((Lyr, batch, W - 1, Hk, Dk), dtype),
            "conv_v": jnp.zeros((Lyr, batch, W - 1, Hv, Dv), dtype), **state}
