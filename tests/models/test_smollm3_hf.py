"""SmolLM3 against transformers: logits (fp32, tiny random configs) with NoPE layers and with a
sliding window on them, round trips that load in transformers, greedy decode, and the NoPE
layers flipped."""
import jax
import pytest
import transformers as tr
from model_helpers import VOCAB, max_diff, tokens
from test_hf import _hf_logits, _hf_model, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.models import forward, from_hf

_BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=1, no_rope_layer_interval=2)
CASES = {
    "smollm3_3b_like": (tr.SmolLM3Config, tr.SmolLM3ForCausalLM, _BASE),
    "windows_on_nope": (tr.SmolLM3Config, tr.SmolLM3ForCausalLM,
                        {**_BASE, "use_sliding_window": True, "sliding_window": 5,
                         "tie_word_embeddings": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_hf_model(case, tmp_path / "hf", cases=CASES), tmp_path)
    assert cfg.no_rope_layers == (False, True, False, True)
    assert (cfg.sliding_window_layers or (True,) * 4) == (
        (False, True, False, True) if case == "windows_on_nope" else (True,) * 4)


def test_nope_layers_change_the_logits(tmp_path):
    model = _hf_model("smollm3_3b_like", tmp_path / "hf", cases=CASES)
    cfg, params = from_hf(tmp_path / "hf")
    ours = jax.jit(lambda p, x: forward(p, x, cfg.replace(no_rope_layers=None)))(params, tokens())
    assert max_diff(ours, _hf_logits(model, tokens())) > 1e-2


def test_greedy_decode_matches_transformers(tmp_path):
    check_greedy_decode(_hf_model("windows_on_nope", tmp_path / "hf", cases=CASES),
                        tmp_path / "hf")
