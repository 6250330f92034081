"""pgs memory.gradient_release (jaxtrain/release.py): the optimizer applied layer by layer
during the backward gives the plain step's parameters and optimizer state; the combinations
it cannot serve stop the run with exit 2 naming both keys; the compiled step needs less
scratch memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.conftest import run_module
from tests.train.test_step import batch, model_cfg, train_cfg
from jaxtrain import models
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.step import init_state, make_train_step

ONE = dict(num_microbatches=1, micro_batch_size=4, global_batch_size=4)


def _run(mcfg, tcfg, b, optimizer, steps):
    state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg,
                       jax.random.key(1))
    step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1)))
    out = []
    for _ in range(steps):
        state, metrics = step(state, b)
        out.append((state, metrics))
    return out


def _close(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol),
                 a, b)


@pytest.mark.parametrize("param_scan_axis", [1, pytest.param(0, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_matches_the_plain_step_after_one_and_three_steps(param_scan_axis):
    """AdamW with weight decay, no clipping, fp32: parameters, both moments and the count."""
    mcfg = model_cfg(num_layers=3, param_scan_axis=param_scan_axis)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    b = batch(1, 4)
    plain = _run(mcfg, train_cfg(**ONE), b, optimizer, 3)
    fused = _run(mcfg, train_cfg(**ONE, gradient_release=True), b, optimizer, 3)
    for n in (0, 2):   # after one and after three steps
        (s0, m0), (s1, m1) = plain[n], fused[n]
        _close(s1.params, s0.params, rtol=1e-5, atol=1e-6)
        _close(s1.opt_state, s0.opt_state, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
        # pgs's grad_norm: per-tensor squared norms summed during the backward
        np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
        assert int(s1.opt_step) == int(s0.opt_step) == n + 1
    moved = jax.tree.map(lambda a, c: float(jnp.max(jnp.abs(a - c))), fused[2][0].params,
                         models.init(mcfg, jax.random.key(0)))
    assert min(jax.tree.leaves(moved)) > 0   # every parameter was updated


@pytest.mark.slow
def test_dropout_and_untied_output_layer_match():
    mcfg = model_cfg(hidden_dropout=0.1, untie_embeddings_and_output_weights=True)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    b = batch(1, 4)
    (s0, _), = _run(mcfg, train_cfg(**ONE, loss_chunks=4), b, optimizer, 1)
    (s1, _), = _run(mcfg, train_cfg(**ONE, loss_chunks=4, gradient_release=True), b,
                    optimizer, 1)
    _close(s1.params, s0.params, rtol=1e-5, atol=1e-6)


def test_step_refuses_what_it_does_not_cover():
    mcfg = model_cfg()
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        make_train_step(mcfg, train_cfg(gradient_release=True), optax.sgd(0.1), None)
    with pytest.raises(ConfigError, match="scan_layers"):
        make_train_step(model_cfg(scan_layers=False), train_cfg(**ONE, gradient_release=True),
                        optax.sgd(0.1), None)


def test_non_elementwise_optimizer_state_is_refused():
    """A state leaf that mirrors no parameter (here a per-tensor norm of a stacked tensor)."""
    mcfg = model_cfg()

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape[:1], p.dtype), params)

    optimizer = optax.GradientTransformation(init, lambda g, s, p=None: (g, s))
    tcfg = train_cfg(**ONE, gradient_release=True)
    state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg, jax.random.key(1))
    step = make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1))
    with pytest.raises(ConfigError, match="element-wise"):
        jax.eval_shape(step, state, batch(1, 4))


@pytest.mark.parametrize("overrides, other", [
    (["train.gradient_accumulation_steps=2"], "train.gradient_accumulation_steps"),
    (["optimizer_family=pgs", "train.optimizer=muon"], "train.optimizer"),
    (["optimizer=muon"], "optimizer"),
    (["train.ga_ramp_start=1"], "train.ga_ramp_start"),
    (["train.spike_detection=true"], "train.spike_detection"),
])
def test_bad_combinations_name_both_keys(overrides, other):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["memory.gradient_release=true", *overrides])
    assert "memory.gradient_release" in str(err.value) and f"{other} =" in str(err.value)


def test_global_clipping_is_turned_off_with_a_warning_as_in_pgs():
    cfg = load_config(None, ["memory.gradient_release=true", "train.max_grad_norm=1.0"])
    assert cfg["clip_grad"] == 0.0
    assert any("turns global gradient clipping off" in w for w in cfg.warnings)
    assert load_config(None, ["train.max_grad_norm=1.0"])["clip_grad"] == 1.0


def test_cli_exits_2_naming_both_keys(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("hardware: cpu\nmock_data: true\nvocab_size: 64\nmicro_batch_size: 2\n"
                    "global_batch_size: 2\nmemory:\n  gradient_release: true\n"
                    "train:\n  gradient_accumulation_steps: 4\n")
    result = run_module("jaxtrain.train", path, f"workspace={tmp_path}", "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "memory.gradient_release" in result.stderr
    assert "train.gradient_accumulation_steps" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_compiled_step_needs_less_scratch_memory():
    """Where the gradients dominate (wide layers, short sequences), XLA's temporaries shrink:
    observed on the CPU compiler 42.8 -> 36.3 MB for 12.3 MB of parameters (about half a
    gradient tree: the CPU compile still copies carried stacks in the backward loop); the
    margin asked is a quarter of the parameters' bytes."""
    mcfg = model_cfg(hidden_size=256, num_attention_heads=4, num_layers=4)
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    params = models.init(mcfg, jax.random.key(0))
    b = batch(1, 2)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    temp = {}
    for on in (False, True):
        tcfg = train_cfg(num_microbatches=1, micro_batch_size=2, global_batch_size=2,
                         gradient_release=on)
        state = init_state(params, optimizer, tcfg, jax.random.key(1))
        step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1)),
                       donate_argnums=0)
        temp[on] = step.lower(state, b).compile().memory_analysis().temp_size_in_bytes
    assert temp[True] < temp[False] - param_bytes // 4, (temp, param_bytes)
