"""Muon: Megatron's ``TensorParallelMuon`` (Emerging-Optimizers) and pgs's ``torch.optim.Muon``.

Muon takes the leaves :func:`jaxtrain.optim.leaves.muon_member` picks; Adam
(:mod:`jaxtrain.optim.adam`) the rest.

- ``muon`` / ``dist_muon`` (Megatron): per layer (the stacked axis is a batch axis), attention
  ``wq`` [D, N, H] is the matrix D x (N*H), ``wo`` [N, H, D] is (N*H) x D. Update:
  ``m = lerp(m, g, 1 - muon_momentum)``; ``u = lerp(g, m, momentum)`` with ``muon_use_nesterov``
  else ``m``; Newton-Schulz with the "quintic" coefficient sets (``muon_num_ns_steps``, a
  multiple of 5, as Emerging-Optimizers requires); times ``muon_scale_mode``'s factor of
  (out, in) -- spectral ``sqrt(max(out, in))``, shape_scaling ``sqrt(max(1, out/in))``,
  unit_rms_norm ``sqrt(out/in)`` -- and ``muon_extra_scale_factor``;
  ``p -= lr * (update + wd * p)``. ``muon_fp32_matmul_prec``: medium (and low: torch has nothing
  lower) runs the iteration on bfloat16 inputs with float32 accumulation, as Emerging-Optimizers
  does explicitly; high keeps float32 (XLA precision HIGH: TF32-class on GPU, exact on CPU).
  ``muon_split_qkv``: Megatron fuses Q, K and V into one weight and splits it per component
  when true; here ``wq``, ``wk``, ``wv`` are separate leaves, so true holds by construction, and
  false orthogonalises the fused [D, (N + 2K) * H] matrix (concatenated per layer; the row
  order of Megatron's per-group interleaving does not change the result, which is equivariant
  to permutations). The gated MLP's ``wi_0``/``wi_1`` are Megatron's one fused ``linear_fc1``
  and are orthogonalised together. ``muon_tp_mode``: blockwise orthogonalises each
  tensor-parallel shard on its own (the ``tensor_model_parallel_size`` column/row blocks of each
  matrix, with the shard's shape in the scale factor, as Megatron does; KV heads fewer than the
  TP degree are replicated, hence whole); duplicated and distributed orthogonalise the whole
  matrix (identical maths; under XLA the sharding decides where it runs). Same-shaped stacks
  share one batched Newton-Schulz. ``dist_muon`` (Megatron's layer-wise distributed Muon) only
  shards state: the same update.
- ``muon`` (pgs): ``torch.optim.Muon`` at 10x the LR, Nesterov (the pgs default of
  ``muon_use_nesterov``), Jordan's single coefficient set, scale ``sqrt(max(1, out/in))``
  (torch's "original"; ``muon_scale_mode`` set explicitly overrides it), no fused ``wi_0``/
  ``wi_1``. :class:`jaxtrain.optim.config.OptimConfig` sets these from the flavour.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.optim.config import NS_COEFFICIENTS, OptimConfig
from jaxtrain.optim.leaves import TP_AXES, Leaf, Path, path_of


def muon_scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """Emerging-Optimizers' ``get_muon_scale_factor`` (out, in as torch's [out, in])."""
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    raise ValueError(f"muon_scale_mode {mode!r}")


@functools.partial(jax.jit, static_argnames=("steps", "coefficients", "precision", "eps"))
def newton_schulz(x: jax.Array, steps: int = 5, coefficients: str = "quintic",
                  precision: str = "medium", eps: float = 1e-7) -> jax.Array:
    """Orthogonalise each (..., m, n) matrix: Frobenius-normalise, then ``steps`` iterations
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the wide orientation, cycling through the
    coefficient sets. medium/low: bfloat16 operands, float32 accumulation (Emerging-Optimizers'
    explicit bf16 path); high: float32 operands at XLA precision HIGH."""
    coeffs = NS_COEFFICIENTS[coefficients]
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))
    x = x / jnp.maximum(norm, eps)
    dt = jnp.float32 if precision == "high" else jnp.bfloat16
    prec = jax.lax.Precision.HIGH if precision == "high" else None

    # bfloat16 operands, float32 accumulation. XLA:CPU has no BF16 x BF16 = F32 dot: there the
    # operands are widened first (exact: a bf16 product is exact in float32).
    widen = dt == jnp.bfloat16 and jax.default_backend() == "cpu"

    def mm(a, b):
        if widen:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.matmul(a, b, precision=prec, preferred_element_type=jnp.float32)

    def iteration(x, abc):
        a, b, c = abc[0], abc[1], abc[2]
        gram = mm(x, jnp.swapaxes(x, -1, -2)).astype(dt)
        poly = (b * gram.astype(jnp.float32) + c * mm(gram, gram)).astype(dt)
        return (a * x.astype(jnp.float32) + mm(poly, x)).astype(dt), None

    table = jnp.asarray([coeffs[i % len(coeffs)] for i in range(steps)], jnp.float32)
    x = jax.lax.scan(iteration, x.astype(dt), table)[0].astype(jnp.float32)
    return jnp.swapaxes(x, -1, -2) if tall else x


def _to_matrix(x: jax.Array, leaf: Leaf):
    """(B, in, out) view of a leaf and the function that undoes it."""
    ins, outs = leaf.matrix_axes()
    batch = leaf.batch_axes
    perm = batch + ins + outs
    shape = lambda axes: tuple(x.shape[a] for a in axes)  # noqa: E731
    size = lambda axes: math.prod(shape(axes))  # noqa: E731
    mat = jnp.transpose(x, perm).reshape(size(batch), size(ins), size(outs))
    inv = tuple(perm.index(i) for i in range(x.ndim))

    def back(m):
        return jnp.transpose(m.reshape(shape(batch) + shape(ins) + shape(outs)), inv)
    return mat, back


def _tp_side(leaf: Leaf, x: jax.Array, tp: int) -> str | None:
    """'in' or 'out': the side of the matrix Megatron's tensor parallelism splits, if any. KV
    heads fewer than the TP degree (``tp % K == 0``) are replicated on every rank by Megatron,
    so each rank holds (and orthogonalises) the whole matrix."""
    if tp <= 1:
        return None
    ins, outs = leaf.matrix_axes()
    for side, axes in (("in", ins), ("out", outs)):
        named = [a for a in axes if leaf.axes[a] in TP_AXES]
        if not named:
            continue
        size = x.shape[named[0]]
        if leaf.axes[named[0]] == "kv_heads" and size < tp and tp % size == 0:
            return None
        if named[0] != axes[0] or size % tp:
            raise ValueError(
                f"muon_tp_mode blockwise: {'/'.join(leaf.path)} {x.shape} cannot be split into "
                f"{tp} tensor-parallel blocks along {leaf.axes[named[0]]!r}")
        return side
    return None


def _split_tp(m: jax.Array, side: str | None, tp: int) -> jax.Array:
    """(B, in, out) -> (B*tp, ...): the tensor-parallel blocks along ``side`` as batch."""
    if not side or tp <= 1:
        return m
    b, i, o = m.shape
    if side == "out":
        return m.reshape(b, i, tp, o // tp).transpose(0, 2, 1, 3).reshape(b * tp, i, o // tp)
    return m.reshape(b * tp, i // tp, o)


def _unsplit(m: jax.Array, shape: tuple[int, int, int], side: str | None, tp: int) -> jax.Array:
    if not side or tp <= 1:
        return m
    b, i, o = shape
    if side == "out":
        return m.reshape(b, tp, i, o // tp).transpose(0, 2, 1, 3).reshape(b, i, o)
    return m.reshape(b, i, o)


def _fusion_groups(paths: list[Path], opt: OptimConfig) -> list[tuple[Path, ...]]:
    """Leaves that Megatron keeps as one weight: Q/K/V (when muon_split_qkv is false) and the
    gated MLP's wi_0/wi_1 (Megatron's fused linear_fc1). Everything else alone."""
    present, used, groups = set(paths), set(), []
    families = []
    if not opt.muon_split_qkv:
        families.append(("wq", "wk", "wv"))
    if opt.muon_fuse_fc1:
        families.append(("wi_0", "wi_1"))
    for path in paths:
        if path in used:
            continue
        for fam in families:
            if path[-1] in fam:
                members = tuple(path[:-1] + (n,) for n in fam)
                if all(m in present for m in members):
                    groups.append(members)
                    used.update(members)
                    break
        else:
            groups.append((path,))
            used.add(path)
    return groups


class MuonState(NamedTuple):
    mu: Any


def scale_by_megatron_muon(plan: Mapping[Path, Leaf], opt: OptimConfig
                           ) -> optax.GradientTransformation:
    """Muon's direction for the leaves it receives: EMA momentum (optionally Nesterov), then
    scaled Newton-Schulz per stacked matrix, fused weights and TP blocks as configured."""
    beta = opt.muon_momentum

    def init(params):
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: m + (1.0 - beta) * (g.astype(jnp.float32) - m),
                          updates, state.mu)
        if opt.muon_nesterov:
            direction = jax.tree.map(lambda g, m: g.astype(jnp.float32)
                                     + beta * (m - g.astype(jnp.float32)), updates, mu)
        else:
            direction = mu
        flat, treedef = jax.tree_util.tree_flatten_with_path(direction)
        paths = [path_of(kp) for kp, _ in flat]
        value = dict(zip(paths, (x for _, x in flat)))
        # One matrix stack per fused weight (TP blocks as extra batch), on its wide side.
        jobs = []
        for group in _fusion_groups(paths, opt):
            leaves = [plan[p] for p in group]
            views = [_to_matrix(value[p], leaf) for p, leaf in zip(group, leaves)]
            sides = {(_tp_side(leaf, value[p], opt.tp_size)
                      if opt.muon_tp_mode == "blockwise" else None)
                     for p, leaf in zip(group, leaves)}
            if len(sides) > 1:
                raise NotImplementedError(
                    f"muon_tp_mode blockwise with fused {[p[-1] for p in group]}: the members "
                    f"split differently across {opt.tp_size} tensor-parallel ranks (replicated KV "
                    f"heads); set muon_split_qkv true or use muon_tp_mode duplicated")
            side = sides.pop()
            mats = [_split_tp(m, side, opt.tp_size) for m, _ in views]
            fused = jnp.concatenate(mats, axis=-1) if len(mats) > 1 else mats[0]
            size_in, size_out = fused.shape[-2:]
            tall = size_in > size_out
            jobs.append(dict(group=group, views=views, side=side, tall=tall,
                             widths=[m.shape[-1] for m in mats], size=(size_out, size_in),
                             wide=jnp.swapaxes(fused, -1, -2) if tall else fused))
        # Same-shaped stacks are orthogonalised in one batched Newton-Schulz.
        buckets: dict[tuple[int, int], list[int]] = {}
        for j, job in enumerate(jobs):
            buckets.setdefault(job["wide"].shape[-2:], []).append(j)
        for members in buckets.values():
            stacked = jnp.concatenate([jobs[j]["wide"] for j in members], axis=0)
            ortho = newton_schulz(stacked, opt.muon_num_ns_steps, opt.muon_coefficients,
                                  opt.muon_fp32_matmul_prec)
            start = 0
            for j in members:
                n = jobs[j]["wide"].shape[0]
                jobs[j]["ortho"] = ortho[start:start + n]
                start += n
        out = {}
        for job in jobs:
            o = jnp.swapaxes(job["ortho"], -1, -2) if job["tall"] else job["ortho"]
            o = o * (muon_scale_factor(*job["size"], opt.muon_scale_mode)
                     * opt.muon_extra_scale_factor)
            start = 0
            for p, w, (m, back) in zip(job["group"], job["widths"], job["views"]):
                part = _unsplit(o[..., start:start + w], m.shape, job["side"], opt.tp_size)
                out[p] = back(part)
                start += w
        new = treedef.unflatten([out[p] for p in paths])
        new = jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates)
        return new, MuonState(mu)

    return optax.GradientTransformation(init, update)


def muon(plan: Mapping[Path, Leaf], opt: OptimConfig, lr, wd, mask=None
         ) -> optax.GradientTransformation:
    """Muon for its leaves: the direction, decoupled decay on all of them (on ``mask``'s when
    given), the LR times ``muon_lr_mult`` (pgs's 10x)."""
    if opt.muon_lr_mult != 1.0:
        lr = _scaled(lr, opt.muon_lr_mult)
    return optax.chain(scale_by_megatron_muon(plan, opt), optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


def _scaled(schedule, factor: float):
    if callable(schedule):
        return lambda count: schedule(count) * factor
    return schedule * factor
