"""Gemma 4 small's per-layer inputs (Hugging Face's "PLE", MaxText's gemma4_small block).

Every token gets one small input vector per layer, made once from the token and its embedding:

    ids   = E_pl[token] * sqrt(P)                          [L, P]  a second embedding table
    ctx   = rms_norm((x0 @ W_pl) * D^-0.5)                 [L, P]  x0: the scaled embedding
    u     = (ids + ctx) * 2^-0.5

and layer l adds, after its MLP, a gated projection of its slice u_l to the residual stream:

    x = x + norm(((act(x @ W_gate) * u_l) @ W_proj)

Parameters: top level ``per_layer_embedding`` [Vp, L*P], ``per_layer_projection`` [D, L*P],
``per_layer_norm`` {scale [P]}; in every layer ``ple_gate`` [D,P], ``ple_proj`` [P,D],
``ple_norm`` {scale [D]}. The L*P columns are layer-major, as the Hugging Face tables.

Legend: B batch, T length, D hidden, L layers, P per-layer width, Vp its vocabulary.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.models import layers as L
from jaxtrain.models.spec import ParamSpec, _linear_init, _norm


def model_specs(cfg) -> dict:
    """The top-level :class:`ParamSpec` entries (empty without per-layer inputs)."""
    P = cfg.per_layer_input_size
    if not P:
        return {}
    D, LP, dt = cfg.hidden_size, cfg.num_layers * P, cfg.param_dtype
    V = cfg.per_layer_vocab_size or cfg.vocab_size
    return {"per_layer_embedding": ParamSpec((V, LP), dt, ("vocab", "embed"),
                                             _linear_init(cfg, 1, 0)),
            "per_layer_projection": ParamSpec((D, LP), dt, ("embed", "mlp"),
                                              _linear_init(cfg, 0, 1)),
            "per_layer_norm": _norm(cfg, P)}


def layer_specs(cfg) -> dict:
    """One layer's gate, projection and norm (empty without per-layer inputs)."""
    P = cfg.per_layer_input_size
    if not P:
        return {}
    D, dt = cfg.hidden_size, cfg.param_dtype
    return {"ple_gate": ParamSpec((D, P), dt, ("embed", "mlp"), _linear_init(cfg, 0, 1)),
            "ple_proj": ParamSpec((P, D), dt, ("mlp", "embed"),
                                  _linear_init(cfg, 0, 1, output_layer=True)),
            "ple_norm": _norm(cfg, cfg.hidden_size)}


def inputs(params: dict, tokens, x, cfg):
    """u [B,T,L,P] for tokens [B,T] and their scaled embeddings x [B,T,D] (module doc)."""
    B, T = tokens.shape
    P, dt = cfg.per_layer_input_size, cfg.compute_dtype
    table = params["per_layer_embedding"].astype(dt)
    ids = jnp.take(table, tokens, axis=0) * jnp.asarray(P ** 0.5, dt)
    ctx = L.dense(x, params["per_layer_projection"], None, "btd,dk->btk", "ple_model_proj", cfg)
    ctx = ctx * jnp.asarray(cfg.hidden_size ** -0.5, dt)
    ctx = L.norm(params["per_layer_norm"], ctx.reshape(B, T, cfg.num_layers, P), cfg)
    return ((ids.reshape(B, T, cfg.num_layers, P) + ctx) * jnp.asarray(2 ** -0.5, dt)
            ).astype(dt)


def block(p: dict, x, u, cfg):
    """The residual stream x [B,T,D] after layer's per-layer input u [B,T,P] is added."""
    g = L.activation(cfg.activation, L.dense(x, p["ple_gate"], None, "btd,dp->btp",
                                             "ple_gate", cfg))
    h = L.dense(g * u.astype(g.dtype), p["ple_proj"], None, "btp,pd->btd", "ple_proj", cfg)
    return (x + L.norm(p["ple_norm"], h, cfg)).astype(x.dtype)
