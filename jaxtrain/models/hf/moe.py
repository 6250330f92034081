"""Mixtral and Qwen3-MoE: Llama-style attention (Mistral's window; Qwen3's q/k norms) with MoE
layers of a softmax router and experts [E, ...].

Mixtral: every layer MoE, top-k of a softmax over all experts renormalised (= a softmax over the
top-k logits, Megatron's default). Qwen3-MoE: the same without the renormalisation unless
norm_topk_prob (pre_softmax), dense layers where mlp_only_layers / decoder_sparse_step say.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import llama
from jaxtrain.models.hf.common import Adapter, Tensors, experts_in, experts_out
from jaxtrain.models.moe import moe_pattern

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# Expert tensor names (gate, up, down) and the module holding the router and experts.
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
BLOCK = {"mixtral": "block_sparse_moe.", "qwen3_moe": "mlp."}
STYLE = {"mixtral": "mistral", "qwen3_moe": "qwen3"}    # attention as in llama.py


def picks(cfg: ModelConfig) -> str | None:
    if cfg.moe is None:
        return None
    return "qwen3_moe" if cfg.qk_layernorm else "mixtral"


def params(t: Tensors, cfg: ModelConfig, hf: dict) -> dict:
    family = hf["model_type"]

    def moe_in(t, pre, cfg):
        # Older Mixtral-layout checkpoints name the block block_sparse_moe, newer ones mlp.
        base = pre + ("block_sparse_moe." if pre + "block_sparse_moe.gate.weight" in t.left
                      else "mlp.")
        return experts_in(t, base, cfg, EXPERT_NAMES[family])

    return llama.params(t, cfg, hf, moe_in=moe_in)


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    return llama.tensors(params, cfg, family, moe_out=lambda p, pre: experts_out(
        p, pre + BLOCK[family], EXPERT_NAMES[family]))


def problems(cfg: ModelConfig, family: str) -> dict:
    """The attention's problems, then MoE settings these routers cannot reproduce (training-only
    knobs such as aux losses, capacity and dispatch do not change the checkpoint and are not
    checked)."""
    out = llama.problems(cfg, family, STYLE[family], moe=True)
    m = cfg.moe
    if m is None:
        return out
    return {**out,
            "moe.layer_freq": family == "mixtral" and not all(moe_pattern(m, cfg.num_layers)),
            "moe.score_function": m.score_function != "softmax",
            "moe.pre_softmax": family == "mixtral" and m.pre_softmax and m.topk > 1,
            "moe.shared_expert_size": bool(m.shared_expert_size),
            "moe.num_groups": bool(m.num_groups),
            "moe.topk_scaling_factor": bool(m.topk_scaling_factor),
            "moe.router_bias": m.router_bias, "moe.expert_bias": m.expert_bias,
            "moe.router_softcap": bool(m.router_softcap),
            "moe.force_balancing": m.force_balancing is not None,
            "moe.activation": m.activation is not None,
            "moe.load_balancing": "sinkhorn" in m.load_balancing}


def config(cfg: ModelConfig, family: str) -> dict:
    m = cfg.moe
    out = {**llama.config(cfg, family, STYLE[family]), "num_experts_per_tok": m.topk,
           "output_router_logits": False}
    if family == "mixtral":
        return {**out, "num_local_experts": m.num_experts, "intermediate_size": m.ffn_hidden_size,
                "router_jitter_noise": m.input_jitter_eps or 0.0}
    dense = [i for i, on in enumerate(moe_pattern(m, cfg.num_layers)) if not on]
    return {**out, "num_experts": m.num_experts, "moe_intermediate_size": m.ffn_hidden_size,
            "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "norm_topk_prob": not m.pre_softmax}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
