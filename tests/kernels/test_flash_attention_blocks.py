"""Fully-masked blocks are skipped: loop bounds against brute force, and poisoned blocks."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import compile_fast

from kernels.flash_attention import BlockSizes, flash_attention
from kernels.flash_attention.masking import (
    kv_block_range,
    make_band,
    q_block_range,
    segment_block_ranges,
    visible,
)

BANDS = [(True, None), (False, None), (True, 5), (False, 7), (True, (9, 3)), (False, (4, 20)),
         (False, (None, 6)), (False, (0, 0)), (True, 40)]
LENGTHS = [(64, 64), (40, 72), (72, 40), (33, 17)]
TILES = [(16, 16), (32, 16), (16, 64)]


def _dense(band, T, S):
    """[T, S] bool: which query rows see which keys."""
    mask = visible(band, np.arange(T)[:, None], np.arange(S)[None, :])
    return np.ones((T, S), bool) if mask is None else np.broadcast_to(mask, (T, S))


@pytest.mark.parametrize("causal, window", BANDS)
def test_block_ranges_are_exact_for_bands(causal, window):
    for (T, S), (bq, bk) in itertools.product(LENGTHS, TILES):
        band = make_band(causal, window, T, S)
        dense = _dense(band, T, S)
        nq, nk = -(-T // bq), -(-S // bk)
        hit = np.array([[dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
                         for j in range(nk)] for i in range(nq)])
        for i in range(nq):
            lo, hi = kv_block_range(band, i, bq, bk, T, S)
            assert list(np.flatnonzero(hit[i])) == list(range(lo, hi)), (T, S, bq, bk, i)
        for j in range(nk):
            lo, hi = q_block_range(band, j, bq, bk, T, S)
            assert list(np.flatnonzero(hit[:, j])) == list(range(lo, hi)), (T, S, bq, bk, j)


def test_traced_bounds_match_python_ints():
    band = make_band(True, (9, 3), 72, 40)
    traced = jax.jit(lambda i: jnp.stack([*kv_block_range(band, i, 16, 16, 72, 40),
                                          *q_block_range(band, i, 16, 16, 72, 40)]))
    for i in range(3):
        want = [*kv_block_range(band, i, 16, 16, 72, 40), *q_block_range(band, i, 16, 16, 72, 40)]
        assert [int(x) for x in traced(jnp.int32(i))] == want


def test_causal_visits_about_half_the_blocks():
    band = make_band(True, None, 256, 256)
    visits = sum(hi - lo for lo, hi in (kv_block_range(band, i, 64, 64, 256, 256)
                                        for i in range(4)))
    assert visits == 1 + 2 + 3 + 4
    band = make_band(True, 64, 256, 256)
    assert [kv_block_range(band, i, 64, 64, 256, 256) for i in range(4)] == [
        (0, 1), (0, 2), (1, 3), (2, 4)]


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_segment_ranges_cover_every_shared_id(sorted_ids):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5 if sorted_ids else 3, (2, 70))
    if sorted_ids:
        ids = np.sort(ids, axis=1)
    (kv_lo, kv_hi), (q_lo, q_hi) = segment_block_ranges(jnp.asarray(ids), jnp.asarray(ids), 16, 32)
    for b in range(2):
        same = ids[b][:, None] == ids[b][None, :]
        hit = np.array([[same[i * 16:(i + 1) * 16, j * 32:(j + 1) * 32].any() for j in range(3)]
                        for i in range(5)])
        for i in range(5):
            inside = np.zeros(3, bool)
            inside[kv_lo[b, i]:kv_hi[b, i]] = True
            assert not (hit[i] & ~inside).any()
            if sorted_ids:
                assert (hit[i] == inside).all()
        for j in range(3):
            inside = np.zeros(5, bool)
            inside[q_lo[b, j]:q_hi[b, j]] = True
            assert not (hit[:, j] & ~inside).any()


def _poisoned_runs(clean, *poisoned, **kwargs):
    """Kernel output and (dq, dk, dv) for a cotangent of ones, per (q, k, v) triple given.

    One compiled program serves every triple; `clean` only fixes the shapes.
    """
    fn = lambda q, k, v: flash_attention(q, k, v, block_sizes=BlockSizes(16, 16), interpret=None,
                                         **kwargs)

    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(jnp.ones_like(out))

    compiled = compile_fast(run, *clean)
    return [compiled(*qkv) for qkv in poisoned]


def _qkv(T, S):
    rng = np.random.default_rng(1)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for shape in [(1, T, 2, 16), (1, S, 1, 16), (1, S, 1, 16)])


def test_causal_kernels_never_touch_masked_blocks():
    """NaN in a block that no one may see stays out: the block is never loaded."""
    q, k, v = _qkv(64, 64)
    (out, _), (_, (dq, dk, dv)) = _poisoned_runs(
        (q, k, v), (q, k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan)),
        (q.at[:, :16].set(jnp.nan), k, v))
    assert np.isfinite(out[:, :48]).all() and np.isnan(out[:, 48:]).all()
    assert np.isfinite(dk[:, 16:]).all() and np.isfinite(dv[:, 16:]).all()
    assert np.isnan(dk[:, :16]).all() and np.isfinite(dq[:, 16:]).all()


def test_segment_kernels_skip_other_documents():
    ids = jnp.asarray([[0] * 32 + [1] * 32], jnp.int32)
    q, k, v = _qkv(64, 64)
    (out, _), (_, (_, dk, dv)) = _poisoned_runs(
        (q, k, v), (q, k, v.at[:, :32].set(jnp.nan)), (q.at[:, :32].set(jnp.nan), k, v),
        causal=False, segment_ids=ids)
    assert np.isfinite(out[:, 32:]).all() and np.isnan(out[:, :32]).all()
    assert np.isfinite(dk[:, 32:]).all() and np.isfinite(dv[:, 32:]).all()
    assert np.isnan(dk[:, :32]).all()
