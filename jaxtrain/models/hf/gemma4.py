"""Gemma 4 (text; the 31B dense and 26B-A4B MoE shapes): plain RMSNorms (x·w, unlike Gemma
1-3's 1 + w), embeddings times sqrt(hidden_size), sandwich norms, q/k norms and a value norm
without a scale, attention scale 1, five sliding-window layers to one global layer by default.
The global layers have their own head width and key/value heads, take their values from the
key projection (``attention_k_eq_v``: no ``v_proj``) and rotate a quarter of their channels
(proportional RoPE); each layer's output is multiplied by its ``layer_scalar``.

The MoE variant runs the dense MLP (``mlp``, intermediate_size) and the routed experts in
parallel: the experts take ``pre_feedforward_layernorm_2`` of the residual stream, the router
an unscaled RMS norm of it times ``router.scale`` and hidden_size^-0.5, softmax top-k weights
times ``router.per_expert_scale``; ``post_feedforward_layernorm_1`` / ``_2`` norm the two
outputs. Experts are stored fused: ``experts.gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F].

The small models (E2B, E4B) add per-layer inputs (``embed_tokens_per_layer`` [V, L*P],
``per_layer_model_projection`` [L*P, D], ``per_layer_projection_norm``; per layer
``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``) and KV sharing:
the last num_kv_shared_layers layers have no k/v projections or norms (a checkpoint's copies of
them are left out, as transformers ignores them) and, with use_double_wide_mlp, MLPs twice as
wide.

Not built: the vision/audio towers (the vision-language checkpoint, model_type ``gemma4``,
loads its text model and is written back as ``gemma4_text``).

Legend: D hidden, N heads, K kv heads, H head dim, E experts, F expert FFN width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (GATED_MLP, Adapter, Tensors, dense_problems, ends_out,
                                       hf_linear, output_head, plain_router_problems, stacks)
from jaxtrain.models.params import layer_tree
from jaxtrain.models.spec import GLOBAL_STACKS, KV_SHARED_STACKS, layer_slots

ARCHITECTURES = {"gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration"}
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_LEFT_OUT = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
             "model.embed_audio.", "vision_tower.", "embed_vision.", "audio_tower.",
             "embed_audio.", "multi_modal_projector.")
NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
         ("mlp_norm", "pre_feedforward_layernorm"),
         ("post_mlp_norm", "post_feedforward_layernorm"))
# a KV-sharing layer's own key/value weights, which transformers leaves unread
_SHARED_LEFT_OUT = tuple(f"self_attn.{n}.weight" for n in ("k_proj", "v_proj", "k_norm",
                                                          "v_norm"))
BRANCH_NORMS = (("shared_post_norm", "post_feedforward_layernorm_1"),
                ("experts_norm", "pre_feedforward_layernorm_2"),
                ("experts_post_norm", "post_feedforward_layernorm_2"))


def picks(cfg: ModelConfig) -> str | None:
    return "gemma4_text" if cfg.layer_scalar or cfg.has_global_shape else None


def _text_name(name: str) -> str:
    for theirs, ours in _TEXT_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    if (hf or {}).get("model_type") == "gemma4":
        t.left = {_text_name(k): v for k, v in t.left.items() if not k.startswith(_LEFT_OUT)}
    D, N = cfg.hidden_size, cfg.num_attention_heads
    slots = layer_slots(cfg)

    def layer(i):
        pre = f"model.layers.{i}."
        K, H = cfg.attention_shape(slots[i][0] in GLOBAL_STACKS)
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        attn = {"wq": w("self_attn.q_proj").reshape(D, N, H),
                "wo": w("self_attn.o_proj").reshape(N, H, D),
                "q_norm": {"scale": t(pre + "self_attn.q_norm.weight")}}
        if slots[i][0] in KV_SHARED_STACKS:
            for name in _SHARED_LEFT_OUT:
                t.drop(pre + name)
        else:
            attn.update(wk=w("self_attn.k_proj").reshape(D, K, H),
                        k_norm={"scale": t(pre + "self_attn.k_norm.weight")})
            if pre + "self_attn.v_proj.weight" in t.left:
                attn["wv"] = w("self_attn.v_proj").reshape(D, K, H)
        tree = {"attn": attn, "layer_scalar": t(pre + "layer_scalar").reshape(1),
                **{ours: {"scale": t(pre + theirs + ".weight")} for ours, theirs in NORMS}}
        if cfg.per_layer_input_size:
            tree.update(ple_gate=w("per_layer_input_gate"), ple_proj=w("per_layer_projection"),
                        ple_norm={"scale": t(pre + "post_per_layer_input_norm.weight")})
        mlp = {ours: w(f"mlp.{theirs}") for ours, theirs in GATED_MLP}
        if cfg.moe is None:
            return {**tree, "mlp": mlp}
        gate_up = t(pre + "experts.gate_up_proj")
        F = gate_up.shape[1] // 2
        tree["moe"] = {
            "router": {"w": w("router.proj"), "scale": t(pre + "router.scale"),
                       "expert_scale": t(pre + "router.per_expert_scale")},
            "experts": {"wi_0": gate_up[:, :F].transpose(0, 2, 1),
                        "wi_1": gate_up[:, F:].transpose(0, 2, 1),
                        "wo": t(pre + "experts.down_proj").transpose(0, 2, 1)},
            "shared": mlp,
            **{ours: {"scale": t(pre + theirs + ".weight")} for ours, theirs in BRANCH_NORMS}}
        return tree

    top = {}
    if cfg.per_layer_input_size:
        top = {"per_layer_embedding": t("model.embed_tokens_per_layer.weight"),
               "per_layer_projection": t("model.per_layer_model_projection.weight").T,
               "per_layer_norm": {"scale": t("model.per_layer_projection_norm.weight")}}
    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg), **top,
                                "final_norm": {"scale": t("model.norm.weight")}})


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre = f"model.layers.{i}."
        a = p["attn"]
        out.update({f"{pre}self_attn.{n}_proj.weight": hf_linear(a[f"w{n}"])
                    for n in "qkv" if f"w{n}" in a})
        out[pre + "self_attn.o_proj.weight"] = hf_linear(
            np.asarray(a["wo"]).reshape(-1, cfg.hidden_size))
        out.update({f"{pre}self_attn.{n}.weight": np.asarray(a[n]["scale"])
                    for n in ("q_norm", "k_norm") if n in a})
        out[pre + "layer_scalar"] = np.asarray(p["layer_scalar"]).reshape(1)
        if "ple_gate" in p:
            out.update({pre + "per_layer_input_gate.weight": hf_linear(p["ple_gate"]),
                        pre + "per_layer_projection.weight": hf_linear(p["ple_proj"]),
                        pre + "post_per_layer_input_norm.weight":
                            np.asarray(p["ple_norm"]["scale"])})
        out.update({pre + theirs + ".weight": np.asarray(p[ours]["scale"])
                    for ours, theirs in NORMS})
        m = p.get("moe")
        mlp = m["shared"] if m is not None else p["mlp"]
        out.update({f"{pre}mlp.{theirs}.weight": hf_linear(mlp[ours])
                    for ours, theirs in GATED_MLP})
        if m is not None:
            e = {k: np.asarray(v) for k, v in m["experts"].items()}
            out[pre + "router.proj.weight"] = hf_linear(m["router"]["w"])
            out[pre + "router.scale"] = np.asarray(m["router"]["scale"])
            out[pre + "router.per_expert_scale"] = np.asarray(m["router"]["expert_scale"])
            out[pre + "experts.gate_up_proj"] = np.concatenate(
                [e["wi_0"], e["wi_1"]], -1).transpose(0, 2, 1)
            out[pre + "experts.down_proj"] = e["wo"].transpose(0, 2, 1)
            out.update({pre + theirs + ".weight": np.asarray(m[ours]["scale"])
                        for ours, theirs in BRANCH_NORMS})
    out.update(ends_out(params, cfg))
    if cfg.per_layer_input_size:
        out.update({"model.embed_tokens_per_layer.weight": np.asarray(
                        params["per_layer_embedding"]),
                    "model.per_layer_model_projection.weight": hf_linear(
                        params["per_layer_projection"]),
                    "model.per_layer_projection_norm.weight": np.asarray(
                        params["per_layer_norm"]["scale"])})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    out = dense_problems(cfg, rope=True, qk_norm=True, qkv_only_bias=False, bias_linear=False,
                         windows=True, mha=False, moe=cfg.moe is not None)
    K, H = cfg.attention_shape(wide=True)
    wide = cfg.global_layers or (False,) * cfg.num_layers
    out.update(
        vision_tower=family == "gemma4",
        embedding_multiplier=cfg.embedding_multiplier is None or not np.isclose(
            cfg.embedding_multiplier, cfg.hidden_size ** 0.5),
        apply_layernorm_1p=cfg.apply_layernorm_1p, activation=cfg.activation != "gelu_tanh",
        post_attention_norm=not cfg.post_attention_norm, post_mlp_norm=not cfg.post_mlp_norm,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar != 1,
        local_rotary_base=False, final_logit_softcapping=False, sliding_window_layers=False,
        layer_scalar=not cfg.layer_scalar, v_norm=cfg.v_norm != "plain",
        # transformers makes every full-attention layer a global one of the global shape
        global_layers=any(w != (cfg.window_of_layer(i) is None) for i, w in enumerate(wide)),
        global_kv_heads=(not cfg.attention_k_eq_v) and K != cfg.num_kv_heads,
        rope_type=cfg.rope_type != "rope", rotary_percent=cfg.rotary_percent != 1.0)
    m = cfg.moe
    if m is not None:
        out.update({"moe.layer_freq": m.layer_freq != 1,
                    "moe.score_function": m.score_function != "softmax",
                    "moe.pre_softmax": m.pre_softmax,
                    "moe.branch_norms": not m.branch_norms,
                    "moe.router_input_norm": not m.router_input_norm,
                    "moe.per_expert_scale": not m.per_expert_scale,
                    "moe.shared_expert_size": m.shared_expert_size != cfg.ffn_hidden_size,
                    **plain_router_problems(m)})
    return out


def config(cfg: ModelConfig, family: str) -> dict:
    K, H = cfg.attention_shape(wide=True)
    n, m = cfg.num_layers, cfg.moe
    full = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.global_rotary_percent is not None:
        full = {"rope_type": "proportional", "partial_rotary_factor": cfg.global_rotary_percent,
                "rope_theta": cfg.rotary_base}
    out = {"hidden_size": cfg.hidden_size, "num_hidden_layers": n,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_hidden_size,
           "max_position_embeddings": cfg.max_position_embeddings,
           "rms_norm_eps": cfg.norm_epsilon, "attention_dropout": cfg.attention_dropout,
           "head_dim": cfg.head_dim, "global_head_dim": H, "attention_bias": False,
           "attention_k_eq_v": cfg.attention_k_eq_v,
           "num_global_key_value_heads": K if cfg.attention_k_eq_v else None,
           "hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window,
           "final_logit_softcapping": cfg.final_logit_softcapping,
           "layer_types": ["full_attention" if cfg.window_of_layer(i) is None
                           else "sliding_attention" for i in range(n)],
           "rope_parameters": {"full_attention": full, "sliding_attention": {
               "rope_type": "default",
               "rope_theta": cfg.local_rotary_base or cfg.rotary_base}},
           "hidden_size_per_layer_input": cfg.per_layer_input_size,
           "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
           "num_kv_shared_layers": cfg.kv_shared_layers,
           "use_double_wide_mlp": cfg.double_wide_shared_mlp,
           "enable_moe_block": m is not None}
    if m is not None:
        out.update(num_experts=m.num_experts, top_k_experts=m.topk,
                   moe_intermediate_size=m.ffn_hidden_size)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
