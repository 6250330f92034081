"""The train step with MoE: aux losses join the objective but not the reported LM loss, they
are reported as metrics, and the expert bias moves by Megatron's sign rule outside the
optimizer."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.loss import row_losses
from jaxtrain.models.transformer import hidden_states
from jaxtrain.step import init_state, make_train_step
from tests.train.test_step import batch, model_cfg, train_cfg

M, RATE = 2, 0.01
FAST = {"xla_backend_optimization_level": 0}
MOE = dict(num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=RATE)
PLAIN, AUX = model_cfg(**MOE), model_cfg(**MOE, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1)


def _run(mcfg, steps):
    """[(state before, state after, metrics)] of ``steps`` AdamW steps with weight decay."""
    tcfg = train_cfg(num_microbatches=M, micro_batch_size=8 // M)
    optimizer = optax.adamw(0.1, weight_decay=0.5)
    state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg, jax.random.key(1))
    step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1)),
                   compiler_options=FAST)
    out = []
    for _ in range(steps):
        new, metrics = step(state, batch(M, 8 // M))
        out.append((state, new, metrics))
        state = new
    return out


@pytest.fixture(scope="module")
def runs():
    return {"aux": _run(AUX, 2)}


def _forward(state, mcfg):
    """(MoE statistics, mean token loss) of each microbatch of the step from ``state``."""
    b = batch(M, 8 // M)
    step_rng = jax.random.split(state.rng)[1]

    def fn(p, t, y, r):
        h, stats = hidden_states(p, t, mcfg, deterministic=False, rng=r, with_moe_stats=True)
        sums, counts = row_losses(p, h, y, jnp.ones(y.shape), mcfg)
        return stats, jnp.sum(sums) / jnp.sum(counts)

    fn = jax.jit(fn, compiler_options=FAST)
    return [fn(state.params, b["tokens"][i], b["targets"][i], jax.random.fold_in(step_rng, i))
            for i in range(M)]


def _stats(state, mcfg):
    return [st for st, _ in _forward(state, mcfg)]


def _bias(state):
    return np.asarray(state.params["moe_layers"]["moe"]["router"]["expert_bias"])


@pytest.mark.slow
def test_aux_losses_are_reported_apart_from_the_lm_loss(runs):
    old, _, m1 = runs["aux"][0]
    assert {"moe_aux_loss", "moe_z_loss"} <= set(m1)
    out = _forward(old, AUX)   # reported: means over microbatches (and MoE layers)
    np.testing.assert_allclose(m1["loss"], np.mean([lm for _, lm in out]), rtol=1e-5)
    np.testing.assert_allclose(m1["moe_aux_loss"],
                               np.mean([np.mean(st["lb"][:, 0]) for st, _ in out]), rtol=1e-5)
    np.testing.assert_allclose(m1["moe_z_loss"],
                               np.mean([np.mean(st["z"]) for st, _ in out]), rtol=1e-5)


@pytest.mark.slow
def test_aux_losses_join_the_objective(runs):
    (_, s0, m0), = _run(PLAIN, 1)
    _, s1, m1 = runs["aux"][0]
    assert "moe_aux_loss" not in m0
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)    # the same LM loss
    router = lambda s: s.params["moe_layers"]["moe"]["router"]["w"]  # noqa: E731
    assert float(jnp.max(jnp.abs(router(s1) - router(s0)))) > 1e-4     # aux gradients


@pytest.mark.slow
def test_expert_bias_moves_by_the_sign_rule_outside_the_optimizer(runs):
    for old, new, _ in runs["aux"]:
        delta = _bias(new) - _bias(old)      # AdamW with weight decay 0.5 never touches it
        np.testing.assert_allclose(np.abs(delta)[np.abs(delta) > 0], RATE, rtol=1e-5)
        assert np.any(delta > 0) and np.any(delta < 0)
        assert "expert_bias" not in str(jax.tree_util.tree_structure(new.opt_state))
    old, new, _ = runs["aux"][0]             # under-loaded experts rise
    counts = sum(np.asarray(st["counts"]) for st in _stats(old, AUX))      # [L, E]
    want = RATE * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(np.moveaxis(_bias(new) - _bias(old), AUX.param_scan_axis, 0),
                               want, atol=1e-7)
