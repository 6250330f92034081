"""Hugging Face checkpoints: ``from_hf`` reads, ``to_hf`` writes (config.json + safetensors).

Families: Llama (2, 3.x with llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (qk norm), GPT-2 (learned positions, LayerNorm, biases, Conv1D weights stored [in, out]),
DeepSeek-V3 (multi-latent attention with YaRN; dense layers first, then MoE layers with
group-limited sigmoid routing, e_score_correction_bias and a shared expert), gpt-oss (sinks,
alternating sliding windows, biases, YaRN; biased router and clamped-GLU experts with biases),
Mixtral and Qwen3-MoE (MoE layers: router + experts [E, ...], dense layers where Qwen3-MoE's
mlp_only_layers/decoder_sparse_step say).
A config.json value these models cannot reproduce raises ``ValueError`` naming the field; a
checkpoint tensor that nothing consumes raises too. Neither direction needs torch.

Legend: D hidden, N query heads, K kv heads, H head dim, F ffn hidden, V vocab.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import yarn_attention_factor
from jaxtrain.models.moe import group_score_topk, moe_pattern
from jaxtrain.models.params import MOE_STACK, abstract, layer_slots, layer_tree

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "deepseek_v3", "gpt_oss", "mixtral",
            "qwen3_moe")
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
_MOE_FAMILIES = ("mixtral", "qwen3_moe")
# Expert tensor names (gate, up, down) of the per-expert checkpoint layout.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}
_HF_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
           "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu",
           "quick_gelu": "quick_gelu"}
_ACT_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu",
           "quick_gelu": "quick_gelu"}
_IGNORED_TENSORS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def _bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json {field}={value!r}: {why}")


# ---------------------------------------------------------------- config.json -> ModelConfig

def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig for an HF config.json dict; ``overrides`` replace fields (e.g. dtype)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _bad("model_type", family, f"supported families are {FAMILIES}")
    if family in ("gpt2", "deepseek_v3", "gpt_oss"):
        fields = {"gpt2": _gpt2_fields, "deepseek_v3": _deepseek_fields,
                  "gpt_oss": _gpt_oss_fields}[family](hf)
    else:
        fields = _llama_fields(hf, family)
    fields.update(overrides)
    return ModelConfig(**fields)


def _llama_fields(hf: dict, family: str) -> dict:
    act = hf.get("hidden_act", "silu")
    if act not in _HF_ACT:
        raise _bad("hidden_act", act, f"supported values are {sorted(_HF_ACT)}")
    heads = hf["num_attention_heads"]
    fields = dict(
        _rms_rope_fields(hf, _HF_ACT[act], hf.get("max_position_embeddings", 2048), 1e-6),
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        qk_layernorm=family in ("qwen3", "qwen3_moe"), sliding_window=_sliding_window(hf, family),
    )
    if family in _MOE_FAMILIES:
        fields["moe"] = _moe_fields(hf, family)
    if family == "llama":
        attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn_bias != mlp_bias:
            raise _bad("attention_bias", attn_bias, f"differs from mlp_bias={mlp_bias}; jaxtrain "
                       "has biases on all linears (add_bias_linear) or on qkv only")
        fields["add_bias_linear"] = attn_bias
    elif family == "qwen2":
        fields["add_qkv_bias"] = True
    elif family in ("qwen3", "qwen3_moe") and hf.get("attention_bias", False):
        raise _bad("attention_bias", True, "Qwen3 biases on q/k/v/o without MLP biases are not "
                   "supported")
    fields.update(_rope_fields(hf))
    return fields


def _rms_rope_fields(hf: dict, activation: str, max_positions, eps: float) -> dict:
    """The fields every pre-norm RMSNorm + RoPE gated-MLP family reads alike (Llama-style,
    DeepSeek-V3, gpt-oss): sizes, norm, activation, dropout, tying and init."""
    return dict(
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=max_positions, position_embedding_type="rope",
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", eps),
        activation=activation, gated_linear_unit=True, hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=hf.get("initializer_range", 0.02))


def _moe_fields(hf: dict, family: str):
    """Mixtral: top-k of a softmax over all experts, renormalised (= softmax over the top-k
    logits), every layer MoE. Qwen3-MoE: the same without renormalisation unless
    norm_topk_prob (= pre_softmax), dense layers per mlp_only_layers/decoder_sparse_step."""
    from jaxtrain.models.moe import MoEConfig

    n = hf["num_hidden_layers"]
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if family == "mixtral":
        return MoEConfig(num_experts=experts, topk=hf.get("num_experts_per_tok", 2),
                         ffn_hidden_size=hf["intermediate_size"],
                         input_jitter_eps=hf.get("router_jitter_noise") or None)
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(n))
    return MoEConfig(num_experts=experts, topk=hf.get("num_experts_per_tok", 8),
                     ffn_hidden_size=hf["moe_intermediate_size"],
                     layer_freq=1 if all(pattern) else pattern,
                     pre_softmax=not hf.get("norm_topk_prob", False))


def _sliding_window(hf: dict, family: str) -> int | None:
    if family == "llama":
        return None
    window = hf.get("sliding_window")
    if family in ("mistral", "mixtral"):
        return window or None
    if not hf.get("use_sliding_window", False) or window is None:
        types = hf.get("layer_types")
        if types and any(t != "full_attention" for t in types):
            raise _bad("layer_types", types, "only full_attention is supported without "
                       "use_sliding_window")
        return None
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(n)]
    if all(t == "sliding_attention" for t in types):
        return window
    if all(t == "full_attention" for t in types):
        return None
    raise _bad("layer_types", types, "a mix of sliding and full attention layers is not "
               "supported (one window for all layers)")


def _rope_fields(hf: dict) -> dict:
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rp and all(isinstance(v, dict) for v in rp.values()):
        raise _bad("rope_parameters", rp, "per-layer-type RoPE parameters are not supported")
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _bad("partial_rotary_factor", partial, "this family rotates the full head")
    kind = rp.get("rope_type", rp.get("type", "default"))
    fields: dict[str, Any] = {"rotary_base": float(theta)}
    original = hf.get("original_max_position_embeddings",
                      rp.get("original_max_position_embeddings",
                             hf.get("max_position_embeddings")))
    if kind == "default":
        return fields
    if kind == "linear":
        fields["rotary_seq_len_interpolation_factor"] = float(rp["factor"])
    elif kind == "llama3":
        fields.update(use_rope_scaling=True, rope_scaling_factor=float(rp["factor"]),
                      rope_low_freq_factor=float(rp["low_freq_factor"]),
                      rope_high_freq_factor=float(rp["high_freq_factor"]),
                      original_max_position_embeddings=int(original))
    elif kind == "yarn":
        factor = rp.get("factor") or hf["max_position_embeddings"] / original
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if not (mscale and mscale_all):
            mscale, mscale_all = 1.0, 0.0
        explicit = rp.get("attention_factor")
        if explicit is not None and not math.isclose(
                explicit, yarn_attention_factor(factor, mscale, mscale_all), rel_tol=1e-9):
            if factor <= 1:
                raise _bad("rope_parameters.attention_factor", explicit,
                           "YaRN with factor <= 1 has attention factor 1")
            mscale, mscale_all = (explicit - 1) / (0.1 * math.log(factor)), 0.0
        fields.update(rope_type="yarn", yarn_scaling_factor=float(factor),
                      original_max_position_embeddings=int(original),
                      yarn_beta_fast=float(rp.get("beta_fast") or 32),
                      yarn_beta_slow=float(rp.get("beta_slow") or 1),
                      yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all),
                      yarn_truncate=bool(rp.get("truncate", True)))
    else:
        raise _bad("rope_parameters.rope_type", kind,
                   "supported RoPE types are default, linear, llama3 and yarn")
    return fields


def _gpt2_fields(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACT:
        raise _bad("activation_function", act, f"supported values are {sorted(_HF_ACT)}")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(field, ok) != ok:
            raise _bad(field, hf[field], f"only {ok} is supported")
    resid, emb = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if resid != emb:
        raise _bad("embd_pdrop", emb, f"differs from resid_pdrop={resid}; jaxtrain has one "
                   "hidden_dropout")
    d = hf["n_embd"]
    return dict(
        num_layers=hf["n_layer"], hidden_size=d, num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("n_positions", 1024),
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=_HF_ACT[act],
        gated_linear_unit=False, add_bias_linear=True, add_qkv_bias=True,
        hidden_dropout=float(resid), attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def _mscale(factor: float, coefficient: float) -> float:
    """YaRN's m = 0.1 * coefficient * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def _deepseek_fields(hf: dict) -> dict:
    """DeepSeek-V3: multi-latent attention (latent norms, interleaved RoPE on the shared key),
    YaRN whose mscale_all_dim also scales the softmax, first_k_dense_replace dense MLP layers
    and MoE layers after them (:func:`_deepseek_moe_fields`)."""
    act = hf.get("hidden_act", "silu")
    if act not in _HF_ACT:
        raise _bad("hidden_act", act, f"supported values are {sorted(_HF_ACT)}")
    n, d, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise _bad("num_key_value_heads", kv_heads, "multi-latent attention has one key/value "
                   f"head per query head ({heads})")
    if hf.get("attention_bias", False):
        raise _bad("attention_bias", True, "biases on the MLA projections are not supported")
    fields = dict(
        _rms_rope_fields(hf, _HF_ACT[act], hf.get("max_position_embeddings", 4096), 1e-6),
        num_layers=n, hidden_size=d, num_attention_heads=heads,
        kv_channels=None if d % heads == 0 else hf["v_head_dim"], multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], qk_layernorm=True,
    )
    if hf.get("first_k_dense_replace", 3) < n:
        fields["moe"] = _deepseek_moe_fields(hf)
    fields.update(_rope_fields(hf))
    # HF multiplies the softmax scale by m(factor, mscale_all_dim)^2 for any non-default RoPE
    # that names mscale_all_dim; ours is m(yarn factor, yarn_mscale_all_dim)^2.
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    theirs = (_mscale(rp.get("factor") or fields.get("yarn_scaling_factor", 1.0),
                      rp["mscale_all_dim"]) if kind != "default" and rp.get("mscale_all_dim")
              else 1.0)
    ours = _mscale(fields.get("yarn_scaling_factor", 1.0), fields.get("yarn_mscale_all_dim", 0.0))
    if not math.isclose(theirs, ours, rel_tol=1e-9):
        raise _bad("rope_parameters", rp, "the softmax scale's mscale_all_dim needs YaRN with "
                   "both mscale and mscale_all_dim (and no other attention_factor)")
    return fields


