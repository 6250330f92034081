"""Qwen3-Next and Qwen3.5 (text, dense and MoE) against transformers: logits (fp32, tiny random
configs with wider-than-init weights), from_hf / to_hf round trips that load in transformers,
greedy decode, packed sequences, and the knobs these families add flipped."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import VOCAB, max_diff, random_params, tiny, tokens
from test_hf import _hf_model, check_parity_and_round_trip

from jaxtrain.models import ModelConfig, forward, from_hf, generate
from jaxtrain.models.moe import MoEConfig

_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
               linear_num_key_heads=2, linear_num_value_heads=4)
_BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=64,
             **_LINEAR)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=20)
CASES = {
    "qwen3_next_moe": (tr.Qwen3NextConfig, tr.Qwen3NextForCausalLM,
                       {**_BASE, **_MOE, "mlp_only_layers": [1], "norm_topk_prob": True}),
    "qwen3_next_moe_no_renorm_tied": (
        tr.Qwen3NextConfig, tr.Qwen3NextForCausalLM,
        {**_BASE, **_MOE, "norm_topk_prob": False, "tie_word_embeddings": True,
         "layer_types": ["linear_attention", "full_attention"] * 2}),
    "qwen3_5_text": (tr.Qwen3_5TextConfig, tr.Qwen3_5ForCausalLM,
                     {**_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5,
                                                   "mrope_section": [2, 1, 1],
                                                   "mrope_interleaved": True}}),
    "qwen3_5_moe_text": (tr.Qwen3_5MoeTextConfig, tr.Qwen3_5MoeForCausalLM, {**_BASE, **_MOE}),
}


def _model(case, path, seed=0):
    """The randomized model of ``case`` saved to ``path``: test_hf's N(0, 0.3) weights scaled
    to N(0, 0.2) (ten times the init; at 0.3 the MoE hybrids' logits reach 7 and transformers'
    own float32 forward is 1e-4 from its float64 one), and the RMSNorms, which scale by 1 + w,
    redrawn around 0 (test_hf puts them around 1, doubling every normalised activation)."""
    model = _hf_model(case, path, seed, CASES)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith(("q_norm.weight",
                                                                   "k_norm.weight",
                                                                   "model.norm.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif not name.endswith(("A_log", "dt_bias", "linear_attn.norm.weight")):
                p.mul_(2 / 3)
    model.save_pretrained(path)
    return model


# A seed whose routing has no top-k choice within float32 rounding of a tie (such a token's
# logits differ by ~1e-3 while the rest agree to 1e-5).
SEEDS = {"qwen3_5_moe_text": 1}


# Two cases run by default (a Qwen3-Next MoE with a dense layer, Qwen3.5 with mrope and partial
# RoPE); the others with -m slow.
FAST = ("qwen3_next_moe", "qwen3_5_text")


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_parity_and_round_trip(case, tmp_path):
    model = _model(case, tmp_path / "hf", SEEDS.get(case, 0))
    cfg = check_parity_and_round_trip(model, tmp_path)
    n = model.config.num_hidden_layers
    assert cfg.linear_attention_layers == tuple(
        t == "linear_attention" for t in model.config.layer_types[:n])
    assert cfg.attention_output_gate and cfg.apply_layernorm_1p


@pytest.mark.slow
def test_chunk_length_does_not_change_the_model(tmp_path):
    """The chunked rule with chunks that divide the length, that do not, and one chunk per
    token gives the same logits."""
    _model("qwen3_5_text", tmp_path / "hf")
    toks = tokens(2, 13)
    out = []
    for c in (1, 4, 5, 64):
        cfg, params = from_hf(tmp_path / "hf", linear_chunk_size=c)
        out.append(jax.jit(forward, static_argnums=2)(params, toks, cfg))
    for o in out[1:]:
        assert max_diff(o, out[0]) < 1e-4


@pytest.mark.parametrize("case", [pytest.param("qwen3_next_moe", marks=pytest.mark.slow),
                                  "qwen3_5_text"])
@pytest.mark.slow
def test_greedy_decode_matches_transformers(case, tmp_path):
    model = _model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf", linear_chunk_size=4)
    prompt = tokens(2, 6)
    with torch.no_grad():
        ref = model.generate(torch.tensor(np.asarray(prompt)), max_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(params, cfg, prompt, 8)),
                                  ref[:, prompt.shape[1]:].numpy())


@pytest.mark.slow
def test_left_padded_prompts_decode_as_alone(tmp_path):
    """A short prompt left-padded next to a long one continues as it does alone: padding
    leaves no trace in the convolution or the recurrent state."""
    from jaxtrain.models.decode import left_pad

    _model("qwen3_5_text", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf", linear_chunk_size=4)
    short, long = [5, 9], [3, 1, 4, 1, 5, 9, 2]
    ids, pad = left_pad([short, long])
    both = np.asarray(generate(params, cfg, ids, 5, pad=pad))
    alone = np.asarray(generate(params, cfg, jnp.asarray([short]), 5))
    np.testing.assert_array_equal(both[0], alone[0])


def test_packed_sequences_are_independent(tmp_path):
    """With segment ids, each packed document's logits equal its logits alone (the state and
    the convolution restart at every document)."""
    _model("qwen3_next_moe", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf", linear_chunk_size=4)
    toks = tokens(1, 14)
    seg = jnp.asarray([[1] * 5 + [2] * 6 + [3] * 3])
    pos = jnp.asarray([list(range(5)) + list(range(6)) + list(range(3))])
    fwd = jax.jit(lambda p, x, **kw: forward(p, x, cfg, **kw))
    packed = fwd(params, toks, segment_ids=seg, positions=pos)
    for lo, hi in ((0, 5), (5, 11), (11, 14)):
        alone = fwd(params, toks[:, lo:hi])
        assert max_diff(packed[:, lo:hi], alone) < 1e-4


def _hybrid(**changes):
    return tiny(num_layers=4, kv_channels=16, qk_layernorm=True, apply_layernorm_1p=True,
                rotary_percent=0.5, linear_attention_layers=(True, True, True, False),
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_chunk_size=4, **changes)


@pytest.mark.slow
@pytest.mark.parametrize("field", ["attention_output_gate", "linear_attention_layers",
                                   "linear_qk_l2_norm", "shared_expert_gate"])
def test_each_knob_changes_the_model(field):
    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16, shared_expert_size=16)
    base = _hybrid(moe=moe)
    if field == "shared_expert_gate":
        changed = base.replace(moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16,
                                             shared_expert_size=16, shared_expert_gate=True))
    elif field == "linear_attention_layers":
        changed = base.replace(linear_attention_layers=(True, False, True, False))
    else:
        changed = base.replace(**{field: not getattr(base, field)})
    a, b = random_params(base, seed=1), random_params(changed, seed=1)
    toks = tokens()
    run = jax.jit(forward, static_argnums=2)
    assert max_diff(run(a, toks, base), run(b, toks, changed)) > 1e-3


@pytest.mark.slow
def test_gradients_flow_through_every_linear_parameter():
    cfg = _hybrid()
    params = random_params(cfg, seed=2)
    toks = tokens()
    grads = jax.jit(jax.grad(lambda p: jnp.sum(forward(p, toks, cfg) ** 2) * 1e-3))(params)
    lin = grads["linear_layers"]["linear_attn"]
    for name, g in lin.items():
        for leaf in jax.tree.leaves(g):
            assert np.all(np.isfinite(leaf)) and np.abs(leaf).max() > 0, name


def _knobs(**changes):
    base = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": VOCAB,
            "experimental_attention_variant": "gdn", "linear_attention_freq": 4,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 6, "linear_conv_kernel_dim": 3}
    return ModelConfig.from_config({**base, **changes})


def test_megatron_knobs_build_the_hybrid():
    """experimental_attention_variant gdn with linear_attention_freq (N, a 0/1 list or its
    string form) places Gated DeltaNet layers; the linear_* sizes shape them;
    attention_output_gate and moe_shared_expert_gate add their gates."""
    from jaxtrain.config import ConfigError
    from jaxtrain.models import abstract

    assert _knobs().linear_attention_layers == (True, True, True, False)
    assert _knobs(linear_attention_freq=[0, 1, 1, 0]).linear_attention_layers == (
        False, True, True, False)
    assert _knobs(linear_attention_freq="[1]*2+[0]*2").linear_attention_layers == (
        True, True, False, False)
    assert _knobs(experimental_attention_variant=None).linear_attention_layers is None
    shapes = abstract(_knobs(attention_output_gate=True, num_experts=4, moe_router_topk=2,
                             moe_shared_expert_intermediate_size=16,
                             moe_shared_expert_gate=True))
    lin = shapes["linear_moe_layers"]["linear_attn"]
    assert lin["wq"].shape == (32, 3, 2, 8) and lin["wv"].shape == (32, 3, 4, 6)
    assert lin["conv_v"].shape == (3, 3, 4, 6) and lin["wo"].shape == (4, 3, 6, 32)
    assert shapes["moe_layers"]["attn"]["wg"].shape == (32, 1, 4, 8)
    assert shapes["moe_layers"]["moe"]["shared_gate"].shape == (32, 1, 1)
    plain = abstract(_knobs(num_experts=4, moe_router_topk=2,
                            moe_shared_expert_intermediate_size=16))
    assert "wg" not in plain["moe_layers"]["attn"]
    assert "shared_gate" not in plain["moe_layers"]["moe"]
    with pytest.raises(ConfigError, match="needs linear_attention_freq"):
        _knobs(linear_attention_freq=None)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        _knobs(linear_num_value_heads=3)
    with pytest.raises(ValueError, match="moe_shared_expert_gate"):
        _knobs(num_experts=4, moe_router_topk=2, moe_shared_expert_gate=True)


@pytest.mark.slow
def test_vision_language_checkpoint_trains_its_text_model(tmp_path):
    """A Qwen3.5 vision-language checkpoint (model_type qwen3_5: text_config, the language
    model under model.language_model, a vision tower) loads as transformers'
    AutoModelForCausalLM loads it: the text model, same logits; it exports as the text model,
    and exporting as the vision-language family is refused by name."""
    from jaxtrain.models import to_hf

    text = {**{k: v for k, v in _BASE.items() if k != "max_position_embeddings"},
            "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                  out_hidden_size=32, patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(0)
    vlm = tr.Qwen3_5ForConditionalGeneration(
        tr.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for p in vlm.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    vlm.save_pretrained(tmp_path / "vlm")
    lm = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "vlm", dtype=torch.float32).eval()
    toks = tokens(2, 12)
    with torch.no_grad():
        ref = lm(torch.tensor(np.asarray(toks))).logits.numpy()
    cfg, params = from_hf(tmp_path / "vlm")
    assert max_diff(forward(params, toks, cfg), ref) < 1e-4
    to_hf(params, cfg, tmp_path / "out")
    back = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert max_diff(back(torch.tensor(np.asarray(toks))).logits.numpy(), ref) < 1e-4
    with pytest.raises(ValueError, match="vision_tower"):
        to_hf(params, cfg, tmp_path / "vl", family="qwen3_5")


@pytest.mark.parametrize("extra,match", [
    (["tensor_model_parallel_size=4"], "linear_num_key_heads \\(2\\) must be divisible"),
    (["moe_use_upcycling=true", "num_experts=4"], "moe_use_upcycling with Gated DeltaNet"),
    (["experimental_attention_variant=gdn2"], "not implemented yet: experimental_attention_var"),
    (["memory.seco=true"], "memory.seco with Gated DeltaNet"),
])
def test_what_gated_deltanet_does_not_run_is_refused_by_name(extra, match):
    from jaxtrain.config import ConfigError, load_config

    base = ["experimental_attention_variant=gdn", "linear_attention_freq=2", "num_layers=4",
            "hidden_size=64", "num_attention_heads=4", "linear_num_key_heads=2",
            "linear_num_value_heads=4", "vocab_size=128", "seq_length=64",
            "max_position_embeddings=64"]
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*base, *extra], world_size=8)


def test_the_decode_cache_keeps_keys_for_softmax_layers_and_state_for_linear_ones():
    """A 3-linear + 1-full hybrid caches keys and values of its one softmax layer and the
    convolution inputs and state of its three linear layers, nothing more."""
    from jaxtrain.models import init_cache

    cfg = _hybrid()
    cache = init_cache(cfg, 2, 12)
    assert cache["k"].shape[0] == cache["v"].shape[0] == 1
    assert {a.shape[0] for a in jax.tree.leaves(cache["linear"])} == {3}


def test_use_short_conv_false_drops_the_convolution():
    """Primus's use_short_conv false: no conv_q/k/v, q/k/v are silu of their projections (the
    model then equals one whose convolution passes the current token through unchanged), the
    decoding cache carries the state alone, and no Hugging Face family can hold it."""
    from jaxtrain.models import abstract, to_hf
    from jaxtrain.models.decode import init_cache
    from test_decode import _greedy_by_forward

    cfg = _knobs(use_short_conv=False)
    assert not cfg.linear_short_conv
    lin = abstract(cfg)["linear_layers"]["linear_attn"]
    assert not {"conv_q", "conv_k", "conv_v"} & set(lin)
    with_conv = cfg.replace(linear_short_conv=True)
    params = random_params(cfg, seed=3)
    identity = jax.tree.map(lambda a: a, random_params(with_conv, seed=3))
    for n in "qkv":   # tap W-1 (the current token) 1, the earlier taps 0
        w = identity["linear_layers"]["linear_attn"][f"conv_{n}"]
        identity["linear_layers"]["linear_attn"][f"conv_{n}"] = jnp.zeros_like(w).at[-1].set(1)
    toks = tokens()
    assert max_diff(forward(params, toks, cfg), forward(identity, toks, with_conv)) <= 1e-5
    assert max_diff(forward(params, toks, cfg), forward(random_params(with_conv, seed=3), toks,
                                                        with_conv)) > 1e-3
    assert set(init_cache(cfg, 1, 8)["linear"]) == {"state"}
    prompt = tokens(2, 5)
    got, _ = generate(params, cfg, prompt, 4, return_logits=True)
    np.testing.assert_array_equal(np.asarray(got), _greedy_by_forward(params, cfg, prompt, 4)[0])
    with pytest.raises(ValueError, match="linear_short_conv"):
        to_hf(params, cfg, "/nonexistent")
    with pytest.raises(ValueError, match="use_short_conv"):
        _knobs(use_short_conv=False, experimental_attention_variant=None)
