"""Phi-3 / Phi-4 (model_type phi3) against transformers: logits (fp32, tiny random configs) with
partial RoPE and a sliding window, fused q/k/v and gate/up tensors in and out, round trips that
load in transformers, greedy decode; LongRoPE refused by name."""
import pytest
import transformers as tr
from model_helpers import VOCAB
from test_hf import _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.models.hf import config_from_hf, hf_config

_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
             pad_token_id=0, eos_token_id=1, bos_token_id=1)
CASES = {
    "phi4_mini_like": (tr.Phi3Config, tr.Phi3ForCausalLM, {
        **_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                                     "partial_rotary_factor": 0.75},
        "tie_word_embeddings": True}),
    "phi3_mini_window": (tr.Phi3Config, tr.Phi3ForCausalLM, {**_BASE, "sliding_window": 5}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    model = _hf_model(case, tmp_path / "hf", cases=CASES)
    cfg = check_parity_and_round_trip(model, tmp_path)
    want = CASES[case][2].get("rope_parameters", {}).get("partial_rotary_factor", 1.0)
    assert cfg.rotary_percent == want and cfg.head_dim == 8


def test_greedy_decode_matches_transformers(tmp_path):
    check_greedy_decode(_hf_model("phi4_mini_like", tmp_path / "hf", cases=CASES),
                        tmp_path / "hf")


def test_longrope_and_mismatched_dropouts_are_refused():
    hf = {**CASES["phi3_mini_window"][2], "model_type": "phi3"}
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        config_from_hf({**hf, "rope_parameters": {"rope_type": "longrope", "short_factor": [1],
                                                  "long_factor": [1], "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="embd_pdrop"):
        config_from_hf({**hf, "resid_pdrop": 0.1, "embd_pdrop": 0.0})


def test_partial_rotary_llama_layout_exports_as_phi3():
    """A Llama-layout model rotating part of each head has no Llama checkpoint; Phi-3's holds
    it."""
    from model_helpers import tiny
    out = hf_config(tiny(rotary_percent=0.5))
    assert out["model_type"] == "phi3"
    assert out["rope_parameters"]["partial_rotary_factor"] == 0.5
