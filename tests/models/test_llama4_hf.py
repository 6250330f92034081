"""Llama 4 (text, and the text model of the vision-language checkpoint) against transformers:
logits (fp32, tiny random configs with wider-than-init weights), from_hf / to_hf round trips
that load in transformers, greedy decode, and the knobs Llama 4 adds flipped."""
import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import VOCAB, max_diff, random_params, tiny, tokens
from test_hf import _randomize, TOL, _hf_logits, _hf_model, _load

from jaxtrain.models import ModelConfig, forward, from_hf, generate, to_hf
from jaxtrain.models.moe import MoEConfig

# 16 tokens in chunks of 4, NoPE every 2nd layer with a temperature that steps every 3
# positions, MoE on layers 1 and 3 (Maverick's interleaving) or on all (Scout's).
_BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=24, intermediate_size_mlp=40, vocab_size=VOCAB,
             max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=1,
             no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
             rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16})
CASES = {
    "scout_like": (tr.Llama4TextConfig, tr.Llama4ForCausalLM, {**_BASE, "use_qk_norm": True}),
    "maverick_like": (tr.Llama4TextConfig, tr.Llama4ForCausalLM,
                      {**_BASE, "use_qk_norm": False, "interleave_moe_layer_step": 2,
                       "tie_word_embeddings": True}),
}


def _model(case, path, seed=0):
    return _hf_model(case, path, seed, CASES)


