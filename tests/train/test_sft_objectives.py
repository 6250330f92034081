"""pgs's SFT token-weighting objectives (plugins.dft, plugins.deft, plugins.cadft with
plugins.cadft_beta, plugins.info_sft with plugins.info_sft_pbar) and its embedding noise
(plugins.sym_noise, plugins.sym_noise_alpha).

The objectives are checked against their formulas written out here in numpy (float64), chunked
against unchunked, for constant weights under differentiation, side by side with palingenesis's
own torch code when a checkout is at hand, and through the train step.
"""
import importlib.util
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.config import load_config
from jaxtrain.loss import TokenObjective, model_loss, objective_weights, row_losses, token_nll
from jaxtrain.models import transformer
from jaxtrain.models.transformer import forward
from jaxtrain.step import init_state, make_train_step
from jaxtrain.train_config import TrainConfig
from tests.train.test_step import T, batch, model_cfg, run, train_cfg

OBJECTIVES = {
    "dft": TokenObjective("dft"),
    "deft": TokenObjective("deft"),
    "cadft": TokenObjective("cadft"),
    "cadft beta 2.5": TokenObjective("cadft", cadft_beta=2.5),
    "info_sft": TokenObjective("info_sft"),
    "info_sft pbar 0.8": TokenObjective("info_sft", info_sft_pbar=0.8),
}
KINDS = ("dft", "deft", "cadft", "info_sft")


# ---------------------------------------------------------------- the formulas, in numpy

def probs(logits):
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference(objective, logits, targets, w):
    """(effective token weights [B,T], nll [B,T]) of ``objective`` written from its formula:
    the loss is Σ weights·nll and the weights are constants."""
    w = np.asarray(w, np.float64)
    p_all = probs(logits)
    p = np.take_along_axis(p_all, np.asarray(targets)[..., None], -1)[..., 0]
    nll = -np.log(p)
    valid = w > 0
    kind = objective.kind
    if kind == "dft":
        f = p
    elif kind == "deft":
        focus = np.sum(p_all ** 2, axis=-1)             # collision probability
        f = np.maximum(p, 1e-8) ** focus
    elif kind == "cadft":
        n = valid.sum(1)
        rows = n > 0                                     # rows with loss tokens
        mean_nll = (nll * valid).sum(1)[rows] / n[rows]
        sample = np.ones(len(w))
        if rows.sum() > 1:
            z = (mean_nll - mean_nll.mean()) / max(mean_nll.std(ddof=1), 1e-6)
            sample[rows] = np.exp(-objective.cadft_beta * np.maximum(z, 0.0))
        f = p * sample[:, None]
    elif kind == "info_sft":
        q = np.clip(p, 1e-8, 1 - 1e-8)
        pbar = objective.info_sft_pbar
        raw = q * np.maximum(np.log(pbar / (1 - pbar)) - np.log(q / (1 - q)), 0.0)
        mean = raw[valid].sum() / max(valid.sum(), 1)
        f = raw / max(mean, 1e-8)
    else:
        f = np.ones_like(p)
    return w * f, nll


# ------------------------------------------- logits straight into the loss: an identity head

VI, TI = 16, 8     # vocab = hidden, so hidden states are the logits


def identity_head():
    cfg = model_cfg(hidden_size=VI, vocab_size=VI, seq_length=TI, max_position_embeddings=TI,
                    untie_embeddings_and_output_weights=True)
    return cfg, {"output": jnp.eye(VI, dtype=jnp.float32)}


