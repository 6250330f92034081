"""Optimizers against hand-written references: AdamW, SGD, Muon, 8-bit states, Lion,
schedule-free, precision-aware moments, clipping, decay masks and LR groups."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain.config import ConfigError, load_config
from jaxtrain.optim import quantized as q
from jaxtrain.optim.optimizers import (OptimConfig, build_optimizer, leaf_plan, muon_scale_factor,
                                       newton_schulz, opt_state_memory_kind, param_labels,
                                       schedule_free_eval_params, with_opt_state_memory_kind)

D, L, N, K, H, F, V = 8, 2, 4, 2, 4, 16, 16

AXES = {
    "embedding": P("vocab", "embed"),
    "position_embedding": P(None, "embed"),
    "output": P("embed", "vocab"),
    "final_norm": {"scale": P("norm")},
    "layers": {
        "attn_norm": {"scale": P("norm", "layers")},
        "attn": {"wq": P("embed", "layers", "q_heads", "kv"),
                 "wk": P("embed", "layers", "kv_heads", "kv"),
                 "wv": P("embed", "layers", "kv_heads", "kv"),
                 "wo": P("q_heads", "layers", "kv", "embed"),
                 "bq": P("q_heads", "layers", "kv")},
        "mlp": {"wi_0": P("embed", "layers", "mlp"), "wi_1": P("embed", "layers", "mlp"),
                "wo": P("mlp", "layers", "embed"), "bo": P("embed", "layers")},
    },
}
SHAPES = {
    "embedding": (V, D), "position_embedding": (12, D), "output": (D, V),
    "final_norm": {"scale": (D,)},
    "layers": {
        "attn_norm": {"scale": (D, L)},
        "attn": {"wq": (D, L, N, H), "wk": (D, L, K, H), "wv": (D, L, K, H),
                 "wo": (N, L, H, D), "bq": (N, L, H)},
        "mlp": {"wi_0": (D, L, F), "wi_1": (D, L, F), "wo": (F, L, D), "bo": (D, L)},
    },
}
# Megatron's no_wd: biases and norms (1-D in torch) are not decayed; everything else is.
MEGATRON_DECAY = {"embedding": 1, "position_embedding": 1, "output": 1, "final_norm": {"scale": 0},
                  "layers": {"attn_norm": {"scale": 0},
                             "attn": {"wq": 1, "wk": 1, "wv": 1, "wo": 1, "bq": 0},
                             "mlp": {"wi_0": 1, "wi_1": 1, "wo": 1, "bo": 0}}}
IS_SHAPE = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731


def tree(seed, scale=1.0):
    shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=IS_SHAPE)
    rng = np.random.default_rng(seed)
    return treedef.unflatten([jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
                              for s in shapes])


def cfg(**kw):
    kw.setdefault("clip_grad", 0.0)
    return OptimConfig(**kw)


def run(opt, params, grads_list):
    """Apply ``opt`` for each gradient tree; returns (list of update trees, params, state)."""
    state = opt.init(params)
    step = opt.update  # eager: Newton-Schulz is jitted and cached per shape across tests
    updates = []
    for g in grads_list:
        u, state = step(g, state, params)
        updates.append(u)
        params = optax.apply_updates(params, u)
    return updates, params, state


def adam_state(state):
    """The Adam/Lion state of the 'main' group of build_optimizer's state."""
    return state[-1].inner_states["main"].inner_state[0]


def get(t, path):
    for k in path:
        t = t[k]
    return t


def to_np(t):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), t)


def layer_matrix(x, which):
    """(L, in, out) matrices of a stacked leaf."""
    x = np.asarray(x, np.float64)
    if which in ("wq", "wk", "wv"):  # [D, L, N, H] -> (L, D, N*H)
        return x.transpose(1, 0, 2, 3).reshape(L, D, -1)
    if which == "attn_wo":  # [N, L, H, D] -> (L, N*H, D)
        return x.transpose(1, 0, 2, 3).reshape(L, -1, D)
    return x.transpose(1, 0, 2)  # [in, L, out] -> (L, in, out)


# ----------------------------------------------------------------------------- config

def test_from_config_megatron_defaults():
    oc = OptimConfig.from_config(load_config(None, [], enforce_status=False))
    assert (oc.name, oc.flavour, oc.adam_beta2, oc.clip_grad) == ("adam", "megatron", 0.999, 1.0)
    assert oc.muon_coefficients == "quintic" and oc.muon_lr_mult == 1.0 and not oc.host_offload


def test_from_config_reads_every_knob():
    c = load_config(None, [
        "optimizer=muon", "adam_beta1=0.8", "adam_beta2=0.9", "adam_eps=1e-6",
        "sgd_momentum=0.5", "weight_decay=0.2", "clip_grad=0.3", "muon_momentum=0.7",
        "muon_use_nesterov=true", "muon_num_ns_steps=10", "muon_scale_mode=unit_rms_norm",
        "muon_extra_scale_factor=0.2", "muon_fp32_matmul_prec=high", "muon_split_qkv=false",
        "muon_tp_mode=distributed", "tensor_model_parallel_size=2", "decoupled_lr=1e-3",
        "decoupled_min_lr=1e-5", "use_precision_aware_optimizer=true",
        "main_grads_dtype=bf16", "main_params_dtype=fp16", "exp_avg_dtype=bfloat16",
        "exp_avg_sq_dtype=fp8", "optimizer_memory_host_offload=true", "lr=3e-4"],
        enforce_status=False)
    oc = OptimConfig.from_config(c)
    want = dict(name="muon", adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6, sgd_momentum=0.5,
                weight_decay=0.2, clip_grad=0.3, muon_momentum=0.7, muon_nesterov=True,
                muon_num_ns_steps=10, muon_scale_mode="unit_rms_norm",
                muon_extra_scale_factor=0.2, muon_fp32_matmul_prec="high", muon_split_qkv=False,
                muon_tp_mode="distributed", tp_size=2, decoupled_lr=1e-3, decoupled_min_lr=1e-5,
                use_precision_aware_optimizer=True, main_grads_dtype="bf16",
                main_params_dtype="fp16", exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8",
                optimizer_memory_host_offload=True, lr=3e-4)
    assert {k: getattr(oc, k) for k in want} == want
    assert oc.master_params_dtype == jnp.float16


