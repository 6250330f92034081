"""GPT-2: learned absolute positions, pre-norm LayerNorm with biases, a plain (ungated) MLP,
biases on every linear, multi-head attention, Conv1D weights stored [in, out]."""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (ACT_HF, Adapter, Tensors, dense_problems, norm_scale,
                                       output_head, stack_layers)
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}


def picks(cfg: ModelConfig) -> str | None:
    return "gpt2" if cfg.position_embedding_type == "learned_absolute" else None


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    D, N, H = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    pre = "transformer." if any(k.startswith("transformer.") for k in t.left) else ""

    def ln(name):
        return {"scale": t(name + ".weight"), "bias": t(name + ".bias")}

    def layer(i):
        p = f"{pre}h.{i}."
        wq, wk, wv = np.split(t(p + "attn.c_attn.weight"), 3, axis=1)   # Conv1D: [in, out]
        bq, bk, bv = np.split(t(p + "attn.c_attn.bias"), 3)
        attn = {"wq": wq.reshape(D, N, H), "wk": wk.reshape(D, N, H), "wv": wv.reshape(D, N, H),
                "bq": bq.reshape(N, H), "bk": bk.reshape(N, H), "bv": bv.reshape(N, H),
                "wo": t(p + "attn.c_proj.weight").reshape(N, H, D), "bo": t(p + "attn.c_proj.bias")}
        mlp = {"wi": t(p + "mlp.c_fc.weight"), "bi": t(p + "mlp.c_fc.bias"),
               "wo": t(p + "mlp.c_proj.weight"), "bo": t(p + "mlp.c_proj.bias")}
        return {"attn_norm": ln(p + "ln_1"), "attn": attn, "mlp_norm": ln(p + "ln_2"), "mlp": mlp}

    return output_head(t, cfg, {"embedding": t(pre + "wte.weight"),
                                "position_embedding": t(pre + "wpe.weight"),
                                "layers": stack_layers(layer, cfg),
                                "final_norm": ln(pre + "ln_f")})


def tensors(params: dict, cfg: ModelConfig, family: str = "gpt2") -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    np_ = np.asarray
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        a, m = p["attn"], p["mlp"]
        pre = f"transformer.h.{i}."
        out[pre + "attn.c_attn.weight"] = np.concatenate(
            [np_(a[k]).reshape(D, -1) for k in ("wq", "wk", "wv")], axis=1)
        out[pre + "attn.c_attn.bias"] = np.concatenate(
            [np_(a[k]).reshape(-1) for k in ("bq", "bk", "bv")])
        out[pre + "attn.c_proj.weight"] = np_(a["wo"]).reshape(-1, D)
        out[pre + "attn.c_proj.bias"] = np_(a["bo"])
        out[pre + "mlp.c_fc.weight"], out[pre + "mlp.c_fc.bias"] = np_(m["wi"]), np_(m["bi"])
        out[pre + "mlp.c_proj.weight"], out[pre + "mlp.c_proj.bias"] = np_(m["wo"]), np_(m["bo"])
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[pre + theirs + ".weight"] = norm_scale(p[ours], cfg)
            out[pre + theirs + ".bias"] = np_(p[ours]["bias"])
    out["transformer.wte.weight"] = np_(params["embedding"])
    out["transformer.wpe.weight"] = np_(params["position_embedding"])
    out["transformer.ln_f.weight"] = norm_scale(params["final_norm"], cfg)
    out["transformer.ln_f.bias"] = np_(params["final_norm"]["bias"])
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np_(params["output"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str = "gpt2") -> dict:
    return dense_problems(cfg, rope=False, qk_norm=False, qkv_only_bias=False, bias_linear=True,
                          windows=False, mha=True, moe=False)


def config(cfg: ModelConfig, family: str = "gpt2") -> dict:
    return {"n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_epsilon,
            "activation_function": ACT_HF[cfg.activation],
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout}


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
