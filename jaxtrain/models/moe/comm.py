"""The mesh axes the MoE sees inside its ``shard_map``, and the reductions built on them.

Where a statistic is "per rank" in Megatron (aux losses, z-loss, capacity, sinkhorn) it is
computed over the tokens one data-parallel rank holds: the whole batch without a layout, one
device's tokens under a layout (context-parallel shards of a sequence are summed, so a rank is
sequence-complete), then averaged over the data-parallel ranks like the LM loss. Without a
layout every axis is empty (:data:`LOCAL`) and the reductions are the identity.
"""
from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Comm:
    """Mesh axes seen from inside the MoE's shard_map (all empty without a layout).

    ``seq``: axes splitting one rank's sequences (summed for per-rank statistics); ``batch``:
    data-parallel axes splitting the batch (averaged over); ``expert``: the expert-parallel
    axis when the experts are split over it (``ep`` ways), ``tokens_split`` whether the tokens
    are split over it too; ``tensor``: the axis splitting each expert's FFN.
    """

    seq: tuple[str, ...] = ()
    batch: tuple[str, ...] = ()
    expert: str | None = None
    ep: int = 1
    tokens_split: bool = False
    tensor: str | None = None

    def sum_seq(self, x):
        return jax.lax.psum(x, self.seq) if self.seq else x

    def mean_seq(self, x):
        return jax.lax.pmean(x, self.seq) if self.seq else x

    def mean_ranks(self, x):
        return jax.lax.pmean(x, self.batch) if self.batch else x

    def sum_all(self, x):
        axes = self.seq + self.batch
        return jax.lax.psum(x, axes) if axes else x

    def gather_seq(self, x):
        """x [N, ...] of every rank of the sequence axes, in rank order: [N * ranks, ...]."""
        return jax.lax.all_gather(x, self.seq, axis=0, tiled=True) if self.seq else x

    def own_rows(self, x, n: int):
        """This rank's n rows of a :meth:`gather_seq` result."""
        if not self.seq:
            return x
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.seq) * n, n, 0)

    def rank(self):
        return jax.lax.axis_index(self.expert) if self.expert else 0


LOCAL = Comm()


def _psum(x, axis):
    return jax.lax.psum(x, axis) if axis else x