def sample(seed, rows=4, fractional=False, empty_row=False):
    """Random logits (some targets made likely, so every objective's range shows), targets and
    a loss mask with padding (optionally real-valued weights, optionally a row without loss
    tokens)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (rows, TI, VI)).astype(np.float32)
    targets = rng.integers(0, VI, (rows, TI)).astype(np.int32)
    b, t = np.nonzero(rng.random((rows, TI)) < 0.35)
    logits[b, t, targets[b, t]] += rng.uniform(3.0, 9.0, len(b)).astype(np.float32)
    mask = (rng.random((rows, TI)) < 0.85).astype(np.float32)
    mask[0, TI // 2:] = 0.0                             # a padded row
    mask[:, 0] = 1.0                                    # every row trains on something
    if fractional:
        mask *= rng.uniform(0.25, 2.0, mask.shape).astype(np.float32)
    if empty_row:
        mask[-1] = 0.0
    return logits, targets, mask


def loss_rows(objective, logits, targets, mask, chunks=0):
    cfg, params = identity_head()
    return row_losses(params, jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), cfg,
                      num_chunks=chunks, objective=objective)[0]


@pytest.mark.parametrize("fractional", [False, True], ids=["mask", "weights"])
@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.slow
def test_weights_and_loss_follow_the_formula(name, fractional):
    objective = OBJECTIVES[name]
    for seed in range(3):
        logits, targets, mask = sample(seed, rows=3 + seed, fractional=fractional)
        want_w, nll = reference(objective, logits, targets, mask)
        got_w = objective_weights(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask),
                                  objective)
        np.testing.assert_allclose(got_w, want_w, rtol=2e-5, atol=1e-7)
        got = loss_rows(objective, logits, targets, mask)
        np.testing.assert_allclose(got, (want_w * nll).sum(1), rtol=2e-5, atol=1e-7)
        plain, _ = reference(TokenObjective(), logits, targets, mask)
        assert not np.allclose(want_w, plain)           # the objective does weight


def test_objectives_spread_as_documented():
    """The sanity facts behind the formulas: DEFT's gate lies between DFT's p_t and 1; InfoSFT
    gives no weight above pbar and averages 1 over the loss tokens; CADFT only lowers DFT."""
    logits, targets, mask = sample(0, rows=6)
    valid = mask > 0
    dft, _ = reference(OBJECTIVES["dft"], logits, targets, mask)
    deft = np.asarray(objective_weights(jnp.asarray(logits), jnp.asarray(targets),
                                        jnp.asarray(mask), OBJECTIVES["deft"]))
    assert np.all(deft[valid] >= dft[valid] - 1e-6) and np.all(deft <= 1 + 1e-6)
    info = np.asarray(objective_weights(jnp.asarray(logits), jnp.asarray(targets),
                                        jnp.asarray(mask), OBJECTIVES["info_sft"]))
    p = np.take_along_axis(probs(logits), targets[..., None], -1)[..., 0]
    assert np.all(info[p >= 0.93] == 0) and (p[valid] >= 0.93).any()
    np.testing.assert_allclose(info[valid].mean(), 1.0, rtol=1e-5)
    cadft = np.asarray(objective_weights(jnp.asarray(logits), jnp.asarray(targets),
                                         jnp.asarray(mask), OBJECTIVES["cadft"]))
    ratio = cadft[valid] / dft[valid]
    assert np.all(ratio <= 1 + 1e-6) and ratio.min() < 0.9


@pytest.mark.slow
def test_cadft_counts_only_rows_with_loss_tokens():
    """A row without loss tokens has no NLL: it stays out of the z-score (pgs would count it
    as NLL 0). One row alone has no spread: its factor is 1 (plain DFT), not NaN."""
    logits, targets, mask = sample(4, rows=5, empty_row=True)
    got = objective_weights(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask),
                            OBJECTIVES["cadft"])
    without = objective_weights(jnp.asarray(logits[:-1]), jnp.asarray(targets[:-1]),
                                jnp.asarray(mask[:-1]), OBJECTIVES["cadft"])
    np.testing.assert_allclose(got[:-1], without, rtol=1e-6)
    one = objective_weights(jnp.asarray(logits[:1]), jnp.asarray(targets[:1]),
                            jnp.asarray(mask[:1]), OBJECTIVES["cadft"])
    dft = objective_weights(jnp.asarray(logits[:1]), jnp.asarray(targets[:1]),
                            jnp.asarray(mask[:1]), OBJECTIVES["dft"])
    np.testing.assert_allclose(one, dft, rtol=1e-6)


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.slow
def test_chunked_equals_unchunked(name):
    objective = OBJECTIVES[name]
    logits, targets, mask = sample(5, rows=4, fractional=True, empty_row=True)

    def total(x, chunks):
        return jnp.sum(loss_rows(objective, x, targets, mask, chunks))

    x = jnp.asarray(logits)
    whole, g_whole = jax.value_and_grad(lambda x: total(x, 0))(x)
    for chunks in (2, 4):
        part, g_part = jax.value_and_grad(lambda x: total(x, chunks))(x)
        np.testing.assert_allclose(part, whole, rtol=1e-6)
        np.testing.assert_allclose(g_part, g_whole, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.slow
def test_weights_are_constants_under_differentiation(name):
    """d loss / d logits = weight · (softmax - onehot): the gradient of the plain CE scaled by
    each token's weight, nothing flowing through the weights or the batch statistics."""
    objective = OBJECTIVES[name]
    logits, targets, mask = sample(6, rows=5, fractional=True)
    w, _ = reference(objective, logits, targets, mask)
    want = w[..., None] * (probs(logits) - np.eye(VI)[targets])
    for chunks in (0, 4):
        got = jax.grad(lambda x: jnp.sum(loss_rows(objective, x, targets, mask, chunks)))(
            jnp.asarray(logits))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)   # p - 1 near p = 1


