"""MoE router against Megatron's formulas, dispatch correctness, the layer in the model, and
each MoE knob flipped -> an effect (Megatron-LM's megatron/core/transformer/moe/router.py and
moe_utils.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import max_diff, random_params, tiny, tokens

from jaxtrain.models import ModelConfig, forward
from jaxtrain.models import moe as M
from jaxtrain.models.params import abstract, layer_kinds, logical_axes
from jaxtrain.models.transformer import _layer_blocks, hidden_states

E = 8
FAST = {"xla_backend_optimization_level": 0}   # tiny programs: compile time is what costs
fwd = jax.jit(forward, static_argnums=2, compiler_options=FAST)   # one compile per config


def cfg_(**kw):
    return M.MoEConfig(**{"num_experts": E, "topk": 2, **kw})


def logits_(n=64, e=E, seed=0, scale=1.0):
    return jnp.asarray(np.random.RandomState(seed).standard_normal((n, e)) * scale, jnp.float32)


def np_softmax(x):
    x = np.asarray(x, np.float64)
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


# ----------------------------------------------------------------------------- scores, top-k

def test_softmax_topk_then_softmax_vs_pre_softmax():
    lg = logits_()
    probs, idx = M.topk_routing(lg, cfg_())
    want_idx = np.argsort(-np.asarray(lg), -1)[:, :2]
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(want_idx, -1))
    picked = np.take_along_axis(np.asarray(lg), np.asarray(idx), -1)
    np.testing.assert_allclose(probs, np_softmax(picked), rtol=1e-5)     # sums to 1
    pre, pidx = M.topk_routing(lg, cfg_(pre_softmax=True))
    np.testing.assert_array_equal(pidx, idx)
    np.testing.assert_allclose(pre, np.take_along_axis(np_softmax(lg), np.asarray(idx), -1),
                               rtol=1e-5)                                  # not renormalised
    assert np.all(np.asarray(pre).sum(-1) < 1)


def test_sigmoid_expert_bias_selects_but_does_not_weight():
    lg = logits_()
    bias = jnp.zeros(E).at[3].set(10.0)      # expert 3 always selected
    probs, idx = M.topk_routing(lg, cfg_(score_function="sigmoid", expert_bias=True), bias)
    assert np.all(np.any(np.asarray(idx) == 3, -1))
    s = 1 / (1 + np.exp(-np.asarray(lg, np.float64)))
    raw = np.take_along_axis(s, np.asarray(idx), -1)
    np.testing.assert_allclose(probs, raw / raw.sum(-1, keepdims=True), rtol=1e-5)
    one, _ = M.topk_routing(lg, cfg_(score_function="sigmoid", topk=1))
    np.testing.assert_allclose(one[:, 0], s.max(-1), rtol=1e-5)     # k = 1: no renormalising
    sq, _ = M.topk_routing(lg, cfg_(score_function="sqrtsoftplus"))
    assert max_diff(sq, probs) > 1e-3


def test_learned_score_bias_picks_and_weighs_like_maxtexts_kimi_router():
    """moe_router_score_bias = MaxText's GateLogit bias under non-deepseek3/4 names: scores =
    sigmoid(logits) + bias, top-k of them, those biased scores renormalised (+1e-20) and
    scaled (get_topk + deepseek_scale_weights, transcribed in float64); the bias is learned."""
    lg = logits_()
    bias = jnp.asarray(np.random.RandomState(1).standard_normal(E) * 0.5, jnp.float32)
    m = cfg_(score_function="sigmoid", score_bias=True, topk=3, topk_scaling_factor=2.827)
    probs, idx = M.topk_routing(lg, m, score_bias=bias)
    biased = 1 / (1 + np.exp(-np.asarray(lg, np.float64))) + np.asarray(bias, np.float64)
    want_idx = np.argsort(-biased, -1)[:, :3]
    np.testing.assert_array_equal(idx, want_idx)
    w = np.take_along_axis(biased, want_idx, -1)
    np.testing.assert_allclose(probs, w / (w.sum(-1, keepdims=True) + 1e-20) * 2.827, rtol=1e-5)
    plain, plain_idx = M.topk_routing(lg, m)               # no bias: plain sigmoid routing
    assert np.any(np.asarray(plain_idx) != np.asarray(idx)) and max_diff(plain, probs) > 1e-2
    grad = jax.grad(lambda b: jnp.sum(M.topk_routing(lg, m, score_bias=b)[0] ** 2))(bias)
    assert float(jnp.abs(grad).max()) > 0
    for kw, msg in [(dict(score_function="softmax"), "sigmoid or sqrtsoftplus"),
                    (dict(score_function="sigmoid", expert_bias=True), "aux-loss-free"),
                    (dict(score_function="sigmoid", load_balancing=("aux_loss",),
                          aux_loss_coeff=(0.01,)), "aux loss coefficients to 0")]:
        with pytest.raises(ValueError, match=msg):
            cfg_(score_bias=True, **kw)
    # in the layer: the router's score_bias parameter (zeros at init) moves its output
    cfg = tiny(num_layers=1, moe=cfg_(score_function="sigmoid", score_bias=True))
    p = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0)[0], random_params(cfg)["moe_layers"]["moe"])
    x = jnp.asarray(np.random.RandomState(2).standard_normal((2, 8, 32)), jnp.float32)
    out = lambda p: M.moe_block(p, x, cfg, train=False)[0]   # noqa: E731
    moved = {**p, "router": {**p["router"], "score_bias": p["router"]["score_bias"] + bias}}
    assert max_diff(out(p), out(moved)) > 1e-3


def test_attention_output_dim_is_maxtexts_qwen3_custom_moe_layer(tmp_path):
    """attention_output_dim A (MaxText's qwen3_custom_moe): each layer is x + up(moe(norm(
    attn(norm(x))))) with attention projecting to A and the MoE layer (router and experts) at
    width A: the model's logits equal that composition of the model's own blocks; cached greedy
    decoding equals the full forward; no Hugging Face family has it."""
    from jaxtrain.models import layers as L
    from jaxtrain.models import generate, to_hf
    from jaxtrain.models.transformer import (attention_block, final_hidden, layer_inputs,
                                             layer_stacks, logits_head)
    cfg = tiny(num_layers=2, qk_layernorm=True, attention_output_dim=24,
               moe=cfg_(topk=2, layer_freq=1))
    params = random_params(cfg)
    layers = layer_stacks(params, cfg)["moe_layers"]
    assert layers["attn"]["wo"].shape == (2, 4, 8, 24) and layers["up_proj"]["w"].shape == (
        2, 24, 32)
    assert layers["moe"]["router"]["w"].shape == (2, 24, E)
    ids = tokens(2, 8)
    x, ctx = layer_inputs(params, ids, cfg)
    for i in range(2):
        p = jax.tree.map(lambda a: a[i], layers)
        a = attention_block(p["attn"], L.norm(p["attn_norm"], x, cfg), {**ctx, "stack": "moe"},
                            i + 1, None, cfg)[0]
        m = M.moe_block(p["moe"], L.norm(p["mlp_norm"], a, cfg), cfg, train=False)[0]
        x = x + m @ p["up_proj"]["w"]
    want = logits_head(params, final_hidden(params, x, ctx, cfg), cfg)
    assert max_diff(forward(params, ids, cfg), want) < 1e-5
    got, logits = generate(params, cfg, ids[:, :3], 5, return_logits=True)
    buf = np.asarray(ids[:, :3])
    for step in range(5):
        full = np.asarray(forward(params, jnp.asarray(buf), cfg))[:, -1]
        assert np.abs(np.asarray(logits[:, step]) - full).max() < 2e-5
        buf = np.concatenate([buf, np.asarray(got[:, step:step + 1])], 1)
    with pytest.raises(ValueError, match="attention_output_dim"):
        to_hf(params, cfg, tmp_path)
    with pytest.raises(ValueError, match="shared_expert_size"):
        tiny(attention_output_dim=24, moe=cfg_(shared_expert_size=16))


def test_topk_scaling_factor_multiplies_probs():
    lg = logits_()
    a, _ = M.topk_routing(lg, cfg_())
    b, _ = M.topk_routing(lg, cfg_(topk_scaling_factor=2.5))
    np.testing.assert_allclose(b, 2.5 * a, rtol=1e-6)


def test_group_limited_routing():
    """4 groups of 2; group score = top-(k/group_topk) sum. The best single expert sits in a
    group whose total loses, so it is masked out."""
    row = np.array([[5.0, -9, 3, 3, 2.9, 2.9, -9, -9]], np.float32)
    m = cfg_(num_groups=4, group_topk=2, topk=2, score_function="sigmoid")
    _, idx = M.topk_routing(jnp.asarray(row), m)       # group sums (top-1 each): 5, 3, 2.9, -9
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 2]
    m = cfg_(num_groups=4, group_topk=1, topk=2, score_function="sigmoid")
    _, idx = M.topk_routing(jnp.asarray(row), m)       # top-2 sums: 5-9=-4, 6, 5.8, -18
    assert sorted(np.asarray(idx)[0].tolist()) == [2, 3]
    m = cfg_(num_groups=4, group_topk=1, topk=2, score_function="sigmoid", group_score_topk=1)
    _, idx = M.topk_routing(jnp.asarray(row), m)       # HF-style fixed count: top-1 sums win
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 1]
    with pytest.raises(ValueError, match="divisible by num_groups"):
        cfg_(num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="group_score_topk 3"):
        cfg_(num_groups=4, group_topk=2, group_score_topk=3)


def test_invalid_combinations_are_refused():
    for kw, msg in [(dict(expert_bias=True), "sigmoid"),
                    (dict(load_balancing=("sinkhorn",), aux_loss_coeff=(0.1,)), "coeff 0"),
                    (dict(pad_to_capacity=True), "capacity factor"),
                    (dict(load_balancing=("aux_loss", "z"), aux_loss_coeff=(0.1,)), "as many"),
                    (dict(router_dtype="fp64"), "fp32")]:
        with pytest.raises(ValueError, match=msg):
            cfg_(**kw)


# ----------------------------------------------------------------------------- losses

def _uniform_stats(lg, m, **kw):
    return M.route(lg, m, train=True, **kw)[4]


def test_aux_loss_formula():
    lg = logits_(n=64)
    m = cfg_(aux_loss_coeff=0.1)
    stats = _uniform_stats(lg, m)
    p = np_softmax(lg)
    top = np.argsort(-p, -1)[:, :2]
    counts = np.zeros(E)
    np.add.at(counts, top.ravel(), 1)
    want = E / (2 * 64 ** 2) * np.sum(p.sum(0) * counts)
    np.testing.assert_allclose(stats["lb"][0], want, rtol=1e-5)
    np.testing.assert_allclose(stats["objective"], 0.1 * want, rtol=1e-5)
    assert abs(float(_uniform_stats(jnp.zeros((64, E)), m)["lb"][0]) - 1.0) < 1e-5  # balanced: 1
    assert float(M.route(lg, m, train=False)[4]["objective"]) == 0.0              # training only


def test_seq_aux_loss_is_the_mean_over_sequences():
    lg = logits_(n=48)
    m = cfg_(load_balancing=("seq_aux_loss",), aux_loss_coeff=(1.0,))
    got = _uniform_stats(lg, m, seqs=3)["lb"][0]
    per = [_uniform_stats(lg[i * 16:(i + 1) * 16], cfg_(aux_loss_coeff=1.0))["lb"][0]
           for i in range(3)]
    np.testing.assert_allclose(got, np.mean(per), rtol=1e-5)


def test_global_aux_loss_averages_counts_over_microbatches():
    lg = logits_(n=32)
    m = cfg_(load_balancing=("global_aux_loss",), aux_loss_coeff=(1.0,))
    first = _uniform_stats(lg, m)
    np.testing.assert_allclose(first["lb"][0], _uniform_stats(lg, cfg_(aux_loss_coeff=1.0))
                               ["lb"][0], rtol=1e-6)         # one microbatch: as aux_loss
    prev = jnp.full((E,), 8.0)                               # 32 tokens x 2 over 8: balanced
    second = _uniform_stats(lg, m, prev_aux_counts=prev, prev_steps=1.0)
    mean = (prev + first["aux_counts"]) / 2
    p = np_softmax(lg)
    np.testing.assert_allclose(second["lb"][0], E / (2 * 32 ** 2) * np.sum(p.sum(0) * mean),
                               rtol=1e-5)


def test_z_loss_is_the_mean_squared_logsumexp():
    lg = logits_(scale=3.0)
    stats = _uniform_stats(lg, cfg_(z_loss_coeff=0.01))
    lse = np.log(np.exp(np.asarray(lg, np.float64)).sum(-1))
    np.testing.assert_allclose(stats["z"], np.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(stats["objective"], 0.01 * np.mean(lse ** 2), rtol=1e-5)


def test_sinkhorn_converges_to_balanced_marginals():
    lg = logits_(n=32, scale=2.0)
    out = np.asarray(M.sinkhorn(lg))
    np.testing.assert_allclose(out.sum(0), np.full(E, 1 / E), atol=1e-4 / E * 10)
    np.testing.assert_allclose(out.sum(1), np.full(32, 1 / 32), rtol=1e-3)
    m = cfg_(load_balancing=("sinkhorn",), aux_loss_coeff=(0.0,))
    probs, idx = M.sinkhorn_routing(lg, m, train=True)
    np.testing.assert_allclose(probs, np.take_along_axis(np_softmax(lg), np.asarray(idx), -1),
                               rtol=1e-5)
    _, eval_idx = M.sinkhorn_routing(lg, m, train=False)     # evaluation: plain top-k
    assert not np.array_equal(np.sort(idx, -1), np.sort(eval_idx, -1))
    skewed = lg.at[:, 0].add(5.0)                            # everyone prefers expert 0
    _, plain = jax.lax.top_k(skewed, 2)
    _, balanced = M.sinkhorn_routing(skewed, m, train=True)
    assert np.bincount(np.ravel(balanced), minlength=E).max() < np.bincount(
        np.ravel(plain), minlength=E).max()


# ----------------------------------------------------------------------------- capacity

def test_capacity_drops_by_probs_and_by_position():
    # 4 tokens, 2 experts, top-1 (pre-softmax), factor 0.5: capacity ceil(4*1/2*0.5) = 1
    lg = jnp.asarray([[1.0, 0], [3.0, 0], [2.0, 0], [0, 1.0]])
    base = dict(num_experts=2, topk=1, pre_softmax=True, capacity_factor=0.5)
    assert M.capacity(4, M.MoEConfig(**base)) == 1
    _, idx, keep, _, _ = M.route(lg, M.MoEConfig(**base), train=True)
    assert np.asarray(idx)[:, 0].tolist() == [0, 0, 0, 1]
    assert np.asarray(keep)[:, 0].tolist() == [False, True, False, True]   # highest prob kept
    _, _, keep, _, _ = M.route(lg, M.MoEConfig(**base, drop_policy="position"), train=True)
    assert np.asarray(keep)[:, 0].tolist() == [True, False, False, True]   # earliest kept
    _, _, keep, _, stats = M.route(lg, M.MoEConfig(**{**base, "capacity_factor": 2.0}),
                                   train=True)
    assert np.all(keep) and np.asarray(stats["counts"]).tolist() == [3, 1]  # cap > T: no drop


def _moe_model(**kw):
    return tiny(num_layers=2, moe=cfg_(**{"shared_expert_size": None, **kw}))


@pytest.mark.slow
def test_pad_to_capacity_computes_what_dropping_computes():
    toks = tokens()
    outs = []
    for kw in (dict(capacity_factor=0.75), dict(capacity_factor=0.75, pad_to_capacity=True)):
        c = _moe_model(**kw)
        outs.append(fwd(random_params(c), toks, c))
    assert max_diff(*outs) < 1e-5
    dropless = _moe_model()
    assert max_diff(outs[0], fwd(random_params(dropless), toks, dropless)) > 1e-3


# ----------------------------------------------------------------------------- dispatch

def _layer_params(cfg, seed=0):
    p = random_params(cfg, seed)["moe_layers"]["moe"]
    return jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0)[0], p)


def _dense_reference(p, x, probs, idx):
    """Loop over tokens and their experts in numpy (biases when the experts have them)."""
    e = jax.tree.map(np.asarray, p["experts"])
    b = lambda name, k: e[name][k] if name in e else 0.0  # noqa: E731
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    out = np.zeros(x.shape)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            k = int(idx[n, j])
            h = silu(x[n] @ e["wi_0"][k] + b("bi_0", k)) * (x[n] @ e["wi_1"][k] + b("bi_1", k))
            out[n] += float(probs[n, j]) * (h @ e["wo"][k] + b("bo", k))
    return out


@pytest.mark.parametrize("add_bias", [False, True])
@pytest.mark.slow
def test_sorted_grouped_matmul_dispatch_matches_a_loop(add_bias):
    cfg = tiny(num_layers=1, moe=cfg_(), add_bias_linear=add_bias)
    p = _layer_params(cfg)
    x = np.random.RandomState(1).standard_normal((24, 32)).astype(np.float32)
    probs, idx = M.topk_routing(jnp.asarray(x) @ p["router"]["w"], cfg.moe)
    got = M.experts_local(p["experts"], jnp.asarray(x), probs, idx,
                          jnp.ones(idx.shape, bool), None, cfg)
    want = _dense_reference(p, x, np.asarray(probs), np.asarray(idx))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_one_expert_top1_is_the_dense_mlp():
    dense = tiny(num_layers=2)
    moe = dense.replace(moe=M.MoEConfig(num_experts=1, topk=1, pre_softmax=True))
    pd = random_params(dense)
    layers = {k: v for k, v in pd["layers"].items() if k != "mlp"}
    layers["moe"] = {"router": random_params(moe)["moe_layers"]["moe"]["router"],   # [D, L, F]
                     "experts": jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1)[None],  # [1, L, D, F]
                                             pd["layers"]["mlp"])}
    pm = {**{k: v for k, v in pd.items() if k != "layers"}, "moe_layers": layers}
    assert max_diff(fwd(pm, tokens(), moe), fwd(pd, tokens(), dense)) < 1e-5


def test_shared_expert_adds_an_always_on_mlp():
    c = _moe_model(shared_expert_size=16)
    p = random_params(c)
    zero = jax.tree.map(jnp.zeros_like, p["moe_layers"]["moe"]["shared"]["wo"])
    p0 = {**p, "moe_layers": {**p["moe_layers"], "moe": {
        **p["moe_layers"]["moe"], "shared": {**p["moe_layers"]["moe"]["shared"], "wo": zero}}}}
    without = _moe_model()
    plain = random_params(without)
    assert max_diff(fwd(p0, tokens(), c), fwd(plain, tokens(), without)) < 1e-5
    assert max_diff(fwd(p, tokens(), c), fwd(plain, tokens(), without)) > 1e-3


# ----------------------------------------------------------------------------- the stack

def test_layer_freq_forms():
    assert M.parse_layer_freq("[0]*2+[1]*3") == (0, 0, 1, 1, 1)
    assert M.parse_layer_freq("2") == 2 and M.parse_layer_freq([1, 0]) == (1, 0)
    assert M.moe_pattern(cfg_(layer_freq=2), 5) == (True, False, True, False, True)
    with pytest.raises(ValueError):
        M.parse_layer_freq("__import__('os')")
    with pytest.raises(ValueError, match="entries"):
        tiny(num_layers=3, moe=cfg_(layer_freq=(1, 0)))


@pytest.mark.slow
def test_mixed_layers_are_two_stacks_scanned_in_blocks():
    c = tiny(num_layers=4, moe=cfg_(layer_freq=(0, 1, 0, 1)))
    shapes = jax.tree.map(lambda a: a.shape, abstract(c))
    assert shapes["layers"]["mlp"]["wo"] == (64, 2, 32)
    assert shapes["moe_layers"]["moe"]["experts"]["wo"] == (E, 2, 64, 32)
    assert logical_axes(c)["moe_layers"]["moe"]["experts"]["wi_0"] == jax.sharding.PartitionSpec(
        "exp", "layers", "embed", "mlp")
    assert [(b.start, b.reps, b.units) for b in _layer_blocks(c)] == [(0, 2, 2)]  # one scan
    first_dense = c.replace(moe=cfg_(layer_freq=(0, 1, 1, 1)))
    assert [(b.start, b.reps) for b in _layer_blocks(first_dense)] == [(0, 1), (1, 3)]
    p = random_params(c)
    ref = fwd(p, tokens(), c)
    axis0 = {k: jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), v) if k.endswith("layers")
             else v for k, v in p.items()}
    for changes in (dict(scan_layers=False, param_scan_axis=0),
                    dict(remat_policy="full", recompute_method="uniform", recompute_num_layers=2),
                    dict(recompute_modules=("moe", "moe_act"))):
        c2 = c.replace(**changes)
        p2 = axis0 if "param_scan_axis" in changes else p
        assert max_diff(fwd(p2, tokens(), c2), ref) < 1e-4, changes


def test_moe_stats_come_out_per_moe_layer():
    c = tiny(num_layers=4, moe=cfg_(layer_freq=2, aux_loss_coeff=0.01, z_loss_coeff=1e-3))
    stats = jax.jit(lambda p: hidden_states(p, tokens(), c, deterministic=False,
                                            rng=jax.random.key(0), with_moe_stats=True)[1],
                    compiler_options=FAST)(random_params(c))
    assert stats["lb"].shape == (2, 1) and stats["counts"].shape == (2, E)
    np.testing.assert_allclose(stats["counts"].sum(-1), 2 * tokens().size)   # k per token
    assert M.moe_layer_ids(c) == (0, 2)
    assert layer_kinds(c) == ("moe_layers", "layers", "moe_layers", "layers")


# ----------------------------------------------------------------------------- train-side state

def test_expert_bias_update_sign_and_exclusion_from_the_optimizer():
    c = tiny(num_layers=2, moe=cfg_(score_function="sigmoid", expert_bias=True,
                                     bias_update_rate=0.01))
    p = random_params(c)
    counts = jnp.asarray([[10.0, 0, 5, 5, 5, 5, 5, 5], [5.0] * E])
    new = M.update_expert_bias(p, counts, c)["moe_layers"]["moe"]["router"]["expert_bias"]
    old = p["moe_layers"]["moe"]["router"]["expert_bias"]
    delta = np.moveaxis(np.asarray(new - old), c.param_scan_axis, 0)
    np.testing.assert_allclose(delta[0], [-0.01, 0.01, 0, 0, 0, 0, 0, 0], atol=1e-7)  # mean 5
    np.testing.assert_allclose(delta[1], 0.0)
    assert "expert_bias" not in str(jax.tree_util.tree_structure(M.trainable(p)))
    assert "expert_bias" in str(jax.tree_util.tree_structure(M.merge_trainable(p, M.trainable(p))))
    assert abstract(c)["moe_layers"]["moe"]["router"]["expert_bias"].dtype == jnp.float32


def test_metrics_names_and_per_layer_logging():
    c = tiny(num_layers=2, moe=cfg_(aux_loss_coeff=0.1, z_loss_coeff=0.01,
                                     per_layer_logging=True))
    stats = {"lb": jnp.asarray([[1.0], [3.0]]), "z": jnp.asarray([2.0, 4.0])}
    got = M.metrics(stats, c, M.moe_layer_ids(c))
    assert got == {"moe_aux_loss": 2.0, "moe_aux_loss_layer_0": 1.0, "moe_aux_loss_layer_1": 3.0,
                   "moe_z_loss": 3.0, "moe_z_loss_layer_0": 2.0, "moe_z_loss_layer_1": 4.0}
    quiet = dataclasses.replace(c.moe, per_layer_logging=False, z_loss_coeff=None)
    assert set(M.metrics(stats, c.replace(moe=quiet), (0, 1))) == {"moe_aux_loss"}


# ----------------------------------------------------------------------------- knobs -> effect

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            vocab_size=97, make_vocab_size_divisible_by=1, max_position_embeddings=64,
            position_embedding_type="rope", normalization="RMSNorm", hidden_dropout=0.0,
            attention_dropout=0.0, bf16=False, dtype="float32", num_experts=E,
            moe_router_topk=2)

# knob -> (value, where it shows): "route" = the router's output on fixed logits (probs,
# experts, kept slots; training statistics), "block" = the MoE block's output in training,
# "params" = the parameter tree, "config" = a field the layer reads (its effect is tested above
# or in test_moe_parallel.py).
FLIPS = {
    "num_experts": (4, "params"),
    "moe_layer_freq": ("[1,0]", "params"),
    "moe_ffn_hidden_size": (16, "params"),
    "moe_shared_expert_intermediate_size": (16, "params"),
    "moe_router_enable_expert_bias": (True, "params"),
    "moe_router_topk": (3, "route"),
    "moe_router_score_function": ("sigmoid", "route"),
    "moe_router_pre_softmax": (True, "route"),
    "moe_router_topk_scaling_factor": (2.0, "route"),
    "moe_router_num_groups": (4, "route"),
    "moe_router_load_balancing_type": ("seq_aux_loss", "route"),
    "moe_aux_loss_coeff": (0.5, "route"),
    "moe_z_loss_coeff": (0.5, "route"),
    "router_logit_softcapping": (0.1, "route"),
    "moe_router_force_load_balancing": (True, "route"),
    "moe_router_force_load_balancing_type": ("uniform", "block"),
    "moe_expert_capacity_factor": (0.25, "route"),
    "moe_token_drop_policy": ("position", "route"),
    "moe_input_jitter_eps": (0.5, "block"),
    "moe_router_dtype": ("fp32", "config"),
    "moe_pad_expert_input_to_capacity": (True, "config"),
    "moe_per_layer_logging": (True, "config"),
    "moe_layer_recompute": (True, "config"),
    "moe_token_dispatcher_type": ("alltoall", "config"),
    "moe_router_bias_update_rate": (0.5, "config"),
    "expert_tensor_parallel_size": (1, "config"),
}
BOTH = {"moe_token_drop_policy": dict(moe_expert_capacity_factor=0.5),
        "moe_pad_expert_input_to_capacity": dict(moe_expert_capacity_factor=0.5),
        "moe_router_enable_expert_bias": dict(moe_router_score_function="sigmoid"),
        "moe_router_load_balancing_type": dict(moe_aux_loss_coeff=0.1),
        "moe_router_force_load_balancing_type": dict(moe_router_force_load_balancing=True),
        "expert_tensor_parallel_size": dict(tensor_model_parallel_size=2)}
FLIPPED_TOO = {"moe_router_num_groups": dict(moe_router_group_topk=1)}


def _model(flat):
    return ModelConfig.from_config({**BASE, **flat})


def _route(cfg):
    lg = logits_(n=32, scale=2.0)
    probs, idx, keep, _, stats = M.route(lg, cfg.moe, train=True, seqs=2)
    order = jnp.argsort(idx, -1)
    take = lambda a: jnp.take_along_axis(a, order, -1)  # noqa: E731  slot order is arbitrary
    return [take(probs * keep), take(idx).astype(jnp.float32), stats["objective"][None]]


def _block(cfg):
    p = random_params(tiny(num_layers=1, moe=cfg.moe))["moe_layers"]["moe"]
    p = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0)[0], p)
    x = jnp.asarray(np.random.RandomState(2).standard_normal((2, 8, 32)), jnp.float32)
    return [M.moe_block(p, x, tiny(num_layers=1, moe=cfg.moe), train=True,
                        rng=jax.random.key(1))[0]]


@pytest.mark.parametrize("knob", sorted(FLIPS))
@pytest.mark.slow
def test_each_knob_flipped_has_an_effect(knob):
    value, where = FLIPS[knob]
    both = BOTH.get(knob, {})
    base = _model(both)
    flipped = _model({**both, **FLIPPED_TOO.get(knob, {}), knob: value})
    assert base != flipped
    if where == "params":
        shapes = lambda c: jax.tree.map(lambda a: a.shape, abstract(c))  # noqa: E731
        assert shapes(base) != shapes(flipped)
    elif where in ("route", "block"):
        run = _route if where == "route" else _block
        assert any(a.shape != b.shape or max_diff(a, b) > 1e-4
                   for a, b in zip(run(base), run(flipped)))


def test_from_config_fields():
    c = _model(dict(moe_layer_recompute=True, moe_token_dispatcher_type="alltoall_seq",
                    moe_expert_capacity_factor=-1.0, moe_router_dtype="fp32",
                    moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                    moe_aux_loss_coeff=[0.1, 0.2], tensor_model_parallel_size=2,
                    expert_tensor_parallel_size=1))
    assert "moe" in c.recompute_modules and c.moe.dispatcher == "alltoall"
    assert c.moe.capacity_factor is None and c.moe.router_dtype == "float32"
    assert c.moe.aux_loss_coeff == (0.1, 0.2) and not c.moe.expert_tensor_parallel
    assert c.moe.ffn_hidden_size == 64
    assert _model({}).moe.expert_tensor_parallel
    with pytest.raises(Exception, match="recompute_granularity full"):
        _model(dict(moe_layer_recompute=True, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1))
    with pytest.raises(Exception, match="expert_tensor_parallel_size"):
        _model(dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=2))
    assert _model({"num_experts": None}).moe is None


@pytest.mark.parametrize("axis", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_upcycled_model_computes_what_the_dense_one_did(axis):
    dense = tiny(num_layers=2, param_scan_axis=axis)
    moe = dense.replace(moe=cfg_(layer_freq=(1, 0)))
    pd = random_params(dense)
    pm = M.upcycle(pd, moe, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, pm) == jax.tree.map(lambda a: a.shape, abstract(moe))
    assert max_diff(fwd(pm, tokens(), moe), fwd(pd, tokens(), dense)) < 1e-4


@pytest.mark.parametrize("gated, pre_softmax, exponent, scale", [
    (True, False, 1 / 3, 2.0),           # s = g
    (False, True, 1 / 2, E * 2 / 2),     # s = E·g/k under pre_softmax
])
def test_fine_grained_upcycling_slices_and_scales_like_megatron(gated, pre_softmax, exponent,
                                                                scale):
    """g = ffn / moe_ffn = 2: expert e is dense slice e mod 2 times s^(1/3) (gated) or s^(1/2);
    experts 2i and 2i+1 share router column i; the shared expert starts fresh."""
    dense = tiny(num_layers=2, gated_linear_unit=gated, activation="silu" if gated else "gelu")
    moe = dense.replace(moe=cfg_(ffn_hidden_size=32, pre_softmax=pre_softmax,
                                 shared_expert_size=16))
    pd = random_params(dense)
    pm = M.upcycle(pd, moe, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, pm) == jax.tree.map(lambda a: a.shape, abstract(moe))
    w = scale ** exponent
    up = "wi_0" if gated else "wi"
    dense_up, dense_down = pd["layers"]["mlp"][up][:, 1], pd["layers"]["mlp"]["wo"][:, 1]
    ex = pm["moe_layers"]["moe"]["experts"]
    for e in range(E):
        s = e % 2
        np.testing.assert_allclose(ex[up][e, 1], dense_up[:, 32 * s:32 * (s + 1)] * w, rtol=1e-6)
        np.testing.assert_allclose(ex["wo"][e, 1], dense_down[32 * s:32 * (s + 1)] * w,
                                   rtol=1e-6)
    router = np.asarray(pm["moe_layers"]["moe"]["router"]["w"][:, 1])     # [D, E]
    np.testing.assert_array_equal(router[:, 0::2], router[:, 1::2])
    assert np.abs(router[:, 0] - router[:, 2]).max() > 0
    assert set(pm["moe_layers"]["moe"]["shared"]) == ({"wi_0", "wi_1", "wo"} if gated
                                                      else {"wi", "wo"})
    with pytest.raises(ValueError, match="must divide ffn_hidden_size"):
        M.upcycle(pd, dense.replace(moe=cfg_(ffn_hidden_size=24)), jax.random.key(0))


def test_hooks_for_other_families_router_bias_and_clamped_glu():
    """GPT-OSS needs a learned router bias and its clamped GLU (alpha 1.702, (up + 1))."""
    c = tiny(num_layers=1, moe=cfg_(router_bias=True, activation="swiglu_oai", glu_limit=1.5))
    p = _layer_params(c)
    assert p["router"]["bias"].shape == (E,)
    x = jnp.ones((3, 32))
    np.testing.assert_allclose(M._gate(p["router"], x, c.moe, c),
                               x @ p["router"]["w"] + p["router"]["bias"], rtol=1e-5)
    g, u = np.array([-3.0, 0.5, 4.0]), np.array([-4.0, 0.5, 2.0])
    want = np.minimum(g, 1.5) / (1 + np.exp(-1.702 * np.minimum(g, 1.5))) * (np.clip(u, -1.5,
                                                                                     1.5) + 1)
    np.testing.assert_allclose(M._glu(jnp.asarray(g), jnp.asarray(u), c.moe, c), want,
                               rtol=1e-5)


def _maxtext_kept(idx, num_experts, factor):
    """MaxText's generate_masks: per sequence, each expert keeps its first
    int(max(ceil(S*k/E)*factor, factor)) assignments in (token, choice) order."""
    B, S, k = idx.shape
    cap = int(max(np.ceil(S * k / num_experts) * factor, factor))
    mask = np.eye(num_experts, dtype=np.int64)[idx]                      # [B, S, k, E]
    count = np.cumsum(mask.reshape(B, S * k, num_experts), axis=1).reshape(mask.shape)
    return (mask * (count <= cap)).sum(-1).astype(bool)                   # [B, S, k]


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
@pytest.mark.slow
def test_maxtext_capacity_is_per_sequence_in_token_order(factor):
    B, S, E, k = 3, 16, 4, 2
    logits = jax.random.normal(jax.random.key(3), (B * S, E))
    m = M.MoEConfig(num_experts=E, topk=k, pre_softmax=True, capacity_factor=factor,
                    capacity_per_sequence=True, drop_policy="position")
    _, idx, keep, _, _ = M.route(logits, m, train=True, seqs=B)
    want = _maxtext_kept(np.asarray(idx).reshape(B, S, k), E, factor)
    np.testing.assert_array_equal(np.asarray(keep).reshape(B, S, k), want)
    if not want.all():   # Megatron's batch-wide capacity drops other tokens
        batch_wide = dataclasses.replace(m, capacity_per_sequence=False)
        assert not np.array_equal(np.asarray(M.route(logits, batch_wide, train=True,
                                                     seqs=B)[2]), np.asarray(keep))


def test_moe_capacity_per_sequence_knob_reaches_the_model():
    from jaxtrain.config import load_config

    base = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=128",
            "num_experts=4", "moe_router_topk=2", "moe_expert_capacity_factor=1.0",
            "moe_router_pre_softmax=true"]
    cfg = ModelConfig.from_config({**load_config(None, base)})
    assert not cfg.moe.capacity_per_sequence
    cfg = ModelConfig.from_config({**load_config(None, [*base, "moe_capacity_per_sequence=true"])})
    assert cfg.moe.capacity_per_sequence


def test_megatron_flex_dispatcher_runs_as_the_all_to_all_dispatch():
    """flex (DeepEP/HybridEP in Megatron) builds jaxtrain's all-to-all dispatch; Megatron's
    checks on it hold, and the lossy settings of its kernels are refused by name."""
    from jaxtrain.config import load_config
    from jaxtrain.config.errors import ConfigError

    base = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=128",
            "num_experts=4", "moe_router_topk=2", "moe_router_pre_softmax=true"]

    def dispatcher(*extra):
        return ModelConfig.from_config({**load_config(None, [*base, *extra])}).moe.dispatcher

    assert dispatcher() == "allgather"
    assert dispatcher("moe_token_dispatcher_type=flex") == "alltoall"
    assert dispatcher("moe_token_dispatcher_type=flex", "moe_enable_deepep=true") == "alltoall"
    for extra, says in (
            (["moe_enable_deepep=true"], "set moe_token_dispatcher_type: flex"),
            (["moe_token_dispatcher_type=flex", "moe_pad_expert_input_to_capacity=true",
              "moe_expert_capacity_factor=1.0"], "does not pad experts to capacity"),
            (["moe_token_dispatcher_type=flex", "moe_flex_dispatcher_backend=ncclep",
              "moe_dispatch_fwd_dtype=mxfp8"], "moe_dispatch_fwd_dtype"),
            (["moe_token_dispatcher_type=flex", "moe_flex_dispatcher_backend=hybridep",
              "moe_expert_rank_capacity_factor=1.5"], "moe_expert_rank_capacity_factor")):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [*base, *extra])
    assert dispatcher("moe_token_dispatcher_type=flex", "moe_flex_dispatcher_backend=hybridep",
                      "moe_pad_expert_input_to_capacity=true",
                      "moe_expert_capacity_factor=1.0") == "alltoall"
