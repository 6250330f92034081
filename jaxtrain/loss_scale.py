"""fp16 loss scaling: Megatron's dynamic scaler as a pure state machine, or a fixed scale.

Dynamic: after an overflow (a non-finite gradient) the step is skipped and the hysteresis
budget shrinks by one; when it is spent, the scale halves (never below ``min_scale``). After
``window`` overflow-free steps in a row the scale doubles and the budget refills.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossScale:
    scale: jax.Array         # float32
    good_steps: jax.Array    # int32 overflow-free steps since the last change
    hysteresis: jax.Array    # int32 overflows left before the next backoff


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    dynamic: bool
    initial: float
    min_scale: float
    window: int
    hysteresis: int

    @classmethod
    def from_config(cls, cfg) -> "LossScaleConfig | None":
        """None unless fp16 training; a fixed ``loss_scale`` turns the dynamics off."""
        if not cfg["fp16"]:
            return None
        fixed = cfg["loss_scale"]
        return cls(dynamic=fixed is None, initial=float(fixed or cfg["initial_loss_scale"]),
                   min_scale=float(cfg["min_loss_scale"]), window=int(cfg["loss_scale_window"]),
                   hysteresis=int(cfg["hysteresis"]))

    def init(self) -> LossScale:
        return LossScale(jnp.float32(self.initial), jnp.int32(0), jnp.int32(self.hysteresis))


def update(state: LossScale, overflow: jax.Array, cfg: LossScaleConfig) -> LossScale:
    """The scale for the next step, given whether this step's gradients overflowed."""
    if not cfg.dynamic:
        return state
    budget = jnp.where(overflow, state.hysteresis - 1, state.hysteresis)
    backoff = overflow & (budget <= 0)
    good = jnp.where(overflow, 0, state.good_steps + 1)
    grow = good >= cfg.window
    scale = jnp.where(backoff, jnp.maximum(state.scale * 0.5, cfg.min_scale), state.scale)
    scale = jnp.where(grow, scale * 2.0, scale)
    return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good),
                     hysteresis=jnp.where(grow, cfg.hysteresis, budget))
