"""OLMo 2 and OLMo 3: decoders that normalise the outputs of attention and MLP (RMSNorm before
the residual add) and not their inputs, with one RMSNorm over all heads' queries and one over
the keys (before RoPE), a SwiGLU MLP and untied embeddings; OLMo 3 adds sliding-window layers.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, norm_scale,
                                       output_head, projections_in, projections_out, rope_config,
                                       size_config, stacks)
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
NORMS = (("post_attn_norm", "post_attention_layernorm"),
         ("post_mlp_norm", "post_feedforward_layernorm"))


def picks(cfg: ModelConfig) -> str | None:
    if cfg.pre_norm or not cfg.post_attention_norm:
        return None
    return "olmo3" if cfg.sliding_window_layers is not None or cfg.sliding_window else "olmo2"


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    def layer(i):
        pre = f"model.layers.{i}."
        tree = projections_in(t, pre, cfg)
        tree["attn"].update(q_norm={"scale": t(pre + "self_attn.q_norm.weight")},
                            k_norm={"scale": t(pre + "self_attn.k_norm.weight")})
        return {**tree, **{ours: {"scale": t(pre + theirs + ".weight")} for ours, theirs in NORMS}}

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre = f"model.layers.{i}."
        out.update(projections_out(p, pre, cfg))
        out[pre + "self_attn.q_norm.weight"] = norm_scale(p["attn"]["q_norm"], cfg)
        out[pre + "self_attn.k_norm.weight"] = norm_scale(p["attn"]["k_norm"], cfg)
        for ours, theirs in NORMS:
            out[pre + theirs + ".weight"] = norm_scale(p[ours], cfg)
    out.update(ends_out(params, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    olmo3 = family == "olmo3"
    out = dense_problems(cfg, rope=True, qk_norm=True, qkv_only_bias=False, bias_linear=False,
                         windows=olmo3, mha=False, moe=False)
    out.update(pre_norm=cfg.pre_norm, qk_norm_across_heads=not cfg.qk_norm_across_heads,
               post_attention_norm=not cfg.post_attention_norm,
               post_mlp_norm=not cfg.post_mlp_norm,
               sliding_window_layers=not olmo3 and cfg.sliding_window_layers is not None,
               local_rotary_base=cfg.local_rotary_base is not None and not olmo3)
    return out


def config(cfg: ModelConfig, family: str) -> dict:
    out = {**size_config(cfg), "hidden_act": "silu", "attention_bias": False}
    rope = rope_config(cfg)
    if family == "olmo2":
        return {**out, **rope}
    full = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    if rope["rope_scaling"]:
        full.update(rope["rope_scaling"])
    layers = cfg.sliding_window_layers or [bool(cfg.sliding_window)] * cfg.num_layers
    return {**out, "sliding_window": cfg.sliding_window,
            "layer_types": [("sliding_attention" if on else "full_attention") for on in layers],
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default",
                "rope_theta": cfg.local_rotary_base or rope["rope_theta"]}}}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
