"""Hugging Face checkpoints: ``from_hf`` reads, ``to_hf`` writes (config.json + safetensors).

Families, one adapter module each (see :class:`common.Adapter`):

- llama.py: Llama (2, 3.x with llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv
  bias), Qwen3 (qk norm);
- moe.py: Mixtral and Qwen3-MoE (router + experts [E, ...], dense layers where Qwen3-MoE's
  mlp_only_layers/decoder_sparse_step say);
- gpt2.py: GPT-2 (learned positions, LayerNorm, biases, Conv1D weights stored [in, out]);
- gpt_neox.py: GPT-NeoX / Pythia (parallel layers, partial RoPE, per-head fused q/k/v);
- phi3.py: Phi-3 / Phi-4 (the Llama layout with fused q/k/v and gate/up, partial RoPE);
- smollm3.py: SmolLM3 (the Llama layout with NoPE layers, windows on them optionally);
- granite.py: IBM Granite 3.x (the Llama layout with embedding/attention/residual/logit scalars);
- deepseek_v3.py: DeepSeek-V3 (multi-latent attention with YaRN; dense layers first, then MoE
  layers with group-limited sigmoid routing, e_score_correction_bias and a shared expert);
- deepseek_v4.py: DeepSeek-V4 (compressed sparse / heavily compressed attention beside a
  sliding window, hyper-connections, hash-routed leading MoE layers, clamped SwiGLU);
- gpt_oss.py: gpt-oss (sinks, alternating sliding windows, biases, YaRN; biased router and
  clamped-GLU experts with biases);
- gemma.py: Gemma, Gemma 2, Gemma 3 text ((1 + w) norms, embedding scale, sandwich norms,
  soft-capping, local/global layers with their own RoPE bases), and the text model of the
  vision-language Gemma 3 checkpoints;
- olmo.py: OLMo 2 and OLMo 3 (norms on the sublayer outputs only, q/k norms across heads,
  OLMo 3's sliding-window layers);
- qwen3_next.py: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text models (Gated DeltaNet layers
  between gated full-attention layers; MoE with a gated shared expert);
- kimi_linear.py: Kimi Linear (Kimi Delta Attention layers between multi-latent attention
  layers without RoPE; DeepSeek-V3-routed MoE);
- llama4.py: Llama 4 text (NoPE layers, chunked attention, L2 q/k norms, temperature tuning;
  interleaved MoE layers of a sigmoid top-1 router scaling the expert input, a shared expert);
- gemma4.py: Gemma 4 text (global layers with their own heads, keys as values, proportional
  RoPE, value norms, layer scalars; the MoE layer's parallel dense MLP and experts);
- granite_hybrid.py: IBM Granite 4.0-H (Mamba-2 or attention, then MoE beside a shared MLP);
- lfm2.py: LFM2 and LFM2-MoE (gated short convolutions between attention layers);
- nemotron_h.py: NemotronH and Mamba2 (Megatron's hybrid stack of single sublayers: Mamba-2
  mixers, attention without positions, squared-ReLU MLPs and MoE layers).

config.json -> ModelConfig goes through jaxtrain's knobs: ``config_from_hf`` is
``ModelConfig.from_config`` of the knob values jaxtrain/config/dialects/hf.py translates the
file into, the same values a pgs run naming the model (``model.name_or_path``) resolves to.
A config.json value these models cannot reproduce raises ``ValueError`` naming the field; a
checkpoint tensor that nothing consumes raises too. Neither direction needs torch.

Adding a family: a module with an ``ADAPTER`` listed in :data:`ADAPTERS`, and its translation
in config/dialects/hf.py.
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxtrain.config.dialects import hf as translation
from jaxtrain.config.dialects.hf import HF_GROUP_SCORE_TOPK  # noqa: F401  (re-exported)
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import (deepseek_v3, deepseek_v4, gemma, gemma4, gpt2, gpt_neox,
                                gpt_oss, granite, granite_hybrid, kimi_linear, lfm2, llama, llama4,
                                moe, nemotron_h, olmo, phi3, qwen3_next, smollm3)
from jaxtrain.models.hf.common import Adapter, Tensors, check, common_config, read_tensors
from jaxtrain.models.params import abstract

# In the order hf_family asks them which family reproduces a config most directly.
ADAPTERS: tuple[Adapter, ...] = (granite_hybrid.ADAPTER, nemotron_h.ADAPTER, lfm2.ADAPTER,
                                 kimi_linear.ADAPTER, qwen3_next.ADAPTER,
                                 smollm3.ADAPTER, llama4.ADAPTER, gemma4.ADAPTER,
                                 deepseek_v4.ADAPTER, deepseek_v3.ADAPTER,
                                 gpt_oss.ADAPTER, moe.ADAPTER,
                                 gpt2.ADAPTER, gpt_neox.ADAPTER, gemma.ADAPTER, olmo.ADAPTER,
                                 phi3.ADAPTER, granite.ADAPTER, llama.ADAPTER)
_BY_FAMILY = {family: a for a in ADAPTERS for family in a.families}
FAMILIES = tuple(f for f in translation.FAMILIES if f in _BY_FAMILY)
assert set(FAMILIES) == set(_BY_FAMILY), "every adapter family needs its config translation"

# What config_from_hf assumes of the run beyond config.json: float32 compute and weights, the
# plain-XLA attention (eager), embeddings looked up by a gather (as HF does). The other knobs
# take the registry's defaults. ``overrides`` replace any of them.
RUN_KNOBS = {"dtype": "float32", "weight_dtype": "float32", "model.attn_implementation": "eager",
             "use_iota_embed": False}


def adapter(family: str) -> Adapter:
    """The adapter of ``family`` (config.json's model_type)."""
    if family not in _BY_FAMILY:
        raise ValueError(f"family={family!r}: supported families are {FAMILIES}")
    return _BY_FAMILY[family]


# ---------------------------------------------------------------- config.json -> ModelConfig

def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig for an HF config.json dict; ``overrides`` replace fields (e.g. dtype)."""
    cfg = ModelConfig.from_config({**RUN_KNOBS, **translation.knobs(hf)})
    return cfg.replace(**overrides) if overrides else cfg


def from_hf(path, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from a local HF directory (config.json + *.safetensors)."""
    path = pathlib.Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf, **overrides)
    t = Tensors(read_tensors(path))
    params = adapter(hf["model_type"]).params(t, cfg, hf)
    t.done()
    # Leaves take their declared dtype: weight_dtype, but fp32 for sink logits.
    return cfg, jax.tree.map(lambda a, s: jnp.asarray(np.asarray(a, s.dtype)), params,
                             abstract(cfg))


