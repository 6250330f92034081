"""pgs distill's losses (jaxtrain.distill.losses) against NumPy implementations of their formulas
on the same logits (float32, 1e-5): values, and for the REINFORCE losses the gradient with
respect to the student's logits, ICE-POP masking and xtok's chunk advantages included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.model_helpers import random_params, tiny

from jaxtrain.distill import losses as L
from jaxtrain.models.transformer import logits_head

RTOL = ATOL = 1e-5


def _lsm(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_log1mexp(x):
    x = np.minimum(x, -L.TAIL_FLOOR)
    return np.where(x > -np.log(2), np.log(-np.expm1(x)), np.log1p(-np.exp(x)))


def _np_coarse(lq, lp, valid, beta):
    out = []
    for q, p, v in zip(lq, lp, valid):
        q, p = q[v], p[v]
        tq = _np_log1mexp(np.log(np.exp(q).sum()))
        tp = _np_log1mexp(np.log(np.exp(p).sum()))
        q, p = np.append(q, tq), np.append(p, tp)
        out.append(beta * (np.exp(q) * (q - p)).sum() + (1 - beta) * (np.exp(p) * (p - q)).sum())
    return np.array(out)


def _np_project(lq, size, swap):
    out = lq[:, :size].copy()
    for s, d in swap:
        out[:, d] = np.logaddexp(out[:, d], lq[:, s])
    return out


@pytest.fixture
def logits():
    rng = np.random.default_rng(0)
    R, Vs, Vt = 6, 13, 11
    return (rng.normal(size=(R, Vs)) * 2).astype(np.float32), \
        (rng.normal(size=(R, Vt)) * 2).astype(np.float32), rng


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
def test_coarse_kl(logits, beta):
    s, t, rng = logits
    lq, lp = _lsm(s)[:, :5], _lsm(t)[:, :5]
    valid = rng.random(lq.shape) > 0.3
    valid[:, 0] = True
    got = L.coarse_kl(jnp.asarray(lq), jnp.asarray(lp), jnp.asarray(valid), beta)
    np.testing.assert_allclose(got, _np_coarse(lq, lp, valid, beta), rtol=RTOL, atol=ATOL)


def test_full_rkl_over_the_shared_vocabulary_with_a_swapped_terminator(logits):
    s, t, rng = logits
    vocab = L.SharedVocab(size=10, swap=((12, 3),))   # student-only id 12 -> teacher's 3
    lq_all, lp = _lsm(s), _lsm(t)[:, :10]
    targets = rng.integers(0, 10, size=len(s))
    kl, k1, residual = L.full_rkl_rows(jnp.asarray(lq_all), jnp.asarray(lp),
                                       jnp.asarray(targets), vocab)
    lq = _np_project(lq_all, 10, [(12, 3)])
    q = np.exp(lq)
    np.testing.assert_allclose(kl, (q * (lq - lp)).sum(-1), rtol=RTOL, atol=ATOL)
    r = np.arange(len(s))
    np.testing.assert_allclose(k1, lq[r, targets] - lp[r, targets], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(residual, 1 - q.sum(-1), rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(residual) > 0)     # ids 10, 11 are outside


def test_topk_kl_and_rs_kd(logits):
    s, t, rng = logits
    vocab = L.SharedVocab(size=11)
    lq_all, lp_all = _lsm(s), _lsm(t)
    r = np.arange(len(s))
    targets = rng.integers(0, 11, size=len(s))
    support = np.argsort(-lp_all, -1)[:, :4]
    valid = np.ones_like(support, bool)
    valid[0, 3] = False
    beta = 0.7
    kl, k1 = L.topk_kl_rows(jnp.asarray(lq_all), jnp.asarray(support),
                            jnp.asarray(np.take_along_axis(lp_all, support, 1)),
                            jnp.asarray(valid), jnp.asarray(lp_all[r, targets]),
                            jnp.asarray(targets), vocab, beta)
    lq = lq_all[:, :11]
    want = _np_coarse(np.take_along_axis(lq, support, 1), np.take_along_axis(lp_all, support, 1),
                      valid, beta)
    np.testing.assert_allclose(kl, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(k1, lq[r, targets] - lp_all[r, targets], rtol=RTOL, atol=ATOL)
    ids = rng.integers(0, 13, size=(len(s), 5))          # some draws outside the shared 11
    w = rng.random(ids.shape).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    slp = rng.normal(size=ids.shape).astype(np.float32)
    kl, _ = L.rs_kd_rows(jnp.asarray(lq_all), jnp.asarray(ids), jnp.asarray(w),
                         jnp.asarray(slp), jnp.asarray(lp_all[r, targets]), jnp.asarray(targets),
                         vocab)
    ok = ids < 11
    want = (np.where(ok, w, 0) * (slp - np.take_along_axis(lq, np.minimum(ids, 10), 1))).sum(-1)
    np.testing.assert_allclose(kl, want, rtol=RTOL, atol=ATOL)


def _grad_wrt_logits(loss_of_lq, s, targets):
    """d loss / d logits through lq = log_softmax(logits)[target]."""
    def f(x):
        return loss_of_lq(jnp.take_along_axis(jax.nn.log_softmax(x, -1),
                                              jnp.asarray(targets)[:, None], 1)[:, 0])
    return jax.grad(f)(jnp.asarray(s))


@pytest.mark.parametrize("with_behaviour", [False, True])
def test_sampled_rkl_with_ice_pop(logits, with_behaviour):
    s, t, rng = logits
    targets = rng.integers(0, 11, size=len(s))
    r = np.arange(len(s))
    lq = _lsm(s)[r, targets]
    lp = _lsm(t)[r, targets]
    w = rng.random(len(s)).astype(np.float32)
    mu = (lq + np.array([0.0, 1.5, -1.5, 0.2, -0.9, 0.6])).astype(np.float32) \
        if with_behaviour else None
    adv = lp - lq
    ratio = np.exp(lq - mu) if with_behaviour else np.ones_like(lq)
    kept = (ratio >= 0.5) & (ratio <= 2.0) if with_behaviour else np.ones_like(lq, bool)
    assert with_behaviour is False or (~kept).sum() == 3   # ratios exp(-1.5), e^1.5, e^0.9
    value, stats = L.sampled_rkl(jnp.asarray(lq), jnp.asarray(lp), jnp.asarray(w),
                                 None if mu is None else jnp.asarray(mu))
    np.testing.assert_allclose(value, (w * -ratio * adv * kept).sum(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats["k1"], -adv.sum(), rtol=RTOL, atol=ATOL)
    assert int(stats["is_dropped"]) == (~kept).sum()
    # gradient: -w A ratio kept (onehot(y) - softmax), the advantage held fixed
    g = _grad_wrt_logits(lambda x: L.sampled_rkl(x, jnp.asarray(lp), jnp.asarray(w),
                                                 None if mu is None else jnp.asarray(mu))[0],
                         s, targets)
    onehot = np.eye(s.shape[1])[targets]
    want = (-(w * adv * ratio * kept))[:, None] * (onehot - np.exp(_lsm(s)))
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spread", ["chunk", "proportional"])
def test_xtok_chunk_advantages(logits, spread):
    s, _, rng = logits
    targets = rng.integers(0, 13, size=len(s))
    r = np.arange(len(s))
    lq = _lsm(s)[r, targets]
    chunk = np.array([0, 0, 1, -1, 2, 2])       # token 3 belongs to no chunk
    t_chunk = np.array([-3.0, -1.0, -4.0], np.float32)
    keep = np.array([True, True, False])        # chunk 2 carries no loss (e.g. whitespace)
    w = np.full(len(s), 0.5, np.float32)
    value, stats = L.xtok(jnp.asarray(lq), jnp.asarray(chunk), jnp.asarray(t_chunk),
                          jnp.asarray(keep), jnp.asarray(w), spread=spread)
    on = np.array([keep[c] if c >= 0 else False for c in chunk])
    s_chunk = np.array([lq[chunk == c].sum() for c in range(3)])
    adv = np.array([t_chunk[c] - s_chunk[c] if o else 0.0 for c, o in zip(chunk, on)])
    if spread == "proportional":
        adv = np.array([a * lq[i] / s_chunk[c] if o else 0.0
                        for i, (a, c, o) in enumerate(zip(adv, chunk, on))])
    np.testing.assert_allclose(value, (w * -adv * on).sum(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(stats["k1"], (s_chunk - t_chunk)[:2].sum(), rtol=RTOL, atol=ATOL)
    assert int(stats["supervised"]) == on.sum()
    g = _grad_wrt_logits(lambda x: L.xtok(x, jnp.asarray(chunk), jnp.asarray(t_chunk),
                                          jnp.asarray(keep), jnp.asarray(w), spread=spread)[0],
                         s, targets)
    onehot = np.eye(s.shape[1])[targets]
    want = (-(w * adv * on))[:, None] * (onehot - np.exp(_lsm(s)))
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_over_rows_slices_give_the_whole_loss_and_gradient():
    """full_rkl through the student's output layer, one slice of rows at a time, equals the
    unsliced loss, value and gradient."""
    cfg = tiny()
    params = random_params(cfg)
    rng = np.random.default_rng(1)
    N = 8
    hidden = jnp.asarray(rng.normal(size=(N, cfg.hidden_size)).astype(np.float32))
    teacher = jnp.asarray(_lsm(rng.normal(size=(N, 90)).astype(np.float32) * 2))
    targets = jnp.asarray(rng.integers(0, 90, size=N))
    w = jnp.full((N,), 1.0 / N)
    vocab = L.SharedVocab(90)

    def fn(lq, r):
        kl, k1, res = L.full_rkl_rows(lq, r["teacher"], r["targets"], vocab)
        return kl, {"k1": k1, "residual": res}

    def loss(p, slices):
        return L.over_rows(p, hidden, cfg, w, {"teacher": teacher, "targets": targets}, fn,
                           slices)

    whole, stats = loss(params, 1)
    parts, stats4 = loss(params, 4)
    np.testing.assert_allclose(parts, whole, rtol=1e-5)
    np.testing.assert_allclose(stats4["k1"], stats["k1"], rtol=1e-5)
    g1 = jax.grad(lambda p: loss(p, 1)[0])(params)
    g4 = jax.grad(lambda p: loss(p, 4)[0])(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g4)
    lq = jax.nn.log_softmax(logits_head(params, hidden[None], cfg)[0].astype(jnp.float32), -1)
    kl = np.asarray(fn(lq, {"teacher": teacher, "targets": targets})[0])
    np.testing.assert_allclose(whole, (np.asarray(w) * kl).sum(), rtol=1e-5)


def test_sequence_and_token_weights():
    """length_norm's per-sequence mean, sure's 1 + alpha (1 - p), entropy's kept share (ties at
    the threshold kept), as pgs's trainer weighs tokens."""
    np.testing.assert_allclose(L.sequence_weights([2, 3], False), [0.2] * 5, rtol=1e-6)
    np.testing.assert_allclose(L.sequence_weights([2, 3], True),
                               [1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6], rtol=1e-6)
    w = jnp.full((5,), 0.2)
    behaviour = jnp.log(jnp.asarray([0.9, 0.5, 0.1, 1.0, 0.25]))
    np.testing.assert_allclose(L.token_weighting(w, "sure", behaviour_N=behaviour, sure_alpha=2.0),
                               0.2 * (1 + 2 * (1 - np.array([0.9, 0.5, 0.1, 1.0, 0.25]))),
                               rtol=1e-6)
    entropy = jnp.asarray([0.3, 2.0, 1.0, 1.0, 0.1])
    np.testing.assert_allclose(L.token_weighting(w, "entropy", entropy_N=entropy,
                                                 entropy_keep=0.4), [0, 0.2, 0.2, 0.2, 0])
    np.testing.assert_allclose(L.token_weighting(w, "entropy", entropy_N=entropy,
                                                 entropy_keep=0.01), [0, 0.2, 0, 0, 0])
    assert L.token_weighting(w, "none") is w
    with pytest.raises(ValueError, match="needs the rollout's log-probs"):
        L.token_weighting(w, "sure")


def test_token_entropy_and_topk_support():
    cfg = tiny()
    params = random_params(cfg)
    hidden = jnp.asarray(np.random.default_rng(2).normal(size=(6, cfg.hidden_size)), jnp.float32)
    lp = _lsm(np.asarray(logits_head(params, hidden[None], cfg)[0], np.float64))
    np.testing.assert_allclose(L.token_entropy(params, hidden, cfg, num_slices=3),
                               -(np.exp(lp) * lp).sum(-1), rtol=1e-5)
    ids = jnp.asarray([[3, 5], [7, 9]])
    tlp = jnp.asarray([[-0.5, -1.0], [-0.2, -jnp.inf]])
    support, slp, valid = L.topk_support(ids, tlp, jnp.asarray([5, 2]),
                                         jnp.asarray([-1.0, -3.0]), shared=9)
    np.testing.assert_array_equal(support, [[3, 5, 5], [7, 8, 2]])   # 9 clipped to 8
    np.testing.assert_array_equal(valid, [[True, True, False], [True, False, True]])
    np.testing.assert_allclose(slp[:, 2], [-1.0, -3.0])
