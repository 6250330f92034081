"""Gemma, Gemma 2 and Gemma 3 (text): RMSNorms that scale by 1 + w, token embeddings times
sqrt(hidden_size), a GeGLU MLP (tanh GELU), tied embeddings and a query scale of
query_pre_attn_scalar ** -0.5.

- Gemma: the Llama layer layout with those changes (its ``post_attention_layernorm`` is the
  norm before the MLP).
- Gemma 2: sandwich norms (``post_attention_layernorm`` / ``post_feedforward_layernorm`` after
  each sublayer, ``pre_feedforward_layernorm`` before the MLP), attention and final logit
  soft-capping, sliding-window and full layers alternating.
- Gemma 3: Gemma 2 without soft-capping, with per-head q/k norms and its own RoPE base on the
  sliding-window layers (``local_rotary_base``); every sixth layer is full by default.

The norm weights are stored zero-centred in both jaxtrain (apply_layernorm_1p) and the
checkpoints, so they are copied as they are.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, output_head,
                                       projections_in, projections_out, rope_config, size_config,
                                       stacks)
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}
# The vision-language Gemma 3 checkpoint holds its text model under language_model.model. (the
# published files; transformers' module tree says model.language_model.); the vision tower and
# projector are left out and it is written back as the text model.
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_LEFT_OUT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


def picks(cfg: ModelConfig) -> str | None:
    if cfg.embedding_multiplier is None or not cfg.apply_layernorm_1p:
        return None
    if cfg.qk_layernorm or cfg.local_rotary_base is not None:
        return "gemma3_text"
    return "gemma2" if cfg.post_attention_norm else "gemma"


def _norm_names(family: str) -> dict[str, str]:
    """jaxtrain layer norm -> the checkpoint's name, per family."""
    if family == "gemma":
        return {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    return {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm"}


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    family = (hf or {}).get("model_type") or picks(cfg)
    if family == "gemma3":
        t.left = {_text_name(k): v for k, v in t.left.items() if not k.startswith(_LEFT_OUT)}
        family = "gemma3_text"

    def layer(i):
        pre = f"model.layers.{i}."
        tree = projections_in(t, pre, cfg)
        if cfg.qk_layernorm:
            tree["attn"]["q_norm"] = {"scale": t(pre + "self_attn.q_norm.weight")}
            tree["attn"]["k_norm"] = {"scale": t(pre + "self_attn.k_norm.weight")}
        return {**tree, **{ours: {"scale": t(pre + theirs + ".weight")}
                           for ours, theirs in _norm_names(family).items()}}

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def _text_name(name: str) -> str:
    for theirs, ours in _TEXT_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def _stored(p: dict, cfg: ModelConfig) -> np.ndarray:
    """A norm's checkpoint weight: zero-centred in both jaxtrain and Gemma checkpoints."""
    return np.asarray(p["scale"])


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre = f"model.layers.{i}."
        out.update(projections_out(p, pre, cfg))
        if cfg.qk_layernorm:
            out[pre + "self_attn.q_norm.weight"] = _stored(p["attn"]["q_norm"], cfg)
            out[pre + "self_attn.k_norm.weight"] = _stored(p["attn"]["k_norm"], cfg)
        for ours, theirs in _norm_names(family).items():
            out[pre + theirs + ".weight"] = _stored(p[ours], cfg)
    out.update(ends_out(params, cfg, _stored))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    gemma3 = family in ("gemma3_text", "gemma3")
    out = dense_problems(cfg, rope=True, qk_norm=gemma3, qkv_only_bias=False,
                         bias_linear=False, windows=family != "gemma", mha=False, moe=False)
    out["vision_tower"] = family == "gemma3"   # no vision tower to write: export gemma3_text
    sandwich = family != "gemma"
    out.update(
        embedding_multiplier=cfg.embedding_multiplier is None or not np.isclose(
            cfg.embedding_multiplier, cfg.hidden_size ** 0.5),
        apply_layernorm_1p=not cfg.apply_layernorm_1p,
        activation=cfg.activation != "gelu_tanh",
        post_attention_norm=cfg.post_attention_norm != sandwich,
        post_mlp_norm=cfg.post_mlp_norm != sandwich,
        query_pre_attn_scalar=False,
        local_rotary_base=(cfg.local_rotary_base is not None) != gemma3,
        sliding_window_layers=family == "gemma" and cfg.sliding_window_layers is not None,
        attn_logit_softcapping=family == "gemma" and bool(cfg.attn_logit_softcapping),
        final_logit_softcapping=family == "gemma" and bool(cfg.final_logit_softcapping),
        rotary_seq_len_interpolation_factor=bool(cfg.rotary_seq_len_interpolation_factor)
        and family != "gemma3_text",
        use_rope_scaling=family == "gemma3_text" and cfg.use_rope_scaling,
        rope_type=family == "gemma3_text" and cfg.rope_type != "rope")
    return out


def config(cfg: ModelConfig, family: str) -> dict:
    out = {**size_config(cfg), "head_dim": cfg.head_dim, "attention_bias": False}
    rope = rope_config(cfg)
    if family == "gemma":
        return {**out, **rope, "hidden_act": "gelu_pytorch_tanh"}
    out.update(hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
               attn_logit_softcapping=cfg.attn_logit_softcapping,
               final_logit_softcapping=cfg.final_logit_softcapping,
               sliding_window=cfg.sliding_window,
               layer_types=[("sliding_attention" if on else "full_attention") for on in
                            (cfg.sliding_window_layers or [bool(cfg.sliding_window)]
                             * cfg.num_layers)])
    if family == "gemma2":
        return {**out, **rope}
    full = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    if rope["rope_scaling"]:
        full.update(rope["rope_scaling"])
    return {**out, "rope_parameters": {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": cfg.local_rotary_base or rope["rope_theta"]}}}


def _whole(value):
    """An int when the value is integral: transformers' strict configs type some fields int."""
    return int(value) if float(value).is_integer() else value


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
