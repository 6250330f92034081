"""IBM Granite 3.x against transformers: logits (fp32, tiny random configs) with all four
multipliers, round trips that load in transformers, greedy decode, and each multiplier's knob
flipped."""
import jax
import pytest
import transformers as tr
from model_helpers import VOCAB, max_diff, tokens
from test_hf import _hf_logits, _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.config.dialects import hf as translation
from jaxtrain.models import ModelConfig, forward, from_hf
from jaxtrain.models.hf import RUN_KNOBS

_GRANITE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=True,
                embedding_multiplier=12.0, attention_multiplier=0.25, residual_multiplier=0.22,
                logits_scaling=8.0)
CASES = {"granite_3_like": (tr.GraniteConfig, tr.GraniteForCausalLM, _GRANITE)}


def test_parity_and_round_trip(tmp_path):
    cfg = check_parity_and_round_trip(_hf_model("granite_3_like", tmp_path / "hf", cases=CASES),
                                      tmp_path)
    assert (cfg.residual_multiplier, cfg.logits_scaling, cfg.embedding_multiplier) == (
        0.22, 8.0, 12.0)
    assert cfg.query_pre_attn_scalar == pytest.approx(16.0)


@pytest.mark.parametrize("knob, default", [("residual_multiplier", 1.0),
                                           ("logits_scaling", 1.0),
                                           ("embedding_multiplier", None),
                                           ("query_pre_attn_scalar", None)])
def test_each_multiplier_knob_changes_the_logits(knob, default, tmp_path):
    model = _hf_model("granite_3_like", tmp_path / "hf", cases=CASES)
    _, params = from_hf(tmp_path / "hf")
    knobs = translation.knobs(model.config.to_dict())
    assert knobs[knob] != default
    cfg = ModelConfig.from_config({**RUN_KNOBS, **knobs, knob: default})
    ours = jax.jit(lambda p, x: forward(p, x, cfg))(params, tokens())
    assert max_diff(ours, _hf_logits(model, tokens())) > 1e-3


def test_greedy_decode_matches_transformers(tmp_path):
    check_greedy_decode(_hf_model("granite_3_like", tmp_path / "hf", cases=CASES),
                        tmp_path / "hf")
