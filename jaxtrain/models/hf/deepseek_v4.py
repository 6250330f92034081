"""DeepSeek-V4 (transformers' ``deepseek_v4``; models/compressed.py): every layer attends over a
sliding window of one shared key=value head with per-head sinks; compressed sparse layers (ratio
4, ``self_attn.compressor`` with its ``indexer``) and heavily compressed ones (``compressor``)
add compressed entries. The streams of manifold-constrained hyper-connections (``attn_hc``,
``ffn_hc``: fn/base/scale) and the final ``hc_head``; MoE in every layer with sqrtsoftplus
scores, an expert bias on the learned routers and ``gate.tid2eid`` tables on the hash-routed
first layers (our ``hash_routes``), a clamped SwiGLU in experts and the shared expert.

Checkpoints are read and written in the layout transformers saves (DeepSeek's own names, which
its conversion mapping renames on load). Linears are [out, in]; the two-series projections of
the sparse compressors hold the series that pools over the previous window first ([2W, D] ->
[D, 2, W]); ``wo_a`` is [G*Rg, N*H/G] with the heads of a group consecutive. The
hyper-connection norms of HF have no weight: ours (a learned scale) load as ones and are folded
into ``fn`` on export. The ``mtp.*`` tensors transformers skips are skipped here too.

Legend: D hidden, N heads, H head width, G groups, Rg group rank, n streams, E experts.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.moe import moe_pattern
from jaxtrain.models.hf.common import Adapter, Tensors, hf_linear, stacks
from jaxtrain.models.params import layer_slots, layer_tree
from jaxtrain.models.spec import CSA_STACKS, HCA_STACKS

ARCHITECTURES = {"deepseek_v4": "DeepseekV4ForCausalLM"}
EXPERT_NAMES = (("wi_0", "w1"), ("wi_1", "w3"), ("wo", "w2"))   # gate, up, down


def picks(cfg: ModelConfig) -> str | None:
    return "deepseek_v4" if cfg.compress_ratios is not None else None


# ---------------------------------------------------------------- tensors in

def _hc_in(t: Tensors, pre: str, cfg) -> dict:
    n, D = cfg.hc_streams, cfg.hidden_size
    return {"w": t(pre + "fn").T, "b": t(pre + "base"), "alpha": t(pre + "scale"),
            "norm": {"scale": np.ones(n * D, np.float32)}}


def _pool_in(t: Tensors, pre: str, halves: int) -> dict:
    """A compressor's projections [halves*W, D] -> [D, halves, W], ``ape`` [m, halves*W]."""
    kv = t(pre + "wkv.weight")
    W = kv.shape[0] // halves
    proj = lambda a: a.T.reshape(a.shape[1], halves, W)  # noqa: E731
    bias = t(pre + "ape")
    return {"wkv": proj(kv), "wgate": proj(t(pre + "wgate.weight")),
            "bias": bias.reshape(bias.shape[0], halves, W),
            "norm": {"scale": t(pre + "norm.weight")}}


