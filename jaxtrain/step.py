"""The train state and the one jitted train step ``(state, batch) -> (state, metrics)``.

The step runs the global batch as ``M`` microbatches under ``lax.scan``, accumulating
gradients; normalises the loss as Megatron does (``calculate_per_token_loss``: over all tokens
of the global batch; otherwise the mean over microbatches and data-parallel shards of each
shard's token mean); unscales and checks fp16 gradients; skips pgs gradient spikes; and
applies the optax update. A skipped step (fp16 overflow, spike) keeps params and optimizer
state, so neither the optimizer's count nor the LR schedule advances.

Batch layout: ``tokens``, ``targets``, ``loss_mask`` (and optionally ``positions``,
``segment_ids``) shaped [M, B, T], B = micro_batch_size x data-parallel size.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain import loss_scale as ls
from jaxtrain import spikes
from jaxtrain.loss import row_losses
from jaxtrain.models.transformer import hidden_states


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array             # int32 iterations run (skipped ones included)
    opt_step: jax.Array         # int32 updates applied: what the LR schedule counts
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: ls.LossScale | None
    spike_stats: spikes.SpikeStats | None


def init_state(params, optimizer, tcfg, rng) -> TrainState:
    return TrainState(
        step=jnp.int32(0), opt_step=jnp.int32(0), params=params, opt_state=optimizer.init(params), rng=rng,
        loss_scale=tcfg.loss_scale.init() if tcfg.loss_scale else None,
        spike_stats=spikes.init() if tcfg.spike_detection else None)


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree.leaves(tree)))


def _loss_weights(mask, tcfg):
    """Per-token weights [M,B,T] whose weighted sum is the step's loss (Megatron normalising)."""
    mask = mask.astype(jnp.float32)
    if tcfg.per_token_loss:
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    M, B, T = mask.shape
    dp = tcfg.data_parallel_size
    shards = mask.reshape(M, dp, B // dp, T)
    per_shard = jnp.maximum(jnp.sum(shards, axis=(2, 3), keepdims=True), 1.0)
    return (shards / per_shard / (M * dp)).reshape(M, B, T)


def make_train_step(model_cfg, tcfg, optimizer: optax.GradientTransformation, lr_schedule,
                    opt_state_memory=None):
    """The pure train step for these configs; jit it with donated state.

    ``opt_state_memory`` = (to_device, to_host) keeps the optimizer state in host memory
    between steps (paged_adamw8bit, optimizer_memory_host_offload): the step brings it to the
    device for the update and writes the new state back.
    """
    accum_dtype = jnp.dtype(tcfg.accum_dtype)
    to_device, to_host = opt_state_memory or (lambda t: t, lambda t: t)

    def micro_loss(params, micro, weights, rng):
        hidden = hidden_states(params, micro["tokens"], model_cfg,
                               positions=micro.get("positions"),
                               segment_ids=micro.get("segment_ids"),
                               deterministic=False, rngs=rng)
        sums, _ = row_losses(params, hidden, micro["targets"], weights, model_cfg,
                             num_chunks=tcfg.loss_chunks,
                             half_precision=tcfg.half_precision_loss)
        return jnp.sum(sums)

    def step(state: TrainState, batch: dict):
        weights = _loss_weights(batch["loss_mask"], tcfg)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0)
        rng, step_rng = jax.random.split(state.rng)

        def accumulate(carry, xs):
            grads, loss = carry
            micro, w, i = xs
            value, g = jax.value_and_grad(
                lambda p: micro_loss(p, micro, w, jax.random.fold_in(step_rng, i)) * scale
            )(state.params)
            grads = jax.tree.map(lambda a, b: a + b.astype(accum_dtype), grads, g)
            return (grads, loss + value / scale), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accum_dtype), state.params)
        M = weights.shape[0]
        (grads, loss), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)),
                                        (batch, weights, jnp.arange(M)))
        grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / scale).astype(p.dtype),
                             grads, state.params)
        grad_norm = _global_norm(grads)
        overflow = ~jnp.isfinite(grad_norm)
        skip = overflow if state.loss_scale is not None else jnp.bool_(False)

        spike_stats, spiked = state.spike_stats, jnp.bool_(False)
        if state.spike_stats is not None:
            checked, spiked = spikes.check(state.spike_stats, grad_norm, tcfg.spike_z_threshold)
            spike_stats = jax.tree.map(lambda new, old: jnp.where(overflow, old, new),
                                       checked, state.spike_stats)
            spiked = spiked & ~overflow
            skip = skip | spiked

        lr = lr_schedule(state.opt_step)
        opt_state = to_device(state.opt_state)
        updates, new_opt = optimizer.update(grads, opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + 1, opt_step=state.opt_step + jnp.where(skip, 0, 1).astype(jnp.int32),
            params=keep(new_params, state.params),
            opt_state=to_host(keep(new_opt, opt_state)), rng=rng,
            loss_scale=(ls.update(state.loss_scale, overflow, tcfg.loss_scale)
                        if state.loss_scale is not None else None),
            spike_stats=spike_stats)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
                   "skipped": skip, "spike": spiked,
                   "tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        if tcfg.log_params_norm:
            metrics["params_norm"] = _global_norm(new_state.params)
        if tcfg.log_num_zeros_in_grad:
            metrics["num_zeros_in_grad"] = sum(jnp.sum(g == 0) for g in jax.tree.leaves(grads))
        return new_state, metrics

    return step
