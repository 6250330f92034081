"""IBM Granite 4.0-H (granitemoehybrid): each Hugging Face layer is two jaxtrain sublayers of
the hybrid stack: its Mamba-2 (``mamba.*``, the layout of nemotron_h.py) or attention
(``self_attn.*``) mixer behind ``input_layernorm``, then behind ``post_attention_layernorm`` an
MoE block (router ``block_sparse_moe.router.layer``, experts ``input_linear`` [E, 2F, D] gate
rows first and ``output_linear`` [E, D, F]) beside the always-on ``shared_mlp`` (the MoE's
shared expert), or without experts the ``shared_mlp`` alone. transformers' own renamed layout
(``router.weight``, ``experts.gate_up_proj`` / ``down_proj``) is read too.

Legend: D hidden, N heads, K kv heads, H head dim, E experts, F expert width, S shared width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, hf_linear,
                                       norm_scale, output_head, stacks)
from jaxtrain.models.hf.nemotron_h import _mamba_in, _mamba_out
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"granitemoehybrid": "GraniteMoeHybridForCausalLM"}
_PRE = "model."


def picks(cfg: ModelConfig) -> str | None:
    p = cfg.hybrid_layers
    paired = p is not None and len(p) % 2 == 0 and all(
        a in "M*" and b == p[1] and b in "-E" for a, b in zip(p[::2], p[1::2]))
    return "granitemoehybrid" if paired and cfg.gated_linear_unit else None   # NemotronH: relu2


def _shared_in(t: Tensors, pre: str) -> dict:
    gate_up = t(pre + "input_linear.weight")
    S = gate_up.shape[0] // 2
    return {"wi_0": gate_up[:S].T, "wi_1": gate_up[S:].T, "wo": t(pre + "output_linear.weight").T}


def _moe_in(t: Tensors, pre: str) -> dict:
    router = pre + ("router.layer.weight" if pre + "router.layer.weight" in t.left
                    else "router.weight")
    fused = "input_linear.weight" if pre + "input_linear.weight" in t.left else \
        "experts.gate_up_proj"
    down = "output_linear.weight" if fused == "input_linear.weight" else "experts.down_proj"
    gate_up = t(pre + fused)
    F = gate_up.shape[1] // 2
    return {"router": {"w": t(router).T},
            "experts": {"wi_0": gate_up[:, :F].transpose(0, 2, 1),
                        "wi_1": gate_up[:, F:].transpose(0, 2, 1),
                        "wo": t(pre + down).transpose(0, 2, 1)}}


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim

    def layer(j):
        pre = f"{_PRE}layers.{j // 2}."
        symbol = cfg.hybrid_layers[j]
        if symbol == "M":
            return {"attn_norm": {"scale": t(pre + "input_layernorm.weight")},
                    "mamba": _mamba_in(t, pre + "mamba.", cfg)}
        if symbol == "*":
            w = lambda n: t(pre + "self_attn." + n + ".weight").T  # noqa: E731
            return {"attn_norm": {"scale": t(pre + "input_layernorm.weight")},
                    "attn": {"wq": w("q_proj").reshape(D, N, H),
                             "wk": w("k_proj").reshape(D, K, H),
                             "wv": w("v_proj").reshape(D, K, H),
                             "wo": w("o_proj").reshape(N, H, D)}}
        norm = {"scale": t(pre + "post_attention_layernorm.weight")}
        shared = _shared_in(t, pre + "shared_mlp.")
        if symbol == "-":
            return {"mlp_norm": norm, "mlp": shared}
        return {"mlp_norm": norm, "moe": {**_moe_in(t, pre + "block_sparse_moe."),
                                          "shared": shared}}

    tree = {"embedding": t(_PRE + "embed_tokens.weight"), **stacks(layer, cfg),
            "final_norm": {"scale": t(_PRE + "norm.weight")}}
    return output_head(t, cfg, tree)


def _shared_out(p: dict, pre: str) -> dict[str, np.ndarray]:
    return {pre + "input_linear.weight": np.concatenate([hf_linear(p["wi_0"]),
                                                         hf_linear(p["wi_1"])]),
            pre + "output_linear.weight": hf_linear(p["wo"])}


def tensors(params: dict, cfg: ModelConfig, family: str = "granitemoehybrid"
            ) -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    out: dict[str, np.ndarray] = {}
    for j in range(cfg.num_layers):
        p = layer_tree(params, cfg, j)
        pre = f"{_PRE}layers.{j // 2}."
        if "mamba" in p or "attn" in p:
            out[pre + "input_layernorm.weight"] = norm_scale(p["attn_norm"], cfg)
        if "mamba" in p:
            out.update(_mamba_out(p["mamba"], pre + "mamba.", cfg))
        elif "attn" in p:
            a = p["attn"]
            out.update({f"{pre}self_attn.{n}_proj.weight": hf_linear(a[f"w{n}"])
                        for n in "qkv"})
            out[pre + "self_attn.o_proj.weight"] = np.asarray(a["wo"]).reshape(-1, D).T
        else:
            out[pre + "post_attention_layernorm.weight"] = norm_scale(p["mlp_norm"], cfg)
            ffn = p.get("mlp") or p["moe"]["shared"]
            out.update(_shared_out(ffn, pre + "shared_mlp."))
            if "moe" in p:
                e = p["moe"]
                base = pre + "block_sparse_moe."
                out[base + "router.layer.weight"] = np.asarray(e["router"]["w"]).T
                x = {k: np.asarray(v) for k, v in e["experts"].items()}
                out[base + "input_linear.weight"] = np.concatenate(
                    [x["wi_0"].transpose(0, 2, 1), x["wi_1"].transpose(0, 2, 1)], 1)
                out[base + "output_linear.weight"] = x["wo"].transpose(0, 2, 1)
    out.update(ends_out(params, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str = "granitemoehybrid") -> dict:
    out = dense_problems(cfg, rope=cfg.position_embedding_type == "rope", qk_norm=False,
                         qkv_only_bias=False, bias_linear=False, windows=False, mha=False,
                         moe=cfg.moe is not None)
    m = cfg.moe
    out.update(hybrid_layers=picks(cfg) is None,
               position_embedding_type=cfg.position_embedding_type not in ("none", "rope"),
               normalization=cfg.normalization != "RMSNorm", gated_linear_unit=False,
               query_pre_attn_scalar=False, embedding_multiplier=False,
               residual_multiplier=False, logits_scaling=False,
               mamba_conv_bias=not cfg.mamba_conv_bias,
               mamba_norm_epsilon=cfg.mamba_norm_epsilon != cfg.norm_epsilon,
               kv_channels=cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size)
    if m is not None:
        out.update({"moe.score_function": m.score_function != "softmax",
                    "moe.pre_softmax": m.pre_softmax, "moe.router_bias": m.router_bias,
                    "moe.expert_bias": m.expert_bias, "moe.num_groups": bool(m.num_groups),
                    "moe.topk_scaling_factor": bool(m.topk_scaling_factor),
                    "moe.shared_expert_size": m.shared_expert_size != cfg.ffn_hidden_size,
                    "moe.shared_expert_gate": m.shared_expert_gate})
    return out


def config(cfg: ModelConfig, family: str = "granitemoehybrid") -> dict:
    m = cfg.moe
    types = ["mamba" if c == "M" else "attention" for c in cfg.hybrid_layers[::2]]
    out = {"hidden_size": cfg.hidden_size, "num_hidden_layers": len(types),
           "layers_block_type": types, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_kv_heads, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_position_embeddings,
           "rms_norm_eps": cfg.norm_epsilon, "attention_dropout": cfg.attention_dropout,
           "shared_intermediate_size": cfg.ffn_hidden_size,
           "intermediate_size": m.ffn_hidden_size if m is not None else cfg.ffn_hidden_size,
           "num_local_experts": m.num_experts if m is not None else 0,
           "num_experts_per_tok": m.topk if m is not None else 2,
           "embedding_multiplier": cfg.embedding_multiplier or 1.0,
           "attention_multiplier": (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
           "residual_multiplier": cfg.residual_multiplier, "logits_scaling": cfg.logits_scaling,
           "position_embedding_type": "rope" if cfg.position_embedding_type == "rope" else
           "nope", "mamba_n_heads": cfg.mamba_heads, "mamba_d_head": cfg.mamba_head_dim,
           "mamba_n_groups": cfg.mamba_num_groups, "mamba_d_state": cfg.mamba_state_dim,
           "mamba_d_conv": cfg.mamba_conv_kernel_dim, "mamba_chunk_size": cfg.mamba_chunk_size,
           "mamba_conv_bias": True, "mamba_proj_bias": False,
           "mamba_expand": cfg.mamba_heads * cfg.mamba_head_dim // cfg.hidden_size,
           "time_step_limit": [cfg.mamba_dt_floor, {"__float__": "Infinity"}]}
    if cfg.position_embedding_type == "rope":
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
