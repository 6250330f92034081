"""DeepSeek-V3: multi-latent attention (latent RMSNorms, interleaved RoPE on the shared key,
YaRN whose mscale_all_dim also scales the softmax), first_k_dense_replace dense MLP layers,
then MoE layers: sigmoid scores, experts chosen on score + e_score_correction_bias (our
expert_bias leaf) within the best topk_group of n_group groups (a group scored by the sum of its
top-2 biased scores), the unbiased scores of the chosen experts renormalised and scaled by
routed_scaling_factor, gating in fp32, plus n_shared_experts always-on shared experts.
DeepSeek-V3.2 (``deepseek_v32``) adds the sparse-attention indexer to every layer
(``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``; models/dsa.py); GLM-5 (``glm_moe_dsa``)
rotates the indexer's RoPE on interleaved pairs and keeps an indexer only on its "full" layers
(``indexer_types``), the "shared" ones attending with the last full layer's selection.

Legend: D hidden, N heads, Hn/Hv the no-RoPE q/k and value head widths, Hq = Hn + P, P the RoPE
width, Rkv the kv latent rank.
"""
from __future__ import annotations

import math

import numpy as np

from jaxtrain.config.dialects.hf import HF_GROUP_SCORE_TOPK, mscale
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (ACT_HF, Adapter, Tensors, experts_in, experts_out,
                                       gemma_problems, hf_linear, llama4_problems, norm_scale,
                                       output_head, rope_config, stacks)
from jaxtrain.models.moe import group_score_topk, moe_pattern
from jaxtrain.models.params import layer_slots, layer_tree
from jaxtrain.models.spec import DSA_SHARED_STACKS, MOE_STACKS

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MLP_NAMES = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))


def picks(cfg: ModelConfig) -> str | None:
    if not cfg.multi_latent_attention:
        return None
    if not cfg.dsa_index_heads:
        return "deepseek_v3"
    glm = cfg.dsa_shared_layers is not None or cfg.dsa_rope_interleaved
    return "glm_moe_dsa" if glm else "deepseek_v32"


# ---------------------------------------------------------------- tensors in

