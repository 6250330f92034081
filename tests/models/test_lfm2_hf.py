"""LFM2 and LFM2-MoE against transformers: logits (fp32, tiny random configs with
wider-than-init weights), from_hf / to_hf round trips that load in transformers, greedy decode,
packed sequences, and the short-convolution fields flipped."""
import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import (VOCAB, check_left_padded_decode, check_packed_sequences, max_diff,
                           random_params, tiny, tokens)
from test_hf import _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.models import forward, from_hf

_BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, conv_L_cache=3,
             layer_types=["conv", "full_attention", "conv", "conv"])
CASES = {
    "lfm2": (tr.Lfm2Config, tr.Lfm2ForCausalLM,
             {**_BASE, "intermediate_size": 96, "block_multiple_of": 16}),
    "lfm2_bias_untied": (tr.Lfm2Config, tr.Lfm2ForCausalLM,
                         {**_BASE, "intermediate_size": 48, "block_auto_adjust_ff_dim": False,
                          "conv_bias": True, "tie_word_embeddings": False}),
    "lfm2_moe": (tr.Lfm2MoeConfig, tr.Lfm2MoeForCausalLM,
                 {**_BASE, "intermediate_size": 48, "moe_intermediate_size": 24,
                  "num_experts": 4, "num_experts_per_tok": 2, "num_dense_layers": 1,
                  "routed_scaling_factor": 1.5}),
}


def _model(case, path, seed=0):
    """The randomized model of ``case`` saved to ``path`` (test_hf's weights; an MoE model's
    expert bias buffer drawn too, so that it matters)."""
    model = _hf_model(case, path, seed, CASES)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert cfg.short_conv_layers == (True, False, True, True) and cfg.qk_layernorm


@pytest.mark.parametrize("case", ["lfm2", "lfm2_moe"])
def test_greedy_decode(case, tmp_path):
    check_greedy_decode(_model(case, tmp_path), tmp_path)


def test_packed_sequences_do_not_mix(tmp_path):
    _model("lfm2", tmp_path)
    cfg, params = from_hf(tmp_path)
    check_packed_sequences(params, cfg)


@pytest.mark.parametrize("field, value", [("short_conv_kernel", 2), ("short_conv_bias", True),
                                          ("short_conv_layers", (True, True))])
def test_short_conv_fields_change_the_model(field, value):
    base = tiny(short_conv_layers=(True, False))
    other = base.replace(**{field: value})
    p0, p1 = random_params(base), random_params(other)
    shapes = jax.tree.map(np.shape, p0) != jax.tree.map(np.shape, p1)
    assert shapes or max_diff(forward(p0, tokens(), base), forward(p1, tokens(), other)) > 1e-3


def test_left_padded_prompts_decode_as_alone(tmp_path):
    _model("lfm2", tmp_path)
    cfg, params = from_hf(tmp_path)
    check_left_padded_decode(params, cfg)
