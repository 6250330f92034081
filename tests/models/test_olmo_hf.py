"""OLMo 2 and OLMo 3 against transformers: logits (fp32, tiny random configs with
wider-than-init weights), from_hf / to_hf round trips that load in transformers, greedy decode,
and the two knobs the families add (pre_norm, qk_norm_across_heads) flipped."""
import numpy as np
import pytest
import transformers as tr
from model_helpers import VOCAB, max_diff, random_params, tiny, tokens
from test_hf import _hf_model, check_parity_and_round_trip

from jaxtrain.models import forward, from_hf, generate

_BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
CASES = {
    "olmo2": (tr.Olmo2Config, tr.Olmo2ForCausalLM, _BASE),
    "olmo3": (tr.Olmo3Config, tr.Olmo3ForCausalLM, {**_BASE, "sliding_window": 5}),
    "olmo3_yarn_full_layers": (tr.Olmo3Config, tr.Olmo3ForCausalLM, {
        **_BASE, "sliding_window": 5, "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                               "original_max_position_embeddings": 16},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
}


def _model(case, path, seed=0):
    return _hf_model(case, path, seed, CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert not cfg.pre_norm and cfg.qk_norm_across_heads


def test_olmo3_greedy_decode_matches_transformers(tmp_path):
    import torch

    model = _model("olmo3", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.sliding_window_layers == (True, True, True, False)
    prompt = tokens(2, 6)
    with torch.no_grad():
        ref = model.generate(torch.tensor(np.asarray(prompt)), max_new_tokens=10,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(params, cfg, prompt, 10)),
                                  ref[:, prompt.shape[1]:].numpy())


@pytest.mark.parametrize("field", ["pre_norm", "qk_norm_across_heads"])
def test_each_olmo_knob_changes_the_model(field):
    """pre_norm false drops the input norms (and their parameters); qk_norm_across_heads
    normalises q and k over all heads with [N*H] / [K*H] scales."""
    base = tiny(qk_layernorm=True)
    changed = base.replace(**{field: not getattr(base, field)})
    a, b = random_params(base, seed=1), random_params(changed, seed=1)
    if field == "pre_norm":
        assert "attn_norm" in a["layers"] and "attn_norm" not in b["layers"]
    else:
        assert b["layers"]["attn"]["q_norm"]["scale"].size == 4 * a["layers"]["attn"][
            "q_norm"]["scale"].size
    toks = tokens()
    assert max_diff(forward(a, toks, base), forward(b, toks, changed)) > 1e-3
