"""Phi-3 / Phi-4 (model_type phi3): the Llama layout with q/k/v in one ``qkv_proj`` tensor
(query rows, then key, then value) and gate/up in one ``gate_up_proj`` (gate rows first), RoPE
on the first ``partial_rotary_factor`` of each head, an optional sliding window on every
layer. Read and written through llama.py's layout, the fused tensors split and joined here.

Legend: D hidden, N query heads, K kv heads, H head dim.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import llama
from jaxtrain.models.hf.common import Adapter, Tensors

ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"


def picks(cfg: ModelConfig) -> str | None:
    plain = not (cfg.add_bias_linear or cfg.add_qkv_bias or cfg.qk_layernorm or cfg.moe)
    return "phi3" if cfg.rotary_percent < 1 and plain and cfg.gated_linear_unit else None


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in [n for n in t.left if n.endswith(_QKV)]:
        pre = name[:-len(_QKV)]
        parts = np.split(t(name), [q, q + k], axis=0)
        t.left.update({f"{pre}self_attn.{n}_proj.weight": w for n, w in zip("qkv", parts)})
    for name in [n for n in t.left if n.endswith(_GATE_UP)]:
        pre = name[:-len(_GATE_UP)]
        gate, up = np.split(t(name), 2, axis=0)
        t.left.update({pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up})
    return llama.params(t, cfg, hf)


def tensors(params: dict, cfg: ModelConfig, family: str = "phi3") -> dict[str, np.ndarray]:
    out = llama.tensors(params, cfg, "mistral")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        out[pre + _QKV] = np.concatenate(
            [out.pop(f"{pre}self_attn.{n}_proj.weight") for n in "qkv"], axis=0)
        out[pre + _GATE_UP] = np.concatenate(
            [out.pop(pre + "mlp.gate_proj.weight"), out.pop(pre + "mlp.up_proj.weight")], axis=0)
    return out


def problems(cfg: ModelConfig, family: str = "phi3") -> dict:
    out = llama.problems(cfg, family, style="mistral")
    out.update(rotary_percent=False, rope_type=cfg.rope_type != "rope",
               use_rope_scaling=cfg.use_rope_scaling,
               rotary_seq_len_interpolation_factor=bool(cfg.rotary_seq_len_interpolation_factor))
    return out


def config(cfg: ModelConfig, family: str = "phi3") -> dict:
    out = llama.config(cfg, family, style="mistral")
    out.pop("rope_scaling", None)
    out.update(rope_parameters={"rope_type": "default", "rope_theta": out.pop("rope_theta"),
                                "partial_rotary_factor": cfg.rotary_percent},
               resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
