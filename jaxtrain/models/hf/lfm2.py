"""LFM2 and LFM2-MoE: gated short-convolution layers between attention layers, a SwiGLU FFN
(``w1`` gate, ``w3`` up, ``w2`` down) in every layer, or in LFM2-MoE after the first
num_dense_layers an MoE block (router ``gate``, the ``expert_bias`` buffer, experts one by one
or fused ``gate_up_proj``/``down_proj``).

- Convolution layers: ``conv.in_proj`` rows [B | C | x] (D each), the depthwise ``conv.conv``
  [D, 1, W], ``conv.out_proj``; biases with conv_bias.
- Attention layers: ``self_attn.{q,k,v,out}_proj``, per-head ``q_layernorm``/``k_layernorm``.
- Norms: ``operator_norm`` before the mixer, ``ffn_norm`` before the FFN, and the final norm
  named ``embedding_norm``.

Legend: D hidden, N heads, K kv heads, H head dim, W convolution width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, experts_in,
                                       hf_linear, norm_scale, output_head, rope_config,
                                       size_config, stacks)
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "lfm2_moe": "Lfm2MoeForCausalLM"}
MLP = (("wi_0", "w1"), ("wi_1", "w3"), ("wo", "w2"))
EXPERTS = ("w1", "w3", "w2")
_PRE = "model."


def picks(cfg: ModelConfig) -> str | None:
    if cfg.short_conv_layers is None:
        return None
    return "lfm2_moe" if cfg.moe is not None else "lfm2"


def _conv_in(t: Tensors, pre: str, cfg) -> dict:
    D = cfg.hidden_size
    tree = {"w_in": t(pre + "in_proj.weight").T.reshape(D, 3, D),
            "conv": t(pre + "conv.weight")[:, 0].T, "wo": t(pre + "out_proj.weight").T}
    if cfg.short_conv_bias:
        tree.update(b_in=t(pre + "in_proj.bias").reshape(3, D), conv_bias=t(pre + "conv.bias"),
                    bo=t(pre + "out_proj.bias"))
    return tree


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim

    def layer(i):
        pre = f"{_PRE}layers.{i}."
        tree = {"attn_norm": {"scale": t(pre + "operator_norm.weight")},
                "mlp_norm": {"scale": t(pre + "ffn_norm.weight")}}
        if cfg.short_conv_layers[i]:
            tree["short_conv"] = _conv_in(t, pre + "conv.", cfg)
        else:
            w = lambda n: t(pre + "self_attn." + n + ".weight").T  # noqa: E731
            tree["attn"] = {"wq": w("q_proj").reshape(D, N, H), "wk": w("k_proj").reshape(D, K, H),
                            "wv": w("v_proj").reshape(D, K, H),
                            "wo": w("out_proj").reshape(N, H, D),
                            "q_norm": {"scale": t(pre + "self_attn.q_layernorm.weight")},
                            "k_norm": {"scale": t(pre + "self_attn.k_layernorm.weight")}}
        ff = pre + "feed_forward."
        if ff + "gate.weight" in t.left:
            moe = experts_in(t, ff, cfg, EXPERTS)
            if cfg.moe.expert_bias:
                moe["router"]["expert_bias"] = t(ff + "expert_bias").astype(np.float32)
            tree["moe"] = moe
        else:
            tree["mlp"] = {ours: t(f"{ff}{n}.weight").T for ours, n in MLP}
        return tree

    tree = {"embedding": t(_PRE + "embed_tokens.weight"), **stacks(layer, cfg),
            "final_norm": {"scale": t(_PRE + "embedding_norm.weight")}}
    return output_head(t, cfg, tree)


def tensors(params: dict, cfg: ModelConfig, family: str = "lfm2") -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre = f"{_PRE}layers.{i}."
        out[pre + "operator_norm.weight"] = norm_scale(p["attn_norm"], cfg)
        out[pre + "ffn_norm.weight"] = norm_scale(p["mlp_norm"], cfg)
        if "short_conv" in p:
            c = {k: np.asarray(v) for k, v in p["short_conv"].items()}
            out[pre + "conv.in_proj.weight"] = c["w_in"].reshape(D, 3 * D).T
            out[pre + "conv.conv.weight"] = c["conv"].T[:, None]
            out[pre + "conv.out_proj.weight"] = c["wo"].T
            if cfg.short_conv_bias:
                out[pre + "conv.in_proj.bias"] = c["b_in"].reshape(-1)
                out[pre + "conv.conv.bias"] = c["conv_bias"]
                out[pre + "conv.out_proj.bias"] = c["bo"]
        else:
            a = p["attn"]
            out.update({f"{pre}self_attn.{n}_proj.weight": hf_linear(a[f"w{n}"])
                        for n in "qkv"})
            out[pre + "self_attn.out_proj.weight"] = np.asarray(a["wo"]).reshape(-1, D).T
            out[pre + "self_attn.q_layernorm.weight"] = norm_scale(a["q_norm"], cfg)
            out[pre + "self_attn.k_layernorm.weight"] = norm_scale(a["k_norm"], cfg)
        ff = pre + "feed_forward."
        if "moe" in p:
            e = p["moe"]
            out[ff + "gate.weight"] = np.asarray(e["router"]["w"]).T
            if "expert_bias" in e["router"]:
                out[ff + "expert_bias"] = np.asarray(e["router"]["expert_bias"])
            for ours, n in zip(("wi_0", "wi_1", "wo"), EXPERTS):
                for j, w in enumerate(np.asarray(e["experts"][ours])):
                    out[f"{ff}experts.{j}.{n}.weight"] = w.T
        else:
            out.update({f"{ff}{n}.weight": hf_linear(p["mlp"][ours]) for ours, n in MLP})
    out.update(ends_out(params, cfg, final_norm=_PRE + "embedding_norm.weight"))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str = "lfm2") -> dict:
    out = dense_problems(cfg, rope=True, qk_norm=True, qkv_only_bias=False, bias_linear=False,
                         windows=False, mha=False, moe=cfg.moe is not None)
    m = cfg.moe
    dense_first = m is not None and (m.layer_freq == 1 or list(m.layer_freq) == sorted(
        m.layer_freq))
    out.update(short_conv_layers=cfg.short_conv_layers is None,
               activation=cfg.activation != "silu",
               kv_channels=cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size)
    if m is not None:
        out.update({"moe.score_function": m.score_function != "sigmoid",
                    "moe.layer_freq": not dense_first, "moe.router_bias": m.router_bias,
                    "moe.num_groups": bool(m.num_groups),
                    "moe.shared_expert_size": bool(m.shared_expert_size)})
    return out


def config(cfg: ModelConfig, family: str = "lfm2") -> dict:
    sizes = size_config(cfg)
    out = {**{k: v for k, v in sizes.items() if k != "rms_norm_eps"},
           "norm_eps": cfg.norm_epsilon, "conv_L_cache": cfg.short_conv_kernel,
           "conv_bias": cfg.short_conv_bias,
           "layer_types": ["conv" if c else "full_attention" for c in cfg.short_conv_layers],
           "rope_parameters": {"rope_type": "default",
                               "rope_theta": rope_config(cfg)["rope_theta"]}}
    if family == "lfm2":
        return {**out, "block_auto_adjust_ff_dim": False}
    m = cfg.moe
    freq = (1,) * cfg.num_layers if m.layer_freq == 1 else tuple(m.layer_freq)
    out.update(num_dense_layers=freq.index(1) if 1 in freq else cfg.num_layers,
               num_experts=m.num_experts, num_experts_per_tok=m.topk,
               moe_intermediate_size=m.ffn_hidden_size, use_expert_bias=m.expert_bias,
               norm_topk_prob=m.topk > 1, routed_scaling_factor=m.topk_scaling_factor or 1.0)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
