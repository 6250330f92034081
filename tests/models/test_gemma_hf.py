"""Gemma, Gemma 2 and Gemma 3 (text) against transformers: logits (fp32, tiny random configs
with wider-than-init weights), from_hf / to_hf round trips that load in transformers, and the
knobs that make up the families (each flipped changes the logits)."""
import numpy as np
import pytest
import transformers as tr
from model_helpers import VOCAB, max_diff, random_params, tiny, tokens
from test_hf import _randomize, _hf_model, check_parity_and_round_trip

from jaxtrain.models import forward, from_hf

_BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
CASES = {
    "gemma": (tr.GemmaConfig, tr.GemmaForCausalLM, _BASE),
    "gemma_untied": (tr.GemmaConfig, tr.GemmaForCausalLM, {**_BASE,
                                                           "tie_word_embeddings": False}),
    "gemma2": (tr.Gemma2Config, tr.Gemma2ForCausalLM, {
        **_BASE, "query_pre_attn_scalar": 12, "sliding_window": 5,
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0}),
    "gemma3": (tr.Gemma3TextConfig, tr.Gemma3ForCausalLM, {
        **_BASE, "query_pre_attn_scalar": 12, "sliding_window": 5, "layer_types": _TYPES,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "gemma3_default_pattern": (tr.Gemma3TextConfig, tr.Gemma3ForCausalLM, {
        **_BASE, "num_hidden_layers": 6, "sliding_window": 4}),
}


def _model(case, path, seed=0):
    return _hf_model(case, path, seed, CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert cfg.embedding_multiplier == pytest.approx(32 ** 0.5) and cfg.apply_layernorm_1p


def test_the_families_configs():
    from jaxtrain.models.hf import config_from_hf

    g2 = config_from_hf(tr.Gemma2Config(**{**_BASE, "sliding_window": 5}).to_dict())
    assert g2.sliding_window_layers == (True, False, True) and g2.post_attention_norm
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.embedding_multiplier == pytest.approx(32 ** 0.5) and g2.apply_layernorm_1p
    assert not g2.untie_embeddings_and_output_weights and g2.activation == "gelu_tanh"
    g3 = config_from_hf(tr.Gemma3TextConfig(**{**_BASE, "num_hidden_layers": 6}).to_dict())
    assert g3.sliding_window_layers == (True,) * 5 + (False,)
    assert g3.local_rotary_base == 10000 and g3.rotary_base == 1e6 and g3.qk_layernorm
    assert g3.attn_logit_softcapping is None and g3.query_pre_attn_scalar == 256


@pytest.mark.parametrize("field, value", [
    ("embedding_multiplier", 3.0), ("post_attention_norm", True), ("post_mlp_norm", True),
    ("query_pre_attn_scalar", 5.0), ("local_rotary_base", 50.0)])
def test_each_gemma_knob_changes_the_logits(field, value):
    """embedding_multiplier, post_attention_norm, post_mlp_norm, query_pre_attn_scalar and
    local_rotary_base (on a model with sliding-window layers) each change what the model
    computes; the sandwich norms add parameters of their own."""
    base = tiny(sliding_window=4, sliding_window_layers=(True, False), rotary_base=1e4)
    changed = base.replace(**{field: value})
    params = random_params(changed, seed=1)
    layers = params["layers"]
    own = {"post_attn_norm", "post_mlp_norm"} & set(layers)
    assert bool(own) == field.startswith("post_")
    plain = {**params, "layers": {k: v for k, v in layers.items() if k not in own}}
    toks = tokens()
    assert max_diff(forward(plain, toks, base), forward(params, toks, changed)) > 1e-3


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
@pytest.mark.slow
def test_greedy_decode_matches_transformers_generate(case, tmp_path):
    """The KV-cached decode path (sliding windows, local RoPE, sandwich norms, soft-caps)
    produces transformers' greedy tokens; 12 new tokens run past the window of 5."""
    import torch

    from jaxtrain.models import generate

    model = _model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    prompt = tokens(2, 6)
    with torch.no_grad():
        ref = model.generate(torch.tensor(np.asarray(prompt)), max_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(params, cfg, prompt, 12)),
                                  ref[:, prompt.shape[1]:].numpy())


def test_exported_config_loads_when_the_scalar_came_from_a_float_knob(tmp_path):
    """The query_pre_attn_scalar knob is a float; transformers' strict Gemma configs type it
    int, so a whole value is written as an int (a pgs SFT run's final export loads)."""
    from jaxtrain.models.hf import hf_config

    _model("gemma3", tmp_path / "hf")
    cfg, _ = from_hf(tmp_path / "hf")
    written = hf_config(cfg.replace(query_pre_attn_scalar=12.0))
    assert written["query_pre_attn_scalar"] == 12 and isinstance(
        written["query_pre_attn_scalar"], int)
    tr.Gemma3TextConfig(**{k: v for k, v in written.items()
                           if k not in ("architectures", "model_type")})   # strict: would raise


def test_vision_language_checkpoint_reads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (what gemma-3-4b-it and larger are): from_hf
    reads model.language_model.* (the vision tower and projector left out) and gives the
    model's text logits; exporting as the vision-language family is refused, and a sparse
    text_config (as the published config.json files write it) takes transformers' defaults."""
    import torch
    from jaxtrain.config.dialects import hf as translation

    text = {**_BASE, "query_pre_attn_scalar": 12, "sliding_window": 5, "layer_types": _TYPES}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    vlm = tr.Gemma3ForConditionalGeneration(tr.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        attn_implementation="eager")).eval()
    _randomize(vlm, 5)
    vlm.save_pretrained(tmp_path / "vlm")
    cfg, params = from_hf(tmp_path / "vlm")
    with torch.no_grad():
        ref = vlm(input_ids=torch.tensor(np.asarray(tokens()))).logits.numpy()
    assert max_diff(forward(params, tokens(), cfg), ref) <= 1e-4
    with pytest.raises(ValueError, match="vision_tower"):
        from jaxtrain.models import to_hf
        to_hf(params, cfg, tmp_path / "out", family="gemma3")
    sparse = {"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}}
    full = tr.Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                               rope_scaling={"factor": 8.0, "rope_type": "linear"},
                               sliding_window=1024).to_dict()
    assert translation.knobs(sparse) == translation.knobs(full)
