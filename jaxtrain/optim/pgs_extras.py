"""pgs's (palingenesis's) optimisation extras as optax transformations.

:func:`jaxtrain.optim.optimizers.build_optimizer` composes them around the per-leaf optimizer,
in the order pgs's trainer runs them within one optimizer step::

    [round grads] -> [mona] -> [adagc | clip_grad] -> per-leaf optimizer -> [llrd] -> [hyperball]

(``adamc`` lives inside the per-leaf optimizer, as its weight-decay schedule). A stacked leaf
(the ``layers`` axis, the expert axes) holds one torch tensor per copy, so every per-tensor
statistic below is taken per copy: over the leaf's core axes, one value per layer (and expert).

- ``train.mona`` (:func:`mona`): on the >= 2-D weights (matrices, embeddings, output layer; not
  norms, biases, vectors), ``A <- b A + (1 - b) (g - g_prev)`` and ``g <- g + alpha A`` with
  ``alpha = -1 / (2 (1 - b))``, ``b = train.mona_beta_a``; nothing on the first step.
  ``g_prev`` is the *augmented* gradient of the step before, as pgs stores it. ``mona_lite``
  keeps ``g_prev`` and ``A`` in bfloat16 (rounded where pgs's in-place bf16 ops round, ``1 - b``
  included).
- ``train.adagc`` (:func:`adagc`): during the first ``W`` steps (the LR warm-up: pgs's
  ``int(total_steps * warmup_ratio)``) the global norm is clipped to ``clip_grad``
  (``train.max_grad_norm``) and each tensor's norm EMA starts at the largest raw norm seen.
  After that each tensor with norm ``n`` >= 1e-12 is scaled by ``min(1, lam * ema / n)``
  and ``ema <- beta * ema + (1 - beta) * min(n, lam * ema)`` (``lam`` ``adagc_lambda``, ``beta``
  ``adagc_beta``); there is no global clip. A tensor with no EMA yet (no warm-up) starts at its
  own norm.
- ``train.adamc``: the decoupled weight decay of step ``t`` is ``wd * lr(t) / lr_peak``
  (:func:`adamc_weight_decay`).
- ``train.llrd_decay`` ``d`` (:func:`llrd`): the update of layer ``i`` (of ``L``) is scaled by
  ``d^(L - i)``, the embeddings' by ``d^(L + 1)``, everything else (final norm, output layer)
  is left at 1. The factor multiplies the whole step, decay included, as pgs's per-group LRs do;
  with pgs's AdamW the embeddings are then decayed too, as pgs's layer-wise groups decay them.
- ``train.hyperball`` (:func:`hyperball`): each attention/MLP matrix (kind ``matrix``: not the
  embeddings, norms, biases or output layer) keeps its norm ``R`` of the first step; with the
  base optimizer's step ``dW`` (computed without weight decay on these matrices)
  ``W <- R normalize(W + eta_t R dW / |dW|)``, ``eta_t = eta * lr(t) / lr_peak``. ``eta`` is
  ``train.hyperball_lr``, or when 0 each matrix's ``|dW| / R / (lr(t) / lr_peak)`` at its first
  step that moved it (a matrix stays where it is until then).

Where jaxtrain differs from pgs, and why, is said in each function.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.models.spec import STACKS   # the top-level trees of stacked layers
from jaxtrain.optim.leaves import Leaf, Path, by_path, path_of

TINY_NORM = 1e-12  # AdaGC leaves a tensor whose gradient norm is below this alone
MONA_KINDS = ("matrix", "embedding", "position_embedding", "output")  # torch's ndim >= 2
HYPERBALL_KINDS = ("matrix",)  # attention / MLP weights
EMBEDDINGS = ("embedding", "position_embedding")  # pgs: the names containing "embed"


def copy_norms(x: jax.Array, leaf: Leaf) -> jax.Array:
    """The float32 Frobenius norm of each stacked copy of ``x``, kept as size-1 core axes."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=leaf.core_axes, keepdims=True))


