"""A checkpoint on disk: step directories, items, leaf names, and the layer-axis move.

A step directory ``<root>/step_<N>`` holds one Orbax item per entry of :data:`ITEMS`. The
parameter and optimizer trees (:data:`FLAT_ITEMS`) are stored flat, ``{leaf name: array}``,
with names made from the leaves' tree paths (:func:`flat`), so a restore can ask for some
leaves and compare names (see :mod:`jaxtrain.checkpoint.compat`). Layer-stacked leaves
(every leaf under a layer-stack key: ``layers``, ``moe_layers``, ...) move their layer axis on
restore when the checkpoint's ``param_scan_axis`` differs from the model's
(:func:`restore_targets` reads them in the saved layout, :func:`place` moves the axis and puts
each leaf into the template's sharding).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.checkpoint import local
from jaxtrain.models.spec import STACKS

STEP_PREFIX = "step"
FORMAT_VERSION = 1
STEP_DIR = re.compile(rf"^{STEP_PREFIX}_(\d+)$")
ITEMS = ("params", "opt_state", "rng", "train", "loss_scale", "spike_stats", "fp8", "ema",
         "dpo_reference", "meta")
# Trees saved beside the train state by features that keep their own (the loop passes them as
# ``items``): "ema" is pgs train.ema's shadow weights (jaxtrain.averaging), "dpo_reference" the
# weights a DPO run without a named reference started from. Parameter-shaped: their layer axis
# moves with the parameters'.
SIDE_ITEMS = ("ema", "dpo_reference")
# Train-state fields saved whole, each as its own item: field name -> item name on disk. The
# quantization state keeps the item name "fp8" of the field's first name (TrainState.fp8), so
# checkpoints from before and after the rename to quant_state are the same and load alike.
STATE_ITEMS = {"loss_scale": "loss_scale", "spike_stats": "spike_stats", "quant_state": "fp8"}
FLAT_ITEMS = ("params", "opt_state")  # stored as {leaf name: array}; strictness compares names
FINAL_DIR = "final"  # train.save_final's Hugging Face export, under the save directory
NON_PERSISTENT_DIR = "non_persistent"  # Megatron's subdirectory of the save/load directory


def orbax():
    """The ``orbax.checkpoint`` module, imported on first use (it is slow to import)."""
    import orbax.checkpoint as ocp

    return ocp


@dataclasses.dataclass(frozen=True)
class LocalRoot:
    """A directory of local (per-host) non-persistent checkpoints."""

    path: pathlib.Path

    def __str__(self):
        return f"{self.path} (local)"


def where(root, step: int) -> pathlib.Path:
    """The directory of step ``step`` under ``root`` (a path or a :class:`LocalRoot`), absolute
    (Orbax reads only absolute paths; a relative save directory is the working directory's)."""
    if isinstance(root, LocalRoot):
        return local.step_dir(root.path, step)
    return pathlib.Path(root).absolute() / f"{STEP_PREFIX}_{step}"


def jsonable(value):
    """``value`` if JSON can hold it, else its ``str``."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def flat(tree) -> dict:
    """``tree``'s non-empty leaves by path name, as ``{name: (path, leaf)}`` (Orbax cannot
    store zero-size arrays, which optax's masked transforms leave as placeholders);
    :func:`unflat` puts them back."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf.size:
            name = re.sub(r"[^A-Za-z0-9_]+", "_", jax.tree_util.keystr(path)).strip("_")
            while name in out:
                name += "_"
            out[name] = (path, leaf)
    return out


def unflat(restored: dict, template):
    names = iter(flat(template))  # the names in leaf order
    leaves = [restored[next(names)] if leaf.size else leaf
              for leaf in jax.tree.leaves(template)]
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _is_flat(tree) -> bool:
    """A :func:`flat` dict (``{name: (path, leaf)}``) rather than a tree of arrays."""
    return isinstance(tree, dict) and bool(tree) and all(
        isinstance(v, tuple) and len(v) == 2 for v in tree.values())


# ----------------------------------------------------------------------- the layer-axis move

def _move(seq, src: int, dst: int) -> list:
    """``seq`` with the element at ``src`` moved to ``dst`` (what np.moveaxis does to axes)."""
    seq = list(seq)
    seq.insert(dst, seq.pop(src))
    return seq


def _is_layered(path) -> bool:
    return any(isinstance(k, jax.tree_util.DictKey) and k.key in STACKS
               for k in path)


def device_sharding(sharding):
    """Orbax restores into device memory; host-resident leaves move there afterwards."""
    kind = getattr(sharding, "memory_kind", None)
    if kind not in (None, "device"):
        return sharding.with_memory_kind("device")
    return sharding


def _moved_sharding(sharding, ndim: int, src: int, dst: int):
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*_move(spec, src, dst)),
                             memory_kind=sharding.memory_kind)
    return sharding


@functools.lru_cache(maxsize=None)
def _mover(src: int, dst: int, sharding):
    return jax.jit(lambda x: jnp.moveaxis(x, src, dst), out_shardings=sharding)


def restore_targets(tree, moved):
    """Restore targets for ``tree`` (or a :func:`flat` dict of it) and per-leaf axis moves:
    ``moved`` is (saved axis, this model's axis) of the layer stack, or None."""
    if _is_flat(tree):
        leaves_in, treedef = [tree[k] for k in sorted(tree)], jax.tree.structure(
            {k: 0 for k in tree})
    else:
        leaves_in, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, fixes = [], []
    for path, leaf in leaves_in:
        sharding = device_sharding(leaf.sharding)
        shape, fix = tuple(leaf.shape), None
        if moved is not None and _is_layered(path) and leaf.ndim > max(moved):
            src, dst = moved
            shape = tuple(_move(shape, dst, src))
            sharding = _moved_sharding(sharding, leaf.ndim, dst, src)
            fix = (src, dst)
        leaves.append(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding))
        fixes.append(fix)
    return treedef.unflatten(leaves), fixes


def place(restored, template, fixes):
    """The restored leaves with their layer axis moved back (``fixes`` from
    :func:`restore_targets`) and in ``template``'s shardings."""
    leaves = jax.tree.leaves(restored)
    if _is_flat(template):
        template = {k: leaf for k, (_, leaf) in template.items()}
    targets = jax.tree.leaves(template)
    out = []
    for x, target, fix in zip(leaves, targets, fixes):
        if fix is not None:
            x = _mover(*fix, device_sharding(target.sharding))(x)
        if x.sharding != target.sharding:
            x = jax.device_put(x, target.sharding)
        out.append(x)
    return jax.tree.unflatten(jax.tree.structure(template), out)
