"""LFM2's gated short convolution: the token mixer of its convolution layers (Hugging Face's
Lfm2ShortConv; Primus's lfm_layer_types 'conv'), in place of attention.

    b, c, x = h W_b, h W_c, h W_x               one input projection, three parts
    y = (c * causal_conv(b * x)) W_o            depthwise over time, no activation

Parameters (one layer; W the convolution width): w_in [D,3,D] (b, c, x); conv [W,D] (tap
W-1 multiplies the current token); wo [D,D]; with short_conv_bias the biases b_in [3,D],
conv_bias [D] and bo [D]. Channels split over the tensor axis like an MLP's hidden units.
Decoding carries per layer the last W-1 convolution inputs (:func:`init_cache`).
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.models import layers as L
from jaxtrain.models.linear_attention import _conv_init, last_sequence_inputs, recurrent_inputs
from jaxtrain.models.spec import CONV_STACKS, ParamSpec, _linear_init, _zeros, layer_kinds
from jaxtrain.parallel.sharding import constrain


def short_conv_specs(cfg) -> dict:
    """The :class:`ParamSpec` tree of one short-convolution mixer (module docstring)."""
    D, W, dt = cfg.hidden_size, cfg.short_conv_kernel, cfg.param_dtype
    tree = {"w_in": ParamSpec((D, 3, D), dt, ("embed", None, "mlp"), _linear_init(cfg, 0, 2)),
            "conv": ParamSpec((W, D), dt, (None, "mlp"), _conv_init),
            "wo": ParamSpec((D, D), dt, ("mlp", "embed"),
                            _linear_init(cfg, 0, 1, output_layer=True))}
    if cfg.short_conv_bias:
        tree.update(b_in=ParamSpec((3, D), dt, (None, "mlp"), _zeros),
                    conv_bias=ParamSpec((D,), dt, ("mlp",), _zeros),
                    bo=ParamSpec((D,), dt, ("embed",), _zeros))
    return tree


def short_conv_block(p: dict, x, ctx: dict, cfg, cache=None):
    """The gated short convolution over x [B,T,D] -> [B,T,D] (before the residual add); a
    token's convolution reads only its own packed sequence. With a decoding ``cache`` ({conv}:
    the layer's last W-1 inputs) the tokens continue the cached ones: (out, new cache)."""
    B, T, _ = x.shape
    x, _, seq = recurrent_inputs(x, ctx, cache)
    bcx = L.dense(x, p["w_in"], p.get("b_in"), "btd,dke->btke", "conv_in_proj", cfg)
    b, c, u = bcx[:, :, 0], bcx[:, :, 1], bcx[:, :, 2]
    u = constrain(b * u, "act_batch", "act_seq", "act_mlp")
    W = cfg.short_conv_kernel
    prev = (jnp.zeros((B, W - 1, u.shape[-1]), u.dtype) if cache is None
            else cache["conv"].astype(u.dtype))
    full = jnp.concatenate([prev, u], 1)
    y = jnp.zeros(u.shape, jnp.float32)
    for s in range(W):   # shift s: the input s tokens back, weighted by tap W-1-s
        us = full[:, W - 1 - s:W - 1 - s + T].astype(jnp.float32)
        if seq is not None and s:
            seq_full = jnp.concatenate([jnp.broadcast_to(seq[:, :1], (B, W - 1)), seq], 1)
            us = jnp.where((seq_full[:, W - 1 - s:W - 1 - s + T] == seq)[..., None], us, 0.0)
        y = y + us * p["conv"][W - 1 - s].astype(jnp.float32)
    if "conv_bias" in p:
        y = y + p["conv_bias"].astype(jnp.float32)
    y = (c.astype(jnp.float32) * y).astype(cfg.compute_dtype)
    out = L.dense(y, p["wo"], p.get("bo"), "bte,ed->btd", "out_proj", cfg)
    if cache is None:
        return out
    (state,) = last_sequence_inputs((full[:, T:],), seq)
    return out, {"conv": state}


def init_cache(cfg, batch: int, dtype) -> dict:
    """Empty decoding state of the short-convolution layers ([L_conv, B, W-1, D])."""
    n = sum(k in CONV_STACKS for k in layer_kinds(cfg))
    return {"conv": jnp.zeros((n, batch, cfg.short_conv_kernel - 1, cfg.hidden_size), dtype)}
