"""pgs's Pre-RL objective (plugins.pre_rl, plugins.pre_rl_entropy_coeff, plugins.pre_rl_kl_coeff):
CE on the tokens safe to imitate, an entropy bonus and a KL penalty to the frozen base model on
the others. Against its formula in numpy, chunked against whole, side by side with pgs's torch
code, and through the train step with the base weights held beside the state."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.loss import TokenObjective, _pre_rl_rows, _pre_rl_sums, model_loss
from jaxtrain.models.transformer import forward
from jaxtrain.step import init_state, make_train_step
from tests.train.test_sft_objectives import pgs  # noqa: F401  (the pgs-code fixture)
from tests.train.test_step import batch, model_cfg, run, train_cfg

PRE_RL = TokenObjective("pre_rl", entropy_coeff=0.3, kl_coeff=0.7)


def _log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference(logits, base_logits, targets, valid, c_h, c_kl):
    """pgs pre_rl written out: masks from entropy > 2 or KL > 0.5, three means."""
    lp, lb = _log_softmax(logits), _log_softmax(base_logits)
    p = np.exp(lp)
    entropy = -(p * lp).sum(-1)
    kl = (p * (lp - lb)).sum(-1)
    nll = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    unsafe = (entropy > 2.0) | (kl > 0.5)
    imitate, held = valid & ~unsafe, valid & unsafe
    return (nll[imitate].sum() / max(imitate.sum(), 1)
            - c_h * entropy[held].sum() / max(held.sum(), 1)
            + c_kl * kl[held].sum() / max(held.sum(), 1))


def _loss(logits, base_logits, targets, mask, objective=PRE_RL):
    """The loss from logits directly (the pieces row_losses combines per chunk)."""
    sums = _pre_rl_sums(jnp.asarray(logits), jnp.asarray(base_logits), jnp.asarray(targets),
                        jnp.asarray(mask) > 0)
    return jnp.sum(_pre_rl_rows(objective, sums))


def _random(seed, B=3, S=7, V=11, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, S, V)) * rng.uniform(0.2, scale, size=(B, S, 1))
    base = logits + rng.normal(size=(B, S, V)) * rng.uniform(0, 1.5, size=(B, S, 1))
    targets = rng.integers(0, V, size=(B, S))
    mask = (rng.random((B, S)) > 0.25).astype(np.float32)
    return logits.astype(np.float32), base.astype(np.float32), targets, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pre_rl_loss_is_its_formula(seed):
    logits, base, targets, mask = _random(seed)
    want = reference(logits, base, targets, mask > 0, 0.3, 0.7)
    lp = _log_softmax(logits)
    ent = -(np.exp(lp) * lp).sum(-1)
    assert ((ent > 2.0) & (mask > 0)).any() and ((ent <= 2.0) & (mask > 0)).any()
    np.testing.assert_allclose(float(_loss(logits, base, targets, mask)), want, rtol=1e-5)


def test_same_loss_and_gradient_as_pgs(pgs):  # noqa: F811
    module, torch = pgs
    logits, base, targets, mask = _random(3)
    labels = np.where(mask > 0, targets, -100)
    x = torch.tensor(logits, requires_grad=True)
    theirs = module._pre_rl_loss_inner(x, torch.tensor(labels), torch.tensor(base), 0.3, 0.7,
                                       2.0, 0.5)
    theirs.backward()
    ours, grad = jax.value_and_grad(lambda z: _loss(z, base, targets, mask))(jnp.asarray(logits))
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-4, atol=1e-6)


def _hidden_and_params(seed=0):
    mcfg = model_cfg()
    params = models.init(mcfg, jax.random.key(seed))
    base = models.init(mcfg, jax.random.key(seed + 1))
    b = batch(1, 4, seed=seed)
    return mcfg, params, base, {k: v[0] for k, v in b.items()}


@pytest.mark.slow
def test_chunked_equals_whole_and_uses_the_base_model():
    mcfg, params, base, micro = _hidden_and_params()
    whole = model_loss(params, micro, micro["loss_mask"], mcfg, objective=PRE_RL,
                       base_params=base)[0]
    chunked = model_loss(params, micro, micro["loss_mask"], mcfg, objective=PRE_RL,
                         base_params=base, num_chunks=4)[0]
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-5)
    logits = np.asarray(forward(params, micro["tokens"], mcfg))
    base_logits = np.asarray(forward(base, micro["tokens"], mcfg))
    want = reference(logits, base_logits, np.asarray(micro["targets"]),
                     np.asarray(micro["loss_mask"]) > 0, 0.3, 0.7)
    np.testing.assert_allclose(float(whole), want, rtol=1e-4)
    same = model_loss(params, micro, micro["loss_mask"], mcfg, objective=PRE_RL,
                      base_params=params)[0]
    assert abs(float(same) - float(whole)) > 1e-4       # the base model matters


@pytest.mark.slow
def test_train_step_takes_the_frozen_base_beside_the_state():
    mcfg, params, base, _ = _hidden_and_params()
    tcfg = dataclasses.replace(train_cfg(), objective=PRE_RL)
    b = batch(2, 4)
    opt = optax.sgd(0.1)
    state = init_state(params, opt, tcfg, jax.random.key(1))
    step = jax.jit(make_train_step(mcfg, tcfg, opt, lambda n: jnp.float32(0.1)))
    _, metrics = step(state, b, {"base": base})
    micro = [{k: v[m] for k, v in b.items()} for m in range(2)]
    want = np.mean([float(model_loss(params, m, m["loss_mask"], mcfg, objective=PRE_RL,
                                     base_params=base)[0]) for m in micro])
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    _, ce = run(mcfg, train_cfg(), b, params=params)
    assert abs(float(ce["loss"]) - want) > 1e-3