# ------------------------------------------------------------- side by side with pgs's code

def _pgs_plugins_file():
    roots = [pathlib.Path("/work/corpus/palingenesis"),
             pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent")) / "palingenesis"]
    for root in roots:
        path = root / "src" / "palingenesis" / "plugins.py"
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="module")
def pgs():
    """palingenesis's plugins module, loaded by file path (its folder has a logging.py that
    would shadow the standard library's on sys.path)."""
    path = _pgs_plugins_file()
    if path is None:
        pytest.skip("no palingenesis checkout (/work/corpus or $JAXTRAIN_UPSTREAM)")
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("_pgs_plugins_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, torch


def _pgs_loss(pgs, objective, logits, labels):
    """pgs's eager (uncompiled) loss functions, as its trainer calls them: summed losses."""
    module, _ = pgs
    if objective.kind == "dft":
        return module._dft_loss_fused(logits, labels)
    if objective.kind == "deft":
        return module._deft_loss_fused(logits, labels)
    if objective.kind == "cadft":
        return module.cadft_loss(logits, labels, beta=objective.cadft_beta)
    pbar = objective.info_sft_pbar
    return module._infosft_fused(logits, labels, math.log(pbar / (1 - pbar)))


@pytest.mark.parametrize("name", OBJECTIVES)
def test_same_loss_and_gradient_as_pgs(pgs, name):
    objective = OBJECTIVES[name]
    torch = pgs[1]
    for seed in range(3):
        logits, targets, mask = sample(10 + seed, rows=4)
        labels = torch.tensor(np.where(mask > 0, targets, -100).astype(np.int64))
        t_logits = torch.tensor(logits, requires_grad=True)
        want = _pgs_loss(pgs, objective, t_logits, labels)
        want.backward()
        got, grad = jax.value_and_grad(lambda x: jnp.sum(loss_rows(objective, x, targets, mask)))(
            jnp.asarray(logits))
        np.testing.assert_allclose(float(got), float(want.detach()), rtol=1e-5)
        if objective.kind != "info_sft":   # pgs lets InfoSFT's gradient through its weights
            np.testing.assert_allclose(grad, t_logits.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_pgs_info_sft_gradient_also_flows_through_its_weights(pgs):
    """The one deliberate difference: pgs's InfoSFT does not detach q·[logit(pbar) -
    logit(q)]_+ nor its mean, so its gradient is that of Σ w(l)·nll / mean w(l) with w live.
    jaxtrain holds the weights constant, as for the other objectives."""
    torch = pgs[1]
    logits, targets, mask = sample(20, rows=4)
    labels = torch.tensor(np.where(mask > 0, targets, -100).astype(np.int64))
    t_logits = torch.tensor(logits, requires_grad=True)
    _pgs_loss(pgs, OBJECTIVES["info_sft"], t_logits, labels).backward()
    valid = jnp.asarray(mask > 0, jnp.float32)
    tg = jnp.asarray(targets)

    def live(x):   # the InfoSFT loss with the weights left differentiable
        q = jnp.clip(jnp.exp(-token_nll(x, tg)), 1e-8, 1 - 1e-8)
        raw = q * jnp.maximum(math.log(0.93 / 0.07) - jnp.log(q) + jnp.log1p(-q), 0.0) * valid
        return jnp.sum(raw * token_nll(x, tg)) / (jnp.sum(raw) / jnp.sum(valid))

    np.testing.assert_allclose(jax.grad(live)(jnp.asarray(logits)), t_logits.grad.numpy(),
                               rtol=1e-4, atol=1e-6)
    ours = jax.grad(lambda x: jnp.sum(loss_rows(OBJECTIVES["info_sft"], x, targets, mask)))(
        jnp.asarray(logits))
    assert np.abs(np.asarray(ours) - t_logits.grad.numpy()).max() > 1e-3


def test_chunked_deft_matches_pgs_chunked_deft(pgs):
    module, torch = pgs
    logits, targets, mask = sample(30, rows=4)
    labels = torch.tensor(np.where(mask > 0, targets, -100).astype(np.int64))
    head = torch.nn.Linear(VI, VI, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(VI))
    want = module.chunked_deft_loss(torch.tensor(logits), labels, head, num_chunks=4,
                                    global_valid_tokens=1.0)
    got = jnp.sum(loss_rows(OBJECTIVES["deft"], logits, targets, mask, chunks=4))
    np.testing.assert_allclose(float(got), float(want.detach()), rtol=1e-5)


def test_sym_noise_magnitude_matches_pgs(pgs, monkeypatch):
    module, torch = pgs
    D, S, alpha = 48, 12, 5.0
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(20, D)
    module.SymNoiseHook(model, alpha=alpha)
    ids = torch.randint(0, 20, (3, S))
    with torch.no_grad():
        model.train()
        theirs = (model.model.embed_tokens(ids) - model.model.embed_tokens.weight[ids]).numpy()
        model.eval()
        assert torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight[ids])
    mcfg = model_cfg(hidden_size=D, seq_length=S, max_position_embeddings=S)
    params = models.init(mcfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (3, S)), jnp.int32)
    ours = noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, jax.random.key(3)) - \
        noisy_embeddings(monkeypatch, mcfg, params, tokens, 0.0, jax.random.key(3))
    np.testing.assert_allclose(np.abs(ours), np.abs(theirs), rtol=1e-5)