def _logits(params, cfg, toks):
    return jax.jit(lambda p, x: forward(p, x, cfg))(params, toks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    model = _model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.no_rope_layers == (False, True, False, True)
    assert cfg.attention_chunk_size == 4 and cfg.attn_temperature_tuning
    assert cfg.rotary_interleaved and cfg.moe.apply_probs_on_input
    toks = tokens()
    ref = _hf_logits(model, toks)
    assert max_diff(_logits(params, cfg, toks), ref) <= TOL
    to_hf(params, cfg, tmp_path / "out")
    assert max_diff(_hf_logits(_load(tmp_path / "out"), toks), ref) <= TOL
    cfg2, params2 = from_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("field, value", [
    ("no_rope_layers", None), ("attention_chunk_size", None), ("attn_temperature_tuning", False),
    ("qk_norm_rope_layers_only", False), ("rotary_interleaved", False)])
@pytest.mark.slow
def test_each_llama4_feature_changes_the_logits(field, value, tmp_path):
    """Flip one Llama 4 field of the loaded model: the logits move away from transformers'."""
    model = _model("scout_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    ref = _hf_logits(model, tokens())
    assert max_diff(_logits(params, cfg.replace(**{field: value}), tokens()), ref) > 1e-2


def test_expert_input_scaling_changes_the_logits(tmp_path):
    model = _model("scout_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    flipped = cfg.replace(moe=dataclasses.replace(cfg.moe, apply_probs_on_input=False))
    assert max_diff(_logits(params, flipped, tokens()), _hf_logits(model, tokens())) > 1e-2


def test_vision_language_checkpoint_reads_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint: from_hf reads language_model.* (the vision
    tower and projector left out) and gives the language model's logits; exporting it as the
    vision-language family is refused, as the text model it round-trips."""
    text = tr.Llama4TextConfig(**CASES["scout_like"][2])
    vision = tr.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, image_size=28, patch_size=14,
                                   vision_output_dim=16, projector_input_dim=16,
                                   projector_output_dim=32, pixel_shuffle_ratio=0.5)
    vlm = tr.Llama4ForConditionalGeneration(tr.Llama4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        attn_implementation="eager")).eval()
    _randomize(vlm, 3)
    vlm.save_pretrained(tmp_path / "vlm")
    cfg, params = from_hf(tmp_path / "vlm")
    with torch.no_grad():
        # the VLM's own text-only forward fails in transformers 5.24 (image_outputs): its
        # language model is what runs on text
        ref = vlm.language_model(torch.tensor(np.asarray(tokens()))).logits.numpy()
    assert max_diff(_logits(params, cfg, tokens()), ref) <= TOL
    with pytest.raises(ValueError, match="vision_tower"):
        to_hf(params, cfg, tmp_path / "out", family="llama4")


@pytest.mark.slow
def test_greedy_decode_matches_transformers(tmp_path):
    model = _model("maverick_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    prompt = tokens(2, 6)
    with torch.no_grad():
        ref = model.generate(torch.tensor(np.asarray(prompt)), max_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(params, cfg, prompt, 8)),
                                  ref[:, prompt.shape[1]:].numpy())


def _chunked(**kw) -> ModelConfig:
    return tiny(num_layers=2, attention_chunk_size=4, **kw)


def test_chunked_attention_is_segments_by_chunk():
    """A chunk of C positions attends as a packed document of its own: chunked attention over
    16 tokens equals plain attention with segment ids position // 4, and packed documents
    restart their chunks at their own position 0."""
    cfg = _chunked()
    params = random_params(cfg)
    toks = tokens()
    chunk_ids = np.tile(np.arange(16) // 4, (2, 1))
    plain = forward(params, toks, cfg.replace(attention_chunk_size=None), segment_ids=chunk_ids)
    assert max_diff(forward(params, toks, cfg), plain) < 1e-5
    seg = np.tile(np.repeat([1, 2], [6, 10]), (2, 1))
    pos = np.tile(np.concatenate([np.arange(6), np.arange(10)]), (2, 1))
    ids = seg * 10 + pos // 4
    want = forward(params, toks, cfg.replace(attention_chunk_size=None), segment_ids=ids,
                   positions=pos)
    assert max_diff(forward(params, toks, cfg, segment_ids=seg, positions=pos), want) < 1e-5


def test_chunked_attention_with_the_flash_kernel():
    """The flash kernel (interpreted here) masks the chunks as the xla path does."""
    cfg = _chunked(no_rope_layers=(False, True))
    params = random_params(cfg)
    toks = tokens()
    ref = forward(params, toks, cfg)
    assert max_diff(forward(params, toks, cfg.replace(attention_impl="flash")), ref) < 1e-4


def test_apply_probs_on_input_needs_top1():
    with pytest.raises(ValueError, match="topk"):
        MoEConfig(num_experts=4, topk=2, apply_probs_on_input=True)


def _knobs(**changes) -> ModelConfig:
    base = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": VOCAB,
            "max_position_embeddings": 64, "position_embedding_type": "rope",
            "no_rope_freq": 2, "qk_l2_norm": True,
            "qk_norm_rope_layers_only": True, "chunk_attn_window_size": 4,
            "temperature_tuning": True, "temperature_tuning_scale": 0.5,
            "temperature_tuning_floor_scale": 3.0, "num_experts": 4, "moe_router_topk": 1,
            "moe_router_score_function": "sigmoid", "moe_apply_probs_on_input": True,
            "moe_shared_expert_intermediate_size": 32}
    return ModelConfig.from_config({**base, **changes})


@pytest.mark.parametrize("knob, value", [
    ("no_rope_freq", None), ("no_rope_freq", [1, 0, 0, 1]), ("qk_norm_rope_layers_only", False),
    ("chunk_attn_window_size", 0), ("temperature_tuning", False),
    ("temperature_tuning_scale", 0.1), ("temperature_tuning_floor_scale", 5.0),
    ("moe_apply_probs_on_input", False)])
def test_each_megatron_and_maxtext_knob_changes_the_model(knob, value):
    """The Llama 4 knobs as a Megatron / MaxText file writes them: each one flipped moves the
    logits (the same parameters)."""
    base, changed = _knobs(), _knobs(**{knob: value})
    params = random_params(base, seed=1)
    run = jax.jit(forward, static_argnums=2)
    assert max_diff(run(params, tokens(), base), run(params, tokens(), changed)) > 1e-3


def test_no_rope_freq_follows_megatron():
    """N: 1-based layer l skips RoPE when N divides l (N must divide num_layers, as Megatron
    asserts); a 0/1 list (or its string form) marks each layer, 1 = skip."""
    from jaxtrain.config import ConfigError

    assert _knobs(no_rope_freq=4).no_rope_layers == (False, False, False, True)
    assert _knobs(no_rope_freq="[0]*3+[1]").no_rope_layers == (False, False, False, True)
    assert _knobs(no_rope_freq=[1, 0, 0, 0]).no_rope_layers == (True, False, False, False)
    with pytest.raises(ConfigError, match="no_rope_freq = 3"):
        _knobs(no_rope_freq=3)
    with pytest.raises(ConfigError, match="no_rope_freq has 3 entries"):
        _knobs(no_rope_freq=[0, 1, 0])
