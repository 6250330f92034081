"""Hugging Face ``config.json`` files: where one is found for a model name, and what it says in
jaxtrain's canonical knobs.

pgs names its model by ``model.name_or_path`` (a hub id such as ``meta-llama/Llama-3.1-8B`` or a
local directory); :func:`locate` finds that model's ``config.json`` on this machine (a local
directory, else a snapshot in the local Hugging Face cache) and never downloads. :func:`knobs`
translates a config.json into the knob values that describe the same architecture:
``ModelConfig.from_config`` builds the model from them, in a pgs run (config/dialects/pgs.py puts
them in a preset layer) as in ``jaxtrain.models.hf.config_from_hf``, so both read each HF field
in this one place. A field these knobs cannot express raises ValueError naming it; a family
jaxtrain does not build raises naming its model_type and why.

Built families (model_type): llama, mistral, qwen2, qwen3 (Llama-style attention), phi3 (fused
q/k/v and gate/up, partial RoPE), smollm3 (NoPE layers), granite (embedding, attention, residual
and logit multipliers), mixtral, qwen3_moe (softmax-routed MoE), gpt2, gpt_neox (parallel
layers, partial RoPE), deepseek_v3 (multi-latent attention, sigmoid group-limited MoE), gpt_oss
(sinks, alternating windows, clamped-GLU experts), gemma, gemma2, gemma3_text (embedding scale,
sandwich norms, soft-capping, local/global layers), olmo2, olmo3 (output-only norms, q/k norms
across heads, local/global layers), qwen3_next, qwen3_5_text, qwen3_5_moe_text (Gated DeltaNet
hybrids), llama4_text (NoPE layers, chunked attention, sigmoid top-1 MoE with a shared expert),
gemma4_text (global layers of their own head shape, proportional RoPE, layer scalars, the
parallel dense + expert MoE layer) and the text models of the vision-language checkpoints
qwen3_5, qwen3_5_moe, llama4, gemma3 and gemma4.

This module imports no JAX (the dry run must not start it): only json, math, os and pathlib.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Callable

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.patterns import dsa_shared_pattern

KEY = "model.name_or_path"
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe")
GEMMA = ("gemma", "gemma2", "gemma3_text")
OLMO = ("olmo2", "olmo3")
# Hybrids of gated attention and Gated DeltaNet layers (Qwen3.5's text-only model types).
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
LLAMA4 = ("llama4_text",)
GEMMA4 = ("gemma4_text",)
# Vision-language checkpoints whose text model jaxtrain trains (as transformers'
# AutoModelForCausalLM does: text_config, the language model's weights, no vision tower).
TEXT_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
           "llama4": "llama4_text", "gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# The text_config defaults of transformers' config classes where published checkpoints leave
# fields out (Gemma 3's vision-language config.json files name only what differs).
TEXT_DEFAULTS = {"gemma3": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                            "num_hidden_layers": 26, "num_attention_heads": 8,
                            "num_key_value_heads": 4, "head_dim": 256,
                            "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
                            "hidden_activation": "gelu_pytorch_tanh"}}
FAMILIES = (LLAMA_LIKE + ("phi3", "smollm3", "granite", "gpt2", "gpt_neox", "deepseek_v3",
                          "deepseek_v32", "glm_moe_dsa", "deepseek_v4",
                          "kimi_linear", "gpt_oss") + MOE + GEMMA + OLMO + HYBRID + LLAMA4 + GEMMA4
            + ("nemotron_h", "mamba2", "lfm2", "lfm2_moe", "granitemoehybrid") + tuple(TEXT_OF))
# Text families issue #25 (model families) is to build; their model_type values.
PLANNED = ("gemma3n", "gemma3n_text",
           "deepseek_v2", "kimi_k2", "olmo",
           "phi", "granitemoe", "glm", "glm4", "glm4_moe", "minimax",
           "cohere", "cohere2", "falcon", "falcon_h1", "mamba", "jamba", "starcoder2",
           "gptj", "bloom", "opt", "stablelm", "internlm2", "exaone", "ernie4_5",
           "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe", "seed_oss")
PLANNED_PREFIXES = ("gemma",)
# config.json entries that mark a model reading more than text.
MULTIMODAL_FIELDS = ("vision_config", "audio_config", "speech_config", "image_token_id",
                     "image_token_index", "video_token_id")
# Files that make a model directory hold its tokenizer too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# transformers' DeepSeek-V3 router scores a group by the sum of its top-2 biased scores,
# whatever num_experts_per_tok (Megatron: top-k // topk_group).
HF_GROUP_SCORE_TOPK = 2

_GATED_ACT = {"silu": {"swiglu": True}, "swish": {"swiglu": True},
              "quick_gelu": {"swiglu": False, "quick_geglu": True},
              "gelu_new": {"mlp_activations": ["gelu", "linear"]},
              "gelu_pytorch_tanh": {"mlp_activations": ["gelu", "linear"]},
              "gelu_fast": {"mlp_activations": ["gelu", "linear"]},
              "relu": {"mlp_activations": ["relu", "linear"]}}
_PLAIN_ACT = {"gelu": {"swiglu": False, "bias_gelu_fusion": False},
              "gelu_new": {"swiglu": False, "openai_gelu": True},
              "gelu_pytorch_tanh": {"swiglu": False, "openai_gelu": True},
              "gelu_fast": {"swiglu": False, "openai_gelu": True},
              "relu": {"mlp_activations": ["relu"]}, "silu": {"mlp_activations": ["silu"]},
              "swish": {"mlp_activations": ["silu"]}}


def bad(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json {field}={value!r}: {why}")


# ---------------------------------------------------------------- finding config.json

def hub_cache() -> pathlib.Path:
    """The local Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read when called, so a changed environment counts)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return pathlib.Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return pathlib.Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(xdg).expanduser() / "huggingface" / "hub"


def _snapshot(repo: pathlib.Path) -> pathlib.Path | None:
    """The cached snapshot of a repo holding config.json: the one refs/main names, else the
    newest snapshot that has one."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    snaps = [s for s in (repo / "snapshots").glob("*") if (s / "config.json").is_file()]
    return max(snaps, key=lambda s: (s / "config.json").stat().st_mtime) if snaps else None


def _how_to_fetch(name: str) -> str:
    return (f"jaxtrain reads models from this machine and never downloads. Fetch it first, e.g. "
            f"`hf download {name} --local-dir DIR` (or `huggingface-cli download {name} "
            f"config.json --local-dir DIR` for the architecture alone) and set {KEY}: DIR, or "
            f"point HF_HOME / HF_HUB_CACHE at the Hugging Face cache that holds it")


def locate(name: str) -> pathlib.Path:
    """The directory holding ``name``'s config.json: ``name`` itself when it is a local
    directory, else its snapshot in the local hub cache (:func:`hub_cache`). ConfigError
    naming model.name_or_path when there is none."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{KEY} = {name!r} is a directory without config.json; point it at "
                              f"a Hugging Face model directory (config.json, weights, tokenizer)")
        return path
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local or path.exists():
        raise ConfigError(f"{KEY} = {name!r}: no such model directory")
    cache = hub_cache()
    snap = _snapshot(cache / ("models--" + name.replace("/", "--")))
    if snap is None:
        raise ConfigError(f"{KEY} = {name!r}: no local directory of that name and no copy in the "
                          f"Hugging Face cache {cache}; {_how_to_fetch(name)}")
    return snap