# ---------------------------------------------------------------- export

def hf_family(cfg: ModelConfig) -> str:
    """The HF family that reproduces ``cfg`` most directly."""
    for candidate in ADAPTERS:
        family = candidate.picks(cfg)
        if family is not None:
            return family
    raise AssertionError("the Llama adapter picks every config")


def check_exportable(cfg: ModelConfig, family: str):
    """ValueError naming the ModelConfig fields ``family`` has no equivalent for (no family
    jaxtrain writes has hyper-connections' several residual streams, Gated DeltaNet without
    its convolution, MaxText's learned score bias, its qwen3_custom_moe layer or its default
    block's shared norm, Kimi K3's changes or quantile balancing's bias; only NemotronH has a
    latent MoE)."""
    m = cfg.moe
    latent = m is not None and bool(m.latent_size) and family != "nemotron_h"
    check({"hc_streams": cfg.hc_streams > 1, "moe.latent_size": latent,
           "moe.score_bias": m is not None and m.score_bias,
           "moe.quantile_balancing": m is not None and m.quantile_balancing,
           "moe.latent_norm": m is not None and m.latent_norm,
           "attn_res_block_size": bool(cfg.attn_res_block_size),
           "kda_gate_lower_bound": cfg.kda_gate_lower_bound is not None,
           "kda_full_rank_gate": cfg.kda_full_rank_gate,
           "kda_decay_rank": cfg.kda_decay_rank not in (None, cfg.linear_key_head_dim),
           "kda_gate_bias": cfg.kda_gate_bias,
           "situ_beta": cfg.situ_beta is not None,
           "attention_output_dim": cfg.attention_output_dim is not None,
           "parallel_shared_norm": cfg.parallel_shared_norm,
           "linear_short_conv": not cfg.linear_short_conv,
           **adapter(family).problems(cfg, family)}, family)


_check_exportable = check_exportable   # the name checkpoint.py and older callers use


def hf_config(cfg: ModelConfig, family: str | None = None) -> dict:
    """The config.json dict for ``cfg`` in ``family`` (default :func:`hf_family`)."""
    family = family or hf_family(cfg)
    chosen = adapter(family)
    check_exportable(cfg, family)
    return {**common_config(cfg, family, chosen.architectures[family]),
            **chosen.config(cfg, family)}


def _hf_tensors(params: dict, cfg: ModelConfig, family: str) -> dict[str, np.ndarray]:
    """The checkpoint tensors of ``params`` in ``family``'s layout (host arrays)."""
    return adapter(family).tensors(params, cfg, family)


def to_hf(params: dict, cfg: ModelConfig, path, family: str | None = None) -> pathlib.Path:
    """Write config.json + model.safetensors that ``AutoModelForCausalLM`` loads.

    Exact conversions: zero-centred norm scales (apply_layernorm_1p) are written as 1 + scale;
    interleaved RoPE is written as HF's half-split layout by permuting q/k channels.
    """
    family = family or hf_family(cfg)
    config = hf_config(cfg, family)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(jax.device_get(params), cfg, family)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


__all__ = ["ADAPTERS", "adapter", "FAMILIES", "HF_GROUP_SCORE_TOPK", "RUN_KNOBS",
           "check_exportable", "config_from_hf", "from_hf", "hf_config", "hf_family", "to_hf"]