def test_from_config_pgs_file(write):
    path = write("pgs.yml", """
        model: {name_or_path: null}
        train:
          optimizer: muon
          learning_rate: 1.0e-4
          warmup_ratio: 0.1
          max_steps: 200
          weight_decay: 0.05
          max_grad_norm: 0.5
        plugins:
          schedule_free: true
        """)
    oc = OptimConfig.from_config(load_config(path, [], enforce_status=False))
    assert (oc.flavour, oc.name, oc.schedule_free) == ("pgs", "muon", True)
    assert (oc.adam_beta1, oc.adam_beta2, oc.weight_decay, oc.clip_grad) == (0.9, 0.95, 0.05, 0.5)
    assert oc.muon_nesterov and oc.muon_coefficients == "jordan" and oc.muon_lr_mult == 10.0
    assert oc.muon_scale_mode == "shape_scaling"
    assert oc.schedule_free_warmup_steps == 20  # int(200 * 0.1), as pgs computes it


def test_from_config_cli_train_optimizer_and_conflict():
    c = load_config(None, ["train.optimizer=lion8bit"], enforce_status=False)
    assert OptimConfig.from_config(c).flavour == "pgs"
    with pytest.raises(ConfigError, match="both choose the optimizer"):   # in the dry run
        load_config(None, ["train.optimizer=lion8bit", "optimizer=sgd"], enforce_status=False)


def test_config_refusals():
    with pytest.raises(ValueError, match="use_precision_aware_optimizer"):
        OptimConfig(exp_avg_dtype="bf16")
    with pytest.raises(ValueError, match="multiple of 5"):
        OptimConfig(name="muon", muon_num_ns_steps=3)
    with pytest.raises(ValueError, match="wd_schedule"):
        build_optimizer(cfg(weight_decay_incr_style="linear"), 1e-3, AXES)


def test_leaf_kinds_on_real_model_tree():
    from jaxtrain.models import ModelConfig, logical_axes
    mc = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=64, vocab_size=64, add_bias_linear=True, qk_layernorm=True,
                     normalization="LayerNorm")
    plan = leaf_plan(logical_axes(mc))
    kinds = {"/".join(p): leaf.kind for p, leaf in plan.items()}
    assert kinds["embedding"] == "embedding" and kinds["output"] == "output"
    assert kinds["final_norm/bias"] == kinds["layers/attn/q_norm/scale"] == "norm"
    for name in ("bq", "bk", "bv", "bo"):
        assert kinds[f"layers/attn/{name}"] == "bias"
    assert kinds["layers/mlp/bi_0"] == kinds["layers/mlp/bo"] == "bias"
    for name in ("attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/wi_0", "mlp/wo"):
        assert kinds[f"layers/{name}"] == "matrix"
    labels = param_labels(cfg(name="muon"), logical_axes(mc))
    assert labels[("layers", "attn", "wq")] == "muon" and labels[("embedding",)] == "adam"


# ----------------------------------------------------------------------------- Adam / SGD

def np_adamw(params, grads_list, lrs, b1, b2, eps, wd, decay):
    p, m, v = to_np(params), None, None
    m = jax.tree.map(np.zeros_like, p)
    v = jax.tree.map(np.zeros_like, p)
    for t, (g, lr) in enumerate(zip(grads_list, lrs), start=1):
        g = to_np(g)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        p = jax.tree.map(
            lambda p, m, v, d: p - lr * ((m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
                                         + wd * d * p), p, m, v, decay)
    return p


def assert_trees_close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), **tol)


def test_adam_matches_numpy_adamw_with_megatron_no_decay():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 6)]
    sched = lambda c: 1e-2 * (c + 1) / 5.0  # noqa: E731
    oc = cfg(name="adam", adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.3)
    _, out, _ = run(build_optimizer(oc, sched, AXES), params, grads)
    ref = np_adamw(params, grads, [sched(c) for c in range(5)], 0.8, 0.95, 1e-6, 0.3,
                   MEGATRON_DECAY)
    assert_trees_close(out, ref, rtol=1e-5, atol=1e-6)
    no_decay = np_adamw(params, grads, [sched(c) for c in range(5)], 0.8, 0.95, 1e-6, 0.3,
                        jax.tree.map(lambda _: 1, MEGATRON_DECAY))
    assert not np.allclose(out["final_norm"]["scale"], no_decay["final_norm"]["scale"])