def read(path: pathlib.Path) -> dict:
    """config.json of a model directory, as a dict (ConfigError when it is not JSON)."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{KEY}: cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{KEY}: {file} is not a JSON object")
    return data


def has_tokenizer(path: pathlib.Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


# ---------------------------------------------------------------- config.json -> knobs

def knobs(hf: dict) -> dict:
    """Canonical knob values for the architecture config.json ``hf`` describes (ValueError
    naming a field they cannot express, or a model_type jaxtrain does not build)."""
    family = hf.get("model_type")
    if family not in _TRANSLATIONS:
        raise bad("model_type", family, unsupported(hf))
    return _TRANSLATIONS[family](hf)


def unsupported(hf: dict) -> str:
    """Why a model_type outside :data:`FAMILIES` is not built: planned (issue #25) or refused."""
    family = hf.get("model_type")
    if family in PLANNED or str(family).startswith(PLANNED_PREFIXES):
        return (f"the {family} family is not built yet; it is planned for issue #25 (model "
                f"families). Built: {', '.join(FAMILIES)}")
    multimodal = [f for f in MULTIMODAL_FIELDS if f in hf]
    if multimodal or any(str(a).endswith("ForConditionalGeneration")
                         for a in hf.get("architectures") or ()):
        return (f"a multimodal model ({', '.join(multimodal) or 'ForConditionalGeneration'}); "
                f"jaxtrain trains text-only decoders and rejects multimodal models. Built: "
                f"{', '.join(FAMILIES)}")
    return (f"not a family jaxtrain builds (built: {', '.join(FAMILIES)}); other families are "
            f"planned for issue #25 (model families)")


def _number(value):
    """An int when the value is integral (the knob may be int-typed), else a float."""
    value = float(value)
    return int(value) if value.is_integer() else value


def _gated(hf: dict, field: str = "hidden_act") -> dict:
    act = hf.get(field, "silu")
    if act == "gelu":
        raise bad(field, act, "the exact (erf) GELU in a gated MLP has no jaxtrain knob; the "
                  "tanh approximation (gelu_pytorch_tanh) and silu, relu, quick_gelu are built")
    if act not in _GATED_ACT:
        raise bad(field, act, f"supported values are {sorted(_GATED_ACT)}")
    return dict(_GATED_ACT[act])


def _rms_rope(hf: dict, max_positions, eps: float) -> dict:
    """What every pre-norm RMSNorm + RoPE gated-MLP family reads alike (Llama-style,
    DeepSeek-V3, gpt-oss): sizes, norm, dropout, tying and init."""
    out = {"ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
           "make_vocab_size_divisible_by": 1, "position_embedding_type": "rope",
           "normalization": "RMSNorm", "norm_epsilon": float(hf.get("rms_norm_eps", eps)),
           "hidden_dropout": 0.0, "attention_dropout": float(hf.get("attention_dropout", 0.0)),
           "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
           "init_method_std": float(hf.get("initializer_range", 0.02))}
    if max_positions is not None:
        out["max_position_embeddings"] = max_positions
    return out


def _heads(hf: dict) -> dict:
    """Query heads, key/value heads (grouped-query attention when fewer) and head width."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    out = {"num_layers": hf["num_hidden_layers"], "hidden_size": d, "num_attention_heads": heads,
           "kv_channels": hf.get("head_dim") or d // heads}
    if kv != heads:
        out.update(group_query_attention=True, num_query_groups=kv)
    return out


def windows(window: int | None, layers: tuple[bool, ...] | None = None) -> dict:
    """A sliding window of ``window`` keys (the token itself included, HF's sliding_window) on
    the layers marked true (None: every layer): sliding_window_size when it is every layer,
    else Megatron-LM's window_size (W - 1 keys back, none ahead) and window_attn_skip_freq
    (an int N when every Nth layer is the full one, else the 0/1 list)."""
    if not window or (layers is not None and not any(layers)):
        return {}
    if layers is None or all(layers):
        return {"sliding_window_size": int(window)}
    n = len(layers)
    freq = next((k for k in range(2, n + 1)
                 if layers == tuple((i + 1) % k != 0 for i in range(n))), None)
    return {"window_size": [int(window) - 1, 0],
            "window_attn_skip_freq": freq if freq else [int(b) for b in layers]}


def _llama_window(hf: dict, family: str) -> int | None:
    """Llama: none; Mistral/Mixtral: sliding_window on every layer; Qwen: one window for all
    layers when use_sliding_window says so (a mix of windowed and full layers is refused)."""
    if family == "llama":
        return None
    window = hf.get("sliding_window")
    if family in ("mistral", "mixtral"):
        return window or None
    if not hf.get("use_sliding_window", False) or window is None:
        types = hf.get("layer_types")
        if types and any(t != "full_attention" for t in types):
            raise bad("layer_types", types, "only full_attention is supported without "
                      "use_sliding_window")
        return None
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(n)]
    if all(t == "sliding_attention" for t in types):
        return window
    if all(t == "full_attention" for t in types):
        return None
    raise bad("layer_types", types, "a mix of sliding and full attention layers is not "
              "supported (one window for all layers)")


def mscale(factor: float, coefficient: float) -> float:
    """YaRN's m = 0.1 * coefficient * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def _rope(hf: dict) -> dict:
    """rope_theta and rope_parameters (or the older rope_scaling): default, linear, llama3 or
    yarn RoPE."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rp and all(isinstance(v, dict) for v in rp.values()):
        raise bad("rope_parameters", rp, "per-layer-type RoPE parameters are not supported")
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise bad("partial_rotary_factor", partial, "this family rotates the full head")
    kind = rp.get("rope_type", rp.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": _number(theta), "rope_type": "rope"}
    original = hf.get("original_max_position_embeddings",
                      rp.get("original_max_position_embeddings",
                             hf.get("max_position_embeddings")))
    if kind == "default":
        return out
    if kind == "linear":
        out["rope_linear_scaling_factor"] = float(rp["factor"])
    elif kind == "llama3":
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rp["factor"]),
                   rope_low_freq_factor=float(rp["low_freq_factor"]),
                   rope_high_freq_factor=float(rp["high_freq_factor"]),
                   original_max_position_embeddings=int(original))
    elif kind == "yarn":
        factor = rp.get("factor") or hf["max_position_embeddings"] / original
        scale, scale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if not (scale and scale_all):
            scale, scale_all = 1.0, 0.0
        explicit = rp.get("attention_factor")
        if explicit is not None and not math.isclose(
                explicit, mscale(factor, scale) / mscale(factor, scale_all), rel_tol=1e-9):
            if factor <= 1:
                raise bad("rope_parameters.attention_factor", explicit,
                          "YaRN with factor <= 1 has attention factor 1")
            scale, scale_all = (explicit - 1) / (0.1 * math.log(factor)), 0.0
        out.update(rope_type="yarn", rotary_scaling_factor=float(factor),
                   original_max_position_embeddings=int(original),
                   yarn_beta_fast=float(rp.get("beta_fast") or 32),
                   yarn_beta_slow=float(rp.get("beta_slow") or 1),
                   mscale=float(scale), mscale_all_dim=float(scale_all),
                   yarn_correction_range_round_to_int=bool(rp.get("truncate", True)))
    else:
        raise bad("rope_parameters.rope_type", kind,
                  "supported RoPE types are default, linear, llama3 and yarn")
    return out


def _llama(hf: dict) -> dict:
    """Llama, Mistral, Qwen2, Qwen3 and (with :func:`_moe`) Mixtral and Qwen3-MoE."""
    family = hf["model_type"]
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 2048), 1e-6), **_heads(hf),
           **_gated(hf), **windows(_llama_window(hf, family)), **_rope(hf)}
    if family in ("qwen3", "qwen3_moe"):
        out["qk_layernorm"] = True
        if hf.get("attention_bias", False):
            raise bad("attention_bias", True, "Qwen3 biases on q/k/v/o without MLP biases are "
                      "not supported")
    if family == "llama":
        attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn_bias != mlp_bias:
            raise bad("attention_bias", attn_bias, f"differs from mlp_bias={mlp_bias}; jaxtrain "
                      "has biases on all linears (add_bias_linear) or on qkv only")
        if attn_bias:
            out["add_bias_linear"] = True
    elif family == "qwen2":
        out["add_qkv_bias"] = True
    if family in MOE:
        out.update(_moe(hf, family))
    return out


def _moe(hf: dict, family: str) -> dict:
    """Mixtral: top-k of a softmax over all experts, renormalised (= a softmax over the top-k
    logits, Megatron's default), every layer MoE. Qwen3-MoE: the same without renormalisation
    unless norm_topk_prob (= pre_softmax), dense layers per mlp_only_layers/decoder_sparse_step."""
    n = hf["num_hidden_layers"]
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if family == "mixtral":
        out = {"num_experts": experts, "moe_router_topk": hf.get("num_experts_per_tok", 2),
               "moe_ffn_hidden_size": hf["intermediate_size"]}
        if hf.get("router_jitter_noise"):
            out["moe_input_jitter_eps"] = float(hf["router_jitter_noise"])
        return out
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    return {"num_experts": experts, "moe_router_topk": hf.get("num_experts_per_tok", 8),
            "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False)}


def _gpt2(hf: dict) -> dict:
    """GPT-2: learned positions, LayerNorm, biases everywhere, a plain MLP, multi-head."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _PLAIN_ACT:
        raise bad("activation_function", act, f"supported values are {sorted(_PLAIN_ACT)}")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(field, ok) != ok:
            raise bad(field, hf[field], f"only {ok} is supported")
    resid, emb = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if resid != emb:
        raise bad("embd_pdrop", emb, f"differs from resid_pdrop={resid}; jaxtrain has one "
                  "hidden_dropout")
    d = hf["n_embd"]
    return {"num_layers": hf["n_layer"], "hidden_size": d, "num_attention_heads": hf["n_head"],
            "ffn_hidden_size": hf.get("n_inner") or 4 * d,
            "vocab_size": hf["vocab_size"], "make_vocab_size_divisible_by": 1,
            "max_position_embeddings": hf.get("n_positions", 1024),
            "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
            "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), **_PLAIN_ACT[act],
            "add_bias_linear": True, "add_qkv_bias": True, "hidden_dropout": float(resid),
            "attention_dropout": float(hf.get("attn_pdrop", 0.1)),
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
            "init_method_std": float(hf.get("initializer_range", 0.02))}


def _granite(hf: dict) -> dict:
    """IBM Granite 3.x: Llama with an embedding multiplier, an attention multiplier (the score
    scale), a residual multiplier on each sublayer's output and a logits divisor."""
    out = _llama({**hf, "model_type": "llama"})
    attention = float(hf.get("attention_multiplier", 1.0))
    if attention <= 0:
        raise bad("attention_multiplier", attention, "must be positive")
    out.update(query_pre_attn_scalar=attention ** -2,
               residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
               logits_scaling=float(hf.get("logits_scaling", 1.0)))
    if hf.get("embedding_multiplier", 1.0) != 1.0:
        out["embedding_multiplier"] = float(hf["embedding_multiplier"])
    return out


def _smollm3(hf: dict) -> dict:
    """SmolLM3: Llama with NoPE layers (no_rope_layers, 1 = RoPE; else every
    no_rope_layer_interval-th layer without) and, with use_sliding_window, a sliding window on
    the layers layer_types marks sliding (the NoPE ones by default)."""
    n = hf["num_hidden_layers"]
    rope_on = hf.get("no_rope_layers") or [
        int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    if len(rope_on) != n:
        raise bad("no_rope_layers", rope_on, f"needs an entry per layer ({n})")
    out = _llama({**hf, "model_type": "llama", "tie_word_embeddings":
                  hf.get("tie_word_embeddings", True)})
    if not all(rope_on):
        out["no_rope_freq"] = [int(not on) for on in rope_on]
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        types = hf.get("layer_types") or ["sliding_attention" if not on else "full_attention"
                                          for on in rope_on]
        out.update(windows(hf["sliding_window"],
                           tuple(t == "sliding_attention" for t in types)))
    return out


def _phi3(hf: dict) -> dict:
    """Phi-3 / Phi-4: Llama-style attention and gated MLP (fused in the checkpoint), RoPE on
    partial_rotary_factor of each head, a sliding window on every layer when set; resid_pdrop
    is the hidden dropout (embd_pdrop must match it). LongRoPE (the 128k variants) is refused by
    its rope_type."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = float(rp.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    resid, emb = hf.get("resid_pdrop", 0.0), hf.get("embd_pdrop", 0.0)
    if resid != emb:
        raise bad("embd_pdrop", emb, f"differs from resid_pdrop={resid}; jaxtrain has one "
                  "hidden_dropout")
    plain = {**hf, "rope_parameters": rp, "rope_scaling": None, "partial_rotary_factor": 1.0}
    return {**_rms_rope(hf, hf.get("max_position_embeddings", 4096), 1e-5), **_heads(hf),
            **_gated(hf), **windows(hf.get("sliding_window")), **_rope(plain),
            "rotary_percent": partial, "hidden_dropout": float(resid)}


def _gpt_neox(hf: dict) -> dict:
    """GPT-NeoX (Pythia): LayerNorm with biases, RoPE on partial_rotary_factor (rotary_pct) of
    each head, biases on every linear (attention_bias; the MLP always has them), a plain MLP,
    the parallel layer as use_parallel_residual says, an untied output layer by default."""
    act = hf.get("hidden_act", "gelu")
    if act not in _PLAIN_ACT:
        raise bad("hidden_act", act, f"supported values are {sorted(_PLAIN_ACT)}")
    if not hf.get("attention_bias", True):
        raise bad("attention_bias", False, "GPT-NeoX's MLP keeps its biases; biases on the MLP "
                  "alone are not built")
    rp = dict(hf.get("rope_parameters") or {})
    if rp.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise bad("rope_parameters", rp or hf.get("rope_scaling"), "GPT-NeoX with RoPE scaling "
                  "is not built")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    return {"num_layers": hf["num_hidden_layers"], "hidden_size": d, "num_attention_heads": heads,
            "ffn_hidden_size": hf.get("intermediate_size") or 4 * d,
            "vocab_size": hf["vocab_size"], "make_vocab_size_divisible_by": 1,
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "position_embedding_type": "rope",
            "rotary_base": _number(rp.get("rope_theta", hf.get("rotary_emb_base", 10000))),
            "rotary_percent": float(rp.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))),
            "normalization": "LayerNorm", "norm_epsilon": float(hf.get("layer_norm_eps", 1e-5)),
            **_PLAIN_ACT[act], "add_bias_linear": True, "add_qkv_bias": True,
            "parallel_residual": bool(hf.get("use_parallel_residual", True)),
            "hidden_dropout": float(hf.get("hidden_dropout", 0.0)),
            "attention_dropout": float(hf.get("attention_dropout", 0.0)),
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
            "init_method_std": float(hf.get("initializer_range", 0.02))}


def _deepseek_v3(hf: dict) -> dict:
    """DeepSeek-V3: multi-latent attention (latent norms, interleaved RoPE on the shared key),
    YaRN whose mscale_all_dim also scales the softmax, first_k_dense_replace dense MLP layers
    and MoE layers after them (:func:`_deepseek_moe`)."""
    n, d, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise bad("num_key_value_heads", kv_heads, "multi-latent attention has one key/value "
                  f"head per query head ({heads})")
    if hf.get("attention_bias", False):
        raise bad("attention_bias", True, "biases on the MLA projections are not supported")
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 4096), 1e-6), **_gated(hf),
           "num_layers": n, "hidden_size": d, "num_attention_heads": heads,
           "multi_latent_attention": True, "kv_lora_rank": hf["kv_lora_rank"],
           "qk_head_dim": hf["qk_nope_head_dim"], "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
           "v_head_dim": hf["v_head_dim"], "qk_layernorm": True, **_rope(hf),
           "mla_latent_norm_epsilon": 1e-6}   # transformers' latent norms: their default eps
    if d % heads:
        out["kv_channels"] = hf["v_head_dim"]
    if hf.get("q_lora_rank"):
        out["q_lora_rank"] = hf["q_lora_rank"]
    if hf.get("first_k_dense_replace", 3) < n:
        out.update(_deepseek_moe(hf))
    # HF multiplies the softmax scale by m(factor, mscale_all_dim)^2 for any non-default RoPE
    # that names mscale_all_dim; jaxtrain's is m(rotary_scaling_factor, mscale_all_dim)^2.
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    yarn = out["rope_type"] == "yarn"
    factor = out["rotary_scaling_factor"] if yarn else 1.0
    theirs = (mscale(rp.get("factor") or factor, rp["mscale_all_dim"])
              if kind != "default" and rp.get("mscale_all_dim") else 1.0)
    ours = mscale(factor, out["mscale_all_dim"] if yarn else 0.0)
    if not math.isclose(theirs, ours, rel_tol=1e-9):
        raise bad("rope_parameters", rp, "the softmax scale's mscale_all_dim needs YaRN with "
                  "both mscale and mscale_all_dim (and no other attention_factor)")
    return out


_DSV32_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                      moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                      n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                      kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                      qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                      max_position_embeddings=163840, rms_norm_eps=1e-6, index_topk=2048,
                      index_head_dim=128, index_n_heads=64, first_k_dense_replace=3)
# GlmMoeDsaConfig's defaults where they differ from DeepSeek-V3.2's
_GLM_DSA_DEFAULTS = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                         num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
                         v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1,
                         max_position_embeddings=202752, rms_norm_eps=1e-5, index_n_heads=32)


def _deepseek_v32(hf: dict, defaults: dict | None = None) -> dict:
    """DeepSeek-V3.2: DeepSeek-V3 (always with a query latent and interleaved MLA RoPE) plus
    the sparse-attention indexer on every layer (index_n_heads x index_head_dim, index_topk
    keys kept; half-split RoPE, ReLU scores, a LayerNorm of epsilon 1e-6 on its key). Missing
    fields take DeepseekV32Config's defaults; mlp_layer_types may place the MoE layers."""
    hf = {**_DSV32_DEFAULTS, **(defaults or {}), **{k: v for k, v in hf.items() if v is not None}}
    hf.pop("rope_interleave", None)   # the class has no such field: MLA always interleaves
    n = hf["num_hidden_layers"]
    mlp = hf.get("mlp_layer_types") or ["dense" if i < hf["first_k_dense_replace"] else "sparse"
                                        for i in range(n)]
    if sorted(set(mlp) - {"dense", "sparse"}) or len(mlp) != n:
        raise bad("mlp_layer_types", mlp, f"expected {n} entries of dense or sparse")
    out = _deepseek_v3({**hf, "first_k_dense_replace": n})
    if "sparse" in mlp:
        out.update(_deepseek_moe({**hf, "first_k_dense_replace": 0}))
        out["moe_layer_freq"] = [int(t == "sparse") for t in mlp]
    out.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=hf["index_n_heads"],
               dsa_indexer_head_dim=hf["index_head_dim"], dsa_indexer_topk=hf["index_topk"],
               dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_rope_interleaved=False,
               dsa_indexer_scoring_relu=True)
    return out


def _glm_moe_dsa(hf: dict) -> dict:
    """GLM-5 (GLM-MoE-DSA): DeepSeek-V3.2 with interleaved RoPE in the indexer and index
    sharing: indexer_types marks each layer "full" (its own indexer) or "shared" (the last full
    layer's selection), by default from index_topk_freq / index_skip_topk_offset (2) or
    index_topk_pattern; the pattern must be one Megatron's dsa_indexer_topk_freq /
    dsa_indexer_skip_topk_offset give."""
    n = hf.get("num_hidden_layers", _GLM_DSA_DEFAULTS["num_hidden_layers"])
    types = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if types is None and pattern is not None:
        types = ([{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str)
                 else list(pattern))
    if types is None:
        freq = max(hf.get("index_topk_freq", 1), 1)
        offset = hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or set(types) - {"full", "shared"}:
        raise bad("indexer_types", types, f"expected {n} entries of full or shared")
    shared = tuple(t == "shared" for t in types)
    found = next(((f, o) for f in range(1, n + 1) for o in range(n + 1)
                  if dsa_shared_pattern(f, o, n) == shared), None)
    if found is None:
        raise bad("indexer_types", types, "not a pattern of one full layer every N layers after "
                  "an offset (Megatron's dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset)")
    out = _deepseek_v32(hf, _GLM_DSA_DEFAULTS)
    out.update(dsa_indexer_rope_interleaved=True, dsa_indexer_topk_freq=found[0],
               dsa_indexer_skip_topk_offset=found[1])
    return out


# KimiLinearConfig's attribute_map: the names its config.json files use -> DeepSeek-V3's
_KIMI_NAMES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
               "num_expert_group": "n_group", "num_experts": "n_routed_experts",
               "num_local_experts": "n_routed_experts",
               "num_experts_per_token": "num_experts_per_tok",
               "num_shared_experts": "n_shared_experts"}


def _kimi_linear(hf: dict) -> dict:
    """Kimi Linear: Kimi Delta Attention layers (linear_attention_kind kda) and multi-latent
    attention layers without RoPE (mla_nope) as layer_types (or the checkpoint's
    linear_attn_config, 1-based kda_layers / full_attn_layers) say; dense MLPs then MoE layers
    as mlp_layer_types (or first_k_dense_replace) say, routed as DeepSeek-V3 routes. Fields
    missing take KimiLinearConfig's defaults. transformers never ties its output layer to the
    embedding (tie_word_embeddings is not read), so neither does this."""
    hf = {_KIMI_NAMES.get(k, k): v for k, v in hf.items()}
    defaults = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216,
                    moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
                    n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
                    topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                    max_position_embeddings=1048576, rms_norm_eps=1e-5, n_routed_experts=256,
                    tie_word_embeddings=False, first_k_dense_replace=1)
    hf = {**defaults, **{k: v for k, v in hf.items() if v is not None}}
    n = hf["num_hidden_layers"]
    lin = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention"
                      for i in range(n)]
    if sorted(set(types) - {"linear_attention", "full_attention"}) or len(types) != n:
        raise bad("layer_types", types, f"expected {n} entries of linear_attention or "
                  "full_attention")
    mlp = hf.get("mlp_layer_types") or ["dense" if i < hf["first_k_dense_replace"] else "sparse"
                                        for i in range(n)]
    if sorted(set(mlp) - {"dense", "sparse"}) or len(mlp) != n:
        raise bad("mlp_layer_types", mlp, f"expected {n} entries of dense or sparse")
    out = _deepseek_v3({**hf, "first_k_dense_replace": n, "rope_parameters": None,
                        "rope_scaling": None})
    width = lin.get("head_dim", hf.get("linear_head_dim", 128))
    heads = lin.get("num_heads", hf.get("linear_num_heads", 32))
    out.update(mla_nope=True, experimental_attention_variant="gdn",
               linear_attention_kind="kda", untie_embeddings_and_output_weights=True,
               linear_attention_freq=[int(t == "linear_attention") for t in types],
               linear_conv_kernel_dim=lin.get("short_conv_kernel_size",
                                              hf.get("linear_conv_kernel_dim", 4)),
               linear_key_head_dim=width, linear_value_head_dim=width,
               linear_num_key_heads=heads, linear_num_value_heads=heads)
    if "sparse" in mlp:
        out.update(_deepseek_moe({**hf, "first_k_dense_replace": 0}))
        out["moe_layer_freq"] = [int(t == "sparse") for t in mlp]
    return out


def _deepseek_moe(hf: dict) -> dict:
    """DeepSeek-V3's MoE layers (every layer from first_k_dense_replace on): sigmoid scores,
    experts chosen on score + e_score_correction_bias (the expert bias) within the best
    topk_group of n_group groups (a group scored by the sum of its top-2 biased scores whatever
    num_experts_per_tok), the unbiased scores of the chosen experts renormalised (norm_topk_prob)
    and scaled by routed_scaling_factor, gating in fp32, plus n_shared_experts x
    moe_intermediate_size always-on shared expert. Missing fields take DeepseekV3Config's
    defaults (what transformers would build)."""
    n, k = hf["num_hidden_layers"], hf.get("num_experts_per_tok", 8)
    experts = hf.get("n_routed_experts", 256)
    for field, ok in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if hf.get(field, ok) != ok:
            raise bad(field, hf[field], f"DeepSeek-V3 routing is {field}={ok!r}")
    if hf.get("moe_layer_freq", 1) != 1:
        raise bad("moe_layer_freq", hf["moe_layer_freq"], "transformers makes every layer "
                  "from first_k_dense_replace on an MoE layer (frequency 1)")
    if hf.get("norm_topk_prob", True) != (k > 1):
        raise bad("norm_topk_prob", hf.get("norm_topk_prob", True), "sigmoid routing "
                  "renormalises the top-k weights exactly when top-k > 1 (Megatron's rule)")
    groups, group_topk = hf.get("n_group", 8) or 1, hf.get("topk_group", 4) or 1
    limited = groups > 1 and group_topk < groups
    if limited and experts % groups == 0 and experts // groups < HF_GROUP_SCORE_TOPK:
        raise bad("n_group", groups, f"HF scores a group by its top-{HF_GROUP_SCORE_TOPK} "
                  f"experts; a group of {experts // groups} has fewer")
    first = hf.get("first_k_dense_replace", 3)
    width = hf.get("moe_intermediate_size", 2048)
    shared = (hf.get("n_shared_experts", 1) or 0) * width
    scale = float(hf.get("routed_scaling_factor", 2.5))
    out = {"num_experts": experts, "moe_router_topk": k, "moe_ffn_hidden_size": width,
           "moe_layer_freq": 1 if first <= 0 else [0] * first + [1] * (n - first),
           "moe_router_score_function": "sigmoid", "moe_router_dtype": "fp32",
           "moe_router_enable_expert_bias": True}
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared
    if scale != 1.0:
        out["moe_router_topk_scaling_factor"] = scale
    if limited:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                   moe_router_group_score_topk=HF_GROUP_SCORE_TOPK)
    return out


