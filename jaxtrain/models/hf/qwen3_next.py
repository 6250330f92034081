"""Qwen3-Next and Qwen3.5 (text): hybrids of Gated DeltaNet layers and gated full attention.

- Full-attention layers: ``q_proj`` holds each head's query and output gate side by side
  ([N, 2H] rows: H query channels, then H gate channels), per-head q/k norms, RoPE on the
  first ``partial_rotary_factor`` of each head.
- Gated DeltaNet layers (``linear_attn``): Qwen3-Next fuses the projections per key head
  (``in_proj_qkvz`` rows, per key head: q [D_k], k [D_k], v [r D_v], z [r D_v]; ``in_proj_ba``:
  b [r], a [r]; r = value heads per key head); Qwen3.5 keeps them apart (``in_proj_qkv`` with
  all q, then all k, then all v; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Both have one
  depthwise ``conv1d`` over the q|k|v channels, ``A_log``, ``dt_bias``, a gated ``norm`` and
  ``out_proj``.
- RMSNorms scale by 1 + w (zero-centred weights, as jaxtrain's apply_layernorm_1p stores them;
  copied as they are), except the gated norm's plain weight.
- MoE layers (Qwen3-Next, Qwen3.5-MoE): router ``mlp.gate``, experts, ``mlp.shared_expert`` and
  its ``mlp.shared_expert_gate`` [1, D].

Legend: D hidden, N heads, K kv heads, H head dim, Hk/Hv linear key/value heads, Dk/Dv their
widths, W convolution width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, experts_in,
                                       experts_out, hf_linear, output_head,
                                       plain_router_problems, rope_config, size_config, stacks)
from jaxtrain.models.moe import moe_pattern
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
# A vision-language checkpoint's language model is read as transformers' AutoModelForCausalLM
# reads it: model.language_model.* as model.*, the vision tower (model.visual.*) and the
# multi-token-prediction head (mtp.*) left out; it is written back as the text model.
VISION_LANGUAGE = ("qwen3_5", "qwen3_5_moe")
_LEFT_OUT = ("model.visual.", "mtp.")
MLP = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
EXPERTS = ("gate_proj", "up_proj", "down_proj")


def picks(cfg: ModelConfig) -> str | None:
    if cfg.linear_attention_layers is None and not cfg.attention_output_gate:
        return None
    if cfg.linear_attention_kind != "gdn":
        return None
    return "qwen3_next" if cfg.moe is not None else "qwen3_5_text"


def _sizes(cfg):
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return Hk, Hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk


def _linear_in(t: Tensors, pre: str, cfg, family: str) -> dict:
    D = cfg.hidden_size
    Hk, Hv, Dk, Dv, r = _sizes(cfg)
    w = lambda n: t(pre + n + ".weight").T  # noqa: E731  [out, in] -> [in, out]
    if family == "qwen3_next":
        qkvz = w("in_proj_qkvz").reshape(D, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = np.split(qkvz, np.cumsum([Dk, Dk, r * Dv]), -1)
        ba = w("in_proj_ba").reshape(D, Hk, 2 * r)
        b, a = ba[..., :r].reshape(D, Hv), ba[..., r:].reshape(D, Hv)
        v, z = v.reshape(D, Hv, Dv), z.reshape(D, Hv, Dv)
    else:
        qkv = w("in_proj_qkv")
        q, k, v = np.split(qkv, np.cumsum([Hk * Dk, Hk * Dk]), -1)
        q, k, v = q.reshape(D, Hk, Dk), k.reshape(D, Hk, Dk), v.reshape(D, Hv, Dv)
        z, b, a = w("in_proj_z").reshape(D, Hv, Dv), w("in_proj_b"), w("in_proj_a")
    conv = t(pre + "conv1d.weight")[:, 0].T   # [C, 1, W] -> [W, C]
    cq, ck, cv = np.split(conv, np.cumsum([Hk * Dk, Hk * Dk]), -1)
    W = conv.shape[0]
    return {"wq": q, "wk": k, "wv": v, "wz": z, "wb": b, "wa": a,
            "conv_q": cq.reshape(W, Hk, Dk), "conv_k": ck.reshape(W, Hk, Dk),
            "conv_v": cv.reshape(W, Hv, Dv),
            "A_log": t(pre + "A_log"), "dt_bias": t(pre + "dt_bias"),
            "norm": {"scale": t(pre + "norm.weight")},
            "wo": w("out_proj").reshape(Hv, Dv, D)}


def _attn_in(t: Tensors, pre: str, cfg) -> dict:
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    w = lambda n: t(pre + n + ".weight").T  # noqa: E731
    qg = w("q_proj").reshape(D, N, 2 * H)
    return {"wq": qg[..., :H], "wg": qg[..., H:], "wk": w("k_proj").reshape(D, K, H),
            "wv": w("v_proj").reshape(D, K, H), "wo": w("o_proj").reshape(N, H, D),
            "q_norm": {"scale": t(pre + "q_norm.weight")},
            "k_norm": {"scale": t(pre + "k_norm.weight")}}


def _moe_in(t: Tensors, pre: str, cfg) -> dict:
    tree = experts_in(t, pre, cfg, EXPERTS)
    tree["shared"] = {ours: t(f"{pre}shared_expert.{theirs}.weight").T for ours, theirs in MLP}
    tree["shared_gate"] = t(pre + "shared_expert_gate.weight").T
    return tree


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    family = (hf or {}).get("model_type") or picks(cfg)
    if family in VISION_LANGUAGE:
        t.left = {k.replace("model.language_model.", "model.", 1): v for k, v in t.left.items()
                  if not k.startswith(_LEFT_OUT)}
    moe = moe_pattern(cfg.moe, cfg.num_layers)

    def layer(i):
        pre = f"model.layers.{i}."
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")},
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}}
        if cfg.is_linear(i):
            tree["linear_attn"] = _linear_in(t, pre + "linear_attn.", cfg, family)
        else:
            tree["attn"] = _attn_in(t, pre + "self_attn.", cfg)
        if moe[i]:
            tree["moe"] = _moe_in(t, pre + "mlp.", cfg)
        else:
            tree["mlp"] = {ours: t(f"{pre}mlp.{theirs}.weight").T for ours, theirs in MLP}
        return tree

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def _linear_out(p: dict, pre: str, cfg, family: str) -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    Hk, Hv, Dk, Dv, r = _sizes(cfg)
    a = {k: np.asarray(v) for k, v in p.items() if k != "norm"}
    out = {}
    if family == "qwen3_next":
        grouped = lambda x: x.reshape(D, Hk, -1)   # noqa: E731  value heads by key head
        qkvz = np.concatenate([a["wq"], a["wk"], grouped(a["wv"]), grouped(a["wz"])], -1)
        ba = np.concatenate([grouped(a["wb"]), grouped(a["wa"])], -1)
        out[pre + "in_proj_qkvz.weight"] = hf_linear(qkvz)
        out[pre + "in_proj_ba.weight"] = hf_linear(ba)
    else:
        qkv = np.concatenate([x.reshape(D, -1) for x in (a["wq"], a["wk"], a["wv"])], -1)
        out[pre + "in_proj_qkv.weight"] = hf_linear(qkv)
        out.update({pre + f"in_proj_{n}.weight": hf_linear(a["w" + n]) for n in "zba"})
    W = cfg.linear_conv_kernel_dim
    conv = np.concatenate([a[f"conv_{n}"].reshape(W, -1) for n in "qkv"], -1)
    out[pre + "conv1d.weight"] = np.ascontiguousarray(conv.T[:, None, :])
    out.update({pre + "A_log": a["A_log"], pre + "dt_bias": a["dt_bias"],
                pre + "norm.weight": np.asarray(p["norm"]["scale"]),
                pre + "out_proj.weight": hf_linear(a["wo"].reshape(Hv * Dv, D))})
    return out


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    moe = moe_pattern(cfg.moe, cfg.num_layers)
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = np.asarray(p["attn_norm"]["scale"])
        out[pre + "post_attention_layernorm.weight"] = np.asarray(p["mlp_norm"]["scale"])
        if cfg.is_linear(i):
            out.update(_linear_out(p["linear_attn"], pre + "linear_attn.", cfg, family))
        else:
            a, s = p["attn"], pre + "self_attn."
            qg = np.concatenate([np.asarray(a["wq"]), np.asarray(a["wg"])], -1)
            out[s + "q_proj.weight"] = hf_linear(qg)
            out[s + "k_proj.weight"], out[s + "v_proj.weight"] = (hf_linear(a["wk"]),
                                                                  hf_linear(a["wv"]))
            out[s + "o_proj.weight"] = np.asarray(a["wo"]).reshape(-1, cfg.hidden_size).T
            out[s + "q_norm.weight"] = np.asarray(a["q_norm"]["scale"])
            out[s + "k_norm.weight"] = np.asarray(a["k_norm"]["scale"])
        if moe[i]:
            m, base = p["moe"], pre + "mlp."
            out.update(experts_out(m, base, EXPERTS))
            out.update({f"{base}shared_expert.{theirs}.weight": hf_linear(m["shared"][ours])
                        for ours, theirs in MLP})
            out[base + "shared_expert_gate.weight"] = hf_linear(m["shared_gate"])
        else:
            out.update({f"{pre}mlp.{theirs}.weight": hf_linear(p["mlp"][ours])
                        for ours, theirs in MLP})
    out.update(ends_out(params, cfg, lambda p, cfg: np.asarray(p["scale"])))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    out = dense_problems(cfg, rope=True, qk_norm=True, qkv_only_bias=False, bias_linear=False,
                         windows=False, mha=False, moe=family not in ("qwen3_5_text", "qwen3_5"))
    # jaxtrain holds no vision tower to write: export the text model (qwen3_5_text / _moe_text)
    out["vision_tower"] = family in VISION_LANGUAGE
    m = cfg.moe
    out.update(rotary_percent=False, rotary_interleaved=cfg.rotary_interleaved,
               activation=cfg.activation != "silu",
               apply_layernorm_1p=not cfg.apply_layernorm_1p,
               attention_output_gate=not cfg.attention_output_gate,
               linear_attention_layers=cfg.linear_attention_layers is None,
               linear_qk_l2_norm=not cfg.linear_qk_l2_norm,
               use_rope_scaling=cfg.use_rope_scaling, rope_type=cfg.rope_type != "rope",
               rotary_seq_len_interpolation_factor=bool(cfg.rotary_seq_len_interpolation_factor))
    if m is not None:
        all_moe = all(moe_pattern(m, cfg.num_layers))
        out.update({
            "moe.layer_freq": family == "qwen3_5_moe_text" and not all_moe,
            "moe.score_function": m.score_function != "softmax",
            "moe.pre_softmax": family == "qwen3_5_moe_text" and m.pre_softmax and m.topk > 1,
            "moe.shared_expert_size": not m.shared_expert_size,
            "moe.shared_expert_gate": not m.shared_expert_gate,
            **plain_router_problems(m)})
    return out


def config(cfg: ModelConfig, family: str) -> dict:
    Hk, Hv, Dk, Dv, _ = _sizes(cfg)
    rope = rope_config(cfg)
    out = {**size_config(cfg), "head_dim": cfg.head_dim, "attention_bias": False,
           "hidden_act": "silu", "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
           "linear_key_head_dim": Dk, "linear_value_head_dim": Dv,
           "linear_num_key_heads": Hk, "linear_num_value_heads": Hv,
           "layer_types": ["linear_attention" if cfg.is_linear(i) else "full_attention"
                           for i in range(cfg.num_layers)],
           "rope_parameters": {"rope_type": "default", "rope_theta": rope["rope_theta"],
                               "partial_rotary_factor": cfg.rotary_percent}}
    m = cfg.moe
    if m is None:
        return out
    dense = [i for i, on in enumerate(moe_pattern(m, cfg.num_layers)) if not on]
    out.update(num_experts=m.num_experts, num_experts_per_tok=m.topk,
               moe_intermediate_size=m.ffn_hidden_size,
               shared_expert_intermediate_size=m.shared_expert_size,
               output_router_logits=False)
    if family == "qwen3_next":
        out.update(decoder_sparse_step=1, mlp_only_layers=dense, norm_topk_prob=not m.pre_softmax)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