# ------------------------------------------------------------------------- the train step

def _scaled_params(mcfg):
    # the init scaled up: far-from-uniform predictions, so the objectives' weights spread
    return jax.tree.map(lambda a: a * 3, models.init(mcfg, jax.random.key(0)))


@pytest.mark.parametrize("name", [pytest.param("dft", marks=pytest.mark.slow),
                                  pytest.param("deft", marks=pytest.mark.slow),
                                  pytest.param("cadft beta 2.5", marks=pytest.mark.slow),
                                  "info_sft pbar 0.8"])
@pytest.mark.slow
def test_train_step_loss_and_update_follow_the_formula(name):
    """Each microbatch's statistics are its own (CADFT's z-scores, InfoSFT's mean); the step's
    loss is Σ effective weight · nll and its SGD update is -lr · Σ weight · ∇nll."""
    objective = OBJECTIVES[name]
    mcfg = model_cfg()
    params = _scaled_params(mcfg)
    M, B = 2, 4
    mask = np.ones((M, B, T), np.float32)
    mask[0, 1, T // 2:] = 0.0
    mask[1, :, :3] = 0.0
    b = batch(M, B, seed=3, mask=mask)
    tcfg = train_cfg(num_microbatches=M, micro_batch_size=B, global_batch_size=M * B,
                     objective=objective)
    weights, nlls, plain = [], [], 0.0
    for m in range(M):
        norm = mask[m] / mask[m].sum() / M                   # per-microbatch token mean
        logits = np.asarray(forward(params, b["tokens"][m], mcfg))
        w, nll = reference(objective, logits, np.asarray(b["targets"][m]), norm)
        weights.append(w)
        nlls.append(nll)
        plain += (norm * nll).sum()
    want_loss = sum((w * n).sum() for w, n in zip(weights, nlls))

    def weighted_nll(p):
        return sum(jnp.sum(jnp.asarray(w, jnp.float32)
                           * token_nll(forward(p, b["tokens"][m], mcfg), b["targets"][m]))
                   for m, w in enumerate(weights))

    grads = jax.grad(weighted_nll)(params)
    state, metrics = run(mcfg, tcfg, b, params=params)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=2e-5)
    jax.tree.map(lambda new, p, g: np.testing.assert_allclose(new, p - 0.1 * g, rtol=1e-5,
                                                              atol=2e-6),
                 state.params, params, grads)
    assert abs(plain - want_loss) > 1e-2                   # not the cross-entropy


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_chunked_train_step_matches_and_never_builds_full_logits(kind):
    mcfg = model_cfg()
    params = _scaled_params(mcfg)
    b = batch(2, 4, seed=4)
    objective = TokenObjective(kind)
    if kind in ("cadft", "info_sft"):   # batch statistics: chunked run = whole run
        s0, m0 = run(mcfg, train_cfg(objective=objective), b, params=params)
        s4, m4 = run(mcfg, train_cfg(objective=objective, loss_chunks=4), b, params=params)
        np.testing.assert_allclose(m4["loss"], m0["loss"], rtol=1e-6)
        jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7),
                     s4.params, s0.params)
    tcfg = train_cfg(objective=objective, loss_chunks=4)
    state = init_state(params, optax.sgd(0.1), tcfg, jax.random.key(1))
    jaxpr = str(jax.make_jaxpr(make_train_step(mcfg, tcfg, optax.sgd(0.1),
                                               lambda n: jnp.float32(0.1)))(state, b))
    assert f"[4,{T},{mcfg.vocab_size}]" not in jaxpr
    assert f"f32[4,{T // 4},{mcfg.vocab_size}]" in jaxpr


