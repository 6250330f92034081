"""Megatron's Adam and SGD (also pgs's ``adamw``, Muon's Adam part and the 8-bit AdamW).

- ``adam``: Megatron's Adam is AdamW (TE/apex ``FusedAdam`` with ``adam_w_mode``): bias-corrected
  moments, ``eps`` outside the root (MaxText's ``adam_eps_root`` inside), decoupled decay
  ``p -= lr * wd * p``. pgs's ``adamw`` is torch AdamW, the same update, with betas
  ``(adam_beta1, adam_beta2)`` (pgs: 0.9, 0.95). The moments are computed in float32 and stored
  as :func:`jaxtrain.optim.precision.moment_codecs` says (float32, the precision-aware
  optimizer's exp_avg dtypes, or bitsandbytes' 8-bit blocks for ``adamw8bit``).
- ``sgd``: TE/apex ``FusedSGD`` (torch ``SGD`` fallback): ``buf = momentum * buf + (g + wd * p)``,
  ``p -= lr * buf``. Megatron passes ``weight_decay`` to SGD, which adds it to the gradient before
  the momentum (L2, *coupled*, not AdamW-style).

Which leaves decay is :func:`jaxtrain.optim.leaves.decayed`'s (the ``mask`` here).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.optim import quantized as q
from jaxtrain.optim.config import OptimConfig
from jaxtrain.optim.leaves import Leaf, Path, batch_axes_of, path_of
from jaxtrain.optim.precision import moment_codecs


class AdamState(NamedTuple):
    count: jax.Array
    mu: Any  # per leaf: a stored moment (see jaxtrain.optim.quantized)
    nu: Any


def scale_by_adam_stored(b1: float, b2: float, eps: float, mu_codec: q.Codec,
                         nu_codec: q.Codec, batch_axes: Callable[[Path], tuple] = lambda p: (),
                         eps_root: float = 0.0) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` (eps outside the root, ``eps_root`` inside, bias-corrected) whose
    moments are kept in ``mu_codec``/``nu_codec`` storage and computed in float32."""
    def init(params):
        def zeros(codec):
            return jax.tree_util.tree_map_with_path(
                lambda kp, p: q.encode(codec, jnp.zeros(p.shape, jnp.float32),
                                       batch_axes(path_of(kp))), params)
        return AdamState(jnp.zeros([], jnp.int32), zeros(mu_codec), zeros(nu_codec))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        bc1 = 1.0 - b1 ** count.astype(jnp.float32)
        bc2 = 1.0 - b2 ** count.astype(jnp.float32)

        def step(kp, g, mu, nu):
            ba = batch_axes(path_of(kp))
            g32 = g.astype(jnp.float32)
            m = q.decode(mu_codec, mu, ba)
            v = q.decode(nu_codec, nu, ba)
            m = b1 * m + (1.0 - b1) * g32
            v = b2 * v + (1.0 - b2) * g32 * g32
            u = (m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps)
            return u.astype(g.dtype), q.encode(mu_codec, m, ba), q.encode(nu_codec, v, ba)

        out = jax.tree_util.tree_map_with_path(step, updates, state.mu, state.nu)
        treedef = jax.tree.structure(updates)
        u, mu, nu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))
        return u, AdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def adam(opt: OptimConfig, plan: dict[Path, Leaf], lr, wd, mask) -> optax.GradientTransformation:
    """Adam(W) for the leaves of one LR group: direction, decoupled decay on ``mask``, LR."""
    mu_codec, nu_codec = moment_codecs(opt)
    direction = scale_by_adam_stored(opt.adam_beta1, opt.adam_beta2, opt.adam_eps,
                                     mu_codec, nu_codec, batch_axes_of(plan), opt.adam_eps_root)
    return optax.chain(direction, optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


def sgd(opt: OptimConfig, lr, wd, mask) -> optax.GradientTransformation:
    """SGD with momentum, the decay (on ``mask``) added to the gradient first."""
    return optax.chain(optax.add_decayed_weights(wd, mask),
                       optax.trace(decay=opt.sgd_momentum),
                       optax.scale_by_learning_rate(lr))