HF_GROUP_SCORE_TOPK = 2   # transformers' DeepSeek-V3 router: a group's score is its top-2 sum


def _deepseek_moe_fields(hf: dict):
    """DeepSeek-V3's MoE layers (every layer from first_k_dense_replace on): sigmoid scores,
    experts chosen on score + e_score_correction_bias (our expert_bias leaf) within the best
    topk_group of n_group groups (a group scored by the sum of its top-2 biased scores whatever
    num_experts_per_tok: MoEConfig.group_score_topk 2, not Megatron's top-k // topk_group), the
    unbiased scores of the chosen experts renormalised (norm_topk_prob) and scaled by
    routed_scaling_factor, gating in fp32, plus n_shared_experts x moe_intermediate_size
    always-on shared expert. Evaluation is dropless there, as here without a capacity."""
    from jaxtrain.models.moe import MoEConfig

    # Missing fields take DeepseekV3Config's defaults (what transformers would build).
    n, k = hf["num_hidden_layers"], hf.get("num_experts_per_tok", 8)
    experts = hf.get("n_routed_experts", 256)
    for field, ok in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if hf.get(field, ok) != ok:
            raise _bad(field, hf[field], f"DeepSeek-V3 routing is {field}={ok!r}")
    if hf.get("moe_layer_freq", 1) != 1:
        raise _bad("moe_layer_freq", hf["moe_layer_freq"], "transformers makes every layer "
                   "from first_k_dense_replace on an MoE layer (frequency 1)")
    if hf.get("norm_topk_prob", True) != (k > 1):
        raise _bad("norm_topk_prob", hf.get("norm_topk_prob", True), "sigmoid routing "
                   "renormalises the top-k weights exactly when top-k > 1 (Megatron's rule)")
    groups, group_topk = hf.get("n_group", 8) or 1, hf.get("topk_group", 4) or 1
    limited = groups > 1 and group_topk < groups
    if limited and experts % groups == 0 and experts // groups < HF_GROUP_SCORE_TOPK:
        raise _bad("n_group", groups, f"HF scores a group by its top-{HF_GROUP_SCORE_TOPK} "
                   f"experts; a group of {experts // groups} has fewer")
    first = hf.get("first_k_dense_replace", 3)
    width = hf.get("moe_intermediate_size", 2048)
    shared = (hf.get("n_shared_experts", 1) or 0) * width
    scale = float(hf.get("routed_scaling_factor", 2.5))
    return MoEConfig(num_experts=experts, topk=k, ffn_hidden_size=width,
                     layer_freq=1 if first <= 0 else (0,) * first + (1,) * (n - first),
                     shared_expert_size=shared or None, score_function="sigmoid",
                     router_dtype="float32", topk_scaling_factor=None if scale == 1.0 else scale,
                     num_groups=groups if limited else None,
                     group_topk=group_topk if limited else None,
                     group_score_topk=HF_GROUP_SCORE_TOPK if limited else None,
                     expert_bias=True)


