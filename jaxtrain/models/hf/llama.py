"""Llama, Mistral, Qwen2 and Qwen3: pre-norm RMSNorm + RoPE decoders with a gated MLP.

Their attention differs by style: Llama (biases on every linear, or none), Mistral (one sliding
window), Qwen2 (q/k/v biases; a window under ``use_sliding_window``), Qwen3 (per-head q/k
RMSNorms). The MoE families (moe.py) and gpt-oss reuse this layer layout with their own MLPs
(``moe_in``/``moe_out``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (ACT_HF, Adapter, Tensors, dense_problems, ends_out,
                                       hf_linear, norm_scale, output_head, rope_config,
                                       rope_permutation, size_config, stacks)
from jaxtrain.models.params import layer_slots, layer_tree
from jaxtrain.models.spec import MOE_STACKS

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
MLP_NAMES = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))


def picks(cfg: ModelConfig) -> str:
    if cfg.qk_layernorm:
        return "qwen3"
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


# ---------------------------------------------------------------- tensors in

def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None,
           moe_in: Callable[[Tensors, str, ModelConfig], dict] | None = None) -> dict:
    """The tree of a Llama-layout checkpoint; ``moe_in(t, layer_prefix, cfg)`` reads an MoE
    layer's MLP (MoE families)."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.add_qkv_bias or cfg.add_bias_linear
    slots = [kind for kind, _ in layer_slots(cfg)]

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        attn = {"wq": w("self_attn.q_proj").reshape(D, N, H),
                "wk": w("self_attn.k_proj").reshape(D, K, H),
                "wv": w("self_attn.v_proj").reshape(D, K, H),
                "wo": w("self_attn.o_proj").reshape(N, H, D)}
        if bias:
            attn.update(bq=t(pre + "self_attn.q_proj.bias").reshape(N, H),
                        bk=t(pre + "self_attn.k_proj.bias").reshape(K, H),
                        bv=t(pre + "self_attn.v_proj.bias").reshape(K, H))
        if cfg.qk_layernorm:
            attn["q_norm"] = {"scale": t(pre + "self_attn.q_norm.weight")}
            attn["k_norm"] = {"scale": t(pre + "self_attn.k_norm.weight")}
        if cfg.attention_sinks:
            attn["sinks"] = t(pre + "self_attn.sinks")
        if cfg.add_bias_linear:
            attn["bo"] = t(pre + "self_attn.o_proj.bias")
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")}, "attn": attn,
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}}
        if slots[i] in MOE_STACKS:
            return {**tree, "moe": moe_in(t, pre, cfg)}
        mlp = {ours: w(f"mlp.{theirs}") for ours, theirs in MLP_NAMES}
        if cfg.add_bias_linear:
            mlp.update(bi_0=t(pre + "mlp.gate_proj.bias"), bi_1=t(pre + "mlp.up_proj.bias"),
                       bo=t(pre + "mlp.down_proj.bias"))
        return {**tree, "mlp": mlp}

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


# ---------------------------------------------------------------- tensors out

def tensors(params: dict, cfg: ModelConfig, family: str = "llama",
            moe_out: Callable[[dict, str], dict] | None = None) -> dict[str, np.ndarray]:
    """Checkpoint tensors of the Llama layout; ``moe_out(moe_tree, layer_prefix)`` writes an
    MoE layer's MLP. Interleaved RoPE is written as HF's half-split layout by permuting the
    q/k channels."""
    D = cfg.hidden_size
    np_ = np.asarray
    out: dict[str, np.ndarray] = {}
    perm = rope_permutation(cfg)
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        a, m = p["attn"], p.get("mlp")
        pre = f"model.layers.{i}."
        out[pre + "self_attn.q_proj.weight"] = hf_linear(np_(a["wq"])[..., perm])
        out[pre + "self_attn.k_proj.weight"] = hf_linear(np_(a["wk"])[..., perm])
        out[pre + "self_attn.v_proj.weight"] = hf_linear(a["wv"])
        out[pre + "self_attn.o_proj.weight"] = np.ascontiguousarray(np_(a["wo"]).reshape(-1, D).T)
        if "bq" in a:
            out[pre + "self_attn.q_proj.bias"] = np_(a["bq"])[..., perm].reshape(-1)
            out[pre + "self_attn.k_proj.bias"] = np_(a["bk"])[..., perm].reshape(-1)
            out[pre + "self_attn.v_proj.bias"] = np_(a["bv"]).reshape(-1)
        if cfg.qk_layernorm:
            out[pre + "self_attn.q_norm.weight"] = norm_scale(a["q_norm"], cfg)[perm]
            out[pre + "self_attn.k_norm.weight"] = norm_scale(a["k_norm"], cfg)[perm]
        if "sinks" in a:
            out[pre + "self_attn.sinks"] = np_(a["sinks"])
        if m is None:
            out.update(moe_out(p["moe"], pre))
        else:
            for ours, theirs in MLP_NAMES:
                out[pre + f"mlp.{theirs}.weight"] = hf_linear(m[ours])
        if cfg.add_bias_linear:
            out[pre + "self_attn.o_proj.bias"] = np_(a["bo"])
        if cfg.add_bias_linear and m is not None:
            for ours, theirs in (("bi_0", "gate_proj"), ("bi_1", "up_proj"), ("bo", "down_proj")):
                out[pre + f"mlp.{theirs}.bias"] = np_(m[ours])
        out[pre + "input_layernorm.weight"] = norm_scale(p["attn_norm"], cfg)
        out[pre + "post_attention_layernorm.weight"] = norm_scale(p["mlp_norm"], cfg)
    out.update(ends_out(params, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ---------------------------------------------------------------- config.json out

def problems(cfg: ModelConfig, family: str, style: str | None = None, moe: bool = False) -> dict:
    """What the attention ``style`` (llama, mistral, qwen2 or qwen3; default: the family's)
    cannot express; ``moe``: the family has MoE layers."""
    style = style or family
    return dense_problems(cfg, rope=True, qk_norm=style == "qwen3",
                          qkv_only_bias=style == "qwen2",
                          bias_linear=None if style == "llama" else False,
                          windows=style != "llama", mha=False, moe=moe)


def config(cfg: ModelConfig, family: str, style: str | None = None) -> dict:
    """config.json entries of a Llama-style attention (``style`` as in :func:`problems`)."""
    style = style or family
    out = {**size_config(cfg), "head_dim": cfg.head_dim, "hidden_act": ACT_HF[cfg.activation],
           **rope_config(cfg)}
    if style == "llama":
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    elif style == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=bool(cfg.sliding_window),
                   sliding_window=cfg.sliding_window, max_window_layers=0)
        if style == "qwen3":
            out["attention_bias"] = False
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
