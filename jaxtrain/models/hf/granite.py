"""IBM Granite (3.x, model_type granite): the Llama layout (llama.py's tensors) with four
scalars: embeddings times ``embedding_multiplier``, attention scores times
``attention_multiplier`` (jaxtrain's query_pre_attn_scalar = multiplier^-2), each sublayer's
output times ``residual_multiplier`` before its residual add, logits divided by
``logits_scaling``."""
from __future__ import annotations

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import llama
from jaxtrain.models.hf.common import Adapter

ARCHITECTURES = {"granite": "GraniteForCausalLM"}


def picks(cfg: ModelConfig) -> str | None:
    scaled = cfg.residual_multiplier != 1.0 or cfg.logits_scaling != 1.0
    return "granite" if scaled and not cfg.apply_layernorm_1p else None


def problems(cfg: ModelConfig, family: str = "granite") -> dict:
    out = llama.problems(cfg, family, style="llama")
    out.update(embedding_multiplier=False, query_pre_attn_scalar=False,
               residual_multiplier=False, logits_scaling=False)
    return out


def config(cfg: ModelConfig, family: str = "granite") -> dict:
    out = llama.config(cfg, family, style="llama")
    out.update(embedding_multiplier=cfg.embedding_multiplier or 1.0,
               attention_multiplier=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
               residual_multiplier=cfg.residual_multiplier, logits_scaling=cfg.logits_scaling)
    return out


# tensors as llama.py reads and writes them (its names and layout)
ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=llama.params,
                  problems=problems, config=config, tensors=llama.tensors)