def _rope_pair_order(P: int) -> np.ndarray:
    """Channel order taking a half-split RoPE slice (i, i + P/2) to interleaved pairs."""
    return np.stack([np.arange(P // 2), np.arange(P // 2) + P // 2], -1).reshape(-1)


def moe_in(t: Tensors, base: str, cfg, names=EXPERT_NAMES) -> dict:
    """An MoE layer under ``base``: router (+ e_score_correction_bias as expert_bias), routed
    experts in either layout (``names``: the per-expert gate/up/down names), and the shared
    expert (absent when n_shared_experts is 0)."""
    tree = experts_in(t, base, cfg, names)
    tree["router"]["expert_bias"] = t(base + "gate.e_score_correction_bias")
    if cfg.moe.shared_expert_size:
        tree["shared"] = {ours: t(f"{base}shared_experts.{n}.weight").T for ours, n in MLP_NAMES}
    else:   # zero-width shared expert
        for _, n in MLP_NAMES:
            t.drop(f"{base}shared_experts.{n}.weight")
    return tree


def params(t: Tensors, cfg: ModelConfig, hf: dict) -> dict:
    """The tree (kv_b_proj split into wk_b/wv_b). A checkpoint with ``rope_interleave`` false
    rotates half-split RoPE slices; their channels are reordered into the interleaved pairs this
    model rotates (scores are unchanged). The ``num_nextn_predict_layers``
    multi-token-prediction layers stored after the decoder are skipped, as transformers does."""
    rope_interleave = hf.get("rope_interleave", True)
    mtp_layers = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    Hn, Hq, Rkv, P = cfg.qk_head_dim, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    q_order = np.arange(Hq)
    kv_order = np.arange(Rkv + P)
    if not rope_interleave:
        q_order[Hn:] = Hn + _rope_pair_order(P)
        kv_order[Rkv:] = Rkv + _rope_pair_order(P)
    slots = [kind for kind, _ in layer_slots(cfg)]

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")},
                "attn": mla_in(t, pre + "self_attn.", cfg, q_order, kv_order,
                               indexer=slots[i] not in DSA_SHARED_STACKS),
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}}
        if slots[i] in MOE_STACKS:
            return {**tree, "moe": moe_in(t, pre + "mlp.", cfg)}
        return {**tree, "mlp": {ours: w(f"mlp.{theirs}") for ours, theirs in MLP_NAMES}}

    mtp = tuple(f"model.layers.{cfg.num_layers + j}." for j in range(mtp_layers))
    for name in [k for k in t.left if k.startswith(mtp)]:
        t.drop(name)
    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def mla_in(t: Tensors, pre: str, cfg, q_order=None, kv_order=None, indexer=True) -> dict:
    """One multi-latent attention tree from the projections under ``pre`` (``self_attn.``);
    ``q_order`` / ``kv_order``: channel orders of the query heads and of the kv down
    projection's output (identity when None); ``indexer``: the layer has a DSA indexer (with
    ``cfg.dsa_index_heads``)."""
    D, N, Hn, Hv = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    Hq, Rkv = cfg.head_dim, cfg.kv_lora_rank
    q_order = np.arange(Hq) if q_order is None else q_order
    w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
    if cfg.q_lora_rank is None:
        attn = {"wq": w("q_proj").reshape(D, N, Hq)[..., q_order]}
    else:
        attn = {"wq_a": w("q_a_proj"), "q_a_norm": {"scale": t(pre + "q_a_layernorm.weight")},
                "wq_b": w("q_b_proj").reshape(-1, N, Hq)[..., q_order]}
    kv_a = w("kv_a_proj_with_mqa")
    kv_b = w("kv_b_proj").reshape(Rkv, N, Hn + Hv)
    attn.update(wkv_a=kv_a if kv_order is None else kv_a[:, kv_order],
                kv_a_norm={"scale": t(pre + "kv_a_layernorm.weight")},
                wk_b=kv_b[..., :Hn], wv_b=kv_b[..., Hn:], wo=w("o_proj").reshape(N, Hv, D))
    if cfg.dsa_index_heads and indexer:
        ix = pre + "indexer."
        attn["indexer"] = {
            "wq_b": w("indexer.wq_b").reshape(-1, cfg.dsa_index_heads, cfg.dsa_index_head_dim),
            "wk": w("indexer.wk"),
            "k_norm": {"scale": t(ix + "k_norm.weight"), "bias": t(ix + "k_norm.bias")},
            "weights_proj": w("indexer.weights_proj")}
    return attn


# ---------------------------------------------------------------- tensors out

def mla_out(a: dict, pre: str, cfg) -> dict[str, np.ndarray]:
    """The inverse of :func:`mla_in` (identity channel orders)."""
    out = {}
    if "wq" in a:
        out[pre + "q_proj.weight"] = hf_linear(a["wq"])
    else:
        out[pre + "q_a_proj.weight"] = hf_linear(a["wq_a"])
        out[pre + "q_a_layernorm.weight"] = norm_scale(a["q_a_norm"], cfg)
        out[pre + "q_b_proj.weight"] = hf_linear(a["wq_b"])
    out[pre + "kv_a_proj_with_mqa.weight"] = hf_linear(a["wkv_a"])
    out[pre + "kv_a_layernorm.weight"] = norm_scale(a["kv_a_norm"], cfg)
    out[pre + "kv_b_proj.weight"] = hf_linear(np.concatenate([a["wk_b"], a["wv_b"]], -1))
    out[pre + "o_proj.weight"] = np.asarray(a["wo"]).reshape(-1, cfg.hidden_size).T
    if "indexer" in a:
        ix = a["indexer"]
        out[pre + "indexer.wq_b.weight"] = hf_linear(ix["wq_b"])
        out[pre + "indexer.wk.weight"] = hf_linear(ix["wk"])
        out[pre + "indexer.k_norm.weight"] = np.asarray(ix["k_norm"]["scale"])
        out[pre + "indexer.k_norm.bias"] = np.asarray(ix["k_norm"]["bias"])
        out[pre + "indexer.weights_proj.weight"] = hf_linear(ix["weights_proj"])
    return out


def moe_out(moe: dict, base: str, cfg, names=EXPERT_NAMES) -> dict[str, np.ndarray]:
    """The inverse of :func:`moe_in` (the per-expert layout; a missing expert bias as
    zeros)."""
    out = experts_out(moe, base, names)
    bias = moe["router"].get("expert_bias")
    out[base + "gate.e_score_correction_bias"] = (
        np.zeros(cfg.moe.num_experts, np.float32) if bias is None
        else np.asarray(bias).astype(np.float32))
    for ours, theirs in MLP_NAMES if "shared" in moe else ():
        out[base + f"shared_experts.{theirs}.weight"] = hf_linear(moe["shared"][ours])
    return out


def tensors(params: dict, cfg: ModelConfig, family: str = "deepseek_v3"
            ) -> dict[str, np.ndarray]:
    np_ = np.asarray
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        m, pre = p.get("mlp"), f"model.layers.{i}."
        out.update(mla_out(p["attn"], pre + "self_attn.", cfg))
        if m is None:
            out.update(moe_out(p["moe"], pre + "mlp.", cfg))
        else:
            for ours, theirs in MLP_NAMES:
                out[pre + f"mlp.{theirs}.weight"] = hf_linear(m[ours])
        out[pre + "input_layernorm.weight"] = norm_scale(p["attn_norm"], cfg)
        out[pre + "post_attention_layernorm.weight"] = norm_scale(p["mlp_norm"], cfg)
    out["model.embed_tokens.weight"] = np_(params["embedding"])
    out["model.norm.weight"] = norm_scale(params["final_norm"], cfg)
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np_(params["output"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ---------------------------------------------------------------- config.json out

def problems(cfg: ModelConfig, family: str = "deepseek_v3") -> dict:
    rope_yarn = cfg.rope_type == "yarn" and not cfg.use_rope_scaling
    hf_softmax = (mscale(cfg.yarn_scaling_factor, cfg.yarn_mscale_all_dim)
                  if rope_yarn and cfg.yarn_mscale and cfg.yarn_mscale_all_dim else 1.0)
    out = {
        "multi_latent_attention": not cfg.multi_latent_attention,
        "position_embedding_type": cfg.position_embedding_type != "rope",
        "normalization": cfg.normalization != "RMSNorm",
        "gated_linear_unit": not cfg.gated_linear_unit,
        "activation": cfg.activation not in ACT_HF,
        "qk_layernorm": not cfg.qk_layernorm,
        "add_bias_linear": cfg.add_bias_linear,
        "attention_sinks": cfg.attention_sinks,
        "sliding_window": bool(cfg.sliding_window),
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor)
        and (cfg.use_rope_scaling or cfg.rope_type == "yarn"),
        # transformers' q/kv latent norms take their default epsilon, 1e-6
        "mla_latent_norm_epsilon": not math.isclose(
            cfg.mla_latent_norm_epsilon or cfg.norm_epsilon, 1e-6),
        "yarn_mscale_all_dim": not math.isclose(
            hf_softmax, mscale(cfg.yarn_scaling_factor, cfg.yarn_mscale_all_dim)),
        **gemma_problems(cfg), **llama4_problems(cfg), **_dsa_problems(cfg, family),
    }
    return out if cfg.moe is None else {**out, **_moe_problems(cfg)}


def _dsa_problems(cfg: ModelConfig, family: str) -> dict:
    """DeepSeek-V3 has no indexer; V3.2's scores half-split RoPE with ReLU, a 1e-6 key norm
    and the exact top-k, on every layer; GLM-5's interleaved RoPE, with index sharing (the
    indexer's training knobs are not checked)."""
    if family not in DSA_FAMILIES:
        return {"dsa_index_heads": bool(cfg.dsa_index_heads)}
    eps = cfg.norm_epsilon if cfg.dsa_k_norm_epsilon is None else cfg.dsa_k_norm_epsilon
    glm = family == "glm_moe_dsa"
    return {"dsa_index_heads": not cfg.dsa_index_heads,
            "q_lora_rank": cfg.q_lora_rank is None,
            "dsa_rope_interleaved": cfg.dsa_rope_interleaved != glm,
            "dsa_shared_layers": cfg.dsa_shared_layers is not None and not glm,
            "dsa_scoring_relu": not cfg.dsa_scoring_relu,
            "dsa_k_norm_epsilon": not math.isclose(eps, 1e-6),
            "dsa_exact_topk": not cfg.dsa_exact_topk,
            "dsa_approx_topk_recall": cfg.dsa_approx_topk_recall is not None}


def _moe_problems(cfg: ModelConfig) -> dict:
    """MoE settings DeepSeek-V3's router cannot reproduce (training-only knobs are not checked;
    a missing expert bias is written as zeros)."""
    m = cfg.moe
    pattern = moe_pattern(m, cfg.num_layers)
    first = pattern.index(True) if any(pattern) else cfg.num_layers
    return {
        "moe.layer_freq": any(pattern) and not all(pattern[first:]),
        "moe.score_function": m.score_function != "sigmoid",
        "moe.group_score_topk": bool(m.num_groups) and m.group_topk < m.num_groups
        and group_score_topk(m) != HF_GROUP_SCORE_TOPK,
        "moe.shared_expert_size": bool(m.shared_expert_size)
        and m.shared_expert_size % m.ffn_hidden_size != 0,
        "moe.router_bias": m.router_bias,
        "moe.router_softcap": bool(m.router_softcap),
        "moe.force_balancing": m.force_balancing is not None,
        "moe.activation": m.activation is not None,
        "moe.load_balancing": "sinkhorn" in m.load_balancing,
    }


def config(cfg: ModelConfig, family: str = "deepseek_v3") -> dict:
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_hidden_size, **_moe_config(cfg),
            "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_head_dim, "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
            "v_head_dim": cfg.v_head_dim, "attention_bias": False,
            **({} if family in DSA_FAMILIES else {"rope_interleave": True}),
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "hidden_act": ACT_HF[cfg.activation],
            "attention_dropout": cfg.attention_dropout, **rope_config(cfg),
            **_dsa_config(cfg, family)}


def _dsa_config(cfg: ModelConfig, family: str) -> dict:
    """The indexer's config.json entries (GLM-5: which layers have one)."""
    if family not in DSA_FAMILIES:
        return {}
    out = {"index_n_heads": cfg.dsa_index_heads, "index_head_dim": cfg.dsa_index_head_dim,
           "index_topk": cfg.dsa_index_topk}
    if family == "glm_moe_dsa":
        shared = cfg.dsa_shared_layers or (False,) * cfg.num_layers
        out["indexer_types"] = ["shared" if s else "full" for s in shared]
    return out


def _moe_config(cfg: ModelConfig) -> dict:
    """first_k_dense_replace and the routing fields (checked by _moe_problems)."""
    m = cfg.moe
    pattern = moe_pattern(m, cfg.num_layers)
    if m is None or not any(pattern):
        return {"first_k_dense_replace": cfg.num_layers}
    grouped = bool(m.num_groups) and m.group_topk < m.num_groups   # else no group limit
    return {"first_k_dense_replace": pattern.index(True), "moe_layer_freq": 1,
            "n_routed_experts": m.num_experts, "num_experts_per_tok": m.topk,
            "moe_intermediate_size": m.ffn_hidden_size,
            "n_shared_experts": (m.shared_expert_size or 0) // m.ffn_hidden_size,
            "routed_scaling_factor": m.topk_scaling_factor or 1.0,
            "n_group": m.num_groups if grouped else 1,
            "topk_group": m.group_topk if grouped else 1, "norm_topk_prob": m.topk > 1,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
