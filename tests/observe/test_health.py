"""pgs health metrics (logging.health_tier2_every / health_tier3_every / rl_readiness /
rl_entropy_floor): each value against a hand computation on a tiny model, the cadence and
activation rules, the RL-readiness warning, and health/* fields in a real run's metrics rows.

Every test builds the same tiny pgs run (``loop.build``), so the jitted functions compile once
(a persistent compilation cache shares them with the end-to-end run).
"""
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import loop
from jaxtrain.config import load_config
from jaxtrain.data.batches import global_batches
from jaxtrain.models.transformer import forward
from jaxtrain.observe import health as H
from jaxtrain.observe.health import Health

TINY = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=2", "hidden_size=32", "num_attention_heads=2", "micro_batch_size=2",
        "global_batch_size=4", "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0",
        "attention_dropout=0", "log_interval=1", "exp_name=run"]
PGS = ("model: {name_or_path: null, torch_dtype: float32}\n"
       "logging: {use_wandb: false, use_trackio: false}\n"
       "train: {gradient_accumulation_steps: 2, save_final: false}\n"
       "save_hf: false\n")


pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


@pytest.fixture(scope="module")
def pgs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pgs") / "pgs.yml"
    path.write_text(PGS)
    return path


def pgs_config(pgs_file, workspace, *extra):
    """The tiny run in pgs's dialect; it writes to ``workspace``/run (pgs's own default is
    ./checkpoints) and validates nothing."""
    return load_config(str(pgs_file), [*TINY, f"workspace={workspace}",
                                       f"save={workspace}/run", "eval_iters=0",
                                       "full_validation=false", *extra],
                       world_size=1, enforce_status=False)


@pytest.fixture(scope="module")
def run(pgs_file, tmp_path_factory):
    return loop.build(pgs_config(pgs_file, tmp_path_factory.mktemp("ws"), "train_iters=4"))


@pytest.fixture(scope="module")
def batches(run):
    """Two [M=2, B=2, T=8] batches as the loop makes them; the first masks some tokens."""
    it = global_batches(run.data, run.tcfg, seed=run.tcfg.seed,
                        rows=run.layout.local_rows(run.rows))
    first, second = next(it), next(it)
    first["loss_mask"] = np.asarray(first["loss_mask"]).copy()
    first["loss_mask"][:, 0, :3] = 0
    return run.put_batch(first), run.put_batch(second)


def monitor(run, **kw) -> Health:
    return Health(run.model_cfg, layout=run.layout, loss_chunks=run.tcfg.loss_chunks,
                  half_precision=run.tcfg.half_precision_loss, seed=run.tcfg.seed, **kw)


def measure(h: Health, step, params, batch) -> dict:
    return h.finish(step, jax.device_get(h.fields(step, params, batch)))


# ---- hand computations: one sequence at a time, through models.transformer.forward ---------

@pytest.fixture(scope="module")
def row_fn(run):
    """(tokens [T], targets [T], weights [T]) -> (sum of weighted token NLL, its gradient,
    logits [T, V]) for one sequence."""
    cfg = run.model_cfg

    def loss(p, tokens, targets, weights):
        logits = forward(p, tokens[None], cfg)[0]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        return jnp.sum(nll * weights), logits

    return jax.jit(jax.grad(loss, has_aux=True))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def hand_gradients(row_fn, params, batch, half):
    """Token-mean gradients of the two halves (``half`` [M, B] in {0, 1}) and of the batch."""
    tokens, targets, mask = (np.asarray(batch[k]) for k in ("tokens", "targets", "loss_mask"))
    sums, counts = [0.0, 0.0], [0.0, 0.0]
    for m in range(tokens.shape[0]):
        for b in range(tokens.shape[1]):
            g, _ = row_fn(params, tokens[m, b], targets[m, b], mask[m, b].astype(np.float32))
            sums[half[m, b]] = sums[half[m, b]] + flat(g)
            counts[half[m, b]] += mask[m, b].sum()
    return sums[0] / counts[0], sums[1] / counts[1], (sums[0] + sums[1]) / sum(counts)


def cos(a, b):
    return a @ b / np.sqrt((a @ a) * (b @ b))


def hand_gns(g1, g2, g, small, big):
    """McCandlish et al. (2018), App. A: two batch sizes, |g_small|^2 averaged over halves."""
    small_sq, big_sq = (g1 @ g1 + g2 @ g2) / 2, g @ g
    true_sq = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1 / small - 1 / big)
    return trace / true_sq