def _gpt_oss_fields(hf: dict) -> dict:
    """gpt-oss: GQA with q/k/v/o biases, a learned sink per head, sliding windows on the
    ``sliding_attention`` layers, YaRN; every layer MoE: a biased router, softmax over the top-k
    logits, experts with biases and the clamped GLU (swiglu_oai). Experts always have biases,
    so attention_bias must be true with experts (add_bias_linear covers both)."""
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts and not hf.get("attention_bias", True):
        raise _bad("attention_bias", False, "gpt-oss experts have biases and add_bias_linear "
                   "puts biases on the attention projections too")
    if experts and hf.get("swiglu_alpha", 1.702) != 1.702:
        raise _bad("swiglu_alpha", hf["swiglu_alpha"], "the MoE model's clamped GLU has 1.702")
    n, d, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(n)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise _bad("layer_types", types, "only sliding_attention and full_attention exist")
    window = hf.get("sliding_window")
    sliding = tuple(t == "sliding_attention" for t in types)
    windowed = bool(window) and any(sliding)
    fields = dict(
        _rms_rope_fields(hf, "silu", hf.get("max_position_embeddings"), 1e-5),
        num_layers=n, hidden_size=d, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or d // heads,
        add_bias_linear=hf.get("attention_bias", True), attention_sinks=True,
        sliding_window=window if windowed else None,
        sliding_window_layers=sliding if windowed else None,
    )
    fields.update(_rope_fields(hf))
    if experts:
        from jaxtrain.models.moe import MoEConfig
        fields["moe"] = MoEConfig(num_experts=experts, topk=hf.get("num_experts_per_tok", 4),
                                  ffn_hidden_size=hf["intermediate_size"], router_bias=True,
                                  activation="swiglu_oai",
                                  glu_limit=float(hf.get("swiglu_limit", 7.0)))
    return fields


# ---------------------------------------------------------------- reading tensors

def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors = {}
    for name in files:
        with safe_open(path / name, framework="numpy") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


class _Tensors:
    """Checkpoint tensors taken one by one; ``done()`` rejects any left unconsumed."""

    def __init__(self, tensors: dict):
        self.left = dict(tensors)

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.left:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        return self.left.pop(name)

    def drop(self, name: str):
        self.left.pop(name, None)

    def done(self):
        rest = [k for k in self.left if not k.endswith(_IGNORED_TENSORS)]
        if rest:
            raise ValueError(f"checkpoint tensors not used by the model: {sorted(rest)[:8]}")