def test_pgs_adamw_skips_embedding_decay_megatron_does_not():
    params = tree(0)
    zeros = [jax.tree.map(jnp.zeros_like, params)]
    for flavour, emb_decayed in (("pgs", False), ("megatron", True)):
        oc = cfg(name="adamw" if flavour == "pgs" else "adam", flavour=flavour, weight_decay=0.5)
        _, out, _ = run(build_optimizer(oc, 0.1, AXES), params, zeros)
        np.testing.assert_allclose(out["output"], params["output"] * 0.95, rtol=1e-6)
        emb = params["embedding"] * (0.95 if emb_decayed else 1.0)
        np.testing.assert_allclose(out["embedding"], emb, rtol=1e-6)
        np.testing.assert_allclose(out["layers"]["attn"]["bq"], params["layers"]["attn"]["bq"])


def test_sgd_momentum_and_megatron_l2_decay():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 5)]
    oc = cfg(name="sgd", sgd_momentum=0.6, weight_decay=0.2)
    _, out, _ = run(build_optimizer(oc, 0.05, AXES), params, grads)
    p, buf = to_np(params), None
    for g in grads:  # torch SGD: d = g + wd p; buf = mom buf + d; p -= lr buf
        d = jax.tree.map(lambda g, p, k: g + 0.2 * k * p, to_np(g), p, MEGATRON_DECAY)
        buf = d if buf is None else jax.tree.map(lambda b, d: 0.6 * b + d, buf, d)
        p = jax.tree.map(lambda p, b: p - 0.05 * b, p, buf)
    assert_trees_close(out, p, rtol=1e-5, atol=1e-6)


def test_clip_grad_scales_by_global_norm_and_zero_turns_it_off():
    params, g = tree(0), tree(1, 10.0)
    norm = float(optax.tree.norm(g))
    for clip, factor in ((0.5, 0.5 / (norm + 1e-6)), (0.0, 1.0), (10 * norm, 1.0)):
        oc = cfg(name="sgd", sgd_momentum=0.0, clip_grad=clip)
        (u,), _, _ = run(build_optimizer(oc, 1.0, AXES), params, [g])
        assert_trees_close(u, jax.tree.map(lambda x: -factor * x, g), rtol=1e-5)


def test_weight_decay_schedule_is_used():
    params = tree(0)
    zeros = [jax.tree.map(jnp.zeros_like, params)] * 3
    wd = lambda c: 0.1 * (c + 1)  # noqa: E731
    oc = cfg(name="sgd", sgd_momentum=0.0, weight_decay=0.0, weight_decay_incr_style="linear")
    _, out, _ = run(build_optimizer(oc, 0.5, AXES, wd_schedule=wd), params, zeros)
    factor = (1 - 0.5 * 0.1) * (1 - 0.5 * 0.2) * (1 - 0.5 * 0.3)
    np.testing.assert_allclose(out["layers"]["mlp"]["wo"], params["layers"]["mlp"]["wo"] * factor,
                               rtol=1e-6)
    np.testing.assert_allclose(out["final_norm"]["scale"], params["final_norm"]["scale"])


def test_decoupled_lr_for_embedding_and_output():
    params = tree(0)
    ones = [jax.tree.map(jnp.ones_like, params)]
    oc = cfg(name="sgd", sgd_momentum=0.0, lr=0.1, decoupled_lr=0.7, min_lr=0.01)
    (u,), _, _ = run(build_optimizer(oc, lambda c: 0.1, AXES,
                                     decoupled_lr_schedule=lambda c: 0.7), params, ones)
    assert float(u["embedding"][0, 0]) == pytest.approx(-0.7)
    assert float(u["output"][0, 0]) == pytest.approx(-0.7)
    assert float(u["position_embedding"][0, 0]) == pytest.approx(-0.1)  # Megatron: not decoupled
    assert float(u["layers"]["mlp"]["wo"][0, 0, 0]) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="decoupled_lr_schedule"):
        build_optimizer(oc, lambda c: 0.1, AXES)
    with pytest.raises(ValueError, match="decoupled_lr_schedule"):
        build_optimizer(dataclasses.replace(oc, min_lr=0.0, decoupled_min_lr=1e-4), 0.1, AXES)
    exact = dataclasses.replace(oc, min_lr=0.0)  # same shape, scaled: derived from lr_schedule
    (u,), _, _ = run(build_optimizer(exact, lambda c: 0.1, AXES), params, ones)
    assert float(u["output"][0, 0]) == pytest.approx(-0.7)


# ----------------------------------------------------------------------------- Muon

