"""The jitted train step: accumulation, loss normalisation, chunked loss, skips, precision."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.loss import row_losses
from jaxtrain.loss_scale import LossScaleConfig
from jaxtrain.models.transformer import hidden_states
from jaxtrain.step import init_state, make_train_step
from jaxtrain.train_config import TrainConfig

V, T = 96, 16


def model_cfg(**kw):
    base = dict(hidden_size=32, num_attention_heads=4, num_layers=2, vocab_size=V,
                seq_length=T, max_position_embeddings=T, position_embedding_type="rope",
                normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
                make_vocab_size_divisible_by=1, bf16=False, dtype="float32",
                weight_dtype="float32", use_iota_embed=False)   # a gather: no [B,T,V] one-hot
    return models.ModelConfig.from_config({**base, **kw})


def train_cfg(**kw):
    base = dict(seq_length=T, micro_batch_size=4, global_batch_size=8, rampup=None,
                decrease_batch_size_if_needed=False, num_microbatches=2,
                data_parallel_size=1, train_iters=10, train_samples=None, epochs=None,
                per_token_loss=False, loss_chunks=0, half_precision_loss=False,
                accum_dtype="float32", loss_scale=None, check_nan=True, check_spiky_loss=False,
                check_large_grads=False, spike_detection=False, spike_z_threshold=5.0,
                log_interval=1, log_avg_skip_iterations=2, log_avg_reset_interval=10,
                log_params_norm=False, log_num_zeros_in_grad=False,
                exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False,
                manual_gc=False, manual_gc_interval=1, seed=0)
    return TrainConfig(**{**base, **kw})


def batch(M, B, seed=0, mask=None):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, V, size=(M, B, T + 1)).astype(np.int32)
    loss_mask = np.ones((M, B, T), np.float32) if mask is None else mask
    return {"tokens": jnp.asarray(rows[..., :-1]), "targets": jnp.asarray(rows[..., 1:]),
            "loss_mask": jnp.asarray(loss_mask)}


def run(mcfg, tcfg, b, optimizer=None, steps=1, params=None):
    optimizer = optimizer or optax.sgd(0.1)
    params = params if params is not None else models.init(mcfg, jax.random.key(0))
    state = init_state(params, optimizer, tcfg, jax.random.key(1))
    step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1)))
    for _ in range(steps):
        state, metrics = step(state, b)
    return state, metrics


def test_accumulating_k_microbatches_equals_one_big_batch():
    mcfg = model_cfg()
    b = batch(4, 2)
    one = {k: v.reshape(1, 8, T) for k, v in b.items()}
    s4, m4 = run(mcfg, train_cfg(num_microbatches=4, micro_batch_size=2), b)
    s1, m1 = run(mcfg, train_cfg(num_microbatches=1, micro_batch_size=8), one)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=2e-5, atol=1e-7),
                 s4.params, s1.params)


def _reference_losses(mcfg, params, b):
    h = hidden_states(params, b["tokens"].reshape(-1, T), mcfg)
    sums, counts = row_losses(params, h, b["targets"].reshape(-1, T),
                              b["loss_mask"].reshape(-1, T), mcfg)
    return np.asarray(sums), np.asarray(counts)


@pytest.mark.slow
def test_loss_normalisation_follows_calculate_per_token_loss():
    mcfg = model_cfg()
    params = models.init(mcfg, jax.random.key(0))
    mask = np.ones((2, 4, T), np.float32)
    mask[0, :, T // 4:] = 0.0  # the first microbatch has far fewer loss tokens
    b = batch(2, 4, mask=mask)
    sums, counts = _reference_losses(mcfg, params, b)
    per_token = sums.sum() / counts.sum()
    per_micro = np.mean([sums[:4].sum() / counts[:4].sum(), sums[4:].sum() / counts[4:].sum()])
    _, m = run(mcfg, train_cfg(per_token_loss=True), b, params=params)
    np.testing.assert_allclose(m["loss"], per_token, rtol=1e-5)
    _, m = run(mcfg, train_cfg(per_token_loss=False), b, params=params)
    np.testing.assert_allclose(m["loss"], per_micro, rtol=1e-5)
    assert abs(per_token - per_micro) > 1e-3


@pytest.mark.slow
def test_per_shard_means_with_data_parallel_shards():
    mcfg = model_cfg()
    params = models.init(mcfg, jax.random.key(0))
    mask = np.ones((1, 8, T), np.float32)
    mask[0, :4, 2:] = 0.0
    b = batch(1, 8, mask=mask)
    sums, counts = _reference_losses(mcfg, params, b)
    shards = np.mean([sums[:4].sum() / counts[:4].sum(), sums[4:].sum() / counts[4:].sum()])
    _, m = run(mcfg, train_cfg(num_microbatches=1, micro_batch_size=4, data_parallel_size=2),
               b, params=params)
    np.testing.assert_allclose(m["loss"], shards, rtol=1e-5)


@pytest.mark.slow
def test_chunked_loss_matches_and_never_builds_full_logits():
    mcfg = model_cfg()
    b = batch(2, 4)
    s0, m0 = run(mcfg, train_cfg(loss_chunks=0), b)
    s4, m4 = run(mcfg, train_cfg(loss_chunks=4), b)
    np.testing.assert_allclose(m4["loss"], m0["loss"], rtol=1e-6)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7),
                 s4.params, s0.params)
    tcfg = train_cfg(loss_chunks=4)
    optimizer = optax.sgd(0.1)
    params = models.init(mcfg, jax.random.key(0))
    state = init_state(params, optimizer, tcfg, jax.random.key(1))
    step = make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1))
    jaxpr = str(jax.make_jaxpr(step)(state, b))
    assert f"f32[4,{T},{mcfg.vocab_size}]" not in jaxpr
    assert f"f32[4,{T // 4},{mcfg.vocab_size}]" in jaxpr


@pytest.mark.slow
def test_fp16_overflow_skips_the_update_and_backs_off_the_scale():
    mcfg = model_cfg()
    ls = LossScaleConfig(dynamic=True, initial=2.0**127, min_scale=1.0, window=1000,
                         hysteresis=1)
    state, m = run(mcfg, train_cfg(loss_scale=ls), batch(2, 4))
    assert bool(m["skipped"]) and int(state.opt_step) == 0 and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**126
    params = models.init(mcfg, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    ok = LossScaleConfig(dynamic=True, initial=1024.0, min_scale=1.0, window=1000, hysteresis=1)
    state, m = run(mcfg, train_cfg(loss_scale=ok), batch(2, 4))
    assert not bool(m["skipped"]) and int(state.opt_step) == 1


@pytest.mark.slow
def test_loss_scale_does_not_change_the_update():
    mcfg = model_cfg()
    b = batch(2, 4)
    ls = LossScaleConfig(dynamic=False, initial=4096.0, min_scale=1.0, window=1, hysteresis=1)
    a, _ = run(mcfg, train_cfg(loss_scale=ls), b)
    c, _ = run(mcfg, train_cfg(), b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
                 a.params, c.params)


@pytest.mark.slow
def test_spike_skip_skips_exactly_the_spiking_step():
    mcfg = model_cfg()
    tcfg = train_cfg(spike_detection=True, spike_z_threshold=5.0)
    optimizer = optax.sgd(1e-3)
    params = models.init(mcfg, jax.random.key(0))
    state = init_state(params, optimizer, tcfg, jax.random.key(1))
    step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(1e-3)))
    skipped = []
    for i in range(60):
        b = batch(2, 4, seed=i % 3)
        if i == 55:
            b["targets"] = jnp.zeros_like(b["targets"])  # a batch unlike the others
            state = dataclasses.replace(state, params=jax.tree.map(lambda p: p * 1.0, state.params))
        before = state.opt_step
        state, m = step(state, b)
        skipped.append(bool(m["spike"]))
        assert int(state.opt_step) == int(before) + (0 if m["spike"] else 1)
    assert skipped.index(True) == 55 and sum(skipped) == 1


@pytest.mark.slow
def test_accumulation_dtype_changes_the_sum():
    mcfg = model_cfg()
    b = batch(4, 2)
    s32, _ = run(mcfg, train_cfg(num_microbatches=4, micro_batch_size=2), b)
    s16, _ = run(mcfg, train_cfg(num_microbatches=4, micro_batch_size=2,
                                 accum_dtype="bfloat16"), b)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, c: float(jnp.max(jnp.abs(a - c))),
                                         s32.params, s16.params))
    assert max(diffs) > 0


@pytest.mark.slow
def test_optional_metrics():
    mcfg = model_cfg()
    _, m = run(mcfg, train_cfg(log_params_norm=True, log_num_zeros_in_grad=True), batch(2, 4))
    assert float(m["params_norm"]) > 0 and "num_zeros_in_grad" in m
    _, m = run(mcfg, train_cfg(), batch(2, 4))
    assert "params_norm" not in m


def test_optimizer_state_stays_in_host_memory_between_steps():
    from jax.sharding import SingleDeviceSharding
    mcfg, tcfg = model_cfg(), train_cfg()
    device = jax.devices()[0]

    def mover(kind):
        return lambda t: jax.tree.map(
            lambda x: jax.device_put(x, SingleDeviceSharding(device, memory_kind=kind)), t)

    optimizer = optax.adam(1e-3)
    state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg, jax.random.key(1))
    state = dataclasses.replace(state, opt_state=mover("pinned_host")(state.opt_state))
    step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(1e-3),
                                   (mover("device"), mover("pinned_host"))))
    state, _ = step(state, batch(2, 4))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
