"""NemotronH and Mamba2: Megatron's hybrid stack (one sublayer per layer, each behind its own
RMSNorm: Mamba-2 mixers, attention without positional encoding, squared-ReLU MLPs, MoE layers of
squared-ReLU experts with a shared expert) and its all-Mamba case.

A Mamba-2 mixer's ``in_proj`` rows are [z (H*P), x (H*P), B (G*N), C (G*N), dt (H)] and its
depthwise ``conv1d`` [x | B | C, 1, W] (with a bias); jaxtrain keeps each part apart
(mamba.py). The published checkpoints name the trunk ``backbone.`` (transformers renames it
``model.`` on load; both are read, ``backbone.`` is written) and NemotronH's experts one by one
(``experts.{e}.up_proj``; the fused [E, F, D] form is read too). Latent MoE (Nemotron 3
Super/Ultra's ``moe_latent_size``): ``fc1_latent_proj`` / ``fc2_latent_proj`` around the experts,
which work in that width.

Legend: D hidden, H Mamba heads, P head width, G groups, N state width, W convolution width,
E experts, F expert width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (ACT_HF, Adapter, Tensors, dense_problems, ends_out,
                                       hf_linear, norm_scale, output_head, stacks)
from jaxtrain.models.moe import group_score_topk
from jaxtrain.models.params import layer_slots, layer_tree

ARCHITECTURES = {"nemotron_h": "NemotronHForCausalLM", "mamba2": "Mamba2ForCausalLM"}
_LAYER_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_MLP = (("wi", "up_proj"), ("wo", "down_proj"))
_LATENT = (("latent_in", "fc1_latent_proj"), ("latent_out", "fc2_latent_proj"))


def picks(cfg: ModelConfig) -> str | None:
    if cfg.hybrid_layers is None:
        return None
    return "mamba2" if set(cfg.hybrid_layers) == {"M"} else "nemotron_h"


def _prefix(t: Tensors) -> str:
    return "backbone." if any(k.startswith("backbone.") for k in t.left) else "model."


def _split(a, sizes) -> list:
    return np.split(a, np.cumsum(sizes)[:-1], axis=0)


def _mamba_in(t: Tensors, pre: str, cfg) -> dict:
    H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    D = cfg.hidden_size
    z, x, b, c, dt = _split(t(pre + "in_proj.weight"), (H * P, H * P, G * N, G * N, H))
    conv = t(pre + "conv1d.weight")[:, 0]                      # [x|B|C, W]
    bias = t(pre + "conv1d.bias")
    cx, cb, cc = _split(conv, (H * P, G * N, G * N))
    bx, bb, bc = _split(bias, (H * P, G * N, G * N))
    return {"wz": z.T.reshape(D, H, P), "wx": x.T.reshape(D, H, P),
            "wB": b.T.reshape(D, G, N), "wC": c.T.reshape(D, G, N), "wdt": dt.T,
            "conv_x": cx.T.reshape(-1, H, P), "conv_B": cb.T.reshape(-1, G, N),
            "conv_C": cc.T.reshape(-1, G, N), "conv_bias_x": bx.reshape(H, P),
            "conv_bias_B": bb.reshape(G, N), "conv_bias_C": bc.reshape(G, N),
            "A_log": t(pre + "A_log"), "dt_bias": t(pre + "dt_bias"), "D": t(pre + "D"),
            "norm": {"scale": t(pre + "norm.weight").reshape(H, P)},
            "wo": t(pre + "out_proj.weight").T.reshape(H, P, D)}


def _mamba_out(p: dict, pre: str, cfg) -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    a = {k: np.asarray(v) for k, v in p.items() if k != "norm"}
    rows = lambda w: w.reshape(D, -1).T  # noqa: E731   [D, ...] -> HF Linear rows
    conv = lambda w: w.reshape(w.shape[0], -1).T  # noqa: E731   [W, ...] -> [channels, W]
    return {
        pre + "in_proj.weight": np.concatenate([rows(a[n]) for n in ("wz", "wx", "wB", "wC",
                                                                     "wdt")]),
        pre + "conv1d.weight": np.concatenate([conv(a[n]) for n in ("conv_x", "conv_B",
                                                                    "conv_C")])[:, None],
        pre + "conv1d.bias": np.concatenate([a[n].reshape(-1) for n in (
            "conv_bias_x", "conv_bias_B", "conv_bias_C")]),
        pre + "A_log": a["A_log"], pre + "dt_bias": a["dt_bias"], pre + "D": a["D"],
        pre + "norm.weight": np.asarray(p["norm"]["scale"]).reshape(-1),
        pre + "out_proj.weight": a["wo"].reshape(-1, D).T}


def _moe_in(t: Tensors, pre: str, cfg) -> dict:
    """Router (+ e_score_correction_bias), the squared-ReLU experts one by one or fused, the
    shared expert."""
    if pre + "experts.up_proj" in t.left:
        experts = {"wi": t(pre + "experts.up_proj").transpose(0, 2, 1),
                   "wo": t(pre + "experts.down_proj").transpose(0, 2, 1)}
    else:
        w = lambda e, n: t(f"{pre}experts.{e}.{n}.weight").T  # noqa: E731
        experts = {ours: np.stack([w(e, n) for e in range(cfg.moe.num_experts)])
                   for ours, n in _MLP}
    tree = {"router": {"w": t(pre + "gate.weight").T,
                       "expert_bias": t(pre + "gate.e_score_correction_bias")},
            "experts": experts}
    if cfg.moe.shared_expert_size:
        tree["shared"] = {ours: t(f"{pre}shared_experts.{n}.weight").T for ours, n in _MLP}
    if cfg.moe.latent_size:
        tree.update({ours: {"w": t(f"{pre}{n}.weight").T} for ours, n in _LATENT})
    return tree


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    root = _prefix(t)
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim

    def layer(i):
        pre = f"{root}layers.{i}."
        norm = {"scale": t(pre + "norm.weight")}
        symbol = cfg.hybrid_layers[i]
        m = pre + "mixer."
        if symbol == "M":
            return {"attn_norm": norm, "mamba": _mamba_in(t, m, cfg)}
        if symbol == "*":
            w = lambda n: t(m + n + ".weight").T  # noqa: E731
            return {"attn_norm": norm, "attn": {
                "wq": w("q_proj").reshape(D, N, H), "wk": w("k_proj").reshape(D, K, H),
                "wv": w("v_proj").reshape(D, K, H), "wo": w("o_proj").reshape(N, H, D)}}
        if symbol == "-":
            return {"mlp_norm": norm, "mlp": {ours: t(f"{m}{n}.weight").T for ours, n in _MLP}}
        return {"mlp_norm": norm, "moe": _moe_in(t, m, cfg)}

    tree = {"embedding": t(root + "embeddings.weight"), **stacks(layer, cfg),
            "final_norm": {"scale": t(root + "norm_f.weight")}}
    return output_head(t, cfg, tree)


def tensors(params: dict, cfg: ModelConfig, family: str = "nemotron_h") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, (kind, _) in enumerate(layer_slots(cfg)):
        p = layer_tree(params, cfg, i)
        pre = f"backbone.layers.{i}."
        m = pre + "mixer."
        out[pre + "norm.weight"] = norm_scale(p["attn_norm" if "attn_norm" in p else "mlp_norm"],
                                              cfg)
        if "mamba" in p:
            out.update(_mamba_out(p["mamba"], m, cfg))
        elif "attn" in p:
            a = p["attn"]
            out.update({f"{m}{n}_proj.weight": hf_linear(a[f"w{n}"]) for n in "qkv"})
            out[m + "o_proj.weight"] = np.asarray(a["wo"]).reshape(-1, cfg.hidden_size).T
        elif "mlp" in p:
            out.update({f"{m}{n}.weight": hf_linear(p["mlp"][ours]) for ours, n in _MLP})
        else:
            e = p["moe"]
            out[m + "gate.weight"] = np.asarray(e["router"]["w"]).T
            out[m + "gate.e_score_correction_bias"] = np.asarray(e["router"]["expert_bias"])
            for ours, n in _MLP:
                for j, w in enumerate(np.asarray(e["experts"][ours])):
                    out[f"{m}experts.{j}.{n}.weight"] = w.T
            if "shared" in e:
                out.update({f"{m}shared_experts.{n}.weight": hf_linear(e["shared"][ours])
                            for ours, n in _MLP})
            out.update({f"{m}{n}.weight": np.asarray(e[ours]["w"]).T for ours, n in _LATENT
                        if ours in e})
    out.update(ends_out(params, cfg, embedding="backbone.embeddings.weight",
                        final_norm="backbone.norm_f.weight"))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str = "nemotron_h") -> dict:
    out = dense_problems(cfg, rope=False, qk_norm=False, qkv_only_bias=False, bias_linear=False,
                         windows=False, mha=False, moe=cfg.moe is not None)
    m = cfg.moe
    ffn = bool(set(cfg.hybrid_layers or "") & set("-E"))
    out.update(hybrid_layers=cfg.hybrid_layers is None or not set(cfg.hybrid_layers) <= set(
                   "M" if family == "mamba2" else "M*-E"),
               position_embedding_type=cfg.position_embedding_type != "none",
               normalization=cfg.normalization != "RMSNorm",
               gated_linear_unit=cfg.gated_linear_unit and ffn,
               activation=cfg.activation != "squared_relu" and ffn,
               apply_layernorm_1p=cfg.apply_layernorm_1p, mamba_conv_bias=not cfg.mamba_conv_bias,
               mamba_norm_epsilon=cfg.mamba_norm_epsilon != cfg.norm_epsilon,
               mamba_heads=family == "mamba2" and (
                   cfg.mamba_heads * cfg.mamba_head_dim) % cfg.hidden_size != 0)
    if m is not None:
        out.update({"moe.score_function": m.score_function != "sigmoid",
                    "moe.expert_bias": not m.expert_bias, "moe.router_bias": m.router_bias,
                    "moe.shared_expert_gate": m.shared_expert_gate,
                    "moe.num_groups": bool(m.num_groups) and group_score_topk(m) != 2})
    return out


def config(cfg: ModelConfig, family: str = "nemotron_h") -> dict:
    mamba = {"n_groups": cfg.mamba_num_groups, "conv_kernel": cfg.mamba_conv_kernel_dim,
             "chunk_size": cfg.mamba_chunk_size, "use_conv_bias": True, "use_bias": False,
             "layer_norm_epsilon": cfg.norm_epsilon, "hidden_size": cfg.hidden_size,
             "residual_in_fp32": cfg.fp32_residual_connection}
    if family == "mamba2":
        return {**mamba, "num_hidden_layers": cfg.num_layers, "num_heads": cfg.mamba_heads,
                "head_dim": cfg.mamba_head_dim, "state_size": cfg.mamba_state_dim,
                "expand": cfg.mamba_heads * cfg.mamba_head_dim // cfg.hidden_size,
                "hidden_act": "silu", "rms_norm": True,
                "time_step_limit": [cfg.mamba_dt_floor, {"__float__": "Infinity"}]}
    out = {**mamba, "layers_block_type": [_LAYER_TYPES[c] for c in cfg.hybrid_layers],
           "time_step_min": cfg.mamba_dt_floor,
           "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": cfg.mamba_head_dim,
           "ssm_state_size": cfg.mamba_state_dim, "mamba_hidden_act": "silu",
           "expand": 2, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.ffn_hidden_size,
           "mlp_hidden_act": ACT_HF.get(cfg.activation, "relu2"), "mlp_bias": False,
           "attention_bias": False, "attention_dropout": cfg.attention_dropout,
           "max_position_embeddings": cfg.max_position_embeddings,
           "num_nextn_predict_layers": 0}
    m = cfg.moe
    if m is not None:
        groups = m.num_groups or 1
        out.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.topk,
                   moe_intermediate_size=m.ffn_hidden_size,
                   moe_shared_expert_intermediate_size=m.shared_expert_size or 0,
                   n_shared_experts=1 if m.shared_expert_size else 0,
                   n_group=groups, topk_group=m.group_topk or groups,
                   norm_topk_prob=m.topk > 1, routed_scaling_factor=m.topk_scaling_factor or 1.0,
                   moe_latent_size=m.latent_size)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
