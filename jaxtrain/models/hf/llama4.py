"""Llama 4 (text): Llama attention with RoPE on interleaved channel pairs (stored as jaxtrain
keeps them: no permutation) except on the NoPE layers, L2 q/k norms on the RoPE layers, chunked
attention and temperature tuning (no tensors); ``feed_forward`` is a dense gated MLP or an MoE
block of a router, fused experts and a shared expert.

Expert tensors are stored fused and not transposed: ``experts.gate_up_proj`` [E, D, 2F] (gate
columns, then up) and ``experts.down_proj`` [E, F, D]. The vision-language checkpoint (model_type
``llama4``) holds the text model under ``language_model.``; its vision tower and projector are
left out, and it is written back as the text model.

Legend: D hidden, N heads, K kv heads, H head dim, E experts, F expert FFN width.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf.common import (Adapter, Tensors, dense_problems, ends_out, hf_linear,
                                       output_head, plain_router_problems, rope_config,
                                       size_config, stacks)
from jaxtrain.models.moe import moe_pattern
from jaxtrain.models.params import layer_tree

ARCHITECTURES = {"llama4_text": "Llama4ForCausalLM", "llama4": "Llama4ForConditionalGeneration"}
_LEFT_OUT = ("vision_model.", "multi_modal_projector.")
MLP = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))


def picks(cfg: ModelConfig) -> str | None:
    llama4 = (cfg.no_rope_layers is not None or cfg.attention_chunk_size is not None
              or (cfg.moe is not None and cfg.moe.apply_probs_on_input))
    return "llama4_text" if llama4 else None


def _mlp_in(t: Tensors, pre: str) -> dict:
    return {ours: t(f"{pre}{theirs}.weight").T for ours, theirs in MLP}


def params(t: Tensors, cfg: ModelConfig, hf: dict | None = None) -> dict:
    if (hf or {}).get("model_type") == "llama4":
        t.left = {k.removeprefix("language_model."): v for k, v in t.left.items()
                  if not k.startswith(_LEFT_OUT)}
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    moe = moe_pattern(cfg.moe, cfg.num_layers)

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")},
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")},
                "attn": {"wq": w("self_attn.q_proj").reshape(D, N, H),
                         "wk": w("self_attn.k_proj").reshape(D, K, H),
                         "wv": w("self_attn.v_proj").reshape(D, K, H),
                         "wo": w("self_attn.o_proj").reshape(N, H, D)}}
        ff = pre + "feed_forward."
        if not moe[i]:
            return {**tree, "mlp": _mlp_in(t, ff)}
        gate_up = t(ff + "experts.gate_up_proj")
        F = gate_up.shape[-1] // 2
        tree["moe"] = {"router": {"w": t(ff + "router.weight").T},
                       "experts": {"wi_0": gate_up[..., :F], "wi_1": gate_up[..., F:],
                                   "wo": t(ff + "experts.down_proj")},
                       "shared": _mlp_in(t, ff + "shared_expert.")}
        return tree

    return output_head(t, cfg, {"embedding": t("model.embed_tokens.weight"),
                                **stacks(layer, cfg),
                                "final_norm": {"scale": t("model.norm.weight")}})


def tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    moe = moe_pattern(cfg.moe, cfg.num_layers)
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        pre, ff = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
        out[pre + "input_layernorm.weight"] = np.asarray(p["attn_norm"]["scale"])
        out[pre + "post_attention_layernorm.weight"] = np.asarray(p["mlp_norm"]["scale"])
        a = p["attn"]
        out.update({f"{pre}self_attn.{n}_proj.weight": hf_linear(a[f"w{n}"]) for n in "qkv"})
        out[pre + "self_attn.o_proj.weight"] = hf_linear(
            np.asarray(a["wo"]).reshape(-1, cfg.hidden_size))
        mlp = p["moe"]["shared"] if moe[i] else p["mlp"]
        base = ff + "shared_expert." if moe[i] else ff
        out.update({f"{base}{theirs}.weight": hf_linear(mlp[ours]) for ours, theirs in MLP})
        if moe[i]:
            m = p["moe"]
            e = {k: np.asarray(v) for k, v in m["experts"].items()}
            out[ff + "router.weight"] = hf_linear(m["router"]["w"])
            out[ff + "experts.gate_up_proj"] = np.concatenate([e["wi_0"], e["wi_1"]], -1)
            out[ff + "experts.down_proj"] = e["wo"]
    out.update(ends_out(params, cfg))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def problems(cfg: ModelConfig, family: str) -> dict:
    out = dense_problems(cfg, rope=True, qk_norm=False, qkv_only_bias=False, bias_linear=False,
                         windows=False, mha=False, moe=cfg.moe is not None)
    out.update(qk_l2_norm=cfg.qk_l2_norm and not cfg.qk_norm_rope_layers_only,
               qk_norm_rope_layers_only=False, no_rope_layers=False,
               vision_tower=family == "llama4",
               rotary_interleaved=not cfg.rotary_interleaved,
               rope_type=cfg.rope_type != "rope", attention_chunk_size=False,
               attn_temperature_tuning=False)
    m = cfg.moe
    out["moe.apply_probs_on_input"] = m is not None and not m.apply_probs_on_input
    if m is not None:
        out.update({"moe.topk": m.topk != 1, "moe.score_function": m.score_function != "sigmoid",
                    "moe.shared_expert_size": m.shared_expert_size != m.ffn_hidden_size,
                    **plain_router_problems(m)})
    return out


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def config(cfg: ModelConfig, family: str) -> dict:
    n, m = cfg.num_layers, cfg.moe
    rope = rope_config(cfg)
    rope_on = [int(not cfg.is_nope(i)) for i in range(n)]
    out = {**size_config(cfg), "head_dim": cfg.head_dim, "hidden_act": "silu",
           "attention_bias": False, "intermediate_size_mlp": cfg.ffn_hidden_size,
           "rope_theta": rope["rope_theta"], "rope_scaling": rope["rope_scaling"],
           "no_rope_layers": rope_on, "use_qk_norm": cfg.qk_l2_norm,
           "attention_chunk_size": cfg.attention_chunk_size,
           "attn_temperature_tuning": cfg.attn_temperature_tuning,
           "attn_scale": cfg.attn_temperature_scale,
           "floor_scale": _number(cfg.attn_temperature_floor_scale),
           "moe_layers": [i for i, on in enumerate(moe_pattern(m, n)) if on],
           "output_router_logits": False}
    if m is not None:
        out.update(intermediate_size=m.ffn_hidden_size, num_local_experts=m.num_experts,
                   num_experts_per_tok=1)
    return out


ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=params, problems=problems,
                  config=config, tensors=tensors)
