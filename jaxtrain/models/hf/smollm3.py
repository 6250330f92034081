"""SmolLM3: the Llama layout (llama.py's tensors) with NoPE layers (``no_rope_layers``: 1 =
RoPE, by default every fourth layer without) and, with ``use_sliding_window``, a sliding window
on the NoPE layers."""
from __future__ import annotations

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import llama
from jaxtrain.models.hf.common import Adapter

ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}


def picks(cfg: ModelConfig) -> str | None:
    llama_like = not (cfg.rotary_interleaved or cfg.attention_chunk_size or cfg.moe
                      or cfg.qk_l2_norm or cfg.qk_layernorm)
    return "smollm3" if cfg.no_rope_layers is not None and llama_like else None


def _windows_on_nope(cfg: ModelConfig) -> bool:
    """The model's sliding window sits on exactly its NoPE layers (or there is none)."""
    if cfg.sliding_window is None:
        return True
    layers = cfg.sliding_window_layers or (True,) * cfg.num_layers
    return tuple(layers) == tuple(cfg.is_nope(i) for i in range(cfg.num_layers))


def problems(cfg: ModelConfig, family: str = "smollm3") -> dict:
    out = llama.problems(cfg, family, style="llama")
    out.update(no_rope_layers=False, sliding_window=not _windows_on_nope(cfg),
               sliding_window_layers=not _windows_on_nope(cfg),
               attn_temperature_tuning=cfg.attn_temperature_tuning)
    return out


def config(cfg: ModelConfig, family: str = "smollm3") -> dict:
    out = llama.config(cfg, family, style="llama")
    nope = [cfg.is_nope(i) for i in range(cfg.num_layers)]
    window = cfg.sliding_window is not None
    out.update(no_rope_layers=[int(not n) for n in nope], use_sliding_window=window,
               sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if window and n else "full_attention"
                            for n in nope])
    return out


# tensors as llama.py reads and writes them (its names and layout)
ADAPTER = Adapter(architectures=ARCHITECTURES, picks=picks, params=llama.params,
                  problems=problems, config=config, tensors=llama.tensors)