# ------------------------------------------------------------------ knobs and config rules

def _tcfg(*overrides):
    cfg = load_config(None, ["global_batch_size=8", "micro_batch_size=2", *overrides],
                      world_size=2, enforce_status=False)
    return TrainConfig.from_config(cfg)


def test_plugins_knobs_reach_the_train_config():
    plain = _tcfg()
    assert plain.objective == TokenObjective() and plain.embed_noise == 0.0
    assert _tcfg("--plugins.dft=true").objective == TokenObjective("dft")
    assert _tcfg("--plugins.deft=true").objective == TokenObjective("deft")
    assert _tcfg("--plugins.cadft=true", "--plugins.cadft_beta=2.5").objective == \
        TokenObjective("cadft", cadft_beta=2.5)
    assert _tcfg("--plugins.info_sft=true", "--plugins.info_sft_pbar=0.8").objective == \
        TokenObjective("info_sft", info_sft_pbar=0.8)
    assert _tcfg("--plugins.sym_noise=true").embed_noise == 5.0
    assert _tcfg("--plugins.sym_noise=true", "--plugins.sym_noise_alpha=7").embed_noise == 7.0
    assert _tcfg("--plugins.sym_noise_alpha=7").embed_noise == 0.0   # alpha alone: off


def test_info_sft_pbar_must_be_a_probability():
    from jaxtrain.config.errors import ConfigError
    with pytest.raises(ConfigError, match="plugins.info_sft_pbar"):
        _tcfg("--plugins.info_sft=true", "--plugins.info_sft_pbar=1.0")


@pytest.mark.parametrize("pair", [("dft", "cadft"), ("deft", "info_sft"), ("cadft", "info_sft")])
def test_two_token_weighting_objectives_are_a_config_error(pair, write, cli):
    path = write("sft.yml", "model: {name_or_path: null}\nplugins:\n"
                 + "".join(f"  {k}: true\n" for k in pair))
    code, out, err = cli(path, "--dry-run")
    assert code == 2 and err.startswith("jaxtrain: config error:"), err
    assert "choose one token-weighting objective" in err
    assert all(f"plugins.{k}" in err for k in pair), err


