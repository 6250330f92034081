"""The parameters as the optimizer sees them: each leaf's kind, and which rules apply to it.

:func:`leaf_plan` reads the logical-axes tree of the parameters (``jaxtrain.models.logical_axes``)
into one :class:`Leaf` per parameter: its path, axes and kind (embedding, position_embedding,
output, norm, bias, matrix or vector). Stacked axes (``layers`` and the expert axes) are batch
axes: a stacked leaf is one matrix (or vector) per copy. On that plan:

- :func:`decayed`: Megatron's default ``no_weight_decay_cond`` skips biases and 1-D tensors; a
  stacked layer axis makes a norm scale 2-D here, so the rule is applied by kind (norms, biases
  and vectors skip decay; matrices, embeddings and the output layer decay). pgs skips decay for
  1-D tensors and names containing bias, norm or embed (so the embedding is not decayed), except
  in its Muon+AdamW hybrid, which decays everything but biases and norms. MaxText's empty
  ``adamw_mask`` (``decay_all_params``) decays every leaf. Megatron's
  ``apply_wd_to_qk_layernorm`` decays the query/key norm scales too.
- :func:`muon_member`: the leaves Muon takes (the rest go to Adam): Megatron's every parameter
  that is neither 1-D nor the word embedding / output layer (so a learned position embedding is
  Muon's); pgs's >= 2-D non-embedding weights, the output head included.
- :func:`by_path`: a rule as a tree function, for ``optax.partition`` labels and masks.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxtrain.optim.config import PGS, OptimConfig

_BATCH_AXES = ("layers", "exp", "experts", "expert")  # stacked copies: one matrix each
_HEAD_AXES = ("q_heads", "kv_heads", "heads", "kv")
TP_AXES = ("q_heads", "kv_heads", "heads", "mlp")  # what Megatron's TP splits
_BIAS = re.compile(r"bias|b[qkvoi](_\d+)?")
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the optimizer sees it: its path, logical axes and kind (embedding,
    position_embedding, output, norm, bias, matrix or vector)."""

    path: Path
    axes: tuple
    kind: str

    @property
    def batch_axes(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.axes) if a in _BATCH_AXES)

    @property
    def core_axes(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.axes) if a not in _BATCH_AXES)

    def matrix_axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(input axes, output axes) of the matrix this leaf is, per stacked copy. Weights are
        stored [in..., out...]; head axes travel together (wo [N, H, D] is (N*H) x D). A learned
        position embedding is torch's [P, D] = [out, in], as Megatron's scale factor reads it."""
        core = self.core_axes
        if self.kind == "position_embedding":
            return core[1:], core[:1]
        names = [self.axes[i] for i in core]
        k = 0
        while k < len(names) - 1 and names[k] in _HEAD_AXES:
            k += 1
        k = max(k, 1)
        return core[:k], core[k:]


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_of(keypath) -> Path:
    return tuple(_key_name(k) for k in keypath)


def _axes_tuple(spec) -> tuple:
    return tuple(spec) if spec is not None else ()


def _is_axes(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, tuple))


def _kind(path: Path, axes: tuple) -> str:
    name, top = path[-1], path[0]
    core = [a for a in axes if a not in _BATCH_AXES]
    if top == "embedding":
        return "embedding"
    if top == "position_embedding":
        return "position_embedding"
    if top == "output":
        return "output"
    if any("norm" in p for p in path) or "norm" in axes:
        return "norm"
    if _BIAS.fullmatch(name):
        return "bias"
    return "matrix" if len(core) >= 2 else "vector"


def leaf_plan(params_axes) -> dict[Path, Leaf]:
    """path -> :class:`Leaf` for a tree of logical-axes PartitionSpecs (or tuples)."""
    flat = jax.tree_util.tree_flatten_with_path(params_axes, is_leaf=_is_axes)[0]
    plan = {}
    for keypath, spec in flat:
        path, axes = path_of(keypath), _axes_tuple(spec)
        plan[path] = Leaf(path, axes, _kind(path, axes))
    return plan


def by_path(plan: Mapping[Path, Any], fn: Callable[[Leaf], Any]) -> Callable:
    """A function tree -> tree of ``fn(leaf)`` by path (works on optax's masked trees)."""
    def label(tree):
        return jax.tree_util.tree_map_with_path(lambda kp, _: fn(plan[path_of(kp)]), tree)
    return label


def decayed(opt_cfg: OptimConfig, part: str) -> Callable[[Leaf], bool]:
    """Which leaves get weight decay: Megatron skips biases, norms and vectors; pgs also skips
    the embedding (names containing 'embed'), except in its Muon+AdamW hybrid."""
    if opt_cfg.decay_all:
        return lambda leaf: True
    if opt_cfg.flavour == PGS and part != "muon-adam":
        kinds = ("matrix", "output")
    else:
        kinds = ("matrix", "output", "embedding", "position_embedding")
    if opt_cfg.wd_qk_norm:   # Megatron apply_wd_to_qk_layernorm (Qwen3-Next's recipe)
        return lambda leaf: leaf.kind in kinds or any(p in QK_NORMS for p in leaf.path)
    return lambda leaf: leaf.kind in kinds


# Megatron's q_layernorm / k_layernorm: per-head q/k norms, and MLA's query-latent norm.
QK_NORMS = ("q_norm", "k_norm", "q_a_norm")


def muon_member(opt_cfg: OptimConfig) -> Callable[[Leaf], bool]:
    kinds = ("matrix", "output") if opt_cfg.flavour == PGS else ("matrix", "position_embedding")
    return lambda leaf: leaf.kind in kinds and len(leaf.core_axes) >= 2


def batch_axes_of(plan: Mapping[Path, Leaf]) -> Callable[[Path], tuple[int, ...]]:
    """path -> the stacked (batch) axes of that leaf, for the stored-state codecs."""
    return lambda path: plan[path].batch_axes
