"""Parameter declarations: each parameter once, with shape, dtype, logical axes and initializer.

From :func:`param_specs` come :func:`abstract` (shapes), :func:`logical_axes` (for the mesh
rules) and :func:`init` (jitted, optionally born sharded). The tree is a plain nested dict:

    embedding [V,D]; position_embedding [P,D] (learned_absolute); output [D,V] (untied)
    final_norm {scale [D], bias [D] (LayerNorm)}
    layers: attn_norm, mlp_norm       {scale, bias} (pre_norm); post_attn_norm, post_mlp_norm
            attn {wq [D,N,H], wk/wv [D,K,H], wo [N,H,D], bq [N,H], bk/bv [K,H], bo [D],
                  q_norm/k_norm {scale [H] ([N*H], [K*H] across heads), bias}, sinks [N] (fp32),
                  v_norm {scale [H]} (v_norm 'scaled')}
                  (multi-latent attention: the attn tree of mla.py)
            mlp  {wi_0/wi_1 [D,F] (gated) or wi [D,F], wo [F,D], bi_0/bi_1/bi [F], bo [D]}
                  wg [D,N,H] (attention_output_gate); layer_scalar [1] (Gemma 4, not trained)
    moe_layers: the MoE layers (``cfg.moe``), as ``layers`` but with ``moe`` for ``mlp``:
            moe  {router {w [D,E], bias [E], expert_bias [E], qb_beta [E], k3_hist [E,bins]
                          (fp32, not trained)},
                  experts {wi_0/wi_1 or wi [E,D,Fe], wo [E,Fe,D], bi_* [E,Fe], bo [E,D]}
                  (D: the latent width with moe.latent_size, then also latent_in {w [D,Dl],
                  b} and latent_out {w [Dl,D], b} around them),
                  shared {as mlp, with the shared expert's width}, shared_gate [D,1],
                  experts_norm/experts_post_norm/shared_post_norm (branch_norms);
                  router scale [D] (router_input_norm), expert_scale [E] (per_expert_scale)}
            with attention_output_dim A (qwen3_custom_moe): attn wo [N,H,A], mlp_norm [A],
            the moe tree at width A and up_proj {w [A,D]} (when A != D)
    linear_layers, linear_moe_layers: as layers / moe_layers with a Gated DeltaNet mixer
            ``linear_attn`` (linear_attention.py) for ``attn``
    global_layers, global_moe_layers: Gemma 4's global layers, ``attn`` with their own K and H
            (``cfg.attention_shape(wide=True)``) and no ``wv`` with attention_k_eq_v
    kv_shared_layers, global_kv_shared_layers: Gemma 4 small's KV-sharing layers, without
            wk/wv/bk/bv/k_norm/v_norm, the MLP 2F wide with double_wide_shared_mlp
    per_layer_embedding, per_layer_projection, per_layer_norm; per layer ple_gate, ple_proj,
            ple_norm: Gemma 4 small's per-layer inputs (per_layer.py)
            attn_hc, mlp_hc {w, b, alpha, norm}: hyper-connections of each half (hyper.py)
    hc_head {w [nD,n], b [n], alpha [1]}: DeepSeek-V4's learned collapse of the streams
    attn_res_head {norm [D], proj [D]}; per layer attn_res, mlp_res: attention residuals'
            mixers (attn_res.py)
    hash_routes [Lh,V,k] (expert ids as float32, not trained, replicated): hash routing's
            experts per token
    csa_layers, csa_moe_layers, hca_layers, hca_moe_layers: DeepSeek-V4's compressing layers
            (compressed.py; every layer's ``attn`` is that module's with compress_ratios)
    mtp: the multi-token-prediction modules (``cfg.mtp_num_layers``; one with
            mtp_repeated_layer), each leaf stacked over them: enorm, hnorm, final_norm
            {scale}, eh_proj [2D,D], layer (a layer tree of the last layer's stack; a hybrid
            model's: layers {"0", "1", ...}, one per symbol of its MTP pattern)
    conv_layers, conv_moe_layers: LFM2's, as layers / moe_layers with a gated short
            convolution ``short_conv`` (short_conv.py) for ``attn``
    hybrid models (``cfg.hybrid_layers``): one half of a layer each, with its norms:
            mamba_layers {attn_norm, mamba (mamba.py)}, attention_layers {attn_norm, attn},
            gdn_layers {attn_norm, linear_attn}, mlp_layers {mlp_norm, mlp},
            moe_mlp_layers {mlp_norm, moe}

Every leaf under ``layers`` carries a stacked layer axis of size L at position
``cfg.param_scan_axis`` (MaxText's default 1: ``wq`` is [D,L,N,H], a norm scale [D,L]). With
MoE, ``layers`` stacks only the dense layers and ``moe_layers`` the MoE ones, each in layer
order (:func:`layer_kinds` says which stack layer i is in); either may be absent. The
declaration primitives (:class:`ParamSpec`, the initializers) and the stacks come from
:mod:`jaxtrain.models.spec` and are importable from here too.

Legend: V vocab, D hidden, P positions, N query heads, K kv heads (query groups), H head dim,
F ffn hidden, L layers.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxtrain.models import attn_res, compressed, hyper, per_layer
from jaxtrain.models.dsa import indexer_specs
from jaxtrain.models.mla import mla_specs
from jaxtrain.models.linear_attention import linear_attention_specs
from jaxtrain.models.mamba import mamba_specs
from jaxtrain.models.short_conv import short_conv_specs
from jaxtrain.models.spec import (CONV_STACKS, DENSE_STACK, DSA_SHARED_STACKS,
                                  FFN_ONLY_STACKS, GLOBAL_STACKS, KV_SHARED_STACKS,
                                  LINEAR_STACKS, MAMBA_STACK,
                                  MIXER_ONLY_STACKS, MOE_STACKS, STACKS, Init, ParamSpec,
                                  _is_spec, _leaf_key, _linear_init, _norm, _zeros, layer_kinds,
                                  layer_slots, mtp_layer_kinds)


def _layer_specs(cfg, kind: str = "layers") -> dict:
    wide = kind in GLOBAL_STACKS
    D, N, F = cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size
    K, H = cfg.attention_shape(wide)
    dt = cfg.param_dtype
    attn = {
        "wq": ParamSpec((D, N, H), dt, ("embed", "q_heads", "kv"), _linear_init(cfg, 0, (1, 2))),
        "wk": ParamSpec((D, K, H), dt, ("embed", "kv_heads", "kv"), _linear_init(cfg, 0, (1, 2))),
        "wv": ParamSpec((D, K, H), dt, ("embed", "kv_heads", "kv"), _linear_init(cfg, 0, (1, 2))),
        "wo": ParamSpec((N, H, cfg.attention_output_dim or D), dt, ("q_heads", "kv", "embed"),
                        _linear_init(cfg, (0, 1), 2, output_layer=True)),
    }
    if wide and cfg.attention_k_eq_v:   # Gemma 4: the values come from the key projection
        del attn["wv"]
    if cfg.v_norm == "scaled":
        attn["v_norm"] = _norm(cfg, H)
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        attn["bq"] = ParamSpec((N, H), dt, ("q_heads", "kv"), _zeros)
        attn["bk"] = ParamSpec((K, H), dt, ("kv_heads", "kv"), _zeros)
        attn["bv"] = ParamSpec((K, H), dt, ("kv_heads", "kv"), _zeros)
    if cfg.add_bias_linear:
        attn["bo"] = ParamSpec((D,), dt, ("embed",), _zeros)
    if cfg.qk_layernorm and cfg.qk_norm_across_heads:
        attn["q_norm"], attn["k_norm"] = _norm(cfg, N * H), _norm(cfg, K * H)
    elif cfg.qk_layernorm:
        attn["q_norm"], attn["k_norm"] = _norm(cfg, H), _norm(cfg, H)
    if cfg.compress_ratios is not None:   # DeepSeek-V4 (compressed.py)
        attn = compressed.specs(cfg, kind)
    if cfg.multi_latent_attention:
        attn = mla_specs(cfg)
        if cfg.dsa_index_heads and kind not in DSA_SHARED_STACKS:   # DSA's indexer (dsa.py)
            attn["indexer"] = indexer_specs(cfg)
    if cfg.attention_sinks:   # fp32 whatever weight_dtype is, zero-initialised (Primus)
        attn["sinks"] = ParamSpec((N,), jnp.float32, ("q_heads",), _zeros)
    if cfg.attention_output_gate:   # gates the heads' outputs (MLA: v_head_dim wide)
        Hg = cfg.v_head_dim if cfg.multi_latent_attention else H
        attn["wg"] = ParamSpec((D, N, Hg), dt, ("embed", "q_heads", "kv"),
                               _linear_init(cfg, 0, (1, 2)))
    if kind in KV_SHARED_STACKS:   # Gemma 4 small: keys and values come from an earlier layer
        attn = {n: s for n, s in attn.items() if n not in ("wk", "wv", "bk", "bv", "k_norm",
                                                           "v_norm")}
        F = F * 2 if cfg.double_wide_shared_mlp else F
    mixer = ({"linear_attn": linear_attention_specs(cfg)} if kind in LINEAR_STACKS
             else {"mamba": mamba_specs(cfg)} if kind == MAMBA_STACK
             else {"short_conv": short_conv_specs(cfg)} if kind in CONV_STACKS
             else {"attn": attn})
    ffn = {"moe": _moe_specs(cfg)} if kind in MOE_STACKS else {"mlp": _mlp_specs(cfg, F)}
    halves = []
    streams = cfg.hc_streams > 1   # hyper-connections: each half mixes the streams (hyper.py)
    if kind not in FFN_ONLY_STACKS:
        halves.append(({"attn_norm": _norm(cfg, D)} if cfg.pre_norm else {}) | mixer
                      | ({"post_attn_norm": _norm(cfg, D)} if cfg.post_attention_norm else {})
                      | ({"attn_hc": hyper.specs(cfg)} if streams else {}))
    if kind not in MIXER_ONLY_STACKS:
        A = cfg.moe_width
        if A != D:   # qwen3_custom_moe: the MoE output's projection up to the residual stream
            ffn["up_proj"] = {"w": ParamSpec((A, D), dt, ("mlp", "embed"),
                                             _linear_init(cfg, 0, 1, output_layer=True))}
        own_norm = cfg.pre_norm and not cfg.parallel_shared_norm
        halves.append(({"mlp_norm": _norm(cfg, A)} if own_norm else {}) | ffn
                      | ({"post_mlp_norm": _norm(cfg, D)} if cfg.post_mlp_norm else {})
                      | ({"mlp_hc": hyper.specs(cfg)} if streams else {}))
    scalar = ({"layer_scalar": ParamSpec((1,), dt, (None,), jax.nn.initializers.ones)}
              if cfg.layer_scalar else {})
    extra = per_layer.layer_specs(cfg) | scalar | attn_res.layer_specs(cfg)
    return functools.reduce(lambda a, b: a | b, halves, {}) | extra


def _mlp_specs(cfg, F: int) -> dict:
    D, dt = cfg.hidden_size, cfg.param_dtype
    wi = lambda: ParamSpec((D, F), dt, ("embed", "mlp"), _linear_init(cfg, 0, 1))  # noqa: E731
    names = ("0", "1") if cfg.gated_linear_unit else ("",)
    mlp = {f"wi{'_' + n if n else ''}": wi() for n in names}
    mlp["wo"] = ParamSpec((F, D), dt, ("mlp", "embed"), _linear_init(cfg, 0, 1, output_layer=True))
    if cfg.add_bias_linear:
        for n in names:
            mlp[f"bi{'_' + n if n else ''}"] = ParamSpec((F,), dt, ("mlp",), _zeros)
        mlp["bo"] = ParamSpec((D,), dt, ("embed",), _zeros)
    return mlp


def _expert_init(cfg, output_layer=False) -> Init:
    """_linear_init for [E, in, out] expert weights (Xavier fans per expert)."""
    if cfg.init_method_xavier_uniform:
        return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", 1, 2, 0)
    return _linear_init(cfg, 1, 2, output_layer)


def _moe_specs(cfg) -> dict:
    """Router, routed experts [E, ...] and the optional shared expert of one MoE layer."""
    m, D, dt = cfg.moe, cfg.moe_width, cfg.param_dtype
    E, F = m.num_experts, m.ffn_hidden_size
    router = {"w": ParamSpec((D, E), dt, ("embed", None), _linear_init(cfg, 0, 1))}
    if m.router_bias:
        router["bias"] = ParamSpec((E,), dt, (None,), _zeros)
    if m.score_bias:
        router["score_bias"] = ParamSpec((E,), dt, (None,), _zeros)
    if m.router_input_norm:
        router["scale"] = ParamSpec((D,), dt, ("embed",), jax.nn.initializers.ones)
    if m.per_expert_scale:
        router["expert_scale"] = ParamSpec((E,), dt, (None,), jax.nn.initializers.ones)
    if m.expert_bias:
        router["expert_bias"] = ParamSpec((E,), jnp.float32, (None,), _zeros)
    if m.quantile_balancing:   # quantile balancing's bias (not trained; moe/step.py)
        router["qb_beta"] = ParamSpec((E,), jnp.float32, (None,), _zeros)
    if m.bias_rule == "quantile" and m.k3_interval > 1:   # K3's pooled margin histograms
        router["k3_hist"] = ParamSpec((E, m.k3_bins), jnp.float32, (None, None), _zeros)
    names = ("_0", "_1") if cfg.gated_linear_unit else ("",)
    De = m.latent_size or D   # the width the routed experts work in
    experts = {f"wi{n}": ParamSpec((E, De, F), dt, ("exp", "embed", "mlp"), _expert_init(cfg))
               for n in names}
    experts["wo"] = ParamSpec((E, F, De), dt, ("exp", "mlp", "embed"),
                              _expert_init(cfg, output_layer=True))
    if cfg.add_bias_linear:
        experts.update({f"bi{n}": ParamSpec((E, F), dt, ("exp", "mlp"), _zeros) for n in names})
        experts["bo"] = ParamSpec((E, De), dt, ("exp", "embed"), _zeros)
    tree = {"router": router, "experts": experts}
    if m.latent_size:   # Megatron's fc1/fc2_latent_proj around the routed experts
        for name, shape, axes, out in (("latent_in", (D, De), ("embed", None), False),
                                       ("latent_out", (De, D), (None, "embed"), True)):
            tree[name] = {"w": ParamSpec(shape, dt, axes, _linear_init(cfg, 0, 1, out))}
            if cfg.add_bias_linear:
                tree[name]["b"] = ParamSpec(shape[1:], dt, axes[1:], _zeros)
        if m.latent_norm:   # Kimi K3: the combined routed output normed in the latent space
            tree["latent_norm"] = _norm(cfg, De)
    if m.shared_expert_size:
        tree["shared"] = _mlp_specs(cfg, m.shared_expert_size)
    if m.shared_expert_gate:
        tree["shared_gate"] = ParamSpec((D, 1), dt, ("embed", None), _linear_init(cfg, 0, 1))
    if m.branch_norms:   # Gemma 4: before the experts, after them, after the shared expert
        tree.update(experts_norm=_norm(cfg, D), experts_post_norm=_norm(cfg, D),
                    shared_post_norm=_norm(cfg, D))
    return tree


def _mtp_specs(cfg) -> dict:
    """One multi-token-prediction module (mtp.py): the embedding's and the hidden state's
    norms, their joint projection [2D, D] (embedding rows first), a decoder layer of the last
    layer's kind (``layer``; a hybrid model's: the sublayers of its MTP pattern, ``layers``
    {"0": ..., "1": ...}) and its output norm."""
    D = cfg.hidden_size
    kinds = mtp_layer_kinds(cfg)
    cfg = mtp_layer_config(cfg)
    inner = ({"layers": {str(j): _layer_specs(cfg, k) for j, k in enumerate(kinds)}}
             if cfg.mtp_hybrid_layers else {"layer": _layer_specs(cfg, kinds[0])})
    head = {"hc_head": hyper.head_specs(cfg)} if cfg.hc_head else {}
    return {"enorm": _norm(cfg, D), "hnorm": _norm(cfg, D), "final_norm": _norm(cfg, D),
            "eh_proj": ParamSpec((2 * D, D), cfg.param_dtype, ("mlp", "embed"),
                                 _linear_init(cfg, 0, 1)), **inner, **head}


def mtp_layer_config(cfg):
    """The config an MTP layer runs with: the model's, without attention residuals (Kimi K3's
    MTP layer reads the decoder's collapsed output)."""
    return cfg.replace(attn_res_block_size=0) if cfg.attn_res_block_size else cfg