def np_newton_schulz(x, steps, coeffs):
    """Emerging-Optimizers' newton_schulz (fp32): normalise, iterate on the wide side."""
    x = np.asarray(x, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    x = np.swapaxes(x, -1, -2) if tall else x
    x = x / max(np.linalg.norm(x), 1e-7)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return np.swapaxes(x, -1, -2) if tall else x


QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def test_newton_schulz_matches_emerging_optimizers_loop():
    x = np.random.default_rng(0).standard_normal((12, 20)).astype(np.float32)
    for xx in (x, x.T):
        got = newton_schulz(xx, 5, "quintic", "high")
        np.testing.assert_allclose(got, np_newton_schulz(xx, 5, QUINTIC), atol=2e-5)
    jordan = newton_schulz(x, 5, "jordan", "high")
    np.testing.assert_allclose(jordan, np_newton_schulz(x, 5, [(3.4445, -4.7750, 2.0315)]),
                               atol=2e-5)


MUON = dict(name="muon", muon_momentum=0.0, muon_fp32_matmul_prec="high", muon_num_ns_steps=10)


def muon_update(grads_list=None, params=None, lr=1.0, **kw):
    params = tree(0) if params is None else params
    grads_list = grads_list or [tree(1)]
    ups, _, _ = run(build_optimizer(cfg(**{**MUON, **kw}), lr, AXES), params, grads_list)
    return ups[-1]


def svals(m):
    return np.linalg.svd(m, compute_uv=False)


def test_muon_matrix_updates_are_orthogonal_and_the_rest_is_adam():
    g = tree(1)
    u = muon_update([g], lr=0.5)
    for name, leaf, (n_in, n_out) in (("wq", u["layers"]["attn"]["wq"], (D, N * H)),
                                      ("attn_wo", u["layers"]["attn"]["wo"], (N * H, D))):
        scale = muon_scale_factor(n_out, n_in, "spectral")
        for m in layer_matrix(leaf, name):
            s = svals(m / (-0.5 * scale))
            assert m.shape == (n_in, n_out) and 0.95 < s.min() and s.max() < 1.05
    # first Adam step: m_hat = g, v_hat = g^2 -> -lr * g / (|g| + eps)
    for path in (("final_norm", "scale"), ("embedding",), ("output",), ("layers", "attn", "bq")):
        gg = np.asarray(get(g, path))
        np.testing.assert_allclose(get(u, path), -0.5 * gg / (np.abs(gg) + 1e-8), rtol=1e-5)


def test_muon_momentum_and_nesterov_follow_emerging_optimizers():
    g1, g2 = tree(1), tree(2)
    b = 0.9
    for nesterov in (False, True):
        u = muon_update([g1, g2], muon_momentum=b, muon_nesterov=nesterov, muon_split_qkv=True)
        x1, x2 = layer_matrix(g1["layers"]["attn"]["wk"], "wk"), layer_matrix(
            g2["layers"]["attn"]["wk"], "wk")
        m = b * (1 - b) * x1 + (1 - b) * x2  # m = lerp(m, g, 1 - b) twice from 0
        d = x2 + b * (m - x2) if nesterov else m
        scale = muon_scale_factor(K * H, D, "spectral")
        want = np.stack([-scale * np_newton_schulz(di, 10, QUINTIC) for di in d])
        np.testing.assert_allclose(layer_matrix(u["layers"]["attn"]["wk"], "wk"), want,
                                   atol=2e-4)


@pytest.mark.parametrize("knob,value", [
    ("muon_momentum", 0.5), ("muon_nesterov", True), ("muon_num_ns_steps", 5),
    ("muon_scale_mode", "shape_scaling"), ("muon_extra_scale_factor", 0.2),
    ("muon_fp32_matmul_prec", "medium"), ("muon_split_qkv", False),
    ("tp_size", 2)])
def test_each_muon_knob_changes_the_update(knob, value):
    grads = [tree(1), tree(2)]
    base = dict(muon_momentum=0.9)
    a = muon_update(grads, **base)
    b = muon_update(grads, **{**base, knob: value})
    diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a["layers"]),
                                                               jax.tree.leaves(b["layers"])))
    assert diff > 1e-3, knob


def test_muon_scale_modes_and_extra_factor_match_formulas():
    ref = muon_update()["layers"]["mlp"]["wo"]  # (F x D) per layer: out=D, in=F
    for mode, extra in (("shape_scaling", 1.0), ("unit_rms_norm", 1.0), ("spectral", 0.2)):
        u = muon_update(muon_scale_mode=mode, muon_extra_scale_factor=extra)["layers"]["mlp"]["wo"]
        ratio = muon_scale_factor(D, F, mode) * extra / muon_scale_factor(D, F, "spectral")
        np.testing.assert_allclose(u, ref * ratio, rtol=1e-5, atol=1e-7)
    assert muon_scale_factor(D, F, "shape_scaling") == 1.0
    assert muon_scale_factor(D, F, "unit_rms_norm") == pytest.approx((D / F) ** 0.5)


def test_muon_matmul_precision_low_is_medium_bf16():
    low, medium = muon_update(muon_fp32_matmul_prec="low"), muon_update(
        muon_fp32_matmul_prec="medium")
    assert_trees_close(low, medium, rtol=0, atol=0)
    high = muon_update()
    np.testing.assert_allclose(medium["layers"]["mlp"]["wo"], high["layers"]["mlp"]["wo"],
                               atol=0.1)  # bf16 iterations: close, not equal


def test_muon_split_qkv_false_orthogonalises_the_fused_qkv():
    g = tree(1)
    u = muon_update([g], muon_split_qkv=False)["layers"]["attn"]
    fused_g = np.concatenate([layer_matrix(g["layers"]["attn"][n], n) for n in ("wq", "wk", "wv")],
                             axis=-1)  # (L, D, (N + 2K) H)
    scale = muon_scale_factor((N + 2 * K) * H, D, "spectral")
    want = np.stack([-scale * np_newton_schulz(m, 10, QUINTIC) for m in fused_g])
    got = np.concatenate([layer_matrix(u[n], n) for n in ("wq", "wk", "wv")], axis=-1)
    np.testing.assert_allclose(got, want, atol=2e-4)
    split = muon_update([g], muon_split_qkv=True)["layers"]["attn"]
    want_q = np.stack([-muon_scale_factor(N * H, D, "spectral") * np_newton_schulz(m, 10, QUINTIC)
                       for m in layer_matrix(g["layers"]["attn"]["wq"], "wq")])
    np.testing.assert_allclose(layer_matrix(split["wq"], "wq"), want_q, atol=2e-4)