# DeepseekV4Config's defaults (DeepSeek-V4-Flash) for fields a config.json leaves out
_DSV4_DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
                      num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1,
                      head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256,
                      n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
                      max_position_embeddings=1048576, rope_theta=10000.0,
                      compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20,
                      hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
                      o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
                      rms_norm_eps=1e-6, hidden_act="silu")
_DSV4_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4}


def _deepseek_v4(hf: dict) -> dict:
    """DeepSeek-V4 (model_type deepseek_v4; models/compressed.py): layer_types (or the older
    compress_ratios) say each layer's compression; compressed sparse attention must keep
    ratio 4 (it is what marks the indexed layers), heavily compressed any other. mlp_layer_types
    are hash_moe layers first, then moe; the hash layers' tid2eid tables load into
    hash_routes. The compressed layers' YaRN comes from rope_parameters (its attention factor
    unused, as transformers forces 1)."""
    hf = {**_DSV4_DEFAULTS, **hf}
    n = hf["num_hidden_layers"]
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
             **(hf.get("compress_rates") or {})}
    if rates["compressed_sparse_attention"] != 4:
        raise bad("compress_rates", rates, "compressed sparse attention is built at ratio 4")
    if rates["heavily_compressed_attention"] in (0, 4):
        raise bad("compress_rates", rates, "heavily compressed attention needs a ratio other "
                  "than 0 and 4")
    if hf.get("layer_types"):
        ratio = {**_DSV4_RATIO,
                 "heavily_compressed_attention": rates["heavily_compressed_attention"]}
        ratios = [ratio[t] for t in hf["layer_types"][:n]]
    elif hf.get("compress_ratios"):
        ratios = list(hf["compress_ratios"][:n])
    else:   # transformers' default: two heavy layers, then sparse and heavy in turn
        heavy = rates["heavily_compressed_attention"]
        ratios = [heavy] * min(n, 2) + [4 if i % 2 else heavy for i in range(max(n - 2, 0))]
    kinds = list(hf.get("mlp_layer_types") or [])
    hashed = (kinds.index("moe") if "moe" in kinds else len(kinds)) if kinds else hf.get(
        "num_hash_layers", 3)
    if kinds and any(k != "moe" for k in kinds[hashed:]):
        raise bad("mlp_layer_types", kinds, "hash_moe layers must all come first")
    if hf.get("scoring_func") not in ("sqrtsoftplus", "sigmoid"):
        raise bad("scoring_func", hf.get("scoring_func"), "sqrtsoftplus or sigmoid scores are "
                  "built (softmax scores cannot weigh hash-routed experts)")
    if (hf.get("num_key_value_heads") or 1) != 1:
        raise bad("num_key_value_heads", hf["num_key_value_heads"], "DeepSeek-V4 attention has "
                  "one shared key/value head")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise bad("attention_bias", True, "DeepSeek-V4's projections have no biases")
    partial = hf.get("partial_rotary_factor") or 64 / 512
    rope = dict((hf.get("rope_parameters") or {}).get("compress") or {})
    flat = {k: v for k, v in (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).items()
            if not isinstance(v, dict)}
    rope = rope or flat
    out = {**_rms_rope({**hf, "intermediate_size": hf["moe_intermediate_size"]},
                       hf["max_position_embeddings"], 1e-6), **_gated(hf),
           "model_type": "deepseek_v4", "num_layers": n, "hidden_size": hf["hidden_size"],
           "num_attention_heads": hf["num_attention_heads"], "group_query_attention": True,
           "num_query_groups": 1, "kv_channels": hf["head_dim"],
           "q_lora_rank": hf["q_lora_rank"],
           "qk_pos_emb_head_dim": int(hf["head_dim"] * partial),
           "rotary_base": _number(hf["rope_theta"]), "rope_type": "rope",
           "compress_ratios": ratios, "compress_rope_theta": float(hf["compress_rope_theta"]),
           "o_groups": hf["o_groups"], "o_lora_rank": hf["o_lora_rank"],
           "index_n_heads": hf["index_n_heads"], "index_head_dim": hf["index_head_dim"],
           "index_topk": hf["index_topk"], "attn_sliding_window": hf["sliding_window"],
           "attn_sink": True, "hc_mult": hf["hc_mult"],
           "hc_sinkhorn_iters": hf["hc_sinkhorn_iters"], "hc_eps": float(hf["hc_eps"]),
           "swiglu_limit": float(hf["swiglu_limit"] or 0.0),
           "num_experts": hf["n_routed_experts"], "moe_router_topk": hf["num_experts_per_tok"],
           "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_layer_freq": 1,
           "moe_shared_expert_intermediate_size": (hf["n_shared_experts"] or 0)
           * hf["moe_intermediate_size"],
           "moe_router_score_function": hf["scoring_func"], "moe_router_dtype": "fp32",
           "moe_router_enable_expert_bias": True, "num_hash_layers": hashed}
    if float(hf["routed_scaling_factor"]) != 1.0:
        out["moe_router_topk_scaling_factor"] = float(hf["routed_scaling_factor"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings",
                            hf.get("original_max_position_embeddings"))
        out.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                   original_max_position_embeddings=int(original),
                   yarn_beta_fast=float(rope.get("beta_fast") or 32),
                   yarn_beta_slow=float(rope.get("beta_slow") or 1),
                   yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
    elif kind != "default":
        raise bad("rope_parameters.compress.rope_type", kind, "the compressed layers take "
                  "default or yarn RoPE")
    return out


def _gpt_oss(hf: dict) -> dict:
    """gpt-oss: GQA with q/k/v/o biases, a learned sink per head, sliding windows on the
    ``sliding_attention`` layers, YaRN; every layer MoE: a biased router, softmax over the top-k
    logits, experts with biases and the clamped GLU (swiglu_oai: Megatron's quick_geglu with
    glu_linear_offset 1 and activation_func_clamp_value). Experts always have biases, so
    attention_bias must be true with experts (add_bias_linear covers both)."""
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts and not hf.get("attention_bias", True):
        raise bad("attention_bias", False, "gpt-oss experts have biases and add_bias_linear "
                  "puts biases on the attention projections too")
    if experts and hf.get("swiglu_alpha", 1.702) != 1.702:
        raise bad("swiglu_alpha", hf["swiglu_alpha"], "the MoE model's clamped GLU has 1.702")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(n)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise bad("layer_types", types, "only sliding_attention and full_attention exist")
    sliding = tuple(t == "sliding_attention" for t in types)
    out = {**_rms_rope(hf, hf.get("max_position_embeddings"), 1e-5), **_heads(hf),
           "use_sink_attention": True, **windows(hf.get("sliding_window"), sliding),
           **_rope(hf)}
    if hf.get("attention_bias", True):
        out["add_bias_linear"] = True
    if not experts:
        return {**out, "swiglu": True}
    return {**out, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(hf.get("swiglu_limit", 7.0)),
            "num_experts": experts, "moe_router_topk": hf.get("num_experts_per_tok", 4),
            "moe_ffn_hidden_size": hf["intermediate_size"]}


def _per_type_rope(hf: dict, full_theta: float, local_theta: float) -> dict:
    """RoPE of families with per-layer-type rope_parameters (Gemma 3, OLMo 3): full_attention
    takes rope_theta and its scaling, sliding_attention a plain RoPE base (local_rotary_base,
    set when the sliding layers differ from the full ones); or the older rope_theta /
    rope_scaling / rope_local_base_freq fields. ``*_theta``: the family's defaults."""
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        full = dict(rp.get("full_attention") or {"rope_type": "default"})
        local = dict(rp.get("sliding_attention") or {"rope_type": "default"})
    elif rp:
        full, local = dict(rp), {"rope_type": "default", "rope_theta": rp.get("rope_theta")}
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", full_theta)}
        local = {"rope_type": "default",
                 "rope_theta": hf.get("rope_local_base_freq", local_theta)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise bad("rope_parameters.sliding_attention", local, "the sliding-window layers take "
                  "plain RoPE (a base, no scaling)")
    full.setdefault("rope_theta", full_theta)
    out = _rope({"rope_parameters": full})
    base = _number(local.get("rope_theta") or local_theta)
    plain = full.get("rope_type", full.get("type", "default")) == "default"
    if not (plain and base == out["rotary_base"]):
        out["local_rotary_base"] = base
    return out


def _gemma_rope(hf: dict) -> dict:
    """Gemma 3's RoPE: the local layers always carry their own base (10,000 by default)."""
    out = _per_type_rope(hf, 1e6, 1e4)
    out.setdefault("local_rotary_base", out["rotary_base"])
    return out


def _gemma(hf: dict) -> dict:
    """Gemma, Gemma 2, Gemma 3 text: (1 + w) RMSNorms, embeddings times sqrt(hidden_size), a
    tanh-GELU gated MLP, tied embeddings, query_pre_attn_scalar; Gemma 2/3 add sandwich norms
    and sliding-window layers (layer_types), Gemma 2 soft-capping, Gemma 3 q/k norms and a
    RoPE base of its own on the sliding-window layers."""
    family = hf["model_type"]
    act_field = "hidden_act" if family == "gemma" else (
        "hidden_activation" if hf.get("hidden_activation") else "hidden_act")
    hf = {"hidden_act": "gelu_pytorch_tanh", **hf,
          "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    if hf.get("attention_bias"):
        raise bad("attention_bias", True, "Gemma with attention biases is not supported")
    if hf.get("use_bidirectional_attention"):
        raise bad("use_bidirectional_attention", True, "jaxtrain trains causal decoders")
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 8192), 1e-6), **_heads(hf),
           **_gated(hf, act_field), "apply_layernorm_1p": True,
           "embedding_multiplier": hf["hidden_size"] ** 0.5,
           "query_pre_attn_scalar": _number(hf.get("query_pre_attn_scalar")
                                            or hf.get("head_dim") or 256)}
    if family == "gemma":
        return {**out, **_rope(hf)}
    n = hf["num_hidden_layers"]
    pattern = 2 if family == "gemma2" else hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                      "full_attention" for i in range(n)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise bad("layer_types", types, "only sliding_attention and full_attention exist")
    sliding = tuple(t == "sliding_attention" for t in types)
    out.update(post_attention_norm=True, post_mlp_norm=True,
               **windows(hf.get("sliding_window", 4096), sliding))
    caps = {"attn_logit_softcapping": hf.get("attn_logit_softcapping",
                                             50.0 if family == "gemma2" else None),
            "final_logit_softcapping": hf.get("final_logit_softcapping",
                                              30.0 if family == "gemma2" else None)}
    out.update({k: float(v) for k, v in caps.items() if v})
    if family == "gemma2":
        return {**out, **_rope(hf)}
    return {**out, "qk_layernorm": True, **_gemma_rope(hf)}


