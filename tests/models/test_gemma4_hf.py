"""Gemma 4 (text, and the text model of the vision-language checkpoint) against transformers:
logits (fp32, tiny random configs with wider-than-init weights and layer scalars), from_hf /
to_hf round trips that load in transformers, greedy decode, and each Gemma 4 feature flipped."""
import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import (VOCAB, check_left_padded_decode, check_packed_sequences, max_diff,
                           tokens)
from test_hf import (TOL, _hf_logits, _randomize, check_greedy_decode,
                     check_parity_and_round_trip)

from jaxtrain.models import forward, from_hf, to_hf
from jaxtrain.models.hf import config_from_hf
from jaxtrain.models.hf.common import stacks
from jaxtrain.models.params import layer_tree

# Six layers, five sliding (window 4 of 16 tokens) to one global; the global layers twice as
# wide with one key/value head that also gives the values, a quarter of their pairs rotated.
_BASE = dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, global_head_dim=16, intermediate_size=40, vocab_size=VOCAB,
             max_position_embeddings=64, sliding_window=4, hidden_size_per_layer_input=0,
             final_logit_softcapping=30.0, attention_k_eq_v=True, num_global_key_value_heads=1,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "proportional", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.25}})
# Gemma 4 small (E2B/E4B): per-layer inputs, the last three layers sharing the keys and values
# of the last sliding and the last global layer before them (E2B: their MLPs twice as wide)
_SMALL = {**_BASE, "num_hidden_layers": 7, "hidden_size_per_layer_input": 8,
          "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 3,
          "attention_k_eq_v": False, "num_global_key_value_heads": None,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2
          + ["full_attention"]}