def test_megatron_muon_fuses_gated_fc1_pgs_does_not():
    g = tree(1)
    fused = np.concatenate([layer_matrix(g["layers"]["mlp"][n], n) for n in ("wi_0", "wi_1")],
                           axis=-1)
    scale = muon_scale_factor(2 * F, D, "spectral")
    want = np.stack([-scale * np_newton_schulz(m, 10, QUINTIC) for m in fused])
    u = muon_update([g])["layers"]["mlp"]
    got = np.concatenate([layer_matrix(u[n], n) for n in ("wi_0", "wi_1")], axis=-1)
    np.testing.assert_allclose(got, want, atol=2e-4)
    pgs = muon_update([g], flavour="pgs", muon_fuse_fc1=False)["layers"]["mlp"]
    assert not np.allclose(pgs["wi_0"], u["wi_0"], atol=1e-3)


def test_muon_tp_blockwise_orthogonalises_each_shard():
    g = tree(1)
    block = muon_update([g], tp_size=2, muon_tp_mode="blockwise")["layers"]
    whole = muon_update([g], tp_size=2, muon_tp_mode="duplicated")["layers"]
    assert_trees_close(whole, muon_update([g], tp_size=2, muon_tp_mode="distributed")["layers"],
                       rtol=0, atol=0)
    assert_trees_close(whole, muon_update([g], tp_size=1)["layers"], rtol=0, atol=0)
    # column-parallel wq: heads split -> two D x (N/2 * H) blocks, each with its own scale
    gq = layer_matrix(g["layers"]["attn"]["wq"], "wq")
    uq = layer_matrix(block["attn"]["wq"], "wq")
    half = N * H // 2
    for i in range(2):
        blk = gq[..., i * half:(i + 1) * half]
        want = np.stack([-muon_scale_factor(half, D, "spectral") * np_newton_schulz(m, 10, QUINTIC)
                         for m in blk])
        np.testing.assert_allclose(uq[..., i * half:(i + 1) * half], want, atol=2e-4)
    # row-parallel mlp wo: the input (F) side is split
    go, uo = layer_matrix(g["layers"]["mlp"]["wo"], "wo"), layer_matrix(block["mlp"]["wo"], "wo")
    want = np.stack([-muon_scale_factor(D, F // 2, "spectral") * np_newton_schulz(m, 10, QUINTIC)
                     for m in go[:, F // 2:]])
    np.testing.assert_allclose(uo[:, F // 2:], want, atol=2e-4)
    # tp 4 > K = 2 kv heads: Megatron replicates wk/wv, so each rank has the whole matrix
    four = muon_update([g], tp_size=4, muon_tp_mode="blockwise")["layers"]["attn"]
    assert_trees_close(four["wk"], whole["attn"]["wk"], rtol=0, atol=0)
    assert not np.allclose(four["wq"], whole["attn"]["wq"], atol=1e-3)
    with pytest.raises(NotImplementedError, match="muon_split_qkv"):
        muon_update([g], tp_size=4, muon_tp_mode="blockwise", muon_split_qkv=False)


def test_dist_muon_is_muon_and_megatron_muon_param_split():
    assert_trees_close(muon_update(name="dist_muon"), muon_update(name="muon"), rtol=0, atol=0)
    opt, params, g = build_optimizer(cfg(**MUON), 1.0, AXES), tree(0), tree(1)
    jitted = jax.jit(opt.update)(g, opt.init(params), params)[0]
    assert_trees_close(jitted, muon_update(), rtol=1e-4, atol=1e-5)
    labels = param_labels(cfg(name="muon"), AXES)
    assert labels[("position_embedding",)] == "muon"  # 2-D, not embedding/output: Megatron
    for p in (("embedding",), ("output",), ("layers", "attn", "bq"), ("layers", "mlp", "bo"),
              ("layers", "attn_norm", "scale")):
        assert labels[p] == "adam", p


def test_muon_weight_decay_uses_lr():
    params = tree(0)
    zeros = [jax.tree.map(jnp.zeros_like, params)]
    u = muon_update(zeros, params=params, lr=0.1, weight_decay=0.5)
    np.testing.assert_allclose(u["layers"]["mlp"]["wo"], -0.05 * params["layers"]["mlp"]["wo"],
                               rtol=1e-5)


def test_pgs_muon_torch_semantics():
    g, params = tree(1), tree(0)
    oc = dict(flavour="pgs", muon_coefficients="jordan", muon_num_ns_steps=5,
              muon_scale_mode="shape_scaling", muon_lr_mult=10.0, muon_fuse_fc1=False,
              weight_decay=0.0)
    u = muon_update([g], params=params, lr=0.01, **oc)
    labels = param_labels(cfg(name="muon", flavour="pgs"), AXES)
    assert labels[("output",)] == "muon" and labels[("embedding",)] == "adam"
    # output [D, V]: torch lm_head [V, D] -> out V, in D; lr x 10; sqrt(max(1, V/D))
    want = -0.1 * (V / D) ** 0.5 * np_newton_schulz(np.asarray(g["output"]), 5,
                                                   [(3.4445, -4.7750, 2.0315)])
    np.testing.assert_allclose(u["output"], want, atol=2e-4)
    ge = np.asarray(g["embedding"])
    np.testing.assert_allclose(u["embedding"], -0.01 * ge / (np.abs(ge) + 1e-8), rtol=1e-5)
    zeros = [jax.tree.map(jnp.zeros_like, params)]
    u = muon_update(zeros, params=params, lr=0.01, **{**oc, "weight_decay": 0.5})
    np.testing.assert_allclose(u["embedding"], -0.005 * params["embedding"], rtol=1e-5)


# ----------------------------------------------------------------------------- 8-bit states

def test_dynamic_map_is_bitsandbytes_shape():
    s, u = q.dynamic_map(True), q.dynamic_map(False)
    assert s.shape == u.shape == (256,) and np.all(np.diff(s) >= 0) and np.all(np.diff(u) >= 0)
    assert s.max() == u.max() == 1.0 and s.min() < -0.99 and u.min() == 0.0
    assert np.sum(s > 0) == 128 and np.sum(s < 0) == 127 and np.sum(u > 0) == 255


def test_blockwise_quantisation_round_trip_bound():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 1000))
                    * np.logspace(-4, 0, 1000), jnp.float32)
    for signed, data, bound in ((True, x, 0.0072), (False, x * x, 0.0036)):
        st = q.quantize_blockwise(data, signed)
        assert st.codes.dtype == jnp.uint8 and st.codes.shape == data.shape
        assert st.absmax.shape == (6, 4)
        back = q.dequantize_blockwise(st, signed)
        blocks = np.pad(np.asarray(data), ((0, 0), (0, 24))).reshape(6, 4, 256)
        amax = np.repeat(np.abs(blocks).max(-1), 256, axis=-1)[:, :1000]
        assert np.all(np.abs(np.asarray(back) - np.asarray(data)) <= bound * amax + 1e-12)


BIG_AXES = {"w": P("embed", "layers", "mlp"), "b": P("mlp")}


def big_tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(scale * rng.standard_normal((64, 2, 256)), jnp.float32),
            "b": jnp.asarray(scale * rng.standard_normal(256), jnp.float32)}


def test_adamw8bit_state_tracks_fp32_over_100_steps_at_one_byte_per_element():
    params = big_tree(0)
    eight = build_optimizer(cfg(name="adamw8bit", flavour="pgs", adam_beta2=0.95,
                                weight_decay=0.1), 1e-3, BIG_AXES)
    full = build_optimizer(cfg(name="adamw", flavour="pgs", adam_beta2=0.95, weight_decay=0.1),
                           1e-3, BIG_AXES)
    s8, s32 = eight.init(params), full.init(params)
    st8, st32 = adam_state(s8), adam_state(s32)
    assert isinstance(st8.mu["w"], q.Quantized8) and isinstance(st8.nu["w"], q.Quantized8)
    assert st8.mu["b"].dtype == jnp.float32  # 256 < bitsandbytes' min_8bit_size
    n = params["w"].size
    for moment in (st8.mu["w"], st8.nu["w"]):
        assert 1.0 <= q.state_nbytes(moment) / n <= 1.02  # uint8 codes + 1 fp32 per 256
    assert q.state_nbytes(st32.mu["w"]) / n == 4.0
    up8, up32 = jax.jit(eight.update), jax.jit(full.update)
    p8 = p32 = params
    errs = []
    for t in range(100):
        g = big_tree(100 + t, scale=float(np.exp(np.sin(t / 7.0))))
        u8, s8 = up8(g, s8, p8)
        u32, s32 = up32(g, s32, p32)
        p8, p32 = optax.apply_updates(p8, u8), optax.apply_updates(p32, u32)
        a8, a32 = adam_state(s8), adam_state(s32)
        for m8, m32, signed in ((a8.mu["w"], a32.mu["w"], True), (a8.nu["w"], a32.nu["w"], False)):
            back = q.dequantize_blockwise(m8, signed, (1,))
            errs.append(float(jnp.linalg.norm(back - m32) / jnp.linalg.norm(m32)))
    # EMA of per-step rounding (~1% per 8-bit requantisation): bounded, not growing
    assert max(errs) < 0.06 and np.mean(errs[-40:]) < 0.04, (max(errs), np.mean(errs[-40:]))
    assert min(errs) > 1e-3  # it really is quantised
    rel = float(jnp.linalg.norm(p8["w"] - p32["w"]) / jnp.linalg.norm(p32["w"] - params["w"]))
    assert rel < 0.05, rel


def test_lion8bit_sign_update_and_betas():
    params = big_tree(0)
    g1, g2 = big_tree(1), big_tree(2)
    oc = cfg(name="lion8bit", flavour="pgs", weight_decay=0.1)
    (u1, u2), _, state = run(build_optimizer(oc, 1e-2, BIG_AXES), params, [g1, g2])
    # step 1 (m = 0): -lr * (sign(g) + wd p); the bias is not decayed
    np.testing.assert_allclose(u1["w"], -1e-2 * (np.sign(g1["w"]) + 0.1 * params["w"]), rtol=1e-5)
    np.testing.assert_allclose(u1["b"], -1e-2 * np.sign(g1["b"]), rtol=1e-6)
    m1 = 0.02 * np.asarray(g1["b"])  # (1 - 0.98) g: the bias moment is float32
    np.testing.assert_allclose(u2["b"], -1e-2 * np.sign(0.95 * m1 + 0.05 * np.asarray(g2["b"])))
    lion = adam_state(state)
    assert isinstance(lion.mu["w"], q.Quantized8)
    m2 = 0.98 * 0.02 * np.asarray(g1["w"]) + 0.02 * np.asarray(g2["w"])
    back = np.asarray(q.dequantize_blockwise(lion.mu["w"], True, (1,)))
    assert np.linalg.norm(back - m2) / np.linalg.norm(m2) < 0.02


def test_paged_adamw8bit_is_adamw8bit_in_host_memory():
    params, grads = big_tree(0), [big_tree(1), big_tree(2)]
    paged = cfg(name="paged_adamw8bit", flavour="pgs")
    a, _, _ = run(build_optimizer(paged, 1e-3, BIG_AXES), params, grads)
    b, _, _ = run(build_optimizer(cfg(name="adamw8bit", flavour="pgs"), 1e-3, BIG_AXES), params,
                  grads)
    assert_trees_close(a, b, rtol=0, atol=0)
    assert opt_state_memory_kind(paged) == "pinned_host"  # the CPU backend offers it
    assert opt_state_memory_kind(cfg(name="adamw8bit", flavour="pgs")) is None
    assert opt_state_memory_kind(cfg(optimizer_memory_host_offload=True)) == "pinned_host"
    assert opt_state_memory_kind(cfg()) is None
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = {"x": jax.sharding.NamedSharding(mesh, P())}
    placed = with_opt_state_memory_kind(sh, paged)
    assert placed["x"].memory_kind == "pinned_host"
    assert with_opt_state_memory_kind(sh, cfg()) is sh


# ----------------------------------------------------------------------------- schedule-free

def test_schedule_free_runs_warms_up_and_differs_from_adamw():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 6)]
    sf = cfg(name="adamw", flavour="pgs", schedule_free=True, lr=1e-2, adam_beta2=0.95,
             schedule_free_warmup_steps=2, weight_decay=0.1)
    ups, out, state = run(build_optimizer(sf, 123.0, AXES), params, grads)  # lr_schedule unused
    # schedulefree's warmup: the k-th update uses lr * (k + 1) / warmup
    first = jax.tree.leaves(ups[0])
    half = run(build_optimizer(dataclasses.replace(sf, schedule_free_warmup_steps=0,
                                                   lr=0.5e-2), 1.0, AXES), params, grads[:1])[0]
    assert_trees_close(first, jax.tree.leaves(half[0]), rtol=1e-5, atol=1e-9)
    _, adamw, _ = run(build_optimizer(cfg(name="adamw", flavour="pgs", adam_beta2=0.95,
                                          weight_decay=0.1), 1e-2, AXES), params, grads)
    assert not np.allclose(out["output"], adamw["output"], atol=1e-4)
    assert np.all(np.isfinite(np.asarray(out["output"])))
    ev = schedule_free_eval_params(state, out)
    assert not np.allclose(ev["output"], out["output"])
    assert schedule_free_eval_params((optax.EmptyState(),), out) is out
    no_warm = dataclasses.replace(sf, schedule_free_warmup_steps=0)
    ups, _, _ = run(build_optimizer(no_warm, 1.0, AXES), params, grads[:1])
    assert float(jnp.max(jnp.abs(ups[0]["output"]))) > 0