def layer_tree(params: dict, cfg, i: int) -> dict:
    """Layer i's parameters without the stacked axis (numpy or jax arrays alike)."""
    kind, j = layer_slots(cfg)[i]
    take = (lambda a: a.take(j, axis=cfg.param_scan_axis))
    return jax.tree.map(take, params[kind])


def param_specs(cfg) -> dict:
    """The tree of :class:`ParamSpec` for ``cfg``."""
    D, V, dt = cfg.hidden_size, cfg.vocab_size, cfg.param_dtype
    tree = {
        "embedding": ParamSpec((V, D), dt, ("vocab", "embed"), _linear_init(cfg, 1, 0)),
        "final_norm": _norm(cfg, D),
        **per_layer.model_specs(cfg),
    }
    kinds = layer_kinds(cfg)
    for kind in STACKS:
        if kind in kinds or (kind == DENSE_STACK and not kinds):
            tree[kind] = jax.tree.map(lambda s: s.stacked(kinds.count(kind), cfg.param_scan_axis),
                                      _layer_specs(cfg, kind), is_leaf=_is_spec)
    if cfg.mtp_num_layers:
        depths = 1 if cfg.mtp_repeated_layer else cfg.mtp_num_layers
        tree["mtp"] = jax.tree.map(lambda s: s.stacked(depths, cfg.param_scan_axis),
                                   _mtp_specs(cfg), is_leaf=_is_spec)
    if cfg.position_embedding_type == "learned_absolute":
        tree["position_embedding"] = ParamSpec((cfg.max_position_embeddings, D), dt,
                                               (None, "embed"), _linear_init(cfg, 1, 0))
    if cfg.untie_embeddings_and_output_weights:
        tree["output"] = ParamSpec((D, V), dt, ("embed", "vocab"), _linear_init(cfg, 0, 1))
    if cfg.hc_head:
        tree["hc_head"] = hyper.head_specs(cfg)
    if cfg.attn_res_block_size:
        tree["attn_res_head"] = attn_res.mixer_specs(cfg)
    if cfg.moe is not None and cfg.moe.hash_layers:
        m = cfg.moe
        tree["hash_routes"] = ParamSpec((m.hash_layers, V, m.topk), jnp.float32,
                                        (None, None, None), _hash_init(m.num_experts))
    return tree


