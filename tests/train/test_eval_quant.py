"""One loss for training, evaluation and the health monitor (jaxtrain.loss.model_loss), with
the quantization state passed explicitly: under FP8 delayed scaling, validation and the health
passes use the scales the training forward uses, not fresh ones."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.evaluation import make_eval_step
from jaxtrain.models.quant_state import init_state as init_quant_state
from jaxtrain.observe.health import Health
from jaxtrain.quant import QuantConfig
from jaxtrain.step import init_state, make_train_step
from tests.train.test_step import batch, model_cfg, train_cfg


@pytest.fixture(scope="module")
def trained():
    """A delayed-scaling model and its train state after three steps on other batches (the
    amax histories and scales moved on; lr 0 keeps the weights), its scales then cut 64-fold
    as after an amax spike (so they differ clearly from the batch's own), plus a fresh
    batch."""
    mcfg = model_cfg().replace(quant=QuantConfig("delayed", "e4m3", "e4m3", "e5m2",
                                                 history_len=4))
    tcfg = train_cfg(micro_batch_size=4, global_batch_size=4, num_microbatches=1)
    # weights scaled up from the init so the logits are far from uniform and the FP8 rounding
    # shows in the loss
    params = jax.tree.map(lambda a: a * 4, models.init(mcfg, jax.random.key(0)))
    state = init_state(params, optax.sgd(0.0), tcfg, jax.random.key(1),
                       quant_state=init_quant_state(mcfg))
    step = jax.jit(make_train_step(mcfg, tcfg, optax.sgd(0.0), lambda n: jnp.float32(0.0)))
    for seed in (1, 2, 3):
        state, _ = step(state, batch(1, 4, seed=seed))
    spiked = jax.tree_util.tree_map_with_path(
        lambda p, a: a / 64 if jax.tree_util.keystr(p).endswith("['scale']") else a,
        state.quant_state)
    return mcfg, step, dataclasses.replace(state, quant_state=spiked), batch(1, 4, seed=7)


@pytest.mark.slow
def test_eval_loss_is_the_training_loss_on_the_training_scales(trained):
    mcfg, step, state, b = trained
    _, metrics = step(state, b)                  # the training forward's loss on b
    ev = jax.jit(make_eval_step(mcfg))
    total, count = ev(state.params, b, state.quant_state)
    assert float(count) == b["loss_mask"].size
    np.testing.assert_allclose(float(total / count), float(metrics["loss"]), rtol=1e-6)
    ignored, _ = ev(state.params, b)             # without the state: other scales
    assert abs(float(ignored / count) - float(metrics["loss"])) > 1e-4


@pytest.mark.slow
def test_health_passes_use_the_training_scales(trained):
    """The output entropy (64 tokens = every token of the last microbatch here) is the one of
    the model's logits under the state's scales, and changes without the state."""
    mcfg, _, state, b = trained
    health = Health(mcfg, rl_readiness=True, tier2_every=1)

    def measured(quant_state):
        got = jax.device_get(health.fields(1, state.params, b, quant_state=quant_state))
        return float(got["_health/entropy"]), got

    logits = models.forward(state.params, b["tokens"][-1], mcfg, quant_state=state.quant_state)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    want = float(jnp.mean(-jnp.sum(jnp.exp(logp) * logp, axis=-1)))
    with_state, got = measured(state.quant_state)
    assert got["_health/entropy_tokens"] == b["tokens"][-1].size
    np.testing.assert_allclose(with_state, want, rtol=1e-5)
    without, got_none = measured(None)
    assert abs(without - want) > 1e-5
    assert float(got["health/grad_cosine_halves"]) != float(got_none["health/grad_cosine_halves"])