# ----------------------------------------------------------------------------- precision-aware

@pytest.mark.slow
def test_precision_aware_moment_dtypes_in_state():
    params, grads = tree(0), [tree(s, 0.1) for s in range(1, 4)]
    ref = run(build_optimizer(cfg(), 1e-3, AXES), params, grads)[1]
    for mu_t, nu_t, mu_dtype, nu_dtype, tol in (
            ("bf16", "fp16", jnp.bfloat16, jnp.float16, 1e-2),
            ("fp8", "fp8", jnp.float8_e4m3fn, jnp.float8_e4m3fn, 0.2)):
        oc = cfg(use_precision_aware_optimizer=True, exp_avg_dtype=mu_t, exp_avg_sq_dtype=nu_t)
        _, out, state = run(build_optimizer(oc, 1e-3, AXES), params, grads)
        st = adam_state(state)
        mu, nu = st.mu["layers"]["attn"]["wq"], st.nu["layers"]["attn"]["wq"]
        mu_data = mu.data if isinstance(mu, q.Scaled) else mu
        assert mu_data.dtype == mu_dtype and isinstance(nu, q.Scaled) and nu.data.dtype == nu_dtype
        assert nu.scale.shape == (1, L, 1, 1)  # one scale per layer, as per Megatron tensor
        delta = jax.tree.map(lambda a, b: a - b, out, params)
        ref_delta = jax.tree.map(lambda a, b: a - b, ref, params)
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(delta),
                                                                 jax.tree.leaves(ref_delta)))
        scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref_delta))
        assert 0 < err < tol * scale, (mu_t, err / scale)


