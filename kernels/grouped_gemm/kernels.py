"""The two Pallas kernels (Triton lowering): gmm [m,k] x [g,k,n] -> [m,n] and tgmm -> [g,k,n].

Both accumulate in fp32 and cast the tiles they load to one compute dtype (the promotion of
the two input dtypes) before each dot. Rows and columns past the array edges, and rows of
other groups, are masked on load and store, so m, k and n need not be multiples of the tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.grouped_gemm.groups import group_bounds, work_list
from kernels.grouped_gemm.tuning import Tiling


def gmm(lhs, rhs, group_sizes, *, out_dtype, tiling: Tiling, interpret: bool,
        transpose_rhs: bool = False):
    """out[r] = lhs[r] @ rhs[group of r] ([m,n]); rows in no group are zero.

    transpose_rhs: rhs is [g,n,k] and row r uses rhs[group].T (the lhs gradient).
    """
    m, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bk, bn = tiling.gmm(m, k, n)
    work = work_list(group_sizes, m, bm)
    per_item = pl.BlockSpec((None,), lambda w, j: (w,))
    num_warps, num_stages = tiling.launch(tgmm=False)
    kernel = functools.partial(_gmm_kernel, blocks=(bm, bk, bn), dims=(m, k, n), groups=g,
                               transpose_rhs=transpose_rhs,
                               compute=jnp.promote_types(lhs.dtype, rhs.dtype))
    return pl.pallas_call(
        kernel,
        grid=(work.tile.shape[0], pl.cdiv(n, bn)),
        in_specs=[per_item] * 4 + [pl.BlockSpec(lhs.shape, lambda w, j: (0, 0)),
                                   pl.BlockSpec(rhs.shape, lambda w, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((m, n), lambda w, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_gemm_gmm_rhs_t" if transpose_rhs else "grouped_gemm_gmm",
    )(work.tile, work.group, work.lo, work.hi, lhs, rhs)


def _gmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, *, blocks,
                dims, groups, transpose_rhs, compute):
    bm, bk, bn = blocks
    _, k, n = dims
    group = group_ref[...]
    row0 = tile_ref[...] * bm
    col0 = pl.program_id(1) * bn
    rows = pl.ds(row0, bm)
    cols = pl.ds(col0, bn)
    row_idx = _iota(row0, bm)
    rows_ok = (row_idx >= lo_ref[...]) & (row_idx < hi_ref[...])
    cols_ok = _edge(col0, bn, n)
    expert = jnp.minimum(group, groups - 1)

    def step(i, acc):
        red = pl.ds(i * bk, bk)
        red_ok = _edge(i * bk, bk, k)
        x = _load(lhs_ref.at[rows, red], rows_ok, red_ok).astype(compute)
        if transpose_rhs:
            w = _load(rhs_ref.at[expert, cols, red], cols_ok, red_ok).astype(compute)
            return acc + _dot(x, w, ((1,), (1,)))
        w = _load(rhs_ref.at[expert, red, cols], red_ok, cols_ok).astype(compute)
        return acc + _dot(x, w, ((1,), (0,)))

    # The zero-tail segment (group == groups) and unused items run no steps. (No
    # jnp.where on two constants: Triton's select lowering gives them the predicate's type.)
    steps = (group < groups).astype(jnp.int32) * pl.cdiv(k, bk)
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    _store(out_ref.at[rows, cols], acc, rows_ok, cols_ok)


def tgmm(lhs, grad, group_sizes, *, out_dtype, tiling: Tiling, interpret: bool):
    """out[i] = lhs[rows of group i].T @ grad[rows of group i] ([g,k,n]); empty groups: 0."""
    m, k = lhs.shape
    n = grad.shape[1]
    g = group_sizes.shape[0]
    bm, bk, bn = tiling.tgmm(m, k, n)
    starts, ends = group_bounds(group_sizes, m)
    per_group = pl.BlockSpec((None,), lambda i, a, b: (i,))
    num_warps, num_stages = tiling.launch(tgmm=True)
    kernel = functools.partial(_tgmm_kernel, blocks=(bm, bk, bn), dims=(k, n),
                               compute=jnp.promote_types(lhs.dtype, grad.dtype))
    return pl.pallas_call(
        kernel,
        grid=(g, pl.cdiv(k, bk), pl.cdiv(n, bn)),
        in_specs=[per_group, per_group, pl.BlockSpec(lhs.shape, lambda i, a, b: (0, 0)),
                  pl.BlockSpec(grad.shape, lambda i, a, b: (0, 0))],
        out_specs=pl.BlockSpec((None, k, n), lambda i, a, b: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_gemm_tgmm",
    )(starts, ends, lhs, grad)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, grad_ref, out_ref, *, blocks, dims, compute):
    bm, bk, bn = blocks
    k, n = dims
    start, end = start_ref[...], end_ref[...]
    k0 = pl.program_id(1) * bk
    n0 = pl.program_id(2) * bn
    k_ok, n_ok = _edge(k0, bk, k), _edge(n0, bn, n)

    def step(i, acc):
        row0 = start + i * bm
        rows = pl.ds(row0, bm)
        rows_ok = _iota(row0, bm) < end
        x = _load(lhs_ref.at[rows, pl.ds(k0, bk)], rows_ok, k_ok).astype(compute)
        dy = _load(grad_ref.at[rows, pl.ds(n0, bn)], rows_ok, n_ok).astype(compute)
        return acc + _dot(x, dy, ((0,), (0,)))

    steps = pl.cdiv(jnp.maximum(end - start, 0), bm)
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bk, bn), jnp.float32))
    _store(out_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], acc, k_ok, n_ok)


def _iota(start, size: int):
    return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _edge(start, size: int, length: int):
    """[size] mask of indices below length, or None when tiles cover length exactly."""
    return None if length % size == 0 else _iota(start, size) < length


def _mask(shape, rows_ok, cols_ok):
    if rows_ok is None and cols_ok is None:
        return None
    if rows_ok is None:
        return jnp.broadcast_to(cols_ok[None, :], shape)
    if cols_ok is None:
        return jnp.broadcast_to(rows_ok[:, None], shape)
    return rows_ok[:, None] & cols_ok[None, :]


def _load(ref, rows_ok, cols_ok):
    mask = _mask(ref.shape, rows_ok, cols_ok)
    return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)


def _store(ref, value, rows_ok, cols_ok):
    value = value.astype(ref.dtype)
    mask = _mask(ref.shape, rows_ok, cols_ok)
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
