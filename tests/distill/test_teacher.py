"""The JAX teacher's scores (jaxtrain.distill.teacher) against NumPy on the same logits: token
log-probs and top-k, slice by slice; rs_kd's weighted draws estimate the teacher's distribution
without bias, at temperature 1 and below it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.model_helpers import random_params, tiny

from jaxtrain.distill import teacher
from jaxtrain.models.transformer import logits_head


def _logp(params, hidden, cfg):
    x = np.asarray(logits_head(params, hidden[None], cfg)[0], np.float64)
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def test_token_and_topk_scores_slice_by_slice():
    cfg = tiny()
    params = random_params(cfg)
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(12, cfg.hidden_size)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, size=12))
    got = teacher.score(params, hidden, targets, cfg, top_k=4, num_slices=3)
    logp = _logp(params, hidden, cfg)
    np.testing.assert_allclose(got["token_lp"], logp[np.arange(12), np.asarray(targets)],
                               rtol=1e-5, atol=1e-5)
    order = np.argsort(-logp, -1)[:, :4]
    np.testing.assert_array_equal(got["topk_ids"], order)
    np.testing.assert_allclose(got["topk_lp"], np.take_along_axis(logp, order, 1), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="not divisible"):
        teacher.score(params, hidden, targets, cfg, num_slices=5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_rs_kd_draws_estimate_the_teacher_without_bias(temperature):
    """Weighted draws from p^temperature: weights sum to 1 per row, equal 1/rounds at
    temperature 1, and their average over many rows recovers p (within sampling error)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 7)) * 1.5
    logp = jnp.asarray(np.repeat(logits - np.logaddexp.reduce(logits, -1), 4000, 0),
                       jnp.float32)
    ids, w, lp = teacher.sample_draws(logp, 8, temperature, jax.random.key(2))
    ids, w, lp = np.asarray(ids), np.asarray(w, np.float64), np.asarray(lp)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(lp, np.asarray(logp)[0][ids], rtol=1e-6)
    if temperature == 1.0:
        np.testing.assert_allclose(w, 1 / 8, rtol=1e-5)
    estimate = np.zeros(7)
    np.add.at(estimate, ids.ravel(), w.ravel())
    estimate /= len(ids)
    p = np.exp(np.asarray(logp)[0])
    assert np.abs(estimate - p).max() < 0.02, (estimate, p)
    proposal = np.bincount(ids.ravel(), minlength=7) / ids.size
    if temperature != 1.0:   # the draws did come from the flattened proposal, not from p
        flat = np.exp(0.5 * np.log(p)) / np.exp(0.5 * np.log(p)).sum()
        assert np.abs(proposal - flat).max() < 0.02 and np.abs(proposal - p).max() > 0.05