def test_main_grads_dtype_rounds_what_the_optimizer_reads():
    params, g = tree(0), [tree(1, 0.1), tree(2, 0.3)]
    oc = cfg(use_precision_aware_optimizer=True, main_grads_dtype="bf16")
    u = run(build_optimizer(oc, 1e-3, AXES), params, g)[0][-1]
    rounded = [jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), x) for x in g]
    want = run(build_optimizer(cfg(), 1e-3, AXES), params, rounded)[0][-1]
    plain = run(build_optimizer(cfg(), 1e-3, AXES), params, g)[0][-1]
    assert_trees_close(u, want, rtol=1e-6, atol=1e-9)
    assert not np.allclose(u["embedding"], plain["embedding"], rtol=1e-6, atol=1e-12)


def test_main_params_fp16_keeps_a_scaled_master_copy():
    """main_params_dtype fp16: the optimizer steps its own fp16 copy of the weights (one fp32
    scale per layer, amax -> fp16_max / 2, as TE's FusedAdam) and the bf16 parameters follow
    it. Updates far below bf16's resolution still accumulate in the master copy, and the
    parameters move once it has drifted by a bf16 step; without the copy they never move."""
    params = jax.tree.map(lambda x: (1.0 + 0.0 * x).astype(jnp.bfloat16), tree(0))
    grads = [jax.tree.map(jnp.ones_like, tree(0))] * 6
    oc = cfg(name="sgd", sgd_momentum=0.0, use_precision_aware_optimizer=True,
             main_params_dtype="fp16")
    _, out, state = run(build_optimizer(oc, 1e-3, AXES), params, grads)
    master = state[-1].master["layers"]["mlp"]["wi_0"]
    assert isinstance(master, q.Scaled) and master.data.dtype == jnp.float16
    assert master.scale.shape == (1, L, 1)
    decoded = np.asarray(q.decode(q.Codec.for_dtype(jnp.float16), master))
    np.testing.assert_allclose(decoded, 1.0 - 6e-3, rtol=1e-3)   # 1 - 6 x lr, kept in fp16
    assert out["layers"]["mlp"]["wi_0"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["layers"]["mlp"]["wi_0"], np.float32),
                                  decoded.astype(jnp.bfloat16).astype(np.float32))
    assert np.all(np.asarray(out["layers"]["mlp"]["wi_0"], np.float32) < 1.0)
    plain = run(build_optimizer(cfg(name="sgd", sgd_momentum=0.0), 1e-3, AXES), params,
                grads)[1]
    np.testing.assert_array_equal(np.asarray(plain["layers"]["mlp"]["wi_0"], np.float32), 1.0)


