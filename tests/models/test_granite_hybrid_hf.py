"""IBM Granite 4.0-H (granitemoehybrid) against transformers: logits (fp32, tiny random configs
with wider-than-init weights), from_hf / to_hf round trips that load in transformers, greedy
decode: Mamba-2 and attention layers, each followed by MoE experts beside a shared MLP (or the
shared MLP alone), Granite's multipliers, attention without positions or with RoPE."""
import pytest
import transformers as tr
from model_helpers import VOCAB
from test_hf import check_greedy_decode, check_parity_and_round_trip
from test_nemotron_h_hf import mamba_model

_BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64, intermediate_size=24, shared_intermediate_size=40,
             num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=8,
             mamba_n_groups=2, mamba_d_state=6, mamba_chunk_size=8, embedding_multiplier=3.0,
             attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5,
             num_hidden_layers=3, layers_block_type=["mamba", "attention", "mamba"])
CASES = {
    "granite_hybrid_moe": (tr.GraniteMoeHybridConfig, tr.GraniteMoeHybridForCausalLM, _BASE),
    "granite_hybrid_dense_rope": (
        tr.GraniteMoeHybridConfig, tr.GraniteMoeHybridForCausalLM,
        {**_BASE, "num_local_experts": 0, "position_embedding_type": "rope",
         "tie_word_embeddings": True}),
}


def _model(case, path, seed=0):
    """test_hf's random weights with realistic Mamba decays (test_nemotron_h_hf.py)."""
    return mamba_model(case, path, seed, CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert cfg.hybrid_layers in ("MEEEME".replace("EEE", "E*E"), "M-*-M-")
    assert cfg.residual_multiplier == 0.6 and cfg.logits_scaling == 2.5


def test_greedy_decode(tmp_path):
    check_greedy_decode(_model("granite_hybrid_moe", tmp_path), tmp_path)
