"""Forward-pass behaviour: per-knob effects, masking properties, scan/remat equivalence."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from model_helpers import SEQ, VOCAB, max_diff, random_params, tiny, tokens

from jaxtrain.models import forward
from jaxtrain.models.attention import dot_product_attention
from jaxtrain.models.remat import NO_REMAT, layer_plan

DROP = dict(deterministic=False, rng=jax.random.key(7))
BF16 = dict(dtype="bfloat16")


@functools.lru_cache(maxsize=None)
def _fwd(cfg, deterministic=True):
    return jax.jit(lambda p, t, pos, seg, rng: forward(p, t, cfg, positions=pos, segment_ids=seg,
                                                       deterministic=deterministic, rng=rng))


def run(cfg, params=None, toks=None, positions=None, segment_ids=None, deterministic=True,
        rng=None):
    params = random_params(cfg) if params is None else params
    toks = tokens() if toks is None else toks
    return _fwd(cfg, deterministic)(params, toks, positions, segment_ids, rng)


# (knob, base changes, variant changes, forward kwargs): flipping the knob changes the logits.
CHANGES = [
    ("rotary_base", {}, {"rotary_base": 500.0}, {}),
    ("rotary_percent", {}, {"rotary_percent": 0.5}, {}),
    ("rotary_interleaved", {}, {"rotary_interleaved": True}, {}),
    ("rotary_seq_len_interpolation_factor", {}, {"rotary_seq_len_interpolation_factor": 4.0}, {}),
    ("use_rope_scaling", {"original_max_position_embeddings": 16}, {"use_rope_scaling": True}, {}),
    ("rope_scaling_factor", {"use_rope_scaling": True, "original_max_position_embeddings": 16},
     {"rope_scaling_factor": 2.0}, {}),
    ("rope_type", {"original_max_position_embeddings": 16},
     {"rope_type": "yarn", "yarn_scaling_factor": 4.0}, {}),
    ("yarn_mscale", {"rope_type": "yarn", "yarn_scaling_factor": 4.0}, {"yarn_mscale": 2.0}, {}),
    ("position_embedding_type", {}, {"position_embedding_type": "none"}, {}),
    ("position_embedding_type", {}, {"position_embedding_type": "learned_absolute"}, {}),
    ("normalization", {}, {"normalization": "LayerNorm"}, {}),
    ("norm_epsilon", {}, {"norm_epsilon": 0.5}, {}),
    ("qk_layernorm", {}, {"qk_layernorm": True}, {}),
    ("qk_l2_norm", {}, {"qk_l2_norm": True}, {}),
    ("activation", {}, {"activation": "gelu"}, {}),
    ("activation", {}, {"activation": "gelu_tanh"}, {}),
    ("activation", {}, {"activation": "quick_gelu"}, {}),
    ("activation", {}, {"activation": "squared_relu"}, {}),
    ("activation", {}, {"activation": "relu"}, {}),
    ("activation", {"activation": "gelu", "gated_linear_unit": False},
     {"activation": "gelu_tanh"}, {}),
    ("gated_linear_unit", {}, {"gated_linear_unit": False}, {}),
    ("add_bias_linear", {}, {"add_bias_linear": True}, {}),
    ("add_qkv_bias", {}, {"add_qkv_bias": True}, {}),
    ("num_query_groups", {}, {"num_query_groups": 4}, {}),
    ("kv_channels", {}, {"kv_channels": 16}, {}),
    ("ffn_hidden_size", {}, {"ffn_hidden_size": 96}, {}),
    ("num_layers", {}, {"num_layers": 3}, {}),
    ("num_attention_heads", {"num_query_groups": 2}, {"num_attention_heads": 8}, {}),
    ("untie_embeddings_and_output_weights", {}, {"untie_embeddings_and_output_weights": False},
     {}),
    ("apply_residual_connection_post_layernorm", {},
     {"apply_residual_connection_post_layernorm": True}, {}),
    ("sliding_window", {}, {"sliding_window": 3}, {}),
    ("final_logit_softcapping", {}, {"final_logit_softcapping": 2.0}, {}),
    ("attn_logit_softcapping", {}, {"attn_logit_softcapping": 0.5}, {}),
    ("hidden_dropout", {}, {"hidden_dropout": 0.3}, DROP),
    ("attention_dropout", {}, {"attention_dropout": 0.3}, DROP),
    ("dtype", {}, BF16, {}),
    ("weight_dtype", {}, {"weight_dtype": "bfloat16"}, {}),
    ("fp32_residual_connection", BF16, {"fp32_residual_connection": True}, {}),
    ("logits_dot_in_fp32", BF16, {"logits_dot_in_fp32": True}, {}),
    ("attention_softmax_in_fp32", BF16, {"attention_softmax_in_fp32": False}, {}),
]

# Knobs that must not change the logits (layout, numerics-only, or a re-parametrisation).
SAME = [
    ("use_iota_embed", {}, {"use_iota_embed": True}, {}),
    ("scan_layers", {}, {"scan_layers": False}, {}),
    ("apply_query_key_layer_scaling", {"num_layers": 3}, {"apply_query_key_layer_scaling": True},
     {}),
    # random_params stores zero-centred scales as s and plain ones as 1 + s: same function.
    ("apply_layernorm_1p", {}, {"apply_layernorm_1p": True}, {}),
    ("hidden_dropout", {}, {"hidden_dropout": 0.3, "attention_dropout": 0.3}, {}),
    ("remat_policy", {}, {"remat_policy": "minimal"}, {}),
    ("recompute_modules", {}, {"recompute_modules": ("core_attn", "mlp", "layernorm")}, {}),
]


def _ids(table):
    return [f"{k}-{'-'.join(f'{a}={b}' for a, b in v.items())}" for k, _, v, _ in table]


@pytest.mark.parametrize("knob,base,variant,kw", CHANGES, ids=_ids(CHANGES))
@pytest.mark.slow
def test_knob_changes_logits(knob, base, variant, kw):
    ref = run(tiny(**base), **kw)
    out = run(tiny(**{**base, **variant}), **kw)
    assert out.shape == (2, SEQ, VOCAB) and out.dtype == jnp.float32
    assert max_diff(out, ref) > 1e-3, knob


@pytest.mark.parametrize("knob,base,variant,kw", SAME, ids=_ids(SAME))
def test_knob_keeps_logits(knob, base, variant, kw):
    assert max_diff(run(tiny(**{**base, **variant}), **kw), run(tiny(**base), **kw)) < 1e-5


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_layernorm_1p_applies_one_plus_scale(norm):
    params = random_params(tiny(normalization=norm))
    plain = run(tiny(normalization=norm), params)
    assert max_diff(run(tiny(normalization=norm, apply_layernorm_1p=True), params), plain) > 1e-3


def test_param_scan_axis_is_layout_only():
    cfg1, cfg0 = tiny(num_layers=3), tiny(num_layers=3, param_scan_axis=0)
    p1 = random_params(cfg1)
    p0 = {**p1, "layers": jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), p1["layers"])}
    assert p0["layers"]["attn"]["wq"].shape == (3, 32, 4, 8)
    assert max_diff(run(cfg0, p0), run(cfg1, p1)) < 1e-6


@pytest.mark.parametrize("changes", [{}, {"position_embedding_type": "learned_absolute"},
                                     {"sliding_window": 4}, {"scan_layers": False}])
def test_causal(changes):
    cfg = tiny(**changes)
    a, b = tokens(), tokens(seed=1)
    mixed = a.at[:, 7:].set(b[:, 7:])
    la, lm = run(cfg, toks=a), run(cfg, toks=mixed)
    assert max_diff(la[:, :7], lm[:, :7]) < 1e-6
    assert max_diff(la[:, 7:], lm[:, 7:]) > 1e-3


@pytest.mark.parametrize("changes", [{}, {"position_embedding_type": "learned_absolute"}])
def test_segment_ids_block_cross_document_attention(changes):
    cfg = tiny(**changes)
    toks = tokens(batch=1)
    seg = jnp.asarray([[1] * 6 + [2] * 10])
    pos = jnp.asarray([list(range(6)) + list(range(10))])
    packed = run(cfg, toks=toks, positions=pos, segment_ids=seg)
    first = run(cfg, toks=toks[:, :6])
    second = run(cfg, toks=toks[:, 6:])
    assert max_diff(packed[:, :6], first) < 1e-5
    assert max_diff(packed[:, 6:], second) < 1e-5
    unsegmented = run(cfg, toks=toks, positions=pos)
    assert max_diff(unsegmented[:, 6:], second) > 1e-3


def test_sliding_window_limits_attention():
    cfg = tiny(num_layers=1, sliding_window=4)
    a = tokens(batch=1)
    out = run(cfg, toks=a)
    far = run(cfg, toks=a.at[0, 6].set((a[0, 6] + 1) % VOCAB))    # 10 - 6 = 4: outside
    near = run(cfg, toks=a.at[0, 7].set((a[0, 7] + 1) % VOCAB))   # 10 - 7 = 3: inside
    assert max_diff(out[:, 10], far[:, 10]) < 1e-6
    assert max_diff(out[:, 10], near[:, 10]) > 1e-4
    assert max_diff(out[:, 9], far[:, 9]) > 1e-4


def _naive_attention(q, k, v, causal, segment_ids, window, softcap, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            s = q[b, :, n] @ k[b, :, n // G].T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            t, u = np.arange(T)[:, None], np.arange(T)[None]
            ok = np.ones((T, T), bool)
            if causal:
                ok &= u <= t
            if window:
                ok &= t - u < window
            if segment_ids is not None:
                ok &= segment_ids[b][:, None] == segment_ids[b][None]
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, n // G]
    return out


@pytest.mark.parametrize("causal,window,softcap,segments", [
    (True, None, None, False), (True, 3, None, False), (True, None, 2.0, True),
    (False, None, None, True), (True, 5, 1.0, True)])
def test_attention_matches_naive(causal, window, softcap, segments):
    rng = np.random.RandomState(0)
    q = rng.standard_normal((2, 9, 6, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 9, 2, 4)).astype(np.float32) for _ in range(2))
    seg = np.asarray([[1] * 4 + [2] * 5, [3] * 9]) if segments else None
    out = dot_product_attention(q, k, v, causal=causal, segment_ids=seg, sliding_window=window,
                                softcap=softcap, scale=0.7)
    ref = _naive_attention(q, k, v, causal, seg, window, softcap, 0.7)
    assert max_diff(out, ref) < 1e-5


def test_dropout_needs_rng_and_is_reproducible():
    cfg = tiny(hidden_dropout=0.2, attention_dropout=0.2)
    with pytest.raises(ValueError, match="rng"):
        run(cfg, deterministic=False)
    a = run(cfg, deterministic=False, rng=jax.random.key(1))
    assert max_diff(a, run(cfg, deterministic=False, rng=jax.random.key(1))) == 0
    assert max_diff(a, run(cfg, deterministic=False, rng=jax.random.key(2))) > 1e-3


def _loss_and_grads(cfg, params, toks):
    def loss(p):
        logits = forward(p, toks[:, :-1], cfg)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, toks[:, 1:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))(params)


REMAT = [
    dict(remat_policy="full"),
    dict(remat_policy="full", recompute_method="uniform", recompute_num_layers=2),
    dict(scan_layers=False, remat_policy="custom",
         remat_tensors=(("query_proj", "device"), ("mlpwo", "offload"))),
    pytest.param(dict(remat_policy="minimal_with_context", recompute_modules=("core_attn", "mlp")),
                 marks=pytest.mark.slow),
    pytest.param(dict(scan_layers=False, remat_policy="save_dot_except_mlp",
                      recompute_layer_ids=(1,)), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def remat_reference():
    cfg = tiny(num_layers=3)
    params, toks = random_params(cfg), tokens(seq=SEQ + 1)
    return params, toks, _loss_and_grads(cfg, params, toks)


@pytest.mark.parametrize("changes", REMAT, ids=["full", "megatron_uniform_2",
                                                 "custom_offload_loop",
                                                 "minimal_with_context_selective",
                                                 "layer_ids_loop"])
@pytest.mark.slow
def test_remat_and_scan_keep_loss_and_grads(changes, remat_reference):
    params, toks, (loss, grads) = remat_reference
    loss2, grads2 = _loss_and_grads(tiny(num_layers=3, **changes), params, toks)
    assert abs(float(loss2) - float(loss)) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads2, grads)


_ATTN = ["query_proj", "key_proj", "value_proj"]
_MLP = ["mlpwi_0", "mlpwi_1"]   # mlpwo feeds only the residual add: never a residual
SAVES = [
    ("full", [], _ATTN + ["context", "out_proj"] + _MLP),
    ("minimal", _ATTN + ["out_proj"] + _MLP, ["context"]),
    ("minimal_with_context", _ATTN + ["context", "out_proj"] + _MLP, []),
    ("save_dot_with_context_except_mlp", _ATTN + ["context", "out_proj"], _MLP),
    ("save_dot_except_mlpwi", _ATTN + ["out_proj"], ["context"] + _MLP),
    ("save_dot_except_mlp", _ATTN + ["out_proj"], ["context"] + _MLP),
    ("save_qkv_proj", _ATTN, ["context", "out_proj"] + _MLP),
    ("save_out_proj", ["out_proj"], _ATTN + ["context"] + _MLP),
]


def _saved_residuals(cfg, capsys):
    print_saved_residuals(lambda p: forward(p, tokens(), cfg).sum(), random_params(cfg))
    return capsys.readouterr().out


@pytest.mark.parametrize("policy,saved,not_saved", SAVES, ids=[s[0] for s in SAVES])
def test_remat_policy_saves_named_tensors(policy, saved, not_saved, capsys):
    text = _saved_residuals(tiny(remat_policy=policy, scan_layers=False), capsys)
    for name in saved:
        assert f"named '{name}'" in text
    for name in not_saved:
        assert f"named '{name}'" not in text


@pytest.mark.parametrize("policy", ["qkv_proj_offloaded", "minimal_offloaded"])
def test_offloaded_policies_move_residuals_to_host(policy, capsys):
    text = _saved_residuals(tiny(remat_policy=policy, scan_layers=False), capsys)
    host = [line for line in text.splitlines() if "<host>" in line]
    assert len(host) == 2 * (3 if policy == "qkv_proj_offloaded" else 6)
    assert "named '" not in text.replace("named 'decoder_layer_input'", "")


@pytest.mark.parametrize("changes,plan", [
    (dict(remat_policy="none"), [(0, 5, 1, False)]),
    (dict(remat_policy="full"), [(0, 5, 1, True)]),
    (dict(remat_policy="full", recompute_method="uniform", recompute_num_layers=2),
     [(0, 4, 2, True), (4, 5, 1, True)]),
    (dict(remat_policy="full", recompute_method="block", recompute_num_layers=2),
     [(0, 2, 1, True), (2, 5, 1, False)]),
    (dict(remat_policy="full", recompute_layer_ids=(1, 2, 4)),
     [(0, 1, 1, False), (1, 3, 1, True), (3, 4, 1, False), (4, 5, 1, True)]),
])
def test_layer_plan(changes, plan):
    got = [(s.start, s.stop, s.group, s.policy is not NO_REMAT)
           for s in layer_plan(tiny(num_layers=5, **changes))]
    assert got == plan


def test_parallel_shared_norm_is_the_parallel_layer_on_one_norm(tmp_path):
    """parallel_shared_norm (GPT-J / PaLM / MaxText's default block): x + attn(n(x)) + mlp(n(x))
    with the attention's norm: the GPT-NeoX parallel layer whose MLP norm equals it; another
    MLP norm moves the logits; no Hugging Face family jaxtrain writes has it."""
    from jaxtrain.models import to_hf
    shared = tiny(parallel_residual=True, parallel_shared_norm=True)
    neox = shared.replace(parallel_shared_norm=False)
    params = random_params(shared)
    assert "mlp_norm" not in params["layers"] and "mlp_norm" in random_params(neox)["layers"]
    same = {**params, "layers": {**params["layers"], "mlp_norm": params["layers"]["attn_norm"]}}
    assert max_diff(run(shared, params), run(neox, same)) < 1e-6
    assert max_diff(run(shared, params), run(neox, random_params(neox))) > 1e-3
    with pytest.raises(ValueError, match="parallel_shared_norm"):
        to_hf(params, shared, tmp_path)
    with pytest.raises(ValueError, match="parallel_shared_norm"):
        tiny(parallel_shared_norm=True)