def from_hf(path, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from a local HF directory (config.json + *.safetensors)."""
    path = pathlib.Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf, **overrides)
    t = _Tensors(_read_tensors(path))
    if hf["model_type"] == "deepseek_v3":
        params = _deepseek_params(t, cfg, hf.get("rope_interleave", True),
                                  hf.get("num_nextn_predict_layers",
                                         hf.get("num_mtp_layers", 0)) or 0)
    else:
        params = (_gpt2_params(t, cfg) if hf["model_type"] == "gpt2"
                  else _llama_params(t, cfg, hf["model_type"]))
    t.done()
    # Leaves take their declared dtype: weight_dtype, but fp32 for sink logits.
    return cfg, jax.tree.map(lambda a, s: jnp.asarray(np.asarray(a, s.dtype)), params,
                             abstract(cfg))


def _layers(make, cfg) -> dict:
    """Per-layer numpy trees stacked on ``param_scan_axis``."""
    per_layer = [make(i) for i in range(cfg.num_layers)]
    return jax.tree.map(lambda *xs: np.stack(xs, cfg.param_scan_axis), *per_layer)


def _stacks(make, cfg) -> dict:
    """Per-layer numpy trees stacked on ``param_scan_axis``, dense and MoE layers apart
    ('layers', 'moe_layers'; see params.layer_kinds)."""
    per_kind: dict[str, list] = {}
    for i, (kind, _) in enumerate(layer_slots(cfg)):
        per_kind.setdefault(kind, []).append(make(i))
    return {kind: jax.tree.map(lambda *xs: np.stack(xs, cfg.param_scan_axis), *trees)
            for kind, trees in per_kind.items()}


def _moe_from_hf(t: _Tensors, pre: str, cfg, family: str) -> dict:
    """One MoE layer's router and experts from either checkpoint layout: per expert
    (``experts.{e}.<gate/up/down>.weight``, what save_pretrained writes) or fused
    (``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F])."""
    if family == "gpt_oss":
        return _gpt_oss_moe_from_hf(t, pre + "mlp.")
    m = cfg.moe
    base = pre + ("block_sparse_moe." if pre + "block_sparse_moe.gate.weight" in t.left
                  else "mlp.")
    if base + "experts.gate_up_proj" in t.left:
        gate_up = t(base + "experts.gate_up_proj")
        F = gate_up.shape[1] // 2
        experts = {"wi_0": gate_up[:, :F].transpose(0, 2, 1),
                   "wi_1": gate_up[:, F:].transpose(0, 2, 1),
                   "wo": t(base + "experts.down_proj").transpose(0, 2, 1)}
    else:
        names = _EXPERT_NAMES[family]
        w = lambda e, n: t(f"{base}experts.{e}.{n}.weight").T  # noqa: E731
        experts = {ours: np.stack([w(e, n) for e in range(m.num_experts)])
                   for ours, n in zip(("wi_0", "wi_1", "wo"), names)}
    return {"router": {"w": t(base + "gate.weight").T}, "experts": experts}


def _deepseek_moe_from_hf(t: _Tensors, pre: str, cfg) -> dict:
    """A DeepSeek-V3 MoE layer: router (+ e_score_correction_bias as expert_bias), routed
    experts in either layout, and the shared expert (absent when n_shared_experts is 0)."""
    tree = _moe_from_hf(t, pre, cfg, "deepseek_v3")
    base = pre + "mlp."
    tree["router"]["expert_bias"] = t(base + "gate.e_score_correction_bias")
    names = ("gate_proj", "up_proj", "down_proj")
    if cfg.moe.shared_expert_size:
        tree["shared"] = {ours: t(f"{base}shared_experts.{n}.weight").T
                          for ours, n in zip(("wi_0", "wi_1", "wo"), names)}
    else:   # zero-width shared expert
        for n in names:
            t.drop(f"{base}shared_experts.{n}.weight")
    return tree


def _gpt_oss_moe_from_hf(t: _Tensors, base: str) -> dict:
    """gpt-oss's biased router (weight [E, D]) and fused experts: gate_up_proj [E, D, 2F] with
    gate and up interleaved (columns 2f, 2f + 1), down_proj [E, F, D], all with biases."""
    gate_up, gate_up_bias = t(base + "experts.gate_up_proj"), t(base + "experts.gate_up_proj_bias")
    return {"router": {"w": t(base + "router.weight").T, "bias": t(base + "router.bias")},
            "experts": {"wi_0": gate_up[..., 0::2], "wi_1": gate_up[..., 1::2],
                        "bi_0": gate_up_bias[:, 0::2], "bi_1": gate_up_bias[:, 1::2],
                        "wo": t(base + "experts.down_proj"),
                        "bo": t(base + "experts.down_proj_bias")}}


def _llama_params(t: _Tensors, cfg, family: str = "llama") -> dict:
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    bias = cfg.add_qkv_bias or cfg.add_bias_linear

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        attn = {"wq": w("self_attn.q_proj").reshape(D, N, H),
                "wk": w("self_attn.k_proj").reshape(D, K, H),
                "wv": w("self_attn.v_proj").reshape(D, K, H),
                "wo": w("self_attn.o_proj").reshape(N, H, D)}
        if bias:
            attn.update(bq=t(pre + "self_attn.q_proj.bias").reshape(N, H),
                        bk=t(pre + "self_attn.k_proj.bias").reshape(K, H),
                        bv=t(pre + "self_attn.v_proj.bias").reshape(K, H))
        if cfg.qk_layernorm:
            attn["q_norm"] = {"scale": t(pre + "self_attn.q_norm.weight")}
            attn["k_norm"] = {"scale": t(pre + "self_attn.k_norm.weight")}
        if cfg.attention_sinks:
            attn["sinks"] = t(pre + "self_attn.sinks")
        if cfg.add_bias_linear:
            attn["bo"] = t(pre + "self_attn.o_proj.bias")
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")}, "attn": attn,
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}}
        if layer_slots(cfg)[i][0] == MOE_STACK:
            return {**tree, "moe": _moe_from_hf(t, pre, cfg, family)}
        mlp = {"wi_0": w("mlp.gate_proj"), "wi_1": w("mlp.up_proj"), "wo": w("mlp.down_proj")}
        if cfg.add_bias_linear:
            mlp.update(bi_0=t(pre + "mlp.gate_proj.bias"), bi_1=t(pre + "mlp.up_proj.bias"),
                       bo=t(pre + "mlp.down_proj.bias"))
        return {**tree, "mlp": mlp}

    params = {"embedding": t("model.embed_tokens.weight"), **_stacks(layer, cfg),
              "final_norm": {"scale": t("model.norm.weight")}}
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = t("lm_head.weight").T
    else:
        t.drop("lm_head.weight")
    return params


def _rope_pair_order(P: int) -> np.ndarray:
    """Channel order taking a half-split RoPE slice (i, i + P/2) to interleaved pairs."""
    return np.stack([np.arange(P // 2), np.arange(P // 2) + P // 2], -1).reshape(-1)


def _deepseek_params(t: _Tensors, cfg, rope_interleave: bool = True,
                     mtp_layers: int = 0) -> dict:
    """DeepSeek-V3 tensors (kv_b_proj split into wk_b/wv_b). A checkpoint with
    ``rope_interleave`` false rotates half-split RoPE slices; their channels are reordered
    into the interleaved pairs this model rotates (scores are unchanged). The
    ``mtp_layers`` multi-token-prediction layers stored after the decoder are skipped."""
    D, N, Hn, Hv = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    Hq, Rkv, P = cfg.head_dim, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    q_order = np.arange(Hq)
    kv_order = np.arange(Rkv + P)
    if not rope_interleave:
        q_order[Hn:] = Hn + _rope_pair_order(P)
        kv_order[Rkv:] = Rkv + _rope_pair_order(P)

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
        if cfg.q_lora_rank is None:
            attn = {"wq": w("self_attn.q_proj").reshape(D, N, Hq)[..., q_order]}
        else:
            attn = {"wq_a": w("self_attn.q_a_proj"),
                    "q_a_norm": {"scale": t(pre + "self_attn.q_a_layernorm.weight")},
                    "wq_b": w("self_attn.q_b_proj").reshape(-1, N, Hq)[..., q_order]}
        kv_b = w("self_attn.kv_b_proj").reshape(Rkv, N, Hn + Hv)
        attn.update(wkv_a=w("self_attn.kv_a_proj_with_mqa")[:, kv_order],
                    kv_a_norm={"scale": t(pre + "self_attn.kv_a_layernorm.weight")},
                    wk_b=kv_b[..., :Hn], wv_b=kv_b[..., Hn:],
                    wo=w("self_attn.o_proj").reshape(N, Hv, D))
        tree = {"attn_norm": {"scale": t(pre + "input_layernorm.weight")}, "attn": attn,
                "mlp_norm": {"scale": t(pre + "post_attention_layernorm.weight")}}
        if layer_slots(cfg)[i][0] == MOE_STACK:
            return {**tree, "moe": _deepseek_moe_from_hf(t, pre, cfg)}
        return {**tree, "mlp": {"wi_0": w("mlp.gate_proj"), "wi_1": w("mlp.up_proj"),
                                "wo": w("mlp.down_proj")}}

    # Multi-token-prediction layers after the last decoder layer: transformers skips them too.
    mtp = tuple(f"model.layers.{cfg.num_layers + j}." for j in range(mtp_layers))
    for name in [k for k in t.left if k.startswith(mtp)]:
        t.drop(name)
    params = {"embedding": t("model.embed_tokens.weight"), **_stacks(layer, cfg),
              "final_norm": {"scale": t("model.norm.weight")}}
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = t("lm_head.weight").T
    else:
        t.drop("lm_head.weight")
    return params


def _gpt2_params(t: _Tensors, cfg) -> dict:
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

    params = {"embedding": t(pre + "wte.weight"), "position_embedding": t(pre + "wpe.weight"),
              "layers": _layers(layer, cfg), "final_norm": ln(pre + "ln_f")}
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = t("lm_head.weight").T
    else:
        t.drop("lm_head.weight")
    return params


# ---------------------------------------------------------------- export

def hf_family(cfg: ModelConfig) -> str:
    """The HF family that reproduces ``cfg`` most directly."""
    if cfg.multi_latent_attention:
        return "deepseek_v3"
    if cfg.attention_sinks:
        return "gpt_oss"
    if cfg.moe is not None:
        return "qwen3_moe" if cfg.qk_layernorm else "mixtral"
    if cfg.position_embedding_type == "learned_absolute":
        return "gpt2"
    if cfg.qk_layernorm:
        return "qwen3"
    if cfg.add_qkv_bias and not cfg.add_bias_linear:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def _check_exportable(cfg: ModelConfig, family: str):
    if family in ("deepseek_v3", "gpt_oss"):
        return _check_exportable_mla_sinks(cfg, family)
    llama = family in _LLAMA_LIKE
    qkv_only = cfg.add_qkv_bias and not cfg.add_bias_linear
    problems = {
        "position_embedding_type": cfg.position_embedding_type != ("rope" if llama else
                                                                   "learned_absolute"),
        "normalization": cfg.normalization != ("RMSNorm" if llama else "LayerNorm"),
        "gated_linear_unit": cfg.gated_linear_unit != llama,
        "activation": cfg.activation not in _ACT_HF,
        "rotary_percent": llama and cfg.rotary_percent != 1.0,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor)
        and (cfg.use_rope_scaling or cfg.rope_type == "yarn"),
        "qk_l2_norm": cfg.qk_l2_norm,
        "qk_layernorm": cfg.qk_layernorm != (family in ("qwen3", "qwen3_moe")),
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "sliding_window": bool(cfg.sliding_window) and family in ("llama", "gpt2"),
        "add_bias_linear": cfg.add_bias_linear != (family == "gpt2") and family != "llama",
        "add_qkv_bias": qkv_only != (family == "qwen2"),
        "num_query_groups": family == "gpt2" and cfg.num_kv_heads != cfg.num_attention_heads,
        "kv_channels": family == "gpt2" and cfg.head_dim * cfg.num_attention_heads
        != cfg.hidden_size,
        "multi_latent_attention": cfg.multi_latent_attention,
        "attention_sinks": cfg.attention_sinks,
        "sliding_window_layers": cfg.sliding_window_layers is not None,
        "moe": (cfg.moe is not None) != (family in _MOE_FAMILIES),
    }
    if cfg.moe is not None and family in _MOE_FAMILIES:
        problems.update(_moe_export_problems(cfg, family))
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ValueError(f"cannot export to HF {family!r}: ModelConfig fields {bad} have no "
                         "equivalent there")


def _moe_export_problems(cfg: ModelConfig, family: str) -> dict:
    """MoE settings the Mixtral / Qwen3-MoE routers cannot reproduce (training-only knobs such
    as aux losses, capacity and dispatch do not change the checkpoint and are not checked)."""
    m = cfg.moe
    return {
        "moe.layer_freq": family == "mixtral" and not all(moe_pattern(m, cfg.num_layers)),
        "moe.score_function": m.score_function != "softmax",
        "moe.pre_softmax": family == "mixtral" and m.pre_softmax and m.topk > 1,
        "moe.shared_expert_size": bool(m.shared_expert_size),
        "moe.num_groups": bool(m.num_groups),
        "moe.topk_scaling_factor": bool(m.topk_scaling_factor),
        "moe.router_bias": m.router_bias, "moe.expert_bias": m.expert_bias,
        "moe.router_softcap": bool(m.router_softcap),
        "moe.force_balancing": m.force_balancing is not None,
        "moe.activation": m.activation is not None,
        "moe.load_balancing": "sinkhorn" in m.load_balancing,
    }


def _check_exportable_mla_sinks(cfg: ModelConfig, family: str):
    if family == "gpt_oss":
        return _check_gpt_oss_exportable(cfg)
    rope_yarn = cfg.rope_type == "yarn" and not cfg.use_rope_scaling
    hf_softmax = (_mscale(cfg.yarn_scaling_factor, cfg.yarn_mscale_all_dim)
                  if rope_yarn and cfg.yarn_mscale and cfg.yarn_mscale_all_dim else 1.0)
    problems = {
        "multi_latent_attention": not cfg.multi_latent_attention,
        "position_embedding_type": cfg.position_embedding_type != "rope",
        "normalization": cfg.normalization != "RMSNorm",
        "gated_linear_unit": not cfg.gated_linear_unit,
        "activation": cfg.activation not in _ACT_HF,
        "qk_layernorm": not cfg.qk_layernorm,
        "add_bias_linear": cfg.add_bias_linear,
        "attention_sinks": cfg.attention_sinks,
        "sliding_window": bool(cfg.sliding_window),
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor)
        and (cfg.use_rope_scaling or cfg.rope_type == "yarn"),
        "yarn_mscale_all_dim": not math.isclose(
            hf_softmax, _mscale(cfg.yarn_scaling_factor, cfg.yarn_mscale_all_dim)),
    }
    if cfg.moe is not None:
        problems.update(_deepseek_moe_problems(cfg))
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ValueError(f"cannot export to HF {family!r}: ModelConfig fields {bad} have no "
                         "equivalent there")


def _check_gpt_oss_exportable(cfg: ModelConfig):
    from jaxtrain.models.moe import moe_pattern
    m = cfg.moe
    problems = {
        "moe": m is None or not all(moe_pattern(m, cfg.num_layers)),
        "attention_sinks": not cfg.attention_sinks,
        "add_bias_linear": not cfg.add_bias_linear,
        "position_embedding_type": cfg.position_embedding_type != "rope",
        "normalization": cfg.normalization != "RMSNorm",
        "gated_linear_unit": not cfg.gated_linear_unit,
        "rotary_percent": cfg.rotary_percent != 1.0,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor),
        "use_rope_scaling": cfg.use_rope_scaling,
        "qk_layernorm": cfg.qk_layernorm, "qk_l2_norm": cfg.qk_l2_norm,
        "multi_latent_attention": cfg.multi_latent_attention,
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
    }
    if m is not None:
        problems.update({
            "moe.activation": m.activation != "swiglu_oai",
            "moe.router_bias": not m.router_bias,
            "moe.score_function": m.score_function != "softmax",
            "moe.pre_softmax": m.pre_softmax and m.topk > 1,
            "moe.shared_expert_size": bool(m.shared_expert_size),
            "moe.num_groups": bool(m.num_groups),
            "moe.topk_scaling_factor": m.topk_scaling_factor not in (None, 1.0),
            "moe.expert_bias": m.expert_bias,
            "moe.router_softcap": bool(m.router_softcap),
            "moe.capacity_factor": m.capacity_factor is not None,
        })
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ValueError(f"cannot export to HF 'gpt_oss': ModelConfig fields {bad} have no "
                         "equivalent there")


def _gpt_oss_config(cfg: ModelConfig, common: dict) -> dict:
    rope = _rope_hf(cfg)   # written as rope_parameters: gpt-oss reads a missing one as YaRN
    params = {**(rope["rope_scaling"] or {"rope_type": "default"}),
              "rope_theta": rope["rope_theta"]}
    return {**common, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.moe.ffn_hidden_size,
            "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.topk,
            "swiglu_limit": cfg.moe.glu_limit if cfg.moe.glu_limit is not None else 7.0,
            "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if cfg.window_of_layer(i) else "full_attention"
                            for i in range(cfg.num_layers)],
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "hidden_act": "silu", "attention_bias": True,
            "attention_dropout": cfg.attention_dropout, "rope_parameters": params}


def _deepseek_config(cfg: ModelConfig, common: dict) -> dict:
    return {**common, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_hidden_size, **_deepseek_moe_config(cfg),
            "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_head_dim, "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": True, "attention_bias": False,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "hidden_act": _ACT_HF[cfg.activation],
            "attention_dropout": cfg.attention_dropout, **_rope_hf(cfg)}


def _deepseek_moe_config(cfg: ModelConfig) -> dict:
    """first_k_dense_replace and the routing fields (checked by _deepseek_moe_problems)."""
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


def _deepseek_moe_problems(cfg: ModelConfig) -> dict:
    """MoE settings DeepSeek-V3's router cannot reproduce (training-only knobs are not
    checked; a missing expert bias is written as zeros)."""
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


def _deepseek_tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    np_ = np.asarray

    def scale(p):
        return np_(p["scale"]) + 1 if cfg.apply_layernorm_1p else np_(p["scale"])

    def lin(w):  # [in, ...out] -> HF Linear [out, in]
        w = np_(w)
        return w.reshape(w.shape[0], -1).T

    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        a, m, pre = p["attn"], p.get("mlp"), f"model.layers.{i}."
        if "wq" in a:
            out[pre + "self_attn.q_proj.weight"] = lin(a["wq"])
        else:
            out[pre + "self_attn.q_a_proj.weight"] = lin(a["wq_a"])
            out[pre + "self_attn.q_a_layernorm.weight"] = scale(a["q_a_norm"])
            out[pre + "self_attn.q_b_proj.weight"] = lin(a["wq_b"])
        out[pre + "self_attn.kv_a_proj_with_mqa.weight"] = lin(a["wkv_a"])
        out[pre + "self_attn.kv_a_layernorm.weight"] = scale(a["kv_a_norm"])
        out[pre + "self_attn.kv_b_proj.weight"] = lin(np.concatenate([a["wk_b"], a["wv_b"]], -1))
        out[pre + "self_attn.o_proj.weight"] = np_(a["wo"]).reshape(-1, D).T
        names = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
        if m is None:
            moe = p["moe"]
            out.update(_moe_to_hf(moe, pre, family))
            bias = moe["router"].get("expert_bias")
            out[pre + "mlp.gate.e_score_correction_bias"] = (
                np.zeros(cfg.moe.num_experts, np.float32) if bias is None
                else np_(bias).astype(np.float32))
            for ours, theirs in names if "shared" in moe else ():
                out[pre + f"mlp.shared_experts.{theirs}.weight"] = lin(moe["shared"][ours])
        else:
            for ours, theirs in names:
                out[pre + f"mlp.{theirs}.weight"] = lin(m[ours])
        out[pre + "input_layernorm.weight"] = scale(p["attn_norm"])
        out[pre + "post_attention_layernorm.weight"] = scale(p["mlp_norm"])
    out["model.embed_tokens.weight"] = np_(params["embedding"])
    out["model.norm.weight"] = scale(params["final_norm"])
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np_(params["output"]).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _rope_hf(cfg) -> dict:
    out: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_scaling": None}
    if cfg.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings":
                                   cfg.original_max_position_embeddings}
    elif cfg.rope_type == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.yarn_scaling_factor,
                               "original_max_position_embeddings":
                                   cfg.original_max_position_embeddings,
                               "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                               "truncate": cfg.yarn_truncate}
        if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
            out["rope_scaling"].update(mscale=cfg.yarn_mscale,
                                       mscale_all_dim=cfg.yarn_mscale_all_dim)
        elif cfg.yarn_mscale != 1.0:
            out["rope_scaling"]["attention_factor"] = yarn_attention_factor(
                cfg.yarn_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)
    elif cfg.rotary_seq_len_interpolation_factor:
        out["rope_scaling"] = {"rope_type": "linear",
                               "factor": cfg.rotary_seq_len_interpolation_factor}
    return out


def hf_config(cfg: ModelConfig, family: str | None = None) -> dict:
    """The config.json dict for ``cfg`` in ``family`` (default :func:`hf_family`)."""
    family = family or hf_family(cfg)
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: supported families are {FAMILIES}")
    _check_exportable(cfg, family)
    common = {"model_type": family, "vocab_size": cfg.vocab_size,
              "initializer_range": cfg.init_method_std,
              "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
              "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "gpt2": "GPT2LMHeadModel", "deepseek_v3": "DeepseekV3ForCausalLM",
                                 "gpt_oss": "GptOssForCausalLM", "mixtral": "MixtralForCausalLM",
                                 "qwen3_moe": "Qwen3MoeForCausalLM"}[family]]}
    if family == "deepseek_v3":
        return _deepseek_config(cfg, common)
    if family == "gpt_oss":
        return _gpt_oss_config(cfg, common)
    if family == "gpt2":
        return {**common, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
                "n_positions": cfg.max_position_embeddings, "layer_norm_epsilon": cfg.norm_epsilon,
                "activation_function": _ACT_HF[cfg.activation],
                "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
                "attn_pdrop": cfg.attention_dropout}
    out = {**common, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.ffn_hidden_size,
           "max_position_embeddings": cfg.max_position_embeddings,
           "rms_norm_eps": cfg.norm_epsilon, "hidden_act": _ACT_HF[cfg.activation],
           "attention_dropout": cfg.attention_dropout, **_rope_hf(cfg)}
    if family == "llama":
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    elif family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=bool(cfg.sliding_window),
                   sliding_window=cfg.sliding_window, max_window_layers=0)
        if family in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = False
    if family in _MOE_FAMILIES:
        out.update(_moe_hf_config(cfg, family))
    return out


def _moe_hf_config(cfg: ModelConfig, family: str) -> dict:
    m = cfg.moe
    out = {"num_experts_per_tok": m.topk, "output_router_logits": False}
    if family == "mixtral":
        return {**out, "num_local_experts": m.num_experts, "intermediate_size": m.ffn_hidden_size,
                "router_jitter_noise": m.input_jitter_eps or 0.0}
    dense = [i for i, on in enumerate(moe_pattern(m, cfg.num_layers)) if not on]
    return {**out, "num_experts": m.num_experts, "moe_intermediate_size": m.ffn_hidden_size,
            "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "norm_topk_prob": not m.pre_softmax}


def _rope_permutation(cfg) -> np.ndarray:
    """Head-dim order that turns interleaved RoPE pairs (2i, 2i+1) into HF's (i, i + R/2)."""
    R, H = cfg.rotary_dim, cfg.head_dim
    perm = np.arange(H)
    if cfg.rotary_interleaved:
        perm[:R] = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    return perm


