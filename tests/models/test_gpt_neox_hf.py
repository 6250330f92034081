"""GPT-NeoX (Pythia) against transformers: logits (fp32, tiny random configs with wider-than-init
weights) with the parallel layer and without, partial RoPE, from_hf / to_hf round trips that
load in transformers, greedy decode, and the parallel_residual knob flipped."""
import jax
import pytest
import transformers as tr
from model_helpers import VOCAB, max_diff, tokens
from test_hf import _hf_logits, _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.config.dialects import hf as translation
from jaxtrain.models import ModelConfig, forward, from_hf
from jaxtrain.models.hf import RUN_KNOBS

_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             vocab_size=VOCAB, max_position_embeddings=64,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                              "partial_rotary_factor": 0.25})
CASES = {
    "pythia_parallel": (tr.GPTNeoXConfig, tr.GPTNeoXForCausalLM, _BASE),
    "sequential_tied_gelu_new": (tr.GPTNeoXConfig, tr.GPTNeoXForCausalLM,
                                 {**_BASE, "use_parallel_residual": False,
                                  "tie_word_embeddings": True, "hidden_act": "gelu_new"}),
}


def _logits(params, cfg, toks):
    return jax.jit(lambda p, x: forward(p, x, cfg))(params, toks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    model = _hf_model(case, tmp_path / "hf", cases=CASES)
    cfg = check_parity_and_round_trip(model, tmp_path)
    assert cfg.parallel_residual == CASES[case][2].get("use_parallel_residual", True)
    assert cfg.rotary_dim == 2 and cfg.normalization == "LayerNorm"


def test_parallel_residual_knob_changes_the_layer(tmp_path):
    """parallel_residual (the knob the translation sets from use_parallel_residual) reaches the
    model, and flipping it moves the logits away from transformers'."""
    model = _hf_model("pythia_parallel", tmp_path / "hf", cases=CASES)
    cfg, params = from_hf(tmp_path / "hf")
    knobs = translation.knobs({**model.config.to_dict()})
    assert knobs["parallel_residual"] is True
    flipped = ModelConfig.from_config({**RUN_KNOBS, **knobs, "parallel_residual": False})
    assert not flipped.parallel_residual and flipped.replace(parallel_residual=True) == cfg
    ref = _hf_logits(model, tokens())
    assert max_diff(_logits(params, flipped, tokens()), ref) > 1e-2


def test_greedy_decode_matches_transformers(tmp_path):
    check_greedy_decode(_hf_model("pythia_parallel", tmp_path / "hf", cases=CASES),
                        tmp_path / "hf")
