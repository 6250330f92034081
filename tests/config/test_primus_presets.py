"""Primus's own Megatron model presets resolve to the published models (parameter counts from
abstract shapes, and the architecture switches), read from a Primus checkout in
``$JAXTRAIN_UPSTREAM/primus``.

The vocabulary is each family's published one (the presets take it from a Hugging Face
tokenizer the test cannot download). Where Primus's preset itself differs from the published
model, the test pins what the preset builds and says how it differs:
- qwen2.5_*: no q/k/v biases (qwen2.5_base.yaml sets no add_qkv_bias);
- qwen3_4B/8B/14B/32B: no QK-norm (they extend qwen2.5_base.yaml), and qwen3_32B lacks
  kv_channels: 128 (64 heads of 80 channels: 30.5B instead of 32.8B);
- llama3.2_1B/3B: untied embeddings (llama_base.yaml unties them);
- gpt_oss_20B/120B: Primus's proxy (a shared expert, no sinks, a DeepSeek tokenizer).
"""
import math
import os
import pathlib

import jax
import pytest

from jaxtrain.config import load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models.config import assumed_accelerator
from jaxtrain.models.params import abstract

UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
PRIMUS = UPSTREAM / "primus"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PRIMUS / "primus" / "configs").is_dir(),
                                 reason="needs a Primus checkout in $JAXTRAIN_UPSTREAM/primus")]

# preset, published vocabulary, published parameters (model cards / papers), switches
PUBLISHED = [
    ("llama2_7B", 32000, 6.74e9, "llama"), ("llama2_13B", 32000, 13.02e9, "llama"),
    ("llama2_70B", 32000, 68.98e9, "llama"), ("llama3_8B", 128256, 8.03e9, "llama"),
    ("llama3.1_8B", 128256, 8.03e9, "llama"), ("llama3_70B", 128256, 70.55e9, "llama"),
    ("llama3.1_70B", 128256, 70.55e9, "llama"), ("llama3.3_70B", 128256, 70.55e9, "llama"),
    ("llama3.1_405B", 128256, 405.85e9, "llama"),
    ("mixtral_8x7B_v0.1", 32000, 46.70e9, "mixtral"),
    ("mixtral_8x22B_v0.1", 32000, 140.62e9, "mixtral"),
    ("deepseek_v2_lite", 102400, 15.7e9, "deepseek"), ("deepseek_v2", 102400, 236e9, "deepseek"),
    ("deepseek_v3", 129280, 671e9, "deepseek"),
    ("qwen2.5_7B", 151936, 7.62e9, "qwen"), ("qwen2.5_14B", 151936, 14.77e9, "qwen"),
    ("qwen2.5_32B", 151936, 32.76e9, "qwen"), ("qwen2.5_72B", 151936, 72.71e9, "qwen"),
    ("qwen3_8B", 151936, 8.19e9, "qwen"), ("qwen3_14B", 151936, 14.77e9, "qwen"),
    ("qwen3_30B_A3B", 151936, 30.53e9, "qwen3_moe"),
    ("qwen3_235B_A22B", 151936, 235.09e9, "qwen3_moe"),
    ("kimi_k2", 163840, 1.026e12, "deepseek"), ("grok1", 131072, 314e9, "grok"),
]
# Presets that differ from the published model (module docstring): the exact count they build.
PRIMUS_OWN = [("qwen3_32B", 151936, 30_497_182_720), ("llama3.2_1B", 128256, 1_498_482_688),
              ("llama3.2_3B", 128256, 3_606_752_256), ("qwen2.5_3B", 151936, 3_397_011_456),
              ("gpt_oss_20B", 201088, 21_505_127_232)]


def build(preset, vocab, tmp_path) -> ModelConfig:
    exp = PRIMUS / "examples" / "megatron" / "configs" / f"_jaxtrain_probe_{os.getpid()}.yaml"
    exp.write_text(f"modules:\n  pre_trainer:\n    framework: megatron\n    config: "
                   f"pre_trainer.yaml\n    model: {preset}.yaml\n    overrides: "
                   f"{{train_iters: 100, make_vocab_size_divisible_by: 1}}\n")
    try:
        cfg = load_config(exp, enforce_status=False)
    finally:
        exp.unlink()
    with assumed_accelerator("cpu"):
        return ModelConfig.from_config({**cfg, "vocab_size": vocab})


def count(model: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract(model)))


@pytest.mark.parametrize("preset, vocab, params, family", PUBLISHED,
                         ids=[p[0] for p in PUBLISHED])
def test_preset_has_the_published_size_and_switches(preset, vocab, params, family, tmp_path):
    m = build(preset, vocab, tmp_path)
    assert count(m) == pytest.approx(params, rel=0.01)
    assert (m.activation, m.gated_linear_unit, m.normalization) == ("silu", True, "RMSNorm")
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert m.position_embedding_type == "rope"
    if family == "mixtral":
        assert (m.moe.num_experts, m.moe.topk) == (8, 2)
    if family == "deepseek":
        assert m.multi_latent_attention and m.moe is not None and m.qk_layernorm
    if family == "qwen3_moe":
        assert m.qk_layernorm and m.moe.num_experts == 128 and m.moe.topk == 8
    if family == "llama" and preset.startswith("llama3"):
        assert m.num_query_groups == 8


@pytest.mark.parametrize("preset, vocab, params", PRIMUS_OWN, ids=[p[0] for p in PRIMUS_OWN])
def test_presets_that_differ_from_the_published_model_build_what_they_say(preset, vocab,
                                                                           params, tmp_path):
    assert count(build(preset, vocab, tmp_path)) == params
