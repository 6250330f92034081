"""Decoder-only LMs as pure functions over parameter pytrees: dense or mixture-of-experts
layers, grouped-query or multi-latent attention; with HF import/export and KV-cached generation.

    config      ModelConfig (the architecture; research code builds one by hand)
    from_knobs  the flat knobs -> ModelConfig translation (ModelConfig.from_config)
    params      parameter declarations -> abstract shapes, logical axes, init
    transformer forward / hidden_states / logits_head: the decoder stack
    attention, mla, layers, moe, remat, quant_state, spec: its parts
    decode      KV-cached prefill, decode_step and generate
    hf          Hugging Face checkpoints in and out
"""
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decode import decode_step, generate, init_cache, prefill
from jaxtrain.models.hf import from_hf, to_hf
from jaxtrain.models.params import abstract, init, logical_axes, param_specs
from jaxtrain.models.transformer import forward

__all__ = ["ModelConfig", "abstract", "decode_step", "forward", "from_hf", "generate", "init",
           "init_cache", "logical_axes", "param_specs", "prefill", "to_hf"]