def _gemma4(hf: dict) -> dict:
    """Gemma 4 text (31B dense, 26B-A4B MoE): plain RMSNorms, embeddings times sqrt(hidden),
    sandwich norms, q/k norms and an unscaled value norm, attention scale 1, layer scalars,
    sliding-window layers (layer_types; five to one by default, the last one full) and global
    layers with their own head width, key/value heads (when attention_k_eq_v) and
    proportional RoPE; the MoE variant's parallel dense MLP and experts; the small models'
    (E2B/E4B) per-layer inputs (transformers' default width 256 when the field is absent), KV
    sharing of the last num_kv_shared_layers layers and their double-wide MLP."""
    for field, why in (("attention_bias", "Gemma 4 with attention biases is not built"),
                       ("use_bidirectional_attention", "jaxtrain trains causal decoders")):
        if hf.get(field):
            raise bad(field, hf[field], why)
    n = hf["num_hidden_layers"]
    hf = {"hidden_activation": "gelu_pytorch_tanh", **hf,
          "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else
                                           "full_attention" for i in range(n)])
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != n:
        raise bad("layer_types", types, f"needs {n} entries of sliding_attention and "
                  "full_attention")
    types[-1] = "full_attention"   # transformers makes the last layer a full one
    sliding = tuple(t == "sliding_attention" for t in types)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    width, groups = hf.get("global_head_dim", 512), hf.get("num_global_key_value_heads")
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:   # transformers >= 5.2x writes the global layers' overrides
        wanted = {i for i, s in enumerate(sliding) if not s}   # per layer ({}: none differ)
        shapes = {json.dumps(v, sort_keys=True) for v in per_layer.values()}
        if per_layer and ({int(i) for i in per_layer} != wanted or len(shapes) != 1):
            raise bad("per_layer_config", per_layer, "jaxtrain builds one head shape for every "
                      "full_attention layer and the plain one for the sliding layers")
        only = next(iter(per_layer.values()), {})
        extra = set(only) - {"head_dim", "num_key_value_heads"}
        if extra:
            raise bad("per_layer_config", per_layer, f"per-layer fields {sorted(extra)} are "
                      "not built (head_dim and num_key_value_heads are)")
        width, groups = only.get("head_dim", hf.get("head_dim")), only.get("num_key_value_heads")
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 131072), 1e-6), **_heads(hf),
           **_gated(hf, "hidden_activation"), "embedding_multiplier": hf["hidden_size"] ** 0.5,
           "query_pre_attn_scalar": 1, "qk_layernorm": True, "v_norm": "plain",
           "layer_scalar": True, "post_attention_norm": True, "post_mlp_norm": True,
           **windows(hf.get("sliding_window", 512), sliding), **_gemma4_rope(hf)}
    if not all(sliding):
        kv = out.get("num_query_groups", hf["num_attention_heads"])
        out.update(global_kv_channels=int(width), attention_k_eq_v=k_eq_v)
        if groups and k_eq_v and groups != kv:
            out["global_num_query_groups"] = int(groups)
    if hf.get("final_logit_softcapping"):
        out["final_logit_softcapping"] = float(hf["final_logit_softcapping"])
    out.update(_gemma4_small(hf))
    if not hf.get("enable_moe_block"):
        return out
    return {**out, "num_experts": hf["num_experts"], "moe_router_topk": hf["top_k_experts"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_layer_freq": 1,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_shared_expert_intermediate_size": hf["intermediate_size"],
            "moe_branch_norms": True, "moe_router_input_norm": True,
            "moe_per_expert_scale": True}


def _gemma4_small(hf: dict) -> dict:
    """Gemma 4 E2B/E4B: per-layer inputs (their width and table), KV sharing, wide MLPs."""
    out = {}
    width = hf.get("hidden_size_per_layer_input", 256)
    if width:
        out.update(hidden_size_per_layer_input=int(width),
                   vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input", 262144)))
    shared = hf.get("num_kv_shared_layers") or 0
    if shared:
        if shared >= hf["num_hidden_layers"]:
            raise bad("num_kv_shared_layers", shared, "leaves no layer computing keys and "
                      "values to share")
        out["num_kv_shared_layers"] = int(shared)
        out["use_double_wide_mlp"] = bool(hf.get("use_double_wide_mlp", False))
    return out


def _gemma4_rope(hf: dict) -> dict:
    """Gemma 4's RoPE: plain on the sliding layers (local_rotary_base), proportional on the
    global ones (rotary_base and the share of pairs that turn, global_rotary_percent)."""
    rp = hf.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or {"rope_type": "proportional",
                                              "partial_rotary_factor": 0.25,
                                              "rope_theta": 1e6})
    local = dict(rp.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4})
    if local.get("rope_type", "default") != "default":
        raise bad("rope_parameters.sliding_attention", local, "Gemma 4's sliding layers take "
                  "plain RoPE")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
        raise bad("rope_parameters.full_attention", full, "the global layers take default or "
                  "proportional RoPE without a scaling factor")
    out = {"rotary_base": _number(full.get("rope_theta", 1e6)),
           "local_rotary_base": _number(local.get("rope_theta", 1e4))}
    if kind == "proportional":
        out["global_rotary_percent"] = float(full.get("partial_rotary_factor", 1.0))
    elif full.get("partial_rotary_factor", 1.0) != 1.0:
        raise bad("rope_parameters.full_attention", full, "default RoPE rotates the full head")
    return out