def _hash_init(num_experts: int) -> Init:
    """A random table of k distinct experts per token id (hash routing's [Lh, V, k]); expert
    ids stored as float32 (exact below 2^24) so that the table is an ordinary, untrained leaf
    wherever parameters are differentiated."""
    def init(key, shape, dtype):
        *lead, k = shape
        noise = jax.random.uniform(key, (*lead, num_experts))
        return jax.lax.top_k(noise, k)[1].astype(dtype)

    return init


def abstract(cfg) -> dict:
    """ShapeDtypeStruct tree of the parameters."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), param_specs(cfg),
                        is_leaf=_is_spec)


def logical_axes(cfg) -> dict:
    """PartitionSpec tree of logical axis names (map to mesh axes with the rule table)."""
    return jax.tree.map(lambda s: PartitionSpec(*s.axes), param_specs(cfg), is_leaf=_is_spec)


def layer_axes(cfg, kind: str = DENSE_STACK) -> dict:
    """Logical axes of one layer's parameters (the stacked ``kind`` tree without L)."""
    return jax.tree.map(lambda s: PartitionSpec(*s.axes), _layer_specs(cfg, kind),
                        is_leaf=_is_spec)


@functools.lru_cache(maxsize=None)
def _make_fn(cfg) -> Callable[[jax.Array], dict]:
    specs = param_specs(cfg)

    def make(key):
        return jax.tree_util.tree_map_with_path(lambda p, s: s.make(_leaf_key(key, p)), specs,
                                                is_leaf=_is_spec)

    return make


def init(cfg, key: jax.Array, shardings: Any = None) -> dict:
    """Random parameters, jitted; with ``shardings`` (a matching tree) they are born sharded.

    Each leaf's key is derived from its path, so adding a parameter leaves the others unchanged.
    """
    return jax.jit(_make_fn(cfg), out_shardings=shardings)(key)