def _stat_shape(shape: Sequence[int], leaf: Leaf) -> tuple[int, ...]:
    return tuple(1 if i in leaf.core_axes else n for i, n in enumerate(shape))


def _split(updates, out):
    """``tree.map`` output of tuples -> a tuple of trees shaped like ``updates``."""
    treedef = jax.tree.structure(updates)
    return tuple(treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))


def schedule_ratio(lr_schedule, peak: float) -> Callable[[jax.Array], jax.Array]:
    """step -> lr(step) / peak: pgs's ``group['lr'] / group['initial_lr']`` (1 for a constant
    LR or a zero peak)."""
    if not callable(lr_schedule) or peak <= 0:
        return lambda count: jnp.float32(1.0)
    return lambda count: jnp.asarray(lr_schedule(count), jnp.float32) / peak


# ----------------------------------------------------------------------------- MONA

class MonaState(NamedTuple):
    count: jax.Array
    prev: Any   # per member leaf: the (augmented) gradient of the step before, store dtype
    accel: Any  # per member leaf: the EMA of gradient differences, store dtype


def mona(plan: Mapping[Path, Leaf], beta_a: float, lite: bool) -> optax.GradientTransformation:
    """MONA's curvature-aware acceleration of the gradient (pgs ``MONAAcceleration``, its
    default ``alpha``), on the leaves of :data:`MONA_KINDS`.

    pgs calls it after every micro-batch's backward, on the gradient accumulated so far; here it
    runs once per optimizer step on the step's (accumulated, averaged) gradient: the same with
    ``gradient_accumulation_steps`` 1."""
    alpha = -1.0 / (2.0 * (1.0 - beta_a))
    store = jnp.bfloat16 if lite else jnp.float32
    # torch's in-place add to a bf16 buffer rounds its alpha (1 - b) to bf16 as well (and then
    # computes in float32 on its vectorised CPU path, as here)
    keep = float(jnp.asarray(1.0 - beta_a, store).astype(jnp.float32))

    def rnd(x):  # the value a store-dtype buffer holds
        return x.astype(store).astype(jnp.float32)

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, store)  # noqa: E731
        return MonaState(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                         jax.tree.map(zeros, params))

    def update(updates, state, params=None):
        del params
        first = state.count == 0

        def step(g, prev, accel):
            g32 = g.astype(jnp.float32)
            a_old = accel.astype(jnp.float32)
            diff = g32 - prev.astype(jnp.float32)
            a = rnd(rnd(beta_a * a_old) + keep * rnd(diff))
            a = jnp.where(first, a_old, a)
            new = jnp.where(first, g32, g32 + alpha * a).astype(g.dtype)
            return new, new.astype(store), a.astype(store)

        out = jax.tree.map(step, updates, state.prev, state.accel)
        g, prev, accel = _split(updates, out) if jax.tree.leaves(updates) else (
            updates, state.prev, state.accel)
        return g, MonaState(optax.safe_increment(state.count), prev, accel)

    return optax.masked(optax.GradientTransformation(init, update),
                        by_path(plan, lambda leaf: leaf.kind in MONA_KINDS))


# ----------------------------------------------------------------------------- AdaGC

class AdaGCState(NamedTuple):
    count: jax.Array
    ema: Any  # per leaf: each copy's norm EMA (size-1 core axes); negative: none yet