def _olmo(hf: dict) -> dict:
    """OLMo 2 and OLMo 3: no norm before the sublayers, RMSNorms on their outputs, one q and one
    k RMSNorm over all heads, a SwiGLU MLP; OLMo 3 adds sliding-window layers (three of four by
    default) with per-layer-type RoPE."""
    family = hf["model_type"]
    if hf.get("attention_bias"):
        raise bad("attention_bias", True, "OLMo with attention biases is not supported")
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 4096), 1e-5), **_heads(hf),
           **_gated(hf), "pre_norm": False, "post_attention_norm": True, "post_mlp_norm": True,
           "qk_layernorm": True, "qk_norm_across_heads": True}
    if family == "olmo2":
        return {**out, **_rope(hf)}
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                      for i in range(n)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise bad("layer_types", types, "only sliding_attention and full_attention exist")
    sliding = tuple(t == "sliding_attention" for t in types)
    out.update(windows(hf.get("sliding_window", 4096), sliding))
    theta = hf.get("rope_theta", 500000.0)
    rope = _per_type_rope(hf, theta, theta)
    if "local_rotary_base" in rope and not any(sliding):
        del rope["local_rotary_base"]
    return {**out, **rope}


def _hybrid(hf: dict) -> dict:
    """Qwen3-Next and Qwen3.5 (text): layer_types mixes Gated DeltaNet layers (linear_attention)
    with gated full attention (q/k norms, a sigmoid output gate, RoPE on partial_rotary_factor
    of each head; Qwen3.5's multimodal RoPE is plain RoPE for text, whose three position rows
    are equal); RMSNorms scale by 1 + w. MoE layers (Qwen3-Next, Qwen3.5-MoE): softmax top-k
    renormalised when norm_topk_prob, plus a shared expert behind a sigmoid gate."""
    family, n = hf["model_type"], hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", hf["hidden_act"], "the Gated DeltaNet convolution and the MLPs "
                  "of these models are built with silu only")
    hf = {"intermediate_size": hf.get("moe_intermediate_size", 512), **hf}   # MoE-only: unused
    if hf.get("attention_bias", False):
        raise bad("attention_bias", True, "biases on the attention projections are not built")
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = rp.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    for key in ("mrope_section", "mrope_interleaved"):   # text positions make these plain RoPE
        rp.pop(key, None)
    rope = _rope({**{k: v for k, v in hf.items() if k != "partial_rotary_factor"},
                  "rope_parameters": rp, "rope_scaling": None})
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != n:
        raise bad("layer_types", types, f"expected {n} entries of linear_attention or "
                  "full_attention")
    linear = [int(t == "linear_attention") for t in types]
    freq = next((k for k in range(1, n + 1)
                 if linear == [int((i + 1) % k != 0) for i in range(n)]), linear)
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 32768), 1e-6), **_heads(hf),
           **_gated(hf), **rope, "rotary_percent": float(partial), "qk_layernorm": True,
           "apply_layernorm_1p": True, "attention_output_gate": True,
           "experimental_attention_variant": "gdn", "linear_attention_freq": freq,
           **{k: hf.get(k, d) for k, d in (("linear_conv_kernel_dim", 4),
                                           ("linear_key_head_dim", 128),
                                           ("linear_value_head_dim", 128),
                                           ("linear_num_key_heads", 16),
                                           ("linear_num_value_heads", 32))}}
    if family == "qwen3_5_text":
        return out
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    experts = hf.get("num_experts", 512 if family == "qwen3_next" else 256)
    if not experts or not any(pattern):
        return out
    out.update(num_experts=experts, moe_router_topk=hf.get("num_experts_per_tok", 8),
               moe_ffn_hidden_size=hf.get("moe_intermediate_size", 512),
               moe_layer_freq=1 if all(pattern) else pattern,
               moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
               moe_shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size",
                                                          512),
               moe_shared_expert_gate=True)
    if family == "qwen3_5_moe_text":
        out["moe_router_pre_softmax"] = False   # its router always renormalises the top k
    return out


