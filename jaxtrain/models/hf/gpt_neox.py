"""GPT-NeoX (Pythia and the like): pre-norm LayerNorm with biases, RoPE on the first share of
each head (non-interleaved), biases on every linear, a plain GELU MLP, an untied output layer
without a bias, and (use_parallel_residual) the parallel layer x + attn(n1(x)) + mlp(n2(x)).

The attention's q/k/v live in one ``query_key_value`` tensor laid out per head: its output rows
are [N, 3, H] (query, key, value of head 0, then of head 1, ...).

Legend: D hidden, N heads, H head dim, F ffn hidden.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (ACT_HF, Adapter, Tensors, dense_problems, hf_linear,
                                       norm_scale, stack_layers)
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"gpt_neox": "GPTNeoXForCausalLM"}
_PRE = "gpt_neox."


def picks(cfg: ModelConfig) -> str | None:
    return "gpt_neox" if cfg.parallel_residual or (
        cfg.position_embedding_type == "rope" and cfg.normalization == "LayerNorm") else None


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    D, N, H = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim

    def ln(name):
        return {"scale": t(name + ".weight"), "bias": t(name + ".bias")}

    def layer(i):
        p = f"{_PRE}layers.{i}."
        qkv = t(p + "attention.query_key_value.weight").reshape(N, 3, H, D)
        b = t(p + "attention.query_key_value.bias").reshape(N, 3, H)
        attn = {f"w{n}": qkv[:, j].transpose(2, 0, 1) for j, n in enumerate("qkv")}
        attn.update({f"b{n}": b[:, j] for j, n in enumerate("qkv")})
        attn.update(wo=t(p + "attention.dense.weight").T.reshape(N, H, D),
                    bo=t(p + "attention.dense.bias"))
        mlp = {"wi": t(p + "mlp.dense_h_to_4h.weight").T, "bi": t(p + "mlp.dense_h_to_4h.bias"),
               "wo": t(p + "mlp.dense_4h_to_h.weight").T, "bo": t(p + "mlp.dense_4h_to_h.bias")}
        return {"attn_norm": ln(p + "input_layernorm"), "attn": attn,
                "mlp_norm": ln(p + "post_attention_layernorm"), "mlp": mlp}

    tree = {"embedding": t(_PRE + "embed_in.weight"), "layers": stack_layers(layer, cfg),
            "final_norm": ln(_PRE + "final_layer_norm")}
    if cfg.untie_embeddings_and_output_weights:
        tree["output"] = t("embed_out.weight").T
    else:
        t.drop("embed_out.weight")
    return tree


def tensors(params: dict, cfg: ModelConfig, family: str = "gpt_neox") -> dict[str, np.ndarray]:
    N, H = cfg.num_attention_heads, cfg.head_dim
    np_ = np.asarray
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        a, m = p["attn"], p["mlp"]
        pre = f"{_PRE}layers.{i}."
        w = np.stack([np_(a[f"w{n}"]).transpose(1, 2, 0) for n in "qkv"], 1)   # [N, 3, H, D]
        out[pre + "attention.query_key_value.weight"] = w.reshape(N * 3 * H, -1)
        out[pre + "attention.query_key_value.bias"] = np.stack(
            [np_(a[f"b{n}"]) for n in "qkv"], 1).reshape(-1)
        out[pre + "attention.dense.weight"] = hf_linear(np_(a["wo"]).reshape(N * H, -1))
        out[pre + "attention.dense.bias"] = np_(a["bo"])
        out[pre + "mlp.dense_h_to_4h.weight"] = hf_linear(m["wi"])
        out[pre + "mlp.dense_h_to_4h.bias"] = np_(m["bi"])
        out[pre + "mlp.dense_4h_to_h.weight"] = hf_linear(m["wo"])
        out[pre + "mlp.dense_4h_to_h.bias"] = np_(m["bo"])
        for ours, theirs in (("attn_norm", "input_layernorm"),
                             ("mlp_norm", "post_attention_layernorm")):
            out[pre + theirs + ".weight"] = norm_scale(p[ours], cfg)
            out[pre + theirs + ".bias"] = np_(p[ours]["bias"])
    out[_PRE + "embed_in.weight"] = np_(params["embedding"])
    out[_PRE + "final_layer_norm.weight"] = norm_scale(params["final_norm"], cfg)
    out[_PRE + "final_layer_norm.bias"] = np_(params["final_norm"]["bias"])
    out["embed_out.weight"] = (np_(params["output"]).T if cfg.untie_embeddings_and_output_weights
                               else np_(params["embedding"]))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str = "gpt_neox") -> dict:
    out = dense_problems(cfg, rope=True, qk_norm=False, qkv_only_bias=False, bias_linear=True,
                         windows=False, mha=True, moe=False)
    out.update(normalization=cfg.normalization != "LayerNorm",
               gated_linear_unit=cfg.gated_linear_unit, rotary_percent=False,
               apply_layernorm_1p=cfg.apply_layernorm_1p,
               rotary_interleaved=cfg.rotary_interleaved, rope_type=cfg.rope_type != "rope",
               use_rope_scaling=cfg.use_rope_scaling)
    return out


def config(cfg: ModelConfig, family: str = "gpt_neox") -> dict:
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_hidden_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "layer_norm_eps": cfg.norm_epsilon, "hidden_act": ACT_HF[cfg.activation],
            "attention_dropout": cfg.attention_dropout, "hidden_dropout": cfg.hidden_dropout,
            "use_parallel_residual": cfg.parallel_residual, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent}}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