def test_main_params_fp16_holds_the_model_weights_in_the_training_dtype():
    from jaxtrain.models import ModelConfig
    base = ["bf16=true", "use_precision_aware_optimizer=true", "vocab_size=64"]
    fp16 = load_config(None, [*base, "main_params_dtype=fp16"], world_size=1)
    fp32 = load_config(None, base, world_size=1)
    assert ModelConfig.from_config(fp16).param_dtype == jnp.bfloat16
    assert ModelConfig.from_config(fp32).param_dtype == jnp.float32


# ----------------------------------------------------------------------------- torch cross-check

def test_against_torch_adamw_sgd_and_muon():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((8, 24)).astype(np.float32)  # stored [in, out]; torch [out, in]
    grads = [rng.standard_normal((8, 24)).astype(np.float32) for _ in range(3)]
    axes = {"w": P("embed", "mlp")}

    def ours(oc, lr):
        return np.asarray(run(build_optimizer(oc, lr, axes), {"w": jnp.asarray(w0)},
                              [{"w": jnp.asarray(g)} for g in grads])[1]["w"])

    def theirs(make):
        p = torch.nn.Parameter(torch.tensor(w0.T.copy()))
        opt = make([p])
        for g in grads:
            p.grad = torch.tensor(g.T.copy())
            opt.step()
        return p.detach().numpy().T

    np.testing.assert_allclose(
        ours(cfg(name="adam", adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6, weight_decay=0.2),
             0.01),
        theirs(lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), eps=1e-6,
                                            weight_decay=0.2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        ours(cfg(name="sgd", sgd_momentum=0.7, weight_decay=0.2), 0.01),
        theirs(lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.7, weight_decay=0.2)),
        rtol=1e-5, atol=1e-6)
    pgs = cfg(name="muon", flavour="pgs", muon_coefficients="jordan", muon_lr_mult=10.0,
              muon_scale_mode="shape_scaling", muon_nesterov=True, muon_fuse_fc1=False,
              weight_decay=0.1)
    got = ours(pgs, 0.01) - w0
    want = theirs(lambda ps: torch.optim.Muon(ps, lr=0.1, weight_decay=0.1, momentum=0.95,
                                              nesterov=True)) - w0
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02  # both iterate in bf16


@pytest.mark.parametrize("knob", ["apply_wd_to_qk_layernorm=true",
                                  "no_weight_decay_cond_type=apply_wd_to_qk_layernorm"])
def test_apply_wd_to_qk_layernorm_decays_the_query_key_norms_only(knob):
    """Megatron's Qwen3-Next recipe: the q/k norm scales join the decayed leaves; the layer
    norms and biases stay exempt."""
    from jaxtrain.models import ModelConfig, logical_axes
    from jaxtrain.optim.leaves import decayed

    plan = leaf_plan(logical_axes(ModelConfig(qk_layernorm=True, add_qkv_bias=True)))
    base = ["lr=1e-3", "weight_decay=0.1", "num_layers=2", "hidden_size=32",
            "num_attention_heads=4", "vocab_size=64", "seq_length=16"]
    flagged = OptimConfig.from_config(load_config(None, [*base, knob]))
    plain = OptimConfig.from_config(load_config(None, base))
    on, off = decayed(flagged, "main"), decayed(plain, "main")
    changed = {p for p, leaf in plan.items() if on(leaf) != off(leaf)}
    assert changed == {("layers", "attn", "q_norm", "scale"), ("layers", "attn", "k_norm", "scale")}
    assert not on(plan[("layers", "attn_norm", "scale")]) and not on(plan[("layers", "attn", "bq")])