# Hugging Face layer types of hybrid models (and their legacy names) -> pattern symbols.
_BLOCK_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                  "mlp": "-", "moe": "E"}


def _json_float(value) -> float:
    """A float of config.json, where transformers writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _mamba_fields(hf: dict, heads: int, head_dim: int, floor: float) -> dict:
    """The Mamba-2 mixer fields NemotronH and Mamba2 share: heads, groups, state, convolution,
    chunk, the gated norm's epsilon (the model's) and the step-size floor."""
    for field, ok in (("use_conv_bias", True), ("use_bias", False), ("mamba_proj_bias", False),
                      ("mamba_hidden_act", "silu"), ("hidden_act", "silu"),
                      ("norm_before_gate", False), ("rms_norm", True)):
        if field in hf and hf[field] != ok:
            raise bad(field, hf[field], f"jaxtrain's Mamba-2 layers are built with {field}={ok}")
    return {"mamba_num_heads": heads, "mamba_head_dim": head_dim,
            "mamba_num_groups": hf.get("n_groups", 8), "mamba_state_dim": hf.get(
                "ssm_state_size", hf.get("state_size", 128)),
            "mamba_conv_kernel_dim": hf.get("conv_kernel", 4),
            "mamba_chunk_size": hf.get("chunk_size", 128),
            "mamba_norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "mamba_time_step_floor": float(floor)}


def _hybrid_base(hf: dict, pattern: str) -> dict:
    """Sizes, RMSNorm, tying, init, dropout and the float32 residual stream (residual_in_fp32)
    of the Mamba-2 families, as a hybrid model of ``pattern``."""
    return {"is_hybrid_model": True, "hybrid_layer_pattern": pattern,
            "fp32_residual_connection": bool(hf.get("residual_in_fp32", False)),
            "num_layers": len(pattern), "hidden_size": hf["hidden_size"],
            "vocab_size": hf["vocab_size"], "make_vocab_size_divisible_by": 1,
            "normalization": "RMSNorm", "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "position_embedding_type": "none", "hidden_dropout": 0.0,
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
            "init_method_std": float(hf.get("initializer_range", 0.02))}


def _nemotron_h(hf: dict) -> dict:
    """NemotronH (Nemotron-H, Nemotron 3 Nano): Megatron's hybrid stack, one sublayer per layer
    as layers_block_type (or the older hybrid_override_pattern) says: Mamba-2, attention
    without positional encoding, squared-ReLU MLPs, and MoE layers of squared-ReLU experts with
    DeepSeek-V3's sigmoid group-limited routing plus a shared expert."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(_BLOCK_SYMBOLS))
        if unknown:
            raise bad("layers_block_type", unknown, f"known kinds are {sorted(_BLOCK_SYMBOLS)}")
        pattern = "".join(_BLOCK_SYMBOLS[t] for t in types)
    else:
        pattern = hf.get("hybrid_override_pattern") or "ME*-"
    if hf.get("num_nextn_predict_layers", 0):
        raise bad("num_nextn_predict_layers", hf["num_nextn_predict_layers"],
                  "multi-token-prediction layers are not built yet (planned)")
    for field, value in (("attention_bias", False), ("mlp_bias", False),
                         ("sliding_window", None)):
        if hf.get(field, value) != value:
            raise bad(field, hf[field], f"NemotronH with {field} is not built")
    act = hf.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise bad("mlp_hidden_act", act, "NemotronH's MLPs are built with relu2 (squared ReLU)")
    heads = hf.get("num_attention_heads", 32)
    kv = hf.get("num_key_value_heads") or heads
    d = hf["hidden_size"]
    # transformers' NemotronH never ties its output layer to the embedding, whatever
    # tie_word_embeddings says; the checkpoint carries lm_head.weight
    out = {**_hybrid_base({**hf, "tie_word_embeddings": False}, pattern),
           **_mamba_fields(hf, hf.get("mamba_num_heads", 128), hf.get("mamba_head_dim", 64),
                           hf.get("time_step_min", 0.001)),
           "num_attention_heads": heads, "kv_channels": hf.get("head_dim") or d // heads,
           "ffn_hidden_size": hf.get("intermediate_size", 4 * d), "squared_relu": True,
           "swiglu": False, "attention_dropout": float(hf.get("attention_dropout", 0.0)),
           "max_position_embeddings": hf.get("max_position_embeddings", 4096)}
    if kv != heads:
        out.update(group_query_attention=True, num_query_groups=kv)
    if "E" in pattern:
        k, experts = hf.get("num_experts_per_tok", 2), hf.get("n_routed_experts", 8)
        groups, group_topk = hf.get("n_group", 1) or 1, hf.get("topk_group", 1) or 1
        if groups > 1 and group_topk < groups and experts // groups < HF_GROUP_SCORE_TOPK:
            raise bad("n_group", groups, f"HF scores a group by its top-{HF_GROUP_SCORE_TOPK} "
                      f"experts; a group of {experts // groups} has fewer")
        out.update(num_experts=experts, moe_router_topk=k,
                   moe_latent_size=hf.get("moe_latent_size"),
                   moe_ffn_hidden_size=hf.get("moe_intermediate_size", 7688),
                   moe_router_score_function="sigmoid", moe_router_dtype="fp32",
                   moe_router_enable_expert_bias=True)
        if hf.get("norm_topk_prob", True) != (k > 1):
            raise bad("norm_topk_prob", hf.get("norm_topk_prob", True), "sigmoid routing "
                      "renormalises the top-k weights exactly when top-k > 1 (Megatron's rule)")
        shared = hf.get("moe_shared_expert_intermediate_size", 7688)
        if shared and hf.get("n_shared_experts", 1):
            out["moe_shared_expert_intermediate_size"] = shared
        scale = float(hf.get("routed_scaling_factor", 1.0))
        if scale != 1.0:
            out["moe_router_topk_scaling_factor"] = scale
        if groups > 1 and group_topk < groups:
            out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                       moe_router_group_score_topk=HF_GROUP_SCORE_TOPK)
    return out