def _hf_tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    D = cfg.hidden_size
    np_ = lambda a: np.asarray(a)  # noqa: E731

    def scale(p):
        return np_(p["scale"]) + 1 if cfg.apply_layernorm_1p else np_(p["scale"])

    out: dict[str, np.ndarray] = {}
    perm = _rope_permutation(cfg)
    for i in range(cfg.num_layers):
        p = layer_tree(params, cfg, i)
        a, m = p["attn"], p.get("mlp")
        if family == "gpt2":
            pre = f"transformer.h.{i}."
            out[pre + "attn.c_attn.weight"] = np.concatenate(
                [np_(a[k]).reshape(D, -1) for k in ("wq", "wk", "wv")], axis=1)
            out[pre + "attn.c_attn.bias"] = np.concatenate(
                [np_(a[k]).reshape(-1) for k in ("bq", "bk", "bv")])
            out[pre + "attn.c_proj.weight"] = np_(a["wo"]).reshape(-1, D)
            out[pre + "attn.c_proj.bias"] = np_(a["bo"])
            out[pre + "mlp.c_fc.weight"], out[pre + "mlp.c_fc.bias"] = np_(m["wi"]), np_(m["bi"])
            out[pre + "mlp.c_proj.weight"], out[pre + "mlp.c_proj.bias"] = (np_(m["wo"]),
                                                                            np_(m["bo"]))
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[pre + theirs + ".weight"] = scale(p[ours])
                out[pre + theirs + ".bias"] = np_(p[ours]["bias"])
            continue
        pre = f"model.layers.{i}."
        lin = lambda w: np.ascontiguousarray(np_(w).reshape(w.shape[0], -1).T)  # noqa: E731
        out[pre + "self_attn.q_proj.weight"] = lin(np_(a["wq"])[..., perm])
        out[pre + "self_attn.k_proj.weight"] = lin(np_(a["wk"])[..., perm])
        out[pre + "self_attn.v_proj.weight"] = lin(a["wv"])
        out[pre + "self_attn.o_proj.weight"] = np.ascontiguousarray(np_(a["wo"]).reshape(-1, D).T)
        if "bq" in a:
            out[pre + "self_attn.q_proj.bias"] = np_(a["bq"])[..., perm].reshape(-1)
            out[pre + "self_attn.k_proj.bias"] = np_(a["bk"])[..., perm].reshape(-1)
            out[pre + "self_attn.v_proj.bias"] = np_(a["bv"]).reshape(-1)
        if cfg.qk_layernorm:
            out[pre + "self_attn.q_norm.weight"] = scale(a["q_norm"])[perm]
            out[pre + "self_attn.k_norm.weight"] = scale(a["k_norm"])[perm]
        if "sinks" in a:
            out[pre + "self_attn.sinks"] = np_(a["sinks"])
        if m is None:
            out.update(_moe_to_hf(p["moe"], pre, family))
        else:
            for ours, theirs in (("wi_0", "gate_proj"), ("wi_1", "up_proj"),
                                 ("wo", "down_proj")):
                out[pre + f"mlp.{theirs}.weight"] = lin(m[ours])
        if cfg.add_bias_linear:
            out[pre + "self_attn.o_proj.bias"] = np_(a["bo"])
        if cfg.add_bias_linear and m is not None:
            for ours, theirs in (("bi_0", "gate_proj"), ("bi_1", "up_proj"), ("bo", "down_proj")):
                out[pre + f"mlp.{theirs}.bias"] = np_(m[ours])
        out[pre + "input_layernorm.weight"] = scale(p["attn_norm"])
        out[pre + "post_attention_layernorm.weight"] = scale(p["mlp_norm"])
    if family == "gpt2":
        out["transformer.wte.weight"] = np_(params["embedding"])
        out["transformer.wpe.weight"] = np_(params["position_embedding"])
        out["transformer.ln_f.weight"] = scale(params["final_norm"])
        out["transformer.ln_f.bias"] = np_(params["final_norm"]["bias"])
    else:
        out["model.embed_tokens.weight"] = np_(params["embedding"])
        out["model.norm.weight"] = scale(params["final_norm"])
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np.ascontiguousarray(np_(params["output"]).T)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _moe_to_hf(p: dict, pre: str, family: str) -> dict[str, np.ndarray]:
    """One MoE layer in the per-expert layout that save_pretrained writes."""
    if family == "gpt_oss":
        return _gpt_oss_moe_to_hf(p, pre + "mlp.")
    base = pre + ("block_sparse_moe." if family == "mixtral" else "mlp.")
    out = {base + "gate.weight": np.asarray(p["router"]["w"]).T}
    for ours, theirs in zip(("wi_0", "wi_1", "wo"), _EXPERT_NAMES[family]):
        for e, w in enumerate(np.asarray(p["experts"][ours])):
            out[f"{base}experts.{e}.{theirs}.weight"] = w.T
    return out


