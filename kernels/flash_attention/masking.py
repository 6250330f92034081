"""Who may attend to whom, per element (in-kernel masks) and per block (loop bounds).

Query row i sits at position i + offset with offset = S - T (queries aligned at the end of
the keys). Causal attention and sliding windows are one band: key j is visible to row i iff
-left <= j - (i + offset) <= right, either side possibly unbounded. Segment ids restrict
this further to equal ids. Block bounds let the kernels loop only over blocks that hold at
least one visible pair; they are exact for the band and conservative for segments.
"""
from __future__ import annotations

import dataclasses
import operator

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Band:
    """Visible keys j of row i: i + offset - left <= j <= i + offset + right (None: no bound)."""
    left: int | None
    right: int | None
    offset: int


def make_band(causal: bool, sliding_window, q_len: int, kv_len: int) -> Band:
    """Fold `causal` and `sliding_window` (int W or (left, right)) into one Band.

    An int W keeps the W most recent keys including the query's own position (left = W-1);
    the right side stays open unless causal. (left, right) counts keys before/after it.
    """
    left = right = None
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) != 2:
            raise ValueError(f"sliding_window={sliding_window!r}: want an int or (left, right)")
        left, right = (None if w is None else operator.index(w) for w in sliding_window)
        if (left is not None and left < 0) or (right is not None and right < 0):
            raise ValueError(f"sliding_window={sliding_window!r}: sides must be >= 0")
    elif sliding_window is not None:
        width = operator.index(sliding_window)
        if width < 1:
            raise ValueError(f"sliding_window={sliding_window}: must be >= 1")
        left = width - 1
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(left, right, kv_len - q_len)


def visible(band: Band, rows, cols, *, q_len=None, kv_len=None, q_ids=None, kv_ids=None):
    """Boolean mask of visible (row, col) pairs, or None when every pair is visible.

    rows/cols (and q_ids/kv_ids) are int arrays that broadcast against each other. q_len
    and kv_len, when given, also hide padded rows and columns past the real lengths.
    """
    conds = []
    if band.left is not None or band.right is not None:
        rel = cols - (rows + band.offset)
        if band.right is not None:
            conds.append(rel <= band.right)
        if band.left is not None:
            conds.append(rel >= -band.left)
    if q_len is not None:
        conds.append(rows < q_len)
    if kv_len is not None:
        conds.append(cols < kv_len)
    if q_ids is not None:
        conds.append(q_ids == kv_ids)
    if not conds:
        return None
    mask = conds[0]
    for cond in conds[1:]:
        mask = mask & cond
    return mask


def kv_block_range(band: Band, q_block, block_q: int, block_k: int, q_len: int, kv_len: int):
    """[lo, hi) of key blocks holding a key visible to some row of query block q_block.

    Works on Python ints and on traced int32 scalars (inside a kernel).
    """
    num_k = -(-kv_len // block_k)
    first = q_block * block_q + band.offset
    last = _min(q_block * block_q + block_q, q_len) - 1 + band.offset
    lo, hi = 0, num_k
    if band.left is not None:
        lo = _div(_max(first - band.left, 0), block_k)
    if band.right is not None:
        hi = _min(_cdiv(_max(last + band.right + 1, 0), block_k), num_k)
    return lo, hi


def q_block_range(band: Band, k_block, block_q: int, block_k: int, q_len: int, kv_len: int):
    """[lo, hi) of query blocks holding a row that sees some key of key block k_block."""
    num_q = -(-q_len // block_q)
    first = k_block * block_k - band.offset
    last = _min(k_block * block_k + block_k, kv_len) - 1 - band.offset
    lo, hi = 0, num_q
    if band.right is not None:
        lo = _div(_max(first - band.right, 0), block_q)
    if band.left is not None:
        hi = _min(_cdiv(_max(last + band.left + 1, 0), block_q), num_q)
    return lo, hi


def segment_block_ranges(q_ids, kv_ids, block_q: int, block_k: int):
    """Block bounds from segment ids: (kv_lo, kv_hi) [B, nq] and (q_lo, q_hi) [B, nk].

    A query block and a key block can share an id only if their [min, max] id ranges
    overlap; the bounds span the first to the last overlapping block, so they are exact for
    packed (sorted) ids and still safe for any ids. No overlap gives an empty range.
    """
    q_min, q_max = _block_min_max(q_ids, block_q)
    k_min, k_max = _block_min_max(kv_ids, block_k)
    overlap = ((k_min[:, None, :] <= q_max[:, :, None])
               & (k_max[:, None, :] >= q_min[:, :, None]))
    return _first_last(overlap, axis=2), _first_last(overlap, axis=1)


def _block_min_max(ids, block):
    """Per-block min and max id [B, n]; the tail is padded by repeating the last id."""
    B, n = ids.shape
    blocks = -(-n // block)
    padded = jnp.pad(ids, ((0, 0), (0, blocks * block - n)), mode="edge")
    padded = padded.reshape(B, blocks, block)
    return padded.min(-1), padded.max(-1)


def _first_last(overlap, axis):
    """[first, last + 1) index of True along axis, or [0, 0) where there is none."""
    n = overlap.shape[axis]
    hit = overlap.any(axis)
    first = jnp.argmax(overlap, axis)
    last = n - jnp.argmax(jnp.flip(overlap, axis), axis)
    return (jnp.where(hit, first, 0).astype(jnp.int32),
            jnp.where(hit, last, 0).astype(jnp.int32))


def _is_static(*xs):
    return all(isinstance(x, int) for x in xs)


def _max(a, b):
    return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


def _div(a, b: int):
    """Floor division of a non-negative a by a positive int (lax.div lowers to Triton)."""
    return a // b if _is_static(a) else lax.div(a, jnp.asarray(b, a.dtype))


def _cdiv(a, b: int):
    return _div(a + b - 1, b)