def adagc(plan: Mapping[Path, Leaf], lambda_rel: float, beta: float, warmup_steps: int,
          max_norm: float) -> optax.GradientTransformation:
    """AdaGC's per-tensor adaptive clipping (pgs ``perf.AdaGC``), replacing ``clip_grad``.

    The step counter is the optimizer's (updates applied): a step skipped for a loss-scale
    overflow or a spike keeps the old state, where pgs's counter and EMAs move on. ``max_norm``
    0 turns the warm-up's global clip off (jaxtrain's meaning of ``clip_grad`` 0); pgs would
    clip to 0 there, i.e. zero every gradient of the warm-up."""
    def init(params):
        return AdaGCState(jnp.zeros([], jnp.int32), jax.tree_util.tree_map_with_path(
            lambda kp, p: jnp.full(_stat_shape(p.shape, plan[path_of(kp)]), -1.0, jnp.float32),
            params))

    def update(updates, state, params=None):
        del params
        warm = state.count < warmup_steps
        norms = jax.tree_util.tree_map_with_path(
            lambda kp, g: copy_norms(g, plan[path_of(kp)]), updates)
        total = jnp.sqrt(sum(jnp.sum(n * n) for n in jax.tree.leaves(norms)))
        coeff = (jnp.minimum(1.0, max_norm / (total + 1e-6)) if max_norm > 0
                 else jnp.float32(1.0))

        def step(g, n, ema):
            ema_now = jnp.where(ema < 0, n, ema)
            limit = lambda_rel * ema_now
            tiny = n < TINY_NORM
            over = (n > limit) & ~tiny
            scale = jnp.where(over, limit / jnp.where(over, n, 1.0), 1.0)
            main_ema = jnp.where(tiny, ema, beta * ema_now + (1.0 - beta) * jnp.minimum(n, limit))
            factor = jnp.where(warm, coeff, scale)
            new_ema = jnp.where(warm, jnp.maximum(ema, n), main_ema)
            return (g.astype(jnp.float32) * factor).astype(g.dtype), new_ema

        out = jax.tree.map(step, updates, norms, state.ema)
        g, ema = _split(updates, out)
        return g, AdaGCState(optax.safe_increment(state.count), ema)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- AdamC

def adamc_weight_decay(wd, lr_schedule, peak: float):
    """AdamC (Defazio 2025, pgs ``AdamCCorrection``): the weight decay times ``lr(t) / peak``.

    pgs's correction reads each group's peak LR after ``LambdaLR`` has applied the schedule's
    step-0 factor, which is 0 whenever there is a warm-up; its ratio then stays 1 and the decay
    never changes. jaxtrain applies the correction as pgs states it, with the configured peak."""
    if isinstance(wd, (int, float)) and wd == 0:
        return wd
    ratio = schedule_ratio(lr_schedule, peak)
    return lambda count: (wd(count) if callable(wd) else wd) * ratio(count)


# ----------------------------------------------------------------------------- LLRD

def layer_ids(plan: Mapping[Path, Leaf], updates, layer_stacks: Sequence[str] | None
              ) -> tuple[int, dict[str, list[int]]]:
    """(number of layers, stack -> the global index of each of its slots) from the stacked
    leaves' sizes and ``layer_stacks`` (the stack each layer is in, in order; needed when both
    a dense and an MoE stack exist)."""
    sizes = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(updates)[0]:
        leaf = plan[path_of(kp)]
        if leaf.path[0] in STACKS and "layers" in leaf.axes:
            sizes.setdefault(leaf.path[0], x.shape[leaf.axes.index("layers")])
    if layer_stacks is None:
        if len(sizes) > 1:
            raise ValueError("llrd_decay: the model has dense and MoE layer stacks; their order "
                             "(OptimConfig.layer_stacks) is needed to number the layers")
        return sum(sizes.values()), {k: list(range(n)) for k, n in sizes.items()}
    ids = {k: [i for i, s in enumerate(layer_stacks) if s == k] for k in sizes}
    for k, n in sizes.items():
        if len(ids[k]) != n:
            raise ValueError(f"llrd_decay: {len(ids[k])} layers of layer_stacks are in {k!r}, "
                             f"which stacks {n}")
    return len(layer_stacks), ids


