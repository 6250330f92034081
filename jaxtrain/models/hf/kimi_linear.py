"""Kimi Linear (moonshotai/Kimi-Linear): Kimi Delta Attention layers between multi-latent
attention layers without RoPE, a dense MLP first and DeepSeek-V3-routed MoE layers after it.

Checkpoint layout (what the original checkpoints hold and transformers' save_pretrained
writes back):

- KDA layers (``self_attn.``): ``q_proj``/``k_proj``/``v_proj`` [H*Dh, D], one depthwise
  ``{q,k,v}_conv1d`` [H*Dh, 1, W] each, ``f_a_proj`` [Dk, D] / ``f_b_proj`` [H*Dk, Dk] (the
  decay), ``dt_bias`` [H*Dk], ``A_log`` [1, 1, H, 1], ``b_proj`` [H, D], ``g_a_proj`` /
  ``g_b_proj`` (the output gate), ``o_norm`` [Dv], ``o_proj`` [D, H*Dv].
- MLA layers: DeepSeek-V3's names (``q_proj`` or ``q_a_proj``/``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``); nothing rotates.
- MLPs under ``block_sparse_moe.``: the dense layer's ``gate_proj``/``up_proj``/``down_proj``;
  an MoE layer's ``gate`` (+ ``e_score_correction_bias``), ``experts.{e}.w1/w3/w2`` (gate, up,
  down) and ``shared_experts``.

Legend: D hidden, H linear heads, Dk/Dv their key/value widths, W convolution width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import deepseek_v3
from jaxtrain.models.hf.common import (Adapter, Tensors, hf_linear, norm_scale, output_head,
                                       stacks)
from jaxtrain.models.moe import moe_pattern
from jaxtrain.models.params import layer_tree
from jaxtrain.models.spec import LINEAR_STACKS, MOE_STACKS, layer_slots

ARCHITECTURES = {"kimi_linear": "KimiLinearForCausalLM"}
EXPERTS = ("w1", "w3", "w2")
MLP = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
# (ours, theirs, kind): the KDA projections, kind "head" [H*Dh, in] or "low" [r, D]
_KDA = (("wq", "q_proj", "head"), ("wk", "k_proj", "head"), ("wv", "v_proj", "head"),
        ("wf_a", "f_a_proj", "low"), ("wf_b", "f_b_proj", "head"), ("wg_a", "g_a_proj", "low"),
        ("wg_b", "g_b_proj", "head"), ("wb", "b_proj", "low"))


def picks(cfg: ModelConfig) -> str | None:
    return "kimi_linear" if cfg.linear_attention_kind == "kda" else None


def _kda_in(t: Tensors, pre: str, cfg) -> dict:
    H = cfg.linear_num_value_heads
    tree = {}
    for ours, theirs, kind in _KDA:
        w = t(pre + theirs + ".weight").T
        tree[ours] = w.reshape(w.shape[0], H, -1) if kind == "head" else w
    for n in "qkv":
        conv = t(f"{pre}{n}_conv1d.weight")[:, 0].T   # [C, 1, W] -> [W, C]
        tree["conv_" + n] = conv.reshape(conv.shape[0], H, -1)
    tree.update(dt_bias=t(pre + "dt_bias").reshape(H, -1), A_log=t(pre + "A_log").reshape(H),
                norm={"scale": t(pre + "o_norm.weight")},
                wo=t(pre + "o_proj.weight").T.reshape(H, -1, cfg.hidden_size))
    return tree


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    slots = [kind for kind, _ in layer_slots(cfg)]

    def layer(i):
        pre = f"model.layers.{i}."
        mixer = ({"linear_attn": _kda_in(t, pre + "self_attn.", cfg)}
                 if slots[i] in LINEAR_STACKS else
                 {"attn": deepseek_v3.mla_in(t, pre + "self_attn.", cfg)})
        base = pre + "block_sparse_moe."
        ffn = ({"moe": deepseek_v3.moe_in(t, base, cfg, EXPERTS)} if slots[i] in MOE_STACKS
               else {"mlp": {ours: t(f"{base}{n}.weight").T for ours, n in MLP}})
        return {"attn_norm": {"scale": t(pre + "input_layernorm.weight")}, **mixer,
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}, **ffn}

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def _kda_out(p: dict, pre: str, cfg) -> dict[str, np.ndarray]:
    out = {pre + theirs + ".weight": hf_linear(p[ours]) for ours, theirs, _ in _KDA}
    for n in "qkv":
        conv = np.asarray(p["conv_" + n])
        out[f"{pre}{n}_conv1d.weight"] = conv.reshape(conv.shape[0], -1).T[:, None, :]
    H = cfg.linear_num_value_heads
    out.update({pre + "dt_bias": np.asarray(p["dt_bias"]).reshape(-1),
                pre + "A_log": np.asarray(p["A_log"]).reshape(1, 1, H, 1),
                pre + "o_norm.weight": np.asarray(p["norm"]["scale"]),
                pre + "o_proj.weight": np.asarray(p["wo"]).reshape(-1, cfg.hidden_size).T})
    return out


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p, pre = layer_tree(params, cfg, i), f"model.layers.{i}."
        out.update(_kda_out(p["linear_attn"], pre + "self_attn.", cfg) if "linear_attn" in p
                   else deepseek_v3.mla_out(p["attn"], pre + "self_attn.", cfg))
        base = pre + "block_sparse_moe."
        if "moe" in p:
            out.update(deepseek_v3.moe_out(p["moe"], base, cfg, EXPERTS))
        else:
            out.update({f"{base}{n}.weight": hf_linear(p["mlp"][ours]) for ours, n in MLP})
        out[pre + "input_layernorm.weight"] = norm_scale(p["attn_norm"], cfg)
        out[pre + "post_attention_layernorm.weight"] = norm_scale(p["mlp_norm"], cfg)
    out["model.embed_tokens.weight"] = np.asarray(params["embedding"])
    out["model.norm.weight"] = norm_scale(params["final_norm"], cfg)
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np.asarray(params["output"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    out = {k: v for k, v in deepseek_v3.problems(cfg).items()
           if k not in ("position_embedding_type", "yarn_mscale_all_dim",
                        "rotary_seq_len_interpolation_factor", "moe.layer_freq")}
    return {**out, "mla_nope": not cfg.mla_nope, "linear_qk_l2_norm": not cfg.linear_qk_l2_norm,
            "linear_attention_layers": cfg.linear_attention_layers is None,
            "linear_value_head_dim": cfg.linear_value_head_dim != cfg.linear_key_head_dim,
            "linear_num_key_heads": cfg.linear_num_key_heads != cfg.linear_num_value_heads,
            "activation": cfg.activation != "silu",
            # transformers' Kimi Linear never ties its output layer to the embedding
            "untie_embeddings_and_output_weights": not cfg.untie_embeddings_and_output_weights}


def config(cfg: ModelConfig, family: str) -> dict:
    out = {k: v for k, v in deepseek_v3.config(cfg).items()
           if k not in ("rope_theta", "rope_scaling", "rope_interleave", "first_k_dense_replace",
                        "moe_layer_freq", "topk_method", "scoring_func")}
    pattern = moe_pattern(cfg.moe, cfg.num_layers)
    out.update(layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention"
                            for i in range(cfg.num_layers)],
               mlp_layer_types=["sparse" if m else "dense" for m in pattern],
               linear_head_dim=cfg.linear_key_head_dim,
               linear_num_heads=cfg.linear_num_value_heads,
               linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, tie_word_embeddings=False)
    if cfg.moe is not None:
        out["num_local_experts"] = out.pop("n_routed_experts")
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