# ---- tier 2 ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_tier2_gradient_metrics_match_hand_computation(run, batches, row_fn):
    params = run.state.params
    first, second = batches
    h = monitor(run, tier2_every=1)
    row1 = measure(h, 1, params, first)
    g1, g2, g = hand_gradients(row_fn, params, first, np.array([[0, 0], [1, 1]]))
    assert "health/grad_cosine_sim" not in row1  # no earlier tier-2 gradient yet
    np.testing.assert_allclose(row1["health/grad_cosine_halves"], cos(g1, g2), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(row1["health/gns"], hand_gns(g1, g2, g, 2, 4), rtol=2e-3)
    assert row1["health/gns_ema"] == row1["health/gns"]

    row2 = measure(h, 2, params, second)
    _, _, g_next = hand_gradients(row_fn, params, second, np.array([[0, 0], [1, 1]]))
    assert g.size < H.SAMPLE  # the whole gradient is the compared sample
    np.testing.assert_allclose(row2["health/grad_cosine_sim"], cos(g, g_next), rtol=1e-4)
    np.testing.assert_allclose(row2["health/gns_ema"],
                               (row1["health/gns"] + row2["health/gns"]) / 2, rtol=1e-9)


@pytest.mark.slow
def test_tier2_with_one_microbatch_splits_sequences(run, batches, row_fn):
    params, (first, _) = run.state.params, batches
    one = {k: jnp.concatenate([v[0], v[1]])[None] for k, v in first.items()}  # [1, 4, T]
    row = measure(monitor(run, tier2_every=1), 1, params, one)
    g1, g2, g = hand_gradients(row_fn, params, one, np.array([[0, 1, 0, 1]]))
    np.testing.assert_allclose(row["health/grad_cosine_halves"], cos(g1, g2), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(row["health/gns"], hand_gns(g1, g2, g, 2, 4), rtol=2e-3)


def test_noise_scale_formula_with_unequal_halves():
    # E|g_h|^2 = G + tr/S_h, E|g|^2 = G + tr/S; with G = 2, tr = 30, sizes 1 and 2:
    G, tr = 2.0, 30.0
    got = H.noise_scale((G + tr / 1, G + tr / 2), G + tr / 3, (1, 2))
    assert got == pytest.approx(tr / G)


def test_device_memory_fields(run, monkeypatch):
    monkeypatch.setattr(H, "device_memory_stats", lambda devices=None: {
        "mem_bytes_in_use": 3e9, "mem_peak_bytes_in_use": 5e9, "mem_bytes_limit": 12e9})
    assert monitor(run, tier2_every=10).memory() == {
        "health/cuda_peak_gb": 5.0, "health/cuda_allocated_gb": 3.0,
        "health/cuda_utilization_pct": 25.0}
    monkeypatch.setattr(H, "device_memory_stats", lambda devices=None: {})  # CPU: none
    assert monitor(run, tier2_every=10).memory() == {}


# ---- tier 3 ----------------------------------------------------------------------------------

def per_layer(run, params) -> dict[str, dict[str, np.ndarray]]:
    """group -> {name: matrix-shaped weight} for weights of two or more dimensions per layer."""
    axis, out = run.model_cfg.param_scan_axis, {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name, x = jax.tree_util.keystr(path), np.asarray(x, np.float64)
        if name.startswith("['layers']"):
            for i in range(x.shape[axis]):
                w = np.take(x, i, axis=axis)
                if w.ndim >= 2:
                    out.setdefault(f"layer_{i}", {})[name] = w
        elif x.ndim >= 2:
            group = "lm_head" if name == "['output']" else "embed"
            out.setdefault(group, {})[name] = x
    return out


def hand_stable_rank(m) -> float:
    s = np.linalg.svd(m, compute_uv=False)
    return float((m ** 2).sum() / s[0] ** 2)


def test_tier3_weight_norms_stable_rank_and_drift(run, batches, row_fn, caplog):
    params = run.state.params
    h = monitor(run, tier3_every=1)
    row = measure(h, 1, params, batches[0])
    groups = per_layer(run, params)
    assert list(groups) == ["embed", "layer_0", "layer_1", "lm_head"]
    norms = {g: np.mean([np.linalg.norm(w) for w in ws.values()]) for g, ws in groups.items()}
    for g, v in norms.items():
        np.testing.assert_allclose(row[f"health/wnorm/{g}"], v, rtol=1e-5)
    assert row["health/weight_norm_ratio"] == pytest.approx(
        max(norms.values()) / min(norms.values()), rel=1e-5)
    # the largest weight of a layer (gate projection wi_0 [D, F], the first of three of that
    # size) and the output layer [D, V]
    for i in (0, 1):
        layer = groups[f"layer_{i}"]
        wi = layer["['layers']['mlp']['wi_0']"]
        assert wi.size == max(w.size for w in layer.values())
        np.testing.assert_allclose(row[f"health/srank/layer_{i}"], hand_stable_rank(wi),
                                   rtol=1e-4)
    out = np.asarray(params["output"], np.float64)
    np.testing.assert_allclose(row["health/srank/lm_head"], hand_stable_rank(out), rtol=1e-4)
    assert "health/weight_drift_mean" not in row  # the first tier-3 step is the reference

    _, _, g = hand_gradients(row_fn, params, batches[0], np.array([[0, 0], [1, 1]]))
    leaves, treedef = jax.tree.flatten(params)
    sizes = np.cumsum([x.size for x in leaves])[:-1]
    grads = [p.reshape(x.shape) for p, x in zip(np.split(g, sizes), leaves)]

    def sgd(lr):  # one SGD step
        return jax.tree.unflatten(treedef, [np.asarray(x) - lr * d.astype(np.float32)
                                            for x, d in zip(leaves, grads)])

    moved = sgd(0.1)
    row = measure(h, 2, moved, batches[0])
    before, after = per_layer(run, params), per_layer(run, moved)
    drift = [abs(np.linalg.norm(after[grp][n]) - np.linalg.norm(w)) / np.linalg.norm(w)
             for grp, ws in before.items() for n, w in ws.items() if w.size > 1000]
    assert 1e-4 < max(drift) < 0.5
    np.testing.assert_allclose(row["health/weight_drift_mean"], np.mean(drift), rtol=1e-3)
    np.testing.assert_allclose(row["health/weight_drift_max"], np.max(drift), rtol=1e-3)
    assert row["health/warnings"] == 0
    with caplog.at_level(logging.WARNING, logger="jaxtrain.observe.health"):
        row = measure(h, 3, sgd(20.0), batches[0])  # drift over 50%: pgs's third warning
    assert row["health/weight_drift_max"] > 0.5 and row["health/warnings"] == 1
    assert any("drift" in r.message for r in caplog.records)


def test_stable_rank_uses_the_top_left_512_block():
    m = np.random.default_rng(0).normal(size=(600, 700)).astype(np.float32)
    m[:, 0] *= 40  # a dominant direction inside the block
    got = float(jax.jit(H.stable_rank)(jnp.asarray(m)))
    assert got == pytest.approx(hand_stable_rank(m[:512, :512].astype(np.float64)), rel=1e-4)


# ---- RL readiness ------------------------------------------------------------------------------

def test_output_entropy_matches_softmax_of_the_logits(run, batches, row_fn):
    params, (first, _) = run.state.params, batches
    mask = np.asarray(first["loss_mask"]).copy()
    mask[-1, 1, 5:] = 0  # last microbatch: 5 + 5 loss tokens, all among the 64 drawn
    batch = {**first, "loss_mask": run.put_batch({"loss_mask": mask})["loss_mask"]}
    row = measure(monitor(run, rl_readiness=True), 1, params, batch)
    tokens, targets = np.asarray(batch["tokens"][-1]), np.asarray(batch["targets"][-1])
    ents = []
    for b in range(tokens.shape[0]):
        _, logits = row_fn(params, tokens[b], targets[b], np.ones(8, np.float32))
        z = np.asarray(logits, np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ents += list(-(p * np.log(p)).sum(-1)[mask[-1, b] > 0])
    assert len(ents) == 10
    np.testing.assert_allclose(row["health/output_entropy"], np.mean(ents), rtol=1e-5)
    assert row["health/output_entropy_ema"] == row["health/output_entropy"]
    assert "health/rl_readiness_warning" not in row  # needs 10 measurements


@pytest.mark.parametrize("floor,warned", [(100.0, True), (0.5, False)])
def test_entropy_below_the_floor_warns(run, batches, caplog, floor, warned):
    params, (first, _) = run.state.params, batches
    h = monitor(run, rl_readiness=True, entropy_floor=floor)
    with caplog.at_level(logging.WARNING, logger="jaxtrain.observe.health"):
        rows = [measure(h, step, params, first) for step in range(1, 12)]
    messages = [r.message for r in caplog.records if "RL readiness" in r.message]
    assert len(messages) == (1 if warned else 0)
    assert all("health/rl_readiness_warning" not in r for r in rows[:9])
    assert rows[9]["health/rl_readiness_warning"] == (1.0 if warned else 0.0)
    assert "health/rl_readiness_warning" not in rows[10] if warned else (
        rows[10]["health/rl_readiness_warning"] == 0.0)
    assert rows[10]["health/entropy_trend"] == pytest.approx(0.0, abs=1e-6)  # same batch


def test_the_warning_rearms_after_recovery(run, caplog):
    h = monitor(run, rl_readiness=True, entropy_floor=1.0)

    def feed(step, value):
        return h.finish(step, {H._ENTROPY: np.float32(value), H._ENTROPY_N: np.int32(5)})

    with caplog.at_level(logging.WARNING, logger="jaxtrain.observe.health"):
        for step in range(1, 10):
            feed(step, 0.5)
        assert feed(10, 0.5)["health/rl_readiness_warning"] == 1.0   # mean 0.5 < 1
        assert "health/rl_readiness_warning" not in feed(11, 0.5)
        for step in range(12, 40):
            got = feed(step, 3.0)
        assert got["health/rl_readiness_warning"] == 0.0             # recovered
        for step in range(40, 140):
            got = feed(step, 0.1)
        assert got["health/output_entropy_ema"] == pytest.approx(0.1)  # last 100 values
    assert sum("RL readiness" in r.message for r in caplog.records) == 2


# ---- cadence and activation --------------------------------------------------------------------

def test_cadence(run):
    h = monitor(run, log_interval=2, tier2_every=4, tier3_every=6)
    assert [s for s in range(1, 25) if h.tier2_due(s)] == [4, 8, 12, 16, 20, 24]
    assert [s for s in range(1, 25) if h.tier3_due(s)] == [6, 12, 18, 24]
    assert [s for s in range(1, 13) if h.due(s)] == [4, 6, 8, 12]
    h = monitor(run, log_interval=4, tier2_every=2)  # only at logged steps, as pgs
    assert [s for s in range(1, 13) if h.due(s)] == [4, 8, 12]
    h = monitor(run, log_interval=2, rl_readiness=True)
    assert [s for s in range(1, 7) if h.due(s)] == [2, 4, 6]


@pytest.mark.slow
def test_fields_hold_only_what_is_due(run, batches):
    params, (first, _) = run.state.params, batches
    h = monitor(run, tier2_every=2, tier3_every=3)
    assert measure(h, 1, params, first) == {}
    assert {k for k in measure(h, 2, params, first)} == {
        "health/grad_cosine_halves", "health/gns", "health/gns_ema"}
    assert "health/stable_rank_mean" in measure(h, 3, params, first)


def test_on_in_pgs_configs_off_elsewhere_unless_set(run, pgs_file, tmp_path):
    def make(cfg):
        return Health.from_config(cfg, run.model_cfg, run.tcfg, run.layout)

    megatron = [*TINY, f"workspace={tmp_path}"]
    off = make(load_config(None, megatron, world_size=1, enforce_status=False))
    assert not off.enabled and not any(off.due(s) for s in range(1, 201))
    some = make(load_config(None, [*megatron, "logging.health_tier2_every=5"], world_size=1,
                            enforce_status=False))
    assert (some.tier2_every, some.tier3_every, some.rl_readiness) == (5, 0, False)
    pgs = make(pgs_config(pgs_file, tmp_path))
    assert (pgs.tier2_every, pgs.tier3_every, pgs.rl_readiness) == (10, 100, False)
    pgs = make(pgs_config(pgs_file, tmp_path, "logging.health_tier3_every=0",
                          "logging.rl_readiness=true", "logging.rl_entropy_floor=2.5"))
    assert (pgs.tier2_every, pgs.tier3_every, pgs.rl_readiness, pgs.entropy_floor) == (
        10, 0, True, 2.5)


# ---- end to end --------------------------------------------------------------------------------

@pytest.mark.slow
def test_training_rows_carry_health_fields(pgs_file, tmp_path):
    cfg = pgs_config(pgs_file, tmp_path, "train_iters=6", "logging.health_tier2_every=2",
                     "logging.health_tier3_every=3", "logging.rl_readiness=true")
    loop.train(cfg)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl")
                                      .read_text().splitlines()) if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]

    def has(step, key):
        return f"health/{key}" in rows[step]

    for step in rows:
        assert has(step, "output_entropy") and rows[step]["health/output_entropy"] > 0
        assert has(step, "gns") == has(step, "grad_cosine_halves") == (step % 2 == 0)
        assert has(step, "grad_cosine_sim") == (step in (4, 6))
        assert has(step, "stable_rank_mean") == has(step, "wnorm/layer_0") == (step % 3 == 0)
        assert has(step, "weight_drift_mean") == (step == 6)
    assert -1 <= rows[4]["health/grad_cosine_sim"] <= 1
    assert 0 < rows[6]["health/weight_drift_max"] < 0.5