def llrd_factors(plan: Mapping[Path, Leaf], updates, decay: float,
                 layer_stacks: Sequence[str] | None = None):
    """Per leaf, the LR factor of layer-wise LR decay (broadcastable; along the layer axis for
    a stacked leaf)."""
    num, ids = layer_ids(plan, updates, layer_stacks)

    def factor(kp, x):
        leaf = plan[path_of(kp)]
        if leaf.kind in EMBEDDINGS:
            return jnp.float32(decay ** (num + 1))
        if leaf.path[0] in STACKS and "layers" in leaf.axes:
            axis = leaf.axes.index("layers")
            f = jnp.asarray([decay ** (num - i) for i in ids[leaf.path[0]]], jnp.float32)
            return f.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
        return jnp.float32(1.0)

    return jax.tree_util.tree_map_with_path(factor, updates)


def llrd(plan: Mapping[Path, Leaf], decay: float, layer_stacks: Sequence[str] | None = None
         ) -> optax.GradientTransformation:
    """Layer-wise LR decay (pgs ``_build_llrd_groups``) as a scale of each leaf's update."""
    def update(updates, state, params=None):
        del params
        factors = llrd_factors(plan, updates, decay, layer_stacks)
        return jax.tree.map(lambda u, f: (u.astype(jnp.float32) * f).astype(u.dtype),
                            updates, factors), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


# ----------------------------------------------------------------------------- Hyperball

class HyperballState(NamedTuple):
    count: jax.Array
    radius: Any  # per member leaf: each copy's norm at the first step (size-1 core axes)
    eta: Any     # per member leaf: each copy's angular step at the peak LR; 0: not calibrated


def hyperball_member(leaf: Leaf) -> bool:
    return leaf.kind in HYPERBALL_KINDS


def hyperball(plan: Mapping[Path, Leaf], angular_lr: float, lr_schedule, peak: float
              ) -> optax.GradientTransformation:
    """Hyperball (arXiv:2606.16899, Algorithm 1; pgs's ``Hyperball`` over any base optimizer)
    on the leaves :func:`hyperball_member` picks; ``updates`` are the base optimizer's steps,
    which must carry no weight decay on those leaves.

    Every stacked copy (one layer's, one expert's matrix) is one matrix: pgs's torch models
    hold a layer's matrices as separate tensors, but fused 3-D expert weights, which pgs leaves
    unconstrained, are per-expert matrices here as in jaxtrain's Muon."""
    ratio = schedule_ratio(lr_schedule, peak)

    def init(params):
        zeros = lambda kp, p: jnp.zeros(_stat_shape(p.shape, plan[path_of(kp)]),  # noqa: E731
                                        jnp.float32)
        return HyperballState(jnp.zeros([], jnp.int32),
                              jax.tree_util.tree_map_with_path(zeros, params),
                              jax.tree_util.tree_map_with_path(zeros, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("hyperball needs the parameters")
        s = ratio(state.count)
        first = state.count == 0

        def step(kp, d, w, radius, eta):
            leaf = plan[path_of(kp)]
            w32, d32 = w.astype(jnp.float32), d.astype(jnp.float32)
            r = jnp.where(first, copy_norms(w32, leaf), radius)
            dn = copy_norms(d32, leaf)
            if angular_lr > 0:
                eta = jnp.full_like(eta, angular_lr)
            else:
                can = (s > 0) & (dn > 0)
                measured = dn / jnp.maximum(r, 1e-30) / jnp.where(s > 0, s, 1.0)
                eta = jnp.where(eta > 0, eta, jnp.where(can, measured, 0.0))
            trial = w32 + d32 * (eta * s * r / jnp.maximum(dn, 1e-30))
            projected = trial * (r / jnp.maximum(copy_norms(trial, leaf), 1e-30))
            u = jnp.where(eta > 0, projected - w32, 0.0)
            return u.astype(d.dtype), r, eta

        out = jax.tree_util.tree_map_with_path(step, updates, params, state.radius, state.eta)
        u, radius, eta = _split(updates, out) if jax.tree.leaves(updates) else (
            updates, state.radius, state.eta)
        return u, HyperballState(optax.safe_increment(state.count), radius, eta)

    return optax.masked(optax.GradientTransformation(init, update), by_path(plan, hyperball_member))