def test_built_plugins_are_accepted(write, cli):
    path = write("sft.yml", "model: {name_or_path: null}\nmock_data: true\nvocab_size: 64\n"
                 "plugins:\n  cadft: true\n"
                 "  cadft_beta: 2.0\n  sym_noise: true\n  sym_noise_alpha: 7.0\n")
    code, out, err = cli(path, "--dry-run")
    assert code == 0, err
    assert "plugins.cadft_beta: 2.0" in out and "plugins.sym_noise_alpha: 7.0" in out


# ---------------------------------------------------------------------------- sym_noise

def noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, rng, deterministic=False):
    """The residual stream as the first layer would receive it (layers replaced by a probe)."""
    seen = []

    def probe(stacks, x, ctx, cfg):
        seen.append(x)
        return x, None

    monkeypatch.setattr(transformer, "_run_layers", probe)
    transformer.hidden_states(params, tokens, mcfg, deterministic=deterministic, rng=rng,
                              embed_noise=alpha)
    monkeypatch.undo()
    return np.asarray(seen[-1])


def test_sym_noise_is_signed_alpha_over_sqrt_sd_in_training_only(monkeypatch):
    mcfg = model_cfg()
    params = models.init(mcfg, jax.random.key(0))
    tokens = batch(1, 4)["tokens"][0]
    key, alpha = jax.random.key(7), 5.0
    clean = noisy_embeddings(monkeypatch, mcfg, params, tokens, 0.0, key)
    noisy = noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, key)
    noise = noisy - clean
    np.testing.assert_allclose(np.abs(noise), alpha / math.sqrt(T * mcfg.hidden_size),
                               rtol=1e-5)
    assert 0.4 < np.mean(noise > 0) < 0.6                   # fair ±1 signs
    again = noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, key)
    np.testing.assert_array_equal(again, noisy)             # the seed decides
    other = noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, jax.random.key(8))
    assert not np.array_equal(other, noisy)
    evaluation = noisy_embeddings(monkeypatch, mcfg, params, tokens, alpha, key,
                                  deterministic=True)
    np.testing.assert_array_equal(evaluation, clean)


def test_sym_noise_leaves_the_dropout_draws_alone(monkeypatch):
    mcfg = model_cfg(hidden_dropout=0.5)
    params = models.init(mcfg, jax.random.key(0))
    tokens = batch(1, 4)["tokens"][0]
    key = jax.random.key(7)
    dropped = noisy_embeddings(monkeypatch, mcfg, params, tokens, 0.0, key)
    both = noisy_embeddings(monkeypatch, mcfg, params, tokens, 5.0, key)
    np.testing.assert_array_equal(dropped == 0, both == 0)  # the same elements dropped
    kept = dropped != 0
    np.testing.assert_allclose(np.abs(both - dropped)[kept],
                               5.0 / math.sqrt(T * mcfg.hidden_size) / 0.5, rtol=1e-5)


@pytest.mark.slow
def test_sym_noise_changes_the_training_loss_not_evaluation():
    mcfg = model_cfg()
    params = _scaled_params(mcfg)
    b = batch(2, 4, seed=5)
    _, plain = run(mcfg, train_cfg(), b, params=params)
    _, noisy = run(mcfg, train_cfg(embed_noise=5.0), b, params=params)
    assert abs(float(noisy["loss"]) - float(plain["loss"])) > 1e-4
    micro = {k: v[0] for k, v in b.items()}
    mask = micro["loss_mask"]
    evaluated = model_loss(params, micro, mask, mcfg, embed_noise=5.0)[0]
    np.testing.assert_array_equal(evaluated, model_loss(params, micro, mask, mcfg)[0])
    trained = model_loss(params, micro, mask, mcfg, train=True, rng=jax.random.key(2),
                         embed_noise=5.0)[0]
    assert abs(float(trained) - float(evaluated)) > 1e-4
