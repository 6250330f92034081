"""Group tables computed outside the kernels from group_sizes (plain jnp, any backend).

Rows of lhs are grouped consecutively: group i owns rows [starts[i], ends[i]), clipped to
the m rows that exist; rows from sum(group_sizes) to m belong to no group.

The gmm kernel runs one program per (work item, output column tile). A work item is one
(row tile, segment) pair, where the segments are the g groups followed by a "zero tail"
segment holding the rows past the last group (its programs only write zeros). A row tile
that straddles segment boundaries is visited once per segment it touches, and each visit
stores only its segment's rows. g + 1 contiguous segments touch at most
cdiv(m, block_m) + g row tiles in total, which is the static length of the work list;
items past the real count have an empty row range and store nothing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def group_bounds(group_sizes, m: int):
    """(starts, ends) int32 [g]: group i owns lhs rows [starts[i], ends[i]), clipped to m.

    Negative sizes count as empty groups.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkList:
    """Per work item (int32 [cdiv(m, block_m) + g]): its row tile, its group (g for the zero
    tail) and the segment's row range [lo, hi), empty for unused items."""
    tile: jax.Array
    group: jax.Array
    lo: jax.Array
    hi: jax.Array


def work_list(group_sizes, m: int, block_m: int) -> WorkList:
    """The (row tile, segment) pairs the gmm kernel visits, in row order."""
    g = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, m)
    total = ends[-1]
    seg_lo = jnp.concatenate([starts, total[None]])
    seg_hi = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = seg_lo // block_m
    tiles = jnp.where(seg_hi > seg_lo, (seg_hi - 1) // block_m - first + 1, 0)
    done = jnp.cumsum(tiles)  # work items of segments 0..s
    item = jnp.arange(-(-m // block_m) + g, dtype=jnp.int32)
    owner = jnp.searchsorted(done, item, side="right").astype(jnp.int32)
    used = owner <= g
    seg = jnp.minimum(owner, g)
    tile = first[seg] + item - (done[seg] - tiles[seg])
    return WorkList(tile=jnp.where(used, tile, 0), group=seg,
                    lo=jnp.where(used, seg_lo[seg], 0), hi=jnp.where(used, seg_hi[seg], 0))