def _gpt_oss_moe_to_hf(p: dict, base: str) -> dict[str, np.ndarray]:
    e = {k: np.asarray(v) for k, v in p["experts"].items()}
    interleave = lambda a, b: np.stack([a, b], -1).reshape(*a.shape[:-1], -1)  # noqa: E731
    return {base + "router.weight": np.asarray(p["router"]["w"]).T,
            base + "router.bias": np.asarray(p["router"]["bias"]),
            base + "experts.gate_up_proj": interleave(e["wi_0"], e["wi_1"]),
            base + "experts.gate_up_proj_bias": interleave(e["bi_0"], e["bi_1"]),
            base + "experts.down_proj": e["wo"], base + "experts.down_proj_bias": e["bo"]}


def to_hf(params: dict, cfg: ModelConfig, path, family: str | None = None) -> pathlib.Path:
    """Write config.json + model.safetensors that ``AutoModelForCausalLM`` loads.

    Exact conversions: zero-centred norm scales (apply_layernorm_1p) are written as 1 + scale;
    interleaved RoPE is written as HF's half-split layout by permuting q/k channels.
    """
    family = family or hf_family(cfg)
    config = hf_config(cfg, family)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = (_deepseek_tensors if family == "deepseek_v3" else _hf_tensors)(
        jax.device_get(params), cfg, family)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
