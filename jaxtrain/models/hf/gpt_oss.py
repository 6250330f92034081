"""gpt-oss: Llama-layout attention with q/k/v/o biases, a learned sink logit per head and
sliding windows on the ``sliding_attention`` layers, YaRN; every layer MoE with a biased router
(softmax over the top-k logits) and fused experts with biases and the clamped GLU (swiglu_oai).
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import llama
from jaxtrain.models.hf.common import (Adapter, Tensors, gemma_problems, llama4_problems,
                                       rope_config)
from jaxtrain.models.moe import moe_pattern

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}


def picks(cfg: ModelConfig) -> str | None:
    return "gpt_oss" if cfg.attention_sinks else None


def _moe_in(t: Tensors, pre: str, cfg) -> dict:
    """The biased router (weight [E, D]) and fused experts: gate_up_proj [E, D, 2F] with gate
    and up interleaved (columns 2f, 2f + 1), down_proj [E, F, D], all with biases."""
    base = pre + "mlp."
    gate_up, gate_up_bias = t(base + "experts.gate_up_proj"), t(base + "experts.gate_up_proj_bias")
    return {"router": {"w": t(base + "router.weight").T, "bias": t(base + "router.bias")},
            "experts": {"wi_0": gate_up[..., 0::2], "wi_1": gate_up[..., 1::2],
                        "bi_0": gate_up_bias[:, 0::2], "bi_1": gate_up_bias[:, 1::2],
                        "wo": t(base + "experts.down_proj"),
                        "bo": t(base + "experts.down_proj_bias")}}


def _moe_out(p: dict, pre: str) -> dict[str, np.ndarray]:
    base = pre + "mlp."
    e = {k: np.asarray(v) for k, v in p["experts"].items()}
    interleave = lambda a, b: np.stack([a, b], -1).reshape(*a.shape[:-1], -1)  # noqa: E731
    return {base + "router.weight": np.asarray(p["router"]["w"]).T,
            base + "router.bias": np.asarray(p["router"]["bias"]),
            base + "experts.gate_up_proj": interleave(e["wi_0"], e["wi_1"]),
            base + "experts.gate_up_proj_bias": interleave(e["bi_0"], e["bi_1"]),
            base + "experts.down_proj": e["wo"], base + "experts.down_proj_bias": e["bo"]}


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    return llama.params(t, cfg, hf, moe_in=_moe_in)


def tensors(params: dict, cfg: ModelConfig, family: str = "gpt_oss") -> dict[str, np.ndarray]:
    return llama.tensors(params, cfg, family, moe_out=_moe_out)


def problems(cfg: ModelConfig, family: str = "gpt_oss") -> dict:
    m = cfg.moe
    out = {
        "moe": m is None or not all(moe_pattern(m, cfg.num_layers)),
        "attention_sinks": not cfg.attention_sinks,
        "add_bias_linear": not cfg.add_bias_linear,
        "position_embedding_type": cfg.position_embedding_type != "rope",
        "normalization": cfg.normalization != "RMSNorm",
        "gated_linear_unit": not cfg.gated_linear_unit,
        "rotary_percent": cfg.rotary_percent != 1.0,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor),
        "use_rope_scaling": cfg.use_rope_scaling,
        "qk_layernorm": cfg.qk_layernorm, "qk_l2_norm": cfg.qk_l2_norm,
        "multi_latent_attention": cfg.multi_latent_attention,
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        **gemma_problems(cfg), **llama4_problems(cfg),
    }
    if m is None:
        return out
    return {**out,
            "moe.activation": m.activation != "swiglu_oai",
            "moe.router_bias": not m.router_bias,
            "moe.score_function": m.score_function != "softmax",
            "moe.pre_softmax": m.pre_softmax and m.topk > 1,
            "moe.shared_expert_size": bool(m.shared_expert_size),
            "moe.num_groups": bool(m.num_groups),
            "moe.topk_scaling_factor": m.topk_scaling_factor not in (None, 1.0),
            "moe.expert_bias": m.expert_bias,
            "moe.router_softcap": bool(m.router_softcap),
            "moe.capacity_factor": m.capacity_factor is not None}


def config(cfg: ModelConfig, family: str = "gpt_oss") -> dict:
    rope = rope_config(cfg)   # written as rope_parameters: gpt-oss reads a missing one as YaRN
    rope_parameters = {**(rope["rope_scaling"] or {"rope_type": "default"}),
                       "rope_theta": rope["rope_theta"]}
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.moe.ffn_hidden_size,
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.topk,
            "swiglu_limit": cfg.moe.glu_limit if cfg.moe.glu_limit is not None else 7.0,
            "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if cfg.window_of_layer(i) else "full_attention"
                            for i in range(cfg.num_layers)],
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "hidden_act": "silu", "attention_bias": True,
            "attention_dropout": cfg.attention_dropout, "rope_parameters": rope_parameters}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