CASES = {
    "dense_31b_like": _BASE,
    "small_e2b_like": {**_SMALL, "use_double_wide_mlp": True},
    "small_e4b_like": {**_SMALL, "layer_types": ["sliding_attention"] * 3 + [
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
    "moe_26b_like": {**_BASE, "num_hidden_layers": 4, "enable_moe_block": True,
                     "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 12,
                     "layer_types": ["sliding_attention", "full_attention"] * 2},
    "separate_values": {**_BASE, "attention_k_eq_v": False, "num_global_key_value_heads": None,
                        "tie_word_embeddings": False},
}


def _model(case, path, seed=0):
    """transformers' Gemma 4 of ``case`` with random weights and layer scalars, saved."""
    cfg = tr.Gemma4TextConfig(**CASES[case], attn_implementation="eager")
    model = _randomize(tr.Gemma4ForCausalLM(cfg).eval(), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
    model.save_pretrained(path)
    return model


def _logits(params, cfg, toks):
    return jax.jit(lambda p, x: forward(p, x, cfg))(params, toks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert cfg.layer_scalar and cfg.v_norm == "plain" and cfg.global_rotary_percent == 0.25
    assert cfg.global_kv_channels == 16


@pytest.mark.slow
def test_small_models_share_keys_and_values(tmp_path):
    """E2B-like: the sharing layers are stacks of their own without key/value weights (their
    MLP twice as wide), the storing layers are the last sliding and last global layer before
    them; a checkpoint's unread k/v weights of sharing layers are left out, as transformers
    does; packed documents give their logits alone."""
    model = _model("small_e2b_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.kv_roles == (None, None, "store", "store", "reuse", "reuse", "reuse")
    assert (cfg.per_layer_input_size, cfg.kv_shared_layers) == (8, 3)
    shared = params["kv_shared_layers"]
    assert "wk" not in shared["attn"] and "k_norm" not in shared["attn"]
    assert shared["mlp"]["wi_0"].shape[-1] == 2 * params["layers"]["mlp"]["wi_0"].shape[-1]
    assert params["per_layer_embedding"].shape == (VOCAB, 7 * 8)
    ref = _hf_logits(model, tokens())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(4, 7):
        state[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.ones(2 * 8, 32)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(tmp_path / "hf" / "model.safetensors"))
    cfg2, params2 = from_hf(tmp_path / "hf")
    assert max_diff(_logits(params2, cfg2, tokens()), ref) <= TOL
    check_packed_sequences(params, cfg, tol=3e-5)


@pytest.mark.parametrize("field", ["per_layer_input_size", "kv_shared_layers"])
def test_small_model_features_change_the_logits(field, tmp_path):
    """Without the per-layer inputs, or with every layer computing its own keys and values
    (the sharing layers given the storing layers' projections), the logits move away."""
    model = _model("small_e4b_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    if field == "per_layer_input_size":
        flipped = cfg.replace(per_layer_input_size=0)
        params = {k: ({n: v for n, v in s.items() if not n.startswith("ple_")}
                      if k.endswith("layers") else s) for k, s in params.items()
                  if not k.startswith("per_layer")}
    else:
        flipped = cfg.replace(kv_shared_layers=0)
        trees = [layer_tree(params, cfg, i) for i in range(cfg.num_layers)]
        donor = {cfg.kv_kind(i): trees[i] for i, r in enumerate(cfg.kv_roles) if r == "store"}
        assert sorted(donor) == ["global", "sliding"]
        for i in range(4, 7):
            own = donor[cfg.kv_kind(i)]["attn"]
            trees[i]["attn"].update(wk=own["wk"], wv=own["wv"], k_norm=own["k_norm"])
        params = {**{k: v for k, v in params.items() if not k.endswith("layers")},
                  **stacks(lambda i: trees[i], flipped)}
    assert max_diff(_logits(params, flipped, tokens()), _hf_logits(model, tokens())) > 1e-3


def test_kv_sharing_without_global_shapes(tmp_path):
    """Sliding and global layers of one head shape share one stack; a sharing layer then
    picks the storing layer of its own kind by its (scanned) index: the same logits as the
    global-shape model transformers builds, scanned and unrolled."""
    hf = {**CASES["small_e4b_like"], "global_head_dim": 8,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    model = _randomize(tr.Gemma4ForCausalLM(tr.Gemma4TextConfig(
        **hf, attn_implementation="eager")).eval(), 4)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    plain = cfg.replace(global_kv_channels=None)
    assert not plain.has_global_shape
    trees = [layer_tree(params, cfg, i) for i in range(cfg.num_layers)]
    params = {**{k: v for k, v in params.items() if not k.endswith("layers")},
              **stacks(lambda i: trees[i], plain)}
    assert set(params) >= {"layers", "kv_shared_layers"} and "global_layers" not in params
    ref = _hf_logits(model, tokens())
    for scan in (True, False):
        assert max_diff(_logits(params, plain.replace(scan_layers=scan), tokens()), ref) <= TOL


def _flipped(cfg, field, value):
    if field.startswith("moe."):
        return cfg.replace(moe=dataclasses.replace(cfg.moe, **{field[4:]: value}))
    return cfg.replace(**{field: value})


@pytest.mark.parametrize("case, field, value", [
    ("dense_31b_like", "v_norm", None), ("dense_31b_like", "global_rotary_percent", 1.0),
    ("dense_31b_like", "local_rotary_base", None), ("dense_31b_like", "layer_scalar", False),
    ("moe_26b_like", "moe.per_expert_scale", False)])
def test_each_gemma4_feature_changes_the_logits(case, field, value, tmp_path):
    """Flip one Gemma 4 field of the loaded model: the logits move away from transformers'
    (a parameter the flipped model no longer has is dropped)."""
    model = _model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    flipped = _flipped(cfg, field, value)
    if field == "layer_scalar":
        params = {k: ({n: v for n, v in s.items() if n != "layer_scalar"}
                      if k.endswith("layers") else s) for k, s in params.items()}
    ref = _hf_logits(model, tokens())
    assert max_diff(_logits(params, flipped, tokens()), ref) > 1e-3


@pytest.mark.parametrize("field", ["branch_norms", "router_input_norm"])
def test_moe_branch_and_router_norms_change_the_logits(field, tmp_path):
    """Without its own branch norms or the router's input norm the MoE layer is another one."""
    model = _model("moe_26b_like", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    changes = {"router_input_norm": False}
    if field == "branch_norms":
        changes["branch_norms"] = False
        params = {k: ({**s, "moe": {n: v for n, v in s["moe"].items()
                                    if n not in ("experts_norm", "experts_post_norm",
                                                 "shared_post_norm")}}
                      if k.endswith("moe_layers") else s) for k, s in params.items()}
    flipped = cfg.replace(moe=dataclasses.replace(cfg.moe, **changes))
    assert max_diff(_logits(params, flipped, tokens()), _hf_logits(model, tokens())) > 1e-3


def test_vision_language_checkpoint_reads_its_text_model(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint: from_hf reads model.language_model.* (the
    vision tower and its embedder left out) and gives the language model's logits; exporting
    it as the vision-language family is refused."""
    vlm = tr.Gemma4ForConditionalGeneration(tr.Gemma4Config(
        text_config=CASES["dense_31b_like"], audio_config=None,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8),
        attn_implementation="eager")).eval()
    _randomize(vlm, 3)
    vlm.save_pretrained(tmp_path / "vlm")
    cfg, params = from_hf(tmp_path / "vlm")
    with torch.no_grad():
        hidden = vlm.model.language_model(torch.tensor(np.asarray(tokens()))).last_hidden_state
        ref = vlm.lm_head(hidden)
        ref = (torch.tanh(ref / 30.0) * 30.0).numpy()
    assert max_diff(_logits(params, cfg, tokens()), ref) <= TOL
    with pytest.raises(ValueError, match="vision_tower"):
        to_hf(params, cfg, tmp_path / "out", family="gemma4")


@pytest.mark.parametrize("case", ["dense_31b_like", "small_e2b_like",
                                  pytest.param("moe_26b_like", marks=pytest.mark.slow)])
def test_greedy_decode_matches_transformers(case, tmp_path):
    check_greedy_decode(_model(case, tmp_path / "hf"), tmp_path / "hf")


@pytest.mark.slow
def test_small_model_left_padded_decode(tmp_path):
    _model("small_e4b_like", tmp_path / "hf")
    check_left_padded_decode(*reversed(from_hf(tmp_path / "hf")))


@pytest.mark.parametrize("field, value, match", [
    ("num_kv_shared_layers", 6, "leaves no layer"),
    ("use_bidirectional_attention", "all", "causal"),
    ("rope_parameters", {"full_attention": {"rope_type": "proportional", "factor": 8.0},
                         "sliding_attention": {"rope_type": "default"}}, "scaling factor")])
def test_unbuilt_gemma4_features_are_refused_by_name(field, value, match):
    hf = {**CASES["dense_31b_like"], "model_type": "gemma4_text", field: value}
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


def test_per_layer_config_of_newer_transformers():
    """transformers 5.2x writes the global layers' shape as per_layer_config; both spellings
    give one model."""
    old = {**CASES["dense_31b_like"], "model_type": "gemma4_text"}
    new = {k: v for k, v in old.items() if k not in ("global_head_dim",
                                                     "num_global_key_value_heads")}
    new["per_layer_config"] = {"5": {"head_dim": 16, "num_key_value_heads": 1}}
    assert config_from_hf(new) == config_from_hf(old)
    new["per_layer_config"] = {"4": {"head_dim": 16}, "5": {"head_dim": 16}}
    with pytest.raises(ValueError, match="per_layer_config"):
        config_from_hf(new)


_KNOBS = {"global_kv_channels": None, "global_num_query_groups": None,
          "attention_k_eq_v": False, "global_rotary_percent": None, "v_norm": None,
          "layer_scalar": False, "moe_per_expert_scale": False,
          "moe_router_input_norm": False, "moe_branch_norms": False}


@pytest.mark.parametrize("knob", sorted(_KNOBS))
def test_gemma4_knobs_shape_the_model(knob):
    """Each knob the Gemma 4 translation sets, put back to its default, changes the model:
    the parameters' shapes or presence (global heads, value projection, layer scalars, the MoE
    layer's norms and scales) or its config field, whose effect on the logits the tests above
    show."""
    flipped = {knob: _KNOBS[knob]}
    if knob == "moe_branch_norms":
        flipped["moe_router_input_norm"] = False
    base, other, shapes = _translated_and_flipped("moe_26b_like", knob, flipped)
    assert other != base
    if knob not in ("global_rotary_percent", "v_norm"):
        assert shapes[0] != shapes[1]


def _translated_and_flipped(case: str, knob: str, flipped: dict):
    """(the model of CASES[case]'s translated knobs, the model with ``flipped`` knobs, their
    parameter shapes); the translation sets ``knob`` away from its flipped value."""
    from jaxtrain.config.dialects import hf as translation
    from jaxtrain.models import ModelConfig
    from jaxtrain.models.hf import RUN_KNOBS
    from jaxtrain.models.params import abstract

    knobs = translation.knobs({**CASES[case], "model_type": "gemma4_text"})
    assert knobs[knob] != flipped[knob]
    base = ModelConfig.from_config({**RUN_KNOBS, **knobs})
    other = ModelConfig.from_config({**RUN_KNOBS, **knobs, **flipped})
    return base, other, [jax.tree.map(lambda a: a.shape, abstract(c)) for c in (base, other)]


_SMALL_KNOBS = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 50,
                "num_kv_shared_layers": 0, "use_double_wide_mlp": False}


@pytest.mark.parametrize("knob", sorted(_SMALL_KNOBS))
def test_small_gemma4_knobs_shape_the_model(knob):
    """Each knob of the small models' translation, changed, changes the parameters: the
    per-layer input tables and gates, their vocabulary, the sharing layers' missing key/value
    projections, their MLP width."""
    flipped = {knob: _SMALL_KNOBS[knob]}
    if knob == "num_kv_shared_layers":
        flipped["use_double_wide_mlp"] = False
    _, _, shapes = _translated_and_flipped("small_e2b_like", knob, flipped)
    assert shapes[0] != shapes[1]


def test_kernels_check_the_global_head_width():
    """The flash kernel's tuned tiles and cuDNN stop at head dim 256: Gemma 4's 512-wide global
    heads are refused naming global_kv_channels (xla runs them)."""
    from jaxtrain.config.errors import ConfigError
    from jaxtrain.models import ModelConfig
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                vocab_size=64, sliding_window=4, sliding_window_layers=(True, False),
                normalization="RMSNorm", global_kv_channels=512)
    assert ModelConfig(**base).attention_shape(True) == (4, 512)
    with pytest.raises(ConfigError, match="head dim 512 .global_kv_channels"):
        ModelConfig(**base, attention_impl="flash")
