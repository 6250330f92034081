"""pgs's gradient-spike skipping (``train.spike_detection``) as a pure state machine.

The first ``warmup`` (50) pre-clip gradient norms only build a mean and variance (Welford);
after that a norm whose z-score exceeds the threshold is a spike: the step's update is
skipped and the LR schedule does not advance. Norms below the threshold move an exponential
moving average (decay 0.99) of the mean and variance; spikes do not.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

WARMUP, DECAY = 50, 0.99


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpikeStats:
    count: jax.Array  # int32 norms seen
    mean: jax.Array   # float32
    var: jax.Array    # float32: the Welford sum of squares during warmup, a variance after


def init() -> SpikeStats:
    return SpikeStats(jnp.int32(0), jnp.float32(0.0), jnp.float32(0.0))


def check(stats: SpikeStats, norm: jax.Array, z_threshold: float) -> tuple[SpikeStats, jax.Array]:
    """(new stats, is_spike) for this step's pre-clip gradient norm."""
    norm = norm.astype(jnp.float32)
    count = stats.count + 1
    # Warmup: Welford running mean and sum of squared deviations.
    w_mean = jnp.where(count == 1, norm, stats.mean + (norm - stats.mean) / count)
    w_var = jnp.where(count == 1, 0.0, stats.var + (norm - stats.mean) * (norm - w_mean))
    # After warmup: the sum of squares becomes a variance once, then EMAs of non-spikes.
    var = jnp.where(count == WARMUP + 1, stats.var / jnp.maximum(count - 1, 1), stats.var)
    std = jnp.sqrt(var)
    std = jnp.where(std < 1e-8, jnp.abs(stats.mean) * 0.1, std)
    z = (norm - stats.mean) / std
    calm = z < z_threshold
    e_mean = jnp.where(calm, DECAY * stats.mean + (1 - DECAY) * norm, stats.mean)
    e_var = jnp.where(calm, DECAY * var + (1 - DECAY) * (norm - e_mean) ** 2, var)
    warm = count <= WARMUP
    new = SpikeStats(count, jnp.where(warm, w_mean, e_mean), jnp.where(warm, w_var, e_var))
    return new, (~warm) & (z > z_threshold)
