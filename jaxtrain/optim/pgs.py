"""pgs's (palingenesis's) own optimizers: bitsandbytes' 8-bit ones and schedule-free AdamW.

- ``adamw8bit`` / ``paged_adamw8bit`` / ``lion8bit``: bitsandbytes' 8-bit optimizers with real
  8-bit state (see :mod:`jaxtrain.optim.quantized`: blockwise dynamic quantisation, block
  256): each step dequantises, updates in float32 and requantises. The AdamW ones are
  :func:`jaxtrain.optim.adam.adam` with 8-bit moments
  (:func:`jaxtrain.optim.precision.moment_codecs`). Lion uses bitsandbytes' betas (0.95,
  0.98): ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, ``m = b2 m + (1 - b2) g``.
  ``paged_adamw8bit`` is ``adamw8bit`` whose state lives in host memory
  (:func:`jaxtrain.optim.offload.opt_state_memory_kind`; bitsandbytes pages on demand through
  CUDA unified memory, which XLA has no equivalent of: *mapped* to pinned host memory).
- ``plugins.schedule_free``: replaces the optimizer and the LR schedule, as pgs does:
  ``optax.contrib.schedule_free`` around Adam's second moment (the algorithm of schedulefree's
  ``AdamWScheduleFree``), betas ``(adam_beta1, adam_beta2)``, constant ``lr`` after a linear
  warmup of ``int(train_iters * lr_warmup_fraction)`` steps (pgs passes
  ``total_steps * warmup_ratio``). Evaluate with :func:`schedule_free_eval_params`.

pgs's ``adamw`` is :mod:`jaxtrain.optim.adam`'s, its ``muon`` :mod:`jaxtrain.optim.muon`'s.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.optim import quantized as q
from jaxtrain.optim.config import OptimConfig
from jaxtrain.optim.leaves import Leaf, Path, batch_axes_of, by_path, decayed, path_of

LION_BETAS = (0.95, 0.98)  # bitsandbytes Lion8bit as pgs builds it


class LionState(NamedTuple):
    mu: Any


def scale_by_lion_stored(b1: float, b2: float, mu_codec: q.Codec,
                         batch_axes: Callable[[Path], tuple] = lambda p: ()
                         ) -> optax.GradientTransformation:
    """Lion (Chen et al. 2023): ``sign(b1 m + (1 - b1) g)``; ``m <- b2 m + (1 - b2) g``; the
    moment kept in ``mu_codec`` storage."""
    def init(params):
        return LionState(jax.tree_util.tree_map_with_path(
            lambda kp, p: q.encode(mu_codec, jnp.zeros(p.shape, jnp.float32),
                                   batch_axes(path_of(kp))), params))

    def update(updates, state, params=None):
        del params

        def step(kp, g, mu):
            ba = batch_axes(path_of(kp))
            g32, m = g.astype(jnp.float32), q.decode(mu_codec, mu, ba)
            u = jnp.sign(b1 * m + (1.0 - b1) * g32)
            return u.astype(g.dtype), q.encode(mu_codec, b2 * m + (1.0 - b2) * g32, ba)

        out = jax.tree_util.tree_map_with_path(step, updates, state.mu)
        treedef = jax.tree.structure(updates)
        u, mu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))
        return u, LionState(mu)

    return optax.GradientTransformation(init, update)


def lion8bit(plan: dict[Path, Leaf], lr, wd, mask) -> optax.GradientTransformation:
    """bitsandbytes' Lion8bit for the leaves of one LR group, decoupled decay on ``mask``."""
    direction = scale_by_lion_stored(*LION_BETAS, q.Codec("8bit", signed=True),
                                     batch_axes_of(plan))
    return optax.chain(direction, optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


def schedule_free(opt: OptimConfig, plan, wd) -> optax.GradientTransformation:
    """schedulefree's AdamWScheduleFree: the k-th update (0-based) uses
    ``lr * min(1, (k + 1) / warmup)``. optax's wrapper reads its schedule at a 1-based step and
    the inner ``scale_by_learning_rate`` at a 0-based one, so each gets its own view of it."""
    peak, warm = opt.lr, opt.schedule_free_warmup_steps

    def ramp(k):
        return peak * jnp.minimum(1.0, (k + 1.0) / warm) if warm > 0 else jnp.float32(peak)

    inner = optax.chain(
        optax.scale_by_rms(decay=opt.adam_beta2, eps=opt.adam_eps, eps_in_sqrt=False,
                           bias_correction=True),
        optax.add_decayed_weights(wd, by_path(plan, decayed(opt, "schedule_free"))),
        optax.scale_by_learning_rate(ramp))
    return optax.contrib.schedule_free(inner, learning_rate=lambda step: ramp(step - 1),
                                       b1=opt.adam_beta1)


def schedule_free_eval_params(opt_state, params):
    """The averaged iterate (``x``) of a schedule-free optimizer state, for evaluation and
    export; ``params`` unchanged for other optimizers."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
            x, optax.contrib.ScheduleFreeState)):
        if isinstance(node, optax.contrib.ScheduleFreeState):
            return optax.contrib.schedule_free_eval_params(node, params)
    return params
