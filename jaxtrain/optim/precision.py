"""Megatron's precision-aware optimizer: the dtypes the optimizer reads and keeps its state in.

With ``use_precision_aware_optimizer``:

- ``main_grads_dtype``: the optimizer reads gradients rounded to it (:func:`round_grads`).
- ``exp_avg_dtype`` / ``exp_avg_sq_dtype``: Adam's moments are stored as Transformer Engine's
  FusedAdam stores them: a bf16 cast, fp16/fp8 scaled per layer (:func:`moment_codecs`; the
  formats are :mod:`jaxtrain.optim.quantized`'s). bitsandbytes' 8-bit AdamW (pgs's
  ``adamw8bit`` / ``paged_adamw8bit``) stores them in its 8-bit blockwise format the same way.
- ``main_params_dtype`` fp16: the optimizer keeps the master weights in its state
  (:func:`keep_master_copy`) while the parameters are held in the training dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.optim import quantized as q
from jaxtrain.optim.config import DTYPES, OptimConfig
from jaxtrain.optim.leaves import Path, path_of


def round_grads(dtype) -> optax.GradientTransformation:
    """The optimizer reads gradients rounded to ``dtype`` (Megatron's main_grads_dtype)."""
    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: g.astype(dtype).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def moment_codecs(opt: OptimConfig) -> tuple[q.Codec, q.Codec]:
    """How Adam's first and second moments are stored: 8-bit blockwise for bitsandbytes'
    8-bit AdamW, the exp_avg dtypes of the precision-aware optimizer, else float32."""
    if opt.name in ("adamw8bit", "paged_adamw8bit"):
        return q.Codec("8bit", signed=True), q.Codec("8bit", signed=False)
    if opt.use_precision_aware_optimizer:
        return (q.Codec.for_dtype(DTYPES[opt.exp_avg_dtype]),
                q.Codec.for_dtype(DTYPES[opt.exp_avg_sq_dtype]))
    return q.FP32, q.FP32


class MasterState(NamedTuple):
    master: Any  # per leaf: the master weight in main_params_dtype storage
    inner: Any


def keep_master_copy(inner: optax.GradientTransformation, codec: q.Codec,
                     batch_axes: Callable[[Path], tuple] = lambda p: ()
                     ) -> optax.GradientTransformation:
    """Megatron's ``main_params_dtype`` (Transformer Engine FusedAdam's master weights): the
    optimizer keeps its own copy of the weights stored in ``codec`` (fp16 with an fp32 scale per
    tensor, amax -> fp16_max / 2), runs ``inner`` on that copy in float32 (weight decay
    included) and sets each parameter, held in its own (training) dtype, to the new copy
    rounded to that dtype."""
    def init(params):
        master = jax.tree_util.tree_map_with_path(
            lambda kp, p: q.encode(codec, p, batch_axes(path_of(kp))), params)
        return MasterState(master, inner.init(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("keep_master_copy needs the parameters")
        leaf = lambda x: isinstance(x, (q.Scaled, jax.Array))  # noqa: E731
        main = jax.tree_util.tree_map_with_path(
            lambda kp, m: q.decode(codec, m, batch_axes(path_of(kp))), state.master, is_leaf=leaf)
        u, inner_state = inner.update(updates, state.inner, main)
        new = jax.tree.map(lambda m, d: m + d.astype(jnp.float32), main, u)
        stored = jax.tree_util.tree_map_with_path(
            lambda kp, n: q.encode(codec, n, batch_axes(path_of(kp))), new)
        # the step that lands each parameter on the new master copy in its own dtype
        out = jax.tree.map(lambda n, p: n.astype(p.dtype).astype(jnp.float32)
                           - p.astype(jnp.float32), new, params)
        return out, MasterState(stored, inner_state)

    return optax.GradientTransformation(init, update)