def _attn_in(t: Tensors, pre: str, kind: str, cfg) -> dict:
    D, N, H = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels
    G, Rg = cfg.o_groups, cfg.o_lora_rank
    w = lambda n: t(pre + n + ".weight").T  # noqa: E731
    o_a = t(pre + "wo_a.weight").reshape(G, Rg, N // G, H)
    attn = {"wq_a": w("wq_a"), "q_a_norm": {"scale": t(pre + "q_norm.weight")},
            "wq_b": w("wq_b").reshape(-1, N, H), "wkv": w("wkv"),
            "kv_norm": {"scale": t(pre + "norm.weight")},
            "wo_a": o_a.transpose(0, 2, 3, 1).reshape(N, H, Rg),
            "wo_b": w("wo_b").reshape(G, Rg, D), "sinks": t(pre + "attn_sink")}
    if kind in CSA_STACKS:
        attn["compressor"] = _pool_in(t, pre + "compressor.", 2)
        Hi, Di = cfg.compress_index_heads, cfg.compress_index_head_dim
        attn["indexer"] = {"wq_b": w("indexer.wq_b").reshape(-1, Hi, Di),
                           "wweights": w("indexer.weights_proj"),
                           "compressor": _pool_in(t, pre + "indexer.compressor.", 2)}
    elif kind in HCA_STACKS:
        attn["compressor"] = _pool_in(t, pre + "compressor.", 1)
    return attn


def params(t: Tensors, cfg: ModelConfig, hf: dict) -> dict:
    """The tree from the checkpoint in the layout transformers saves (DeepSeek's own names:
    ``attn.*``, ``ffn.*``, ``hc_attn_*``, experts one by one as w1/w2/w3)."""
    kinds = [kind for kind, _ in layer_slots(cfg)]
    E, routes = cfg.moe.num_experts, []

    def layer(i):
        pre = f"model.layers.{i}."
        ffn = pre + "ffn."
        router = {"w": t(ffn + "gate.weight").T}
        if i < cfg.moe.hash_layers:
            routes.append(t(ffn + "gate.tid2eid"))
            router["expert_bias"] = np.zeros(E, np.float32)
        else:
            router["expert_bias"] = t(ffn + "gate.bias")
        expert = lambda e, n: t(f"{ffn}experts.{e}.{n}.weight").T  # noqa: E731
        experts = {ours: np.stack([expert(e, n) for e in range(E)])
                   for ours, n in EXPERT_NAMES}
        return {"attn_norm": {"scale": t(pre + "attn_norm.weight")},
                "attn": _attn_in(t, pre + "attn.", kinds[i], cfg),
                "mlp_norm": {"scale": t(pre + "ffn_norm.weight")},
                "moe": {"router": router, "experts": experts,
                        "shared": {ours: t(f"{ffn}shared_experts.{n}.weight").T
                                   for ours, n in EXPERT_NAMES}},
                "attn_hc": _hc_in(t, pre + "hc_attn_", cfg),
                "mlp_hc": _hc_in(t, pre + "hc_ffn_", cfg)}

    for name in [k for k in t.left if k.startswith(("mtp.", "model.mtp."))]:
        t.drop(name)
    tree = {"embedding": t("model.embed_tokens.weight"), **stacks(layer, cfg),
            "final_norm": {"scale": t("model.norm.weight")},
            "hc_head": {"w": t("model.hc_head.hc_fn").T, "b": t("model.hc_head.hc_base"),
                        "alpha": t("model.hc_head.hc_scale")},
            "output": t("head.weight").T}
    if routes:
        tree["hash_routes"] = np.stack(routes).astype(np.float32)
    return tree


# ---------------------------------------------------------------- tensors out

def _hc_out(p: dict, pre: str) -> dict[str, np.ndarray]:
    """HF's norm has no weight: ours is folded into the mapping (rms(x)*s @ W = rms(x) @ sW)."""
    w = np.asarray(p["w"], np.float32) * np.asarray(p["norm"]["scale"], np.float32)[:, None]
    return {pre + "fn": w.T, pre + "base": np.asarray(p["b"]),
            pre + "scale": np.asarray(p["alpha"])}


def _pool_out(p: dict, pre: str) -> dict[str, np.ndarray]:
    wkv = np.asarray(p["wkv"])
    D = wkv.shape[0]
    bias = np.asarray(p["bias"])
    return {pre + "wkv.weight": wkv.reshape(D, -1).T,
            pre + "wgate.weight": np.asarray(p["wgate"]).reshape(D, -1).T,
            pre + "ape": bias.reshape(bias.shape[0], -1),
            pre + "norm.weight": np.asarray(p["norm"]["scale"])}


def _attn_out(a: dict, pre: str, cfg) -> dict[str, np.ndarray]:
    N, H, G, Rg = cfg.num_attention_heads, cfg.kv_channels, cfg.o_groups, cfg.o_lora_rank
    wo_a = np.asarray(a["wo_a"]).reshape(G, N // G, H, Rg).transpose(0, 3, 1, 2)
    out = {pre + "wq_a.weight": hf_linear(a["wq_a"]),
           pre + "q_norm.weight": np.asarray(a["q_a_norm"]["scale"]),
           pre + "wq_b.weight": hf_linear(a["wq_b"]), pre + "wkv.weight": hf_linear(a["wkv"]),
           pre + "norm.weight": np.asarray(a["kv_norm"]["scale"]),
           pre + "wo_a.weight": wo_a.reshape(G * Rg, -1),
           pre + "wo_b.weight": hf_linear(np.asarray(a["wo_b"]).reshape(G * Rg, -1)),
           pre + "attn_sink": np.asarray(a["sinks"])}
    if "compressor" in a:
        out.update(_pool_out(a["compressor"], pre + "compressor."))
    if "indexer" in a:
        ix = a["indexer"]
        out.update(_pool_out(ix["compressor"], pre + "indexer.compressor."))
        out[pre + "indexer.wq_b.weight"] = hf_linear(ix["wq_b"])
        out[pre + "indexer.weights_proj.weight"] = hf_linear(ix["wweights"])
    return out


def tensors(params: dict, cfg: ModelConfig, family: str = "deepseek_v4"
            ) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    routes = params.get("hash_routes")
    for i in range(cfg.num_layers):
        p, pre = layer_tree(params, cfg, i), f"model.layers.{i}."
        ffn, moe = pre + "ffn.", p["moe"]
        out.update(_attn_out(p["attn"], pre + "attn.", cfg))
        out[ffn + "gate.weight"] = hf_linear(moe["router"]["w"])
        if i < cfg.moe.hash_layers:
            out[ffn + "gate.tid2eid"] = np.asarray(routes[i]).astype(np.int64)
        else:
            out[ffn + "gate.bias"] = np.asarray(moe["router"]["expert_bias"], np.float32)
        for ours, theirs in EXPERT_NAMES:
            for e, w in enumerate(np.asarray(moe["experts"][ours])):
                out[f"{ffn}experts.{e}.{theirs}.weight"] = w.T
            out[f"{ffn}shared_experts.{theirs}.weight"] = hf_linear(moe["shared"][ours])
        out[pre + "attn_norm.weight"] = np.asarray(p["attn_norm"]["scale"])
        out[pre + "ffn_norm.weight"] = np.asarray(p["mlp_norm"]["scale"])
        out.update(_hc_out(p["attn_hc"], pre + "hc_attn_"))
        out.update(_hc_out(p["mlp_hc"], pre + "hc_ffn_"))
    head = params["hc_head"]
    out.update({"model.embed_tokens.weight": np.asarray(params["embedding"]),
                "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
                "model.hc_head.hc_fn": np.asarray(head["w"]).T,
                "model.hc_head.hc_base": np.asarray(head["b"]),
                "model.hc_head.hc_scale": np.asarray(head["alpha"]),
                "head.weight": np.asarray(params["output"]).T})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ---------------------------------------------------------------- config.json out

def problems(cfg: ModelConfig, family: str = "deepseek_v4") -> dict:
    m = cfg.moe
    heavy = cfg.compress_dense_ratio
    return {
        "compress_ratios": cfg.compress_ratios is None,
        "compress_sparse_ratio": cfg.compress_sparse_ratio != 4,
        "hc_streams": cfg.hc_streams < 2 or not cfg.hc_head or cfg.hc_style != "deepseek"
        or cfg.hc_lite,
        "attention_sinks": not cfg.attention_sinks,
        "sliding_window": cfg.sliding_window is None,
        "untie_embeddings_and_output_weights": not cfg.untie_embeddings_and_output_weights,
        "gated_linear_unit": not cfg.gated_linear_unit or cfg.activation != "silu",
        "add_bias_linear": cfg.add_bias_linear,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor),
        "compress_dense_ratio": heavy == 4,
        "moe": m is None or not all(moe_pattern(m, cfg.num_layers)),
        "moe.score_function": m is None or m.score_function not in ("sqrtsoftplus", "sigmoid"),
        "moe.shared_expert_size": m is None or m.shared_expert_size != m.ffn_hidden_size,
        "moe.expert_bias": m is None or not m.expert_bias,
        "moe.num_groups": m is None or bool(m.num_groups),
        "moe.router_bias": m is None or m.router_bias,
        "moe.activation": m is None or m.activation is not None or m.glu_limit is not None,
        "moe.latent_size": m is None or m.latent_size is not None,
        "moe.topk": m is None or m.topk < 2,
        "glu_clamp": cfg.glu_clamp is None,
    }


def config(cfg: ModelConfig, family: str = "deepseek_v4") -> dict:
    m = cfg.moe
    heavy = cfg.compress_dense_ratio or 128
    names = {0: "sliding_attention", 4: "compressed_sparse_attention",
             heavy: "heavily_compressed_attention"}
    rope = {"rope_type": "default"}
    if cfg.rope_type == "yarn":
        rope = {"rope_type": "yarn", "factor": cfg.yarn_scaling_factor,
                "original_max_position_embeddings": cfg.original_max_position_embeddings,
                "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                "truncate": cfg.yarn_truncate}
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": 1,
            "head_dim": cfg.kv_channels, "q_lora_rank": cfg.q_lora_rank,
            "partial_rotary_factor": cfg.qk_pos_emb_head_dim / cfg.kv_channels,
            "moe_intermediate_size": m.ffn_hidden_size, "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.topk, "n_shared_experts": 1,
            "scoring_func": m.score_function, "norm_topk_prob": True,
            "routed_scaling_factor": m.topk_scaling_factor or 1.0,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_theta": cfg.rotary_base, "compress_rope_theta": cfg.compress_rotary_base,
            "rope_parameters": {**rope, "rope_theta": cfg.compress_rotary_base},
            "layer_types": [names[r] for r in cfg.compress_ratios],
            "compress_rates": {"compressed_sparse_attention": 4,
                               "heavily_compressed_attention": heavy},
            "mlp_layer_types": ["hash_moe" if i < m.hash_layers else "moe"
                                for i in range(cfg.num_layers)],
            "hc_mult": cfg.hc_streams, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
            "hc_eps": cfg.hc_eps, "swiglu_limit": cfg.glu_clamp,
            "sliding_window": cfg.sliding_window, "o_groups": cfg.o_groups,
            "o_lora_rank": cfg.o_lora_rank, "index_n_heads": cfg.compress_index_heads,
            "index_head_dim": cfg.compress_index_head_dim,
            "index_topk": cfg.compress_index_topk, "num_nextn_predict_layers": 0,
            "rms_norm_eps": cfg.norm_epsilon, "hidden_act": "silu", "attention_bias": False}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