def _granite_hybrid(hf: dict) -> dict:
    """IBM Granite 4.0-H (granitemoehybrid): each layer a Mamba-2 or attention sublayer
    (layers_block_type), then an MoE sublayer of softmax-over-top-k experts beside an always-on
    shared MLP (shared_intermediate_size) or, without experts, that MLP alone; Granite's
    embedding, attention and residual multipliers and logits divisor; attention without
    positions unless position_embedding_type is rope."""
    types = hf.get("layers_block_type") or hf.get("layer_types") or []
    unknown = sorted(set(types) - set(_BLOCK_SYMBOLS))
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise bad("layers_block_type", types, f"expected {hf['num_hidden_layers']} entries of "
                  "linear_attention (Mamba) or full_attention")
    experts = hf.get("num_local_experts", 0) or 0
    ffn = "E" if experts else "-"
    pattern = "".join(_BLOCK_SYMBOLS[t] + ffn for t in types)
    if hf.get("attention_bias", False):
        raise bad("attention_bias", True, "biases on the attention projections are not built")
    attention = float(hf.get("attention_multiplier", 1.0))
    if attention <= 0:
        raise bad("attention_multiplier", attention, "must be positive")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    limit = [_json_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit[1] != float("inf"):
        raise bad("time_step_limit", limit, "an upper limit on the step size is not built")
    mamba = {"n_groups": hf.get("mamba_n_groups", 1), "ssm_state_size": hf.get("mamba_d_state"),
             "conv_kernel": hf.get("mamba_d_conv", 4), "chunk_size": hf.get("mamba_chunk_size"),
             "use_conv_bias": hf.get("mamba_conv_bias", True),
             "mamba_proj_bias": hf.get("mamba_proj_bias", False),
             "hidden_act": hf.get("hidden_act", "silu"),
             "layer_norm_epsilon": hf.get("rms_norm_eps", 1e-6)}
    pos = hf.get("position_embedding_type") or "none"
    if pos not in ("none", "nope", "rope"):
        raise bad("position_embedding_type", pos, "supported values are nope and rope")
    out = {**_hybrid_base({**hf, **mamba, "layer_norm_epsilon": mamba["layer_norm_epsilon"]},
                          pattern),
           **_mamba_fields({k: v for k, v in mamba.items() if v is not None},
                           hf.get("mamba_n_heads", 128), hf.get("mamba_d_head", 64), limit[0]),
           **_gated(hf), "num_attention_heads": heads, "kv_channels": hf["hidden_size"] // heads,
           "ffn_hidden_size": hf.get("shared_intermediate_size", 1024),
           "attention_dropout": float(hf.get("attention_dropout", 0.0)),
           "max_position_embeddings": hf.get("max_position_embeddings", 2048),
           "query_pre_attn_scalar": attention ** -2,
           "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
           "logits_scaling": float(hf.get("logits_scaling", 1.0))}
    if hf.get("embedding_multiplier", 1.0) != 1.0:
        out["embedding_multiplier"] = float(hf["embedding_multiplier"])
    if pos == "rope":
        out.update(position_embedding_type="rope", **_rope(hf))
    if kv != heads:
        out.update(group_query_attention=True, num_query_groups=kv)
    if experts:
        out.update(num_experts=experts, moe_router_topk=hf.get("num_experts_per_tok", 2),
                   moe_ffn_hidden_size=hf.get("intermediate_size", 11008),
                   moe_shared_expert_intermediate_size=hf.get("shared_intermediate_size", 1024))
    return out


def _mamba2(hf: dict) -> dict:
    """Mamba2 (pure Mamba-2 language models): every layer a Mamba-2 mixer behind an RMSNorm;
    num_heads x head_dim must be expand x hidden_size as the mixer's projections assume."""
    n, d = hf["num_hidden_layers"], hf["hidden_size"]
    heads, head_dim = hf.get("num_heads", 128), hf.get("head_dim", 64)
    if heads * head_dim != hf.get("expand", 2) * d:
        raise bad("num_heads", heads, f"num_heads x head_dim = {heads * head_dim} is not "
                  f"expand x hidden_size = {hf.get('expand', 2) * d}")
    limit = [_json_float(v) for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit[1] != float("inf"):
        raise bad("time_step_limit", limit, "an upper limit on the step size is not built")
    return {**_hybrid_base({"tie_word_embeddings": True, **hf}, "M" * n),
            **_mamba_fields(hf, heads, head_dim, limit[0]),
            "num_attention_heads": 1, "max_position_embeddings": 2048}


def _lfm2(hf: dict) -> dict:
    """LFM2 and LFM2-MoE: layer_types (or full_attn_idxs) mixes gated short convolutions
    (conv_L_cache wide, conv_bias) with attention (per-head q/k RMSNorms, RoPE); every layer
    has a SwiGLU FFN: LFM2's intermediate_size shrunk as block_auto_adjust_ff_dim says, or in
    LFM2-MoE the first num_dense_layers dense and the rest MoE (sigmoid scores with an expert
    bias, renormalised top-k times routed_scaling_factor)."""
    family, n = hf["model_type"], hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention" if i in set(hf.get("full_attn_idxs")
                                                                    or range(n)) else "conv"
                                      for i in range(n)]
    if len(types) != n or set(types) - {"conv", "full_attention"}:
        raise bad("layer_types", types, f"expected {n} entries of conv or full_attention")
    out = {**_rms_rope({**hf, "rms_norm_eps": hf.get("norm_eps", 1e-5)},
                       hf.get("max_position_embeddings", 128000), 1e-5),
           **_heads(hf), **_rope(hf), "swiglu": True, "qk_layernorm": True,
           "lfm_layer_types": list(types), "conv_L_cache": hf.get("conv_L_cache", 3),
           "conv_bias": bool(hf.get("conv_bias", False)),
           "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True)}
    if family == "lfm2":
        ff = hf.get("intermediate_size", 12288)
        if hf.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            multiplier, multiple = hf.get("block_ffn_dim_multiplier", 1.0), hf.get(
                "block_multiple_of", 256)
            if multiplier is not None:
                ff = multiple * ((int(multiplier * ff) + multiple - 1) // multiple)
        return {**out, "ffn_hidden_size": ff}
    k, dense = hf.get("num_experts_per_tok", 4), hf.get("num_dense_layers", 2)
    if hf.get("norm_topk_prob", True) != (k > 1):
        raise bad("norm_topk_prob", hf.get("norm_topk_prob", True), "sigmoid routing "
                  "renormalises the top-k weights exactly when top-k > 1 (Megatron's rule)")
    out.update(ffn_hidden_size=hf.get("intermediate_size", 7168),
               num_experts=hf.get("num_experts", 32), moe_router_topk=k,
               moe_ffn_hidden_size=hf.get("moe_intermediate_size", 1792),
               moe_layer_freq=[0] * dense + [1] * (n - dense) if dense else 1,
               moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=bool(hf.get("use_expert_bias", True)))
    scale = float(hf.get("routed_scaling_factor", 1.0))
    if scale != 1.0:
        out["moe_router_topk_scaling_factor"] = scale
    return out


def _llama4(hf: dict) -> dict:
    """Llama 4 (text): RoPE on interleaved pairs (Llama-3 scaling) except on the NoPE layers
    (no_rope_layers: 1 = RoPE), L2 q/k norms on the RoPE layers (use_qk_norm), chunked
    attention on them (attention_chunk_size), temperature tuning on the NoPE ones; MoE layers
    (moe_layers, or every interleave_moe_layer_step-th): the top-1 logit's sigmoid scales the
    token before its expert, plus a shared expert; dense layers are intermediate_size_mlp
    wide."""
    n = hf["num_hidden_layers"]
    if hf.get("attention_bias", False):
        raise bad("attention_bias", True, "biases on the attention projections alone are not "
                  "built (add_bias_linear gives the MLPs biases too)")
    rope_on = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4)
                                               != 0) for i in range(n)]
    if len(rope_on) < n:
        raise bad("no_rope_layers", rope_on, f"needs an entry per layer ({n})")
    rope_on = [bool(v) for v in rope_on[:n]]
    chunk = hf.get("attention_chunk_size", 8192)
    derived = ["chunked_attention" if on and chunk is not None else "full_attention"
               for on in rope_on]
    if hf.get("layer_types") and list(hf["layer_types"]) != derived:
        raise bad("layer_types", hf["layer_types"], "jaxtrain chunks the attention of exactly "
                  f"the RoPE layers (as Llama 4 derives it): {derived}")
    qk = bool(hf.get("use_qk_norm", True))
    out = {**_rms_rope(hf, hf.get("max_position_embeddings", 131072), 1e-5), **_heads(hf),
           **_gated(hf), **_rope(hf), "rotary_interleaved": True,
           "ffn_hidden_size": hf.get("intermediate_size_mlp", 16384),
           "qk_l2_norm": qk, "qk_norm_rope_layers_only": qk}
    if not all(rope_on):
        out["no_rope_freq"] = [int(not on) for on in rope_on]
        if hf.get("attn_temperature_tuning", True):
            out.update(temperature_tuning=True,
                       temperature_tuning_scale=float(hf.get("attn_scale", 0.1)),
                       temperature_tuning_floor_scale=float(hf.get("floor_scale", 8192)))
    if chunk is not None and any(rope_on):
        out["chunk_attn_window_size"] = int(chunk)
    step = hf.get("interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    moe = set(range(step - 1, n, step) if moe is None else moe)
    pattern = [int(i in moe) for i in range(n)]
    if not any(pattern):
        return out
    k = hf.get("num_experts_per_tok", 1)
    if k != 1:
        raise bad("num_experts_per_tok", k, "jaxtrain scales a token by its routing weight "
                  "before the expert with top-1 routing only (Megatron's "
                  "moe_apply_probs_on_input)")
    width = hf.get("intermediate_size", 8192)
    out.update(num_experts=hf.get("num_local_experts", 16), moe_router_topk=1,
               moe_ffn_hidden_size=width, moe_layer_freq=1 if all(pattern) else pattern,
               moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
               moe_apply_probs_on_input=True, moe_shared_expert_intermediate_size=width)
    return out


def text_config(hf: dict) -> dict:
    """The text model's config.json of a vision-language checkpoint (:data:`TEXT_OF`): its
    text_config, with the top level's tie_word_embeddings when the text part has none."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise bad("text_config", None, f"a {hf['model_type']} checkpoint describes its language "
                  "model in text_config, and this one has none")
    text = {**TEXT_DEFAULTS.get(hf["model_type"], {}), **text,
            "model_type": TEXT_OF[hf["model_type"]]}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


_TRANSLATIONS: dict[str, Callable[[dict], dict]] = {
    **{f: _llama for f in LLAMA_LIKE + MOE}, "phi3": _phi3, "smollm3": _smollm3,
    "granite": _granite, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32, "glm_moe_dsa": _glm_moe_dsa,
    "deepseek_v4": _deepseek_v4,
    "kimi_linear": _kimi_linear,
    "gpt_oss": _gpt_oss, **{f: _gemma for f in GEMMA}, **{f: _olmo for f in OLMO},
    **{f: _hybrid for f in HYBRID}, "llama4_text": _llama4, "gemma4_text": _gemma4,
    "nemotron_h": _nemotron_h, "mamba2": _mamba2, "lfm2": _lfm2, "lfm2_moe": _lfm2,
    "granitemoehybrid": _granite_hybrid,
    **{f: (lambda hf: knobs(text_config(hf))) for f in TEXT_OF}}
assert set(_TRANSLATIONS) == set(FAMILIES)


# ---------------------------------------------------------------- the model of a config file

def model_knobs(name: str) -> tuple[pathlib.Path, dict]:
    """(model directory, knob values) for ``model.name_or_path`` = ``name``; ConfigError naming
    the key for a name with no local config.json or an architecture jaxtrain cannot build."""
    path = locate(name)
    hf = read(path)
    try:
        return path, knobs(hf)
    except (ValueError, KeyError, TypeError) as e:
        what = f"field {e} is missing" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{KEY} = {name!r} ({path / 'config.json'}, model_type "
                          f"{hf.get('model_type')!r}): {what}") from None

