"""NemotronH (Megatron's hybrid stack) and Mamba2 against transformers: logits (fp32, tiny random
configs with wider-than-init weights), from_hf / to_hf round trips that load in transformers,
greedy decode, packed sequences, and the Mamba knobs flipped."""
import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import (VOCAB, check_left_padded_decode, check_packed_sequences, max_diff,
                           random_params, tokens)
from test_hf import _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.models import ModelConfig, forward, from_hf

_MAMBA = dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=6, conv_kernel=4,
              chunk_size=8)
_NH = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
           layer_norm_epsilon=1e-5, **_MAMBA)
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            moe_shared_expert_intermediate_size=20, n_group=1, topk_group=1,
            routed_scaling_factor=1.5, norm_topk_prob=True)
CASES = {
    "nemotron_h": (tr.NemotronHConfig, tr.NemotronHForCausalLM,
                   {**_NH, "layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba"]}),
    "nemotron_h_moe": (
        tr.NemotronHConfig, tr.NemotronHForCausalLM,
        {**_NH, **_MOE,
         "layers_block_type": ["mamba", "moe", "attention", "moe", "mamba", "mlp"]}),
    # Nemotron 3 Super/Ultra: the routed experts work in a narrower latent space
    "nemotron_h_latent_moe": (
        tr.NemotronHConfig, tr.NemotronHForCausalLM,
        {**_NH, **_MOE, "moe_latent_size": 12,
         "layers_block_type": ["mamba", "moe", "attention", "moe"]}),
    # transformers never ties NemotronH's output layer, whatever the config says
    "nemotron_h_tie_flag": (tr.NemotronHConfig, tr.NemotronHForCausalLM,
                            {**_NH, "tie_word_embeddings": True,
                             "layers_block_type": ["mamba", "attention", "mlp"]}),
    "mamba2": (tr.Mamba2Config, tr.Mamba2ForCausalLM,
               dict(hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, n_groups=2,
                    state_size=6, conv_kernel=4, chunk_size=8, vocab_size=VOCAB, expand=2,
                    layer_norm_epsilon=1e-5, tie_word_embeddings=False)),
    "mamba2_tied_floor": (tr.Mamba2Config, tr.Mamba2ForCausalLM,
                          dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                               n_groups=1, state_size=6, conv_kernel=3, chunk_size=8,
                               vocab_size=VOCAB, expand=2, layer_norm_epsilon=1e-5,
                               time_step_limit=(0.3, float("inf")))),
}


def _model(case, path, seed=0):
    """The randomized model of ``case`` saved to ``path`` (:func:`mamba_model`)."""
    return mamba_model(case, path, seed, CASES)


def mamba_model(case, path, seed, cases):
    """test_hf's randomized model (N(0, 0.3) weights, norms around 1) of ``cases[case]`` saved
    to ``path``, with each Mamba decay log A_log redrawn in [0, 2] and the step bias dt_bias in
    [-2, 1] (realistic decays: random signs would make some states grow without bound)."""
    model = _hf_model(case, path, seed, cases)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) * 3 - 2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    model = _model(case, tmp_path / "hf")
    cfg = check_parity_and_round_trip(model, tmp_path)
    assert len(cfg.hybrid_layers) == cfg.num_layers and "M" in cfg.hybrid_layers


@pytest.mark.parametrize("case", ["nemotron_h", "mamba2"])
def test_greedy_decode(case, tmp_path):
    check_greedy_decode(_model(case, tmp_path), tmp_path)


def test_packed_sequences_reset_the_state(tmp_path):
    """Two documents packed in one row give each document's logits as if run alone: the
    convolution and the scan start afresh at a segment boundary."""
    _model("nemotron_h", tmp_path)
    cfg, params = from_hf(tmp_path)
    check_packed_sequences(params, cfg)


@pytest.mark.parametrize("knob, value", [("mamba_state_dim", 4), ("mamba_head_dim", 4),
                                         ("mamba_num_groups", 4), ("mamba_num_heads", 4),
                                         ("mamba_conv_kernel_dim", 2),
                                         ("mamba_norm_epsilon", 1.0),
                                         ("mamba_dt_floor", 0.5), ("hybrid_layers", "M*-M")])
def test_mamba_fields_change_the_model(knob, value):
    """Each Mamba field flipped changes the logits (or the parameter shapes)."""
    base = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       hybrid_layers="M-*M", position_embedding_type="none", mamba_state_dim=8,
                       mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4)
    other = ModelConfig(**{**base.__dict__, knob: value})
    toks = tokens()
    p0, p1 = random_params(base), random_params(other)
    shapes = jax.tree.map(np.shape, p0) != jax.tree.map(np.shape, p1)
    assert shapes or max_diff(forward(p0, toks, base), forward(p1, toks, other)) > 1e-3


def test_chunk_size_does_not_change_the_model():
    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       hybrid_layers="M-", position_embedding_type="none", mamba_state_dim=8,
                       mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4)
    p = random_params(base)
    ref = forward(p, tokens(), base)
    for chunk in (3, 16, 64):
        other = ModelConfig(**{**base.__dict__, "mamba_chunk_size": chunk})
        assert max_diff(forward(p, tokens(), other), ref) <= 1e-5


@pytest.mark.slow
def test_left_padded_prompts_decode_as_alone(tmp_path):
    _model("nemotron_h", tmp_path)
    cfg, params = from_hf(tmp_path)
    check_left_padded_decode(params, cfg)
