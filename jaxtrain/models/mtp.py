"""Multi-token prediction (DeepSeek-V3; Megatron's mtp_num_layers): after the decoder, D
modules each predict one token further ahead, the k-th from the (k-1)-th's hidden states and
the embeddings of the tokens k places on:

    h_0 = the decoder's final-normed hidden states [B,T,D]
    e_k = the embedding of the input tokens shifted k places left
    h_k = final_norm_k(layer_k([enorm_k(e_k), hnorm_k(h_{k-1})] eh_proj_k))
    loss_k = CE(output_layer(h_k), the targets shifted k places left)

A shift stays within its packed sequence: a position whose source lies past the end or in
another sequence reads token 0 and leaves the loss (Megatron's roll_tensor); the layers attend
within the original segments, with the original positions' RoPE. The k-th layer is of the last
decoder layer's kind (Kimi K3's ``mtp_mixer``: KDA or MLA with the last layer's FFN; never with
attention residuals) and is layer num_layers + k (per-layer patterns such as windows: the last
layer's); a hybrid model's is the sequence of sublayers its pattern names after '/', layers
num_layers + (k-1)·P + n for its P sublayers. The train step weighs loss_k like the main loss,
over its own tokens, and adds mtp_loss_scaling_factor times the mean over depths to the
objective (jaxtrain.step); the reported loss stays the main one. With hyper-connections and
their learned head (DeepSeek-V4) each depth lifts its input into the streams and collapses them
with its own head (``hc_head``) before its final norm. Parameters: params.py's ``mtp`` tree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models import dsa, hyper
from jaxtrain.models import layers as L
from jaxtrain.models.params import layer_axes, mtp_layer_config
from jaxtrain.models.spec import mtp_layer_kinds
from jaxtrain.models.remat import NO_REMAT, checkpoint_policy
from jaxtrain.models.transformer import decoder_layer, embed
from jaxtrain.parallel.sharding import gather_weights
from kernels.gated_delta.reference import sequence_numbers


def shift_left(x, k: int, seq=None):
    """x [B,T,...] shifted k places left along T; a position whose source lies past the end
    or in another sequence (``seq`` [B,T] sequence numbers; None: one per row) is zero."""
    T = x.shape[1]
    valid = jnp.broadcast_to(jnp.arange(T) < T - k, x.shape[:2])
    if seq is not None:
        valid = valid & (jnp.roll(seq, -k, axis=1) == seq)
    valid = valid.reshape(*valid.shape, *(1,) * (x.ndim - 2))
    return jnp.where(valid, jnp.roll(x, -k, axis=1), jnp.zeros((), x.dtype))


def sequences(segment_ids, tokens):
    """The sequence numbers shift_left keeps positions within (None without packing)."""
    B, T = tokens.shape
    return sequence_numbers(segment_ids, T, B)


def mtp_hidden_states(params: dict, hidden, tokens, ctx: dict, cfg):
    """(the D modules' hidden states, a list of [B,T,D]; their MoE statistics stacked [D·m, ...]
    (depth-major, m MoE sublayers per depth) or None) after the decoder's final-normed
    ``hidden``. ``ctx``: the decoder layers' context (transformer.layer_inputs; its segments and
    positions are the batch's)."""
    kinds = mtp_layer_kinds(cfg)
    seq = sequences(ctx.get("segment_ids"), tokens)
    policy = checkpoint_policy(cfg)
    lcfg = mtp_layer_config(cfg)

    def layer(p, x, i, kind):
        lctx = {**ctx, "stack": kind}   # global_aux_loss's moe_state has the MTP rows too
        out = decoder_layer(gather_weights(p, layer_axes(lcfg, kind)), x, i, lctx, lcfg)
        return out if isinstance(out, tuple) else (out, None)

    if policy is not NO_REMAT:
        layer = jax.checkpoint(layer, policy=policy, static_argnums=(3,))
    h, outs, stats = hidden, [], []
    for k in range(1, cfg.mtp_num_layers + 1):
        j = 0 if cfg.mtp_repeated_layer else k - 1
        p = jax.tree.map(lambda a: jnp.take(a, j, axis=cfg.param_scan_axis), params["mtp"])
        e = embed(params, shift_left(tokens, k, seq), cfg)
        if cfg.embedding_multiplier is not None:
            e = e * jnp.asarray(cfg.embedding_multiplier, e.dtype)
        if cfg.position_embedding_type == "learned_absolute":
            e = e + jnp.take(params["position_embedding"].astype(e.dtype),
                             shift_left(ctx["positions"], k, seq), axis=0)
        x = jnp.concatenate([L.norm(p["enorm"], e, cfg), L.norm(p["hnorm"], h, cfg)], -1)
        x = L.dense(x, p["eh_proj"], None, "btd,de->bte", "mtp_proj", cfg)
        x = hyper.expand(x.astype(cfg.residual_dtype), cfg)
        inner = ([p["layer"]] if "layer" in p else
                 [p["layers"][str(n)] for n in range(len(kinds))])
        with jax.named_scope(f"mtp_{k}"):
            for n, (kind, q) in enumerate(zip(kinds, inner)):
                x, s = layer(q, x, jnp.int32(cfg.num_layers + (k - 1) * len(kinds) + n), kind)
                s = dsa.pop(dsa.pop(s)[0], "dsa_keep")[0]
                stats += [] if s is None else [s]
        h = L.norm(p["final_norm"], hyper.contract(x, cfg, p.get("hc_head")), cfg)
        outs.append(h)
    return outs, (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)
