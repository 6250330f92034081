"""Mamba-2 token mixing (Megatron's MambaMixer, Hugging Face's NemotronH / Mamba2 mixers): the
state-space layers of hybrid models ('M' in a hybrid layer pattern).

    z, x, B, C, dt = x W_z, x W_x, x W_B, x W_C, x W_dt      Megatron's in_proj, split
    x, B, C = silu(causal_conv(x | B | C) + conv bias)      short depthwise convolution
    dt = max(softplus(dt + dt_bias), dt_floor),  A = -exp(A_log)           per head
    y = ssd(x, dt, A, B, C) + D x                           kernels/ssd (state reset per segment)
    out = (groupnorm(y * silu(z)) * w_norm) W_o             RMS over each group's heads

Parameters (one layer; H heads of width P, G groups of state width N, W the convolution width):
wz, wx [D,H,P]; wB, wC [D,G,N]; wdt [D,H]; conv_x [W,H,P], conv_B, conv_C [W,G,N] (tap W-1
multiplies the current token) with biases conv_bias_x [H,P], conv_bias_B, conv_bias_C [G,N];
A_log, dt_bias, D [H] (float32); norm {scale [H,P]}; wo [H,P,D]. Heads and groups split over the
tensor axis (Megatron: both divisible by the tensor-parallel size).

Decoding carries per layer the last W-1 convolution inputs and the state [B,H,P,N].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models import layers as L
from jaxtrain.models.linear_attention import (_conv_init, _dt_bias_init, causal_conv,
                                              last_sequence_inputs, recurrent_inputs)
from jaxtrain.models.spec import MAMBA_STACK, ParamSpec, _linear_init, _ones, _zeros, layer_kinds
from jaxtrain.parallel.sharding import constrain
from kernels.ssd import chunked_ssd


def _a_log_init(key, shape, dtype):
    """log(A) with A uniform in [1, 16] (Megatron's A_init_range)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def mamba_specs(cfg) -> dict:
    """The :class:`ParamSpec` tree of one Mamba-2 mixer (module docstring)."""
    D, dt = cfg.hidden_size, cfg.param_dtype
    H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    W = cfg.mamba_conv_kernel_dim
    head = ("q_heads", "kv")
    group = ("kv_heads", None)
    proj = lambda *s, ax: ParamSpec((D, *s), dt, ("embed", *ax),  # noqa: E731
                                    _linear_init(cfg, 0, tuple(range(1, len(s) + 1))))
    conv = lambda a, b, ax: ParamSpec((W, a, b), dt, (None, *ax), _conv_init)  # noqa: E731
    tree = {
        "wz": proj(H, P, ax=head), "wx": proj(H, P, ax=head),
        "wB": proj(G, N, ax=group), "wC": proj(G, N, ax=group), "wdt": proj(H, ax=head[:1]),
        "conv_x": conv(H, P, head), "conv_B": conv(G, N, group), "conv_C": conv(G, N, group),
        "A_log": ParamSpec((H,), jnp.float32, ("q_heads",), _a_log_init),
        "dt_bias": ParamSpec((H,), jnp.float32, ("q_heads",), _dt_bias_init),
        "D": ParamSpec((H,), jnp.float32, ("q_heads",), _ones),
        "norm": {"scale": ParamSpec((H, P), dt, head, _ones)},
        "wo": ParamSpec((H, P, D), dt, (*head, "embed"),
                        _linear_init(cfg, (0, 1), 2, output_layer=True)),
    }
    if cfg.mamba_conv_bias:
        tree.update(conv_bias_x=ParamSpec((H, P), dt, head, _zeros),
                    conv_bias_B=ParamSpec((G, N), dt, group, _zeros),
                    conv_bias_C=ParamSpec((G, N), dt, group, _zeros))
    return tree


def gated_group_norm(p: dict, y, z, cfg):
    """RMSNorm of y * silu(z) over each group's heads ([B,T,H,P], float32), times the scale."""
    g = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32)))
    B, T, H, P = g.shape
    G = cfg.mamba_num_groups
    gg = g.reshape(B, T, G, (H // G) * P)
    gg = gg * jax.lax.rsqrt(jnp.mean(gg * gg, -1, keepdims=True) + cfg.mamba_norm_epsilon)
    return (gg.reshape(B, T, H, P) * p["scale"].astype(jnp.float32)).astype(cfg.compute_dtype)


def mamba_block(p: dict, x, ctx: dict, cfg, cache=None):
    """Mamba-2 over x [B,T,D] -> [B,T,D] (before the residual add). With a decoding ``cache``
    ({conv_x, conv_B, conv_C, state}: this layer's slice of :func:`init_cache`) the tokens
    continue the cached sequence and the result is (out, new cache)."""
    x, seg, seq = recurrent_inputs(x, ctx, cache)
    z = L.dense(x, p["wz"], None, "btd,dhp->bthp", "mamba_gate_proj", cfg)
    xs = L.dense(x, p["wx"], None, "btd,dhp->bthp", "mamba_x_proj", cfg)
    Bm = L.dense(x, p["wB"], None, "btd,dgn->btgn", "mamba_b_proj", cfg)
    Cm = L.dense(x, p["wC"], None, "btd,dgn->btgn", "mamba_c_proj", cfg)
    dt = L.dense(x, p["wdt"], None, "btd,dh->bth", "mamba_dt_proj", cfg).astype(jnp.float32)
    z, xs = (constrain(t, "act_batch", "act_seq", "act_heads", "act_kv") for t in (z, xs))
    state = {} if cache is None else cache
    (xs, sx), (Bm, sB), (Cm, sC) = (
        causal_conv(t, p["conv_" + n], seq, state.get("conv_" + n), p.get("conv_bias_" + n))
        for t, n in zip((xs, Bm, Cm), "xBC"))
    dt = jnp.maximum(jax.nn.softplus(dt + p["dt_bias"].astype(jnp.float32)), cfg.mamba_dt_floor)
    A = -jnp.exp(p["A_log"].astype(jnp.float32))
    y, final = chunked_ssd(xs, dt, A, Bm, Cm, segment_ids=seg, chunk_size=cfg.mamba_chunk_size,
                           initial_state=None if cache is None else cache["state"],
                           state_dtype=None if cache is not None else (
                               cfg.mamba_state_dtype or cfg.compute_dtype))
    y = y.astype(jnp.float32) + xs.astype(jnp.float32) * p["D"].astype(jnp.float32)[:, None]
    y = constrain(gated_group_norm(p["norm"], y, z, cfg), "act_batch", "act_seq", "act_heads",
                  "act_kv")
    out = L.dense(y, p["wo"], None, "bthp,hpd->btd", "out_proj", cfg)
    if cache is None:
        return out
    sx, sB, sC = last_sequence_inputs((sx, sB, sC), seq)
    return out, {"conv_x": sx, "conv_B": sB, "conv_C": sC, "state": final}


def init_cache(cfg, batch: int, dtype) -> dict:
    """Empty decoding state of the Mamba layers ([L_mamba, ...], in layer order)."""
    Lyr = layer_kinds(cfg).count(MAMBA_STACK)
    H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    W1 = cfg.mamba_conv_kernel_dim - 1
    return {"conv_x": jnp.zeros((Lyr, batch, W1, H, P), dtype),
            "conv_B": jnp.zeros((Lyr, batch, W1, G, N), dtype),
            "conv_C": jnp.zeros((Lyr, batch, W1, G, N), dtype),
            "state": jnp.zeros((Lyr, batch, H, P, N), jnp.float32)}

