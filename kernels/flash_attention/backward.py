"""Backward: a dq kernel (loops over key blocks) and a dk/dv kernel (loops over query blocks).

Both recompute probabilities from the saved base-2 logsumexp, p = exp2(z - lse), and use
delta = rowsum(dO * O) so that dS = P * (dP - delta). The dk/dv kernel runs one program per
kv head and loops over the query heads of its group, so GQA needs no atomics or reduction
afterwards. Sinks get their gradient from the same residuals:
dsink_h = -sum_rows exp(sink_h - lse) * delta.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.flash_attention import common
from kernels.flash_attention.common import LOG2E, Static
from kernels.flash_attention.masking import (
    kv_block_range,
    q_block_range,
    segment_block_ranges,
    visible,
)


def backward(cfg: Static, q, k, v, q_ids, kv_ids, sinks, out, lse, d_out, d_lse=None):
    """(dq, dk, dv, dsinks or None) for cotangent d_out of the forward output (and d_lse
    [B,Hq,T] of the natural log-sum-exp, when the caller uses it: delta − d_lse)."""
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    dq = _dq(cfg, q, k, v, q_ids, kv_ids, d_out, lse, delta)
    dk, dv = _dkv(cfg, q, k, v, q_ids, kv_ids, d_out, lse, delta)
    dsinks = None
    if sinks is not None:
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * LOG2E - lse)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dsinks


def _probabilities(cfg: Static, q, k, lse, mask):
    """Recomputed probabilities p (rows x cols) and the softcap's tanh (or None)."""
    z, capped = common.logits(common.dot(q, k, trans_b=True), cfg)
    return jnp.exp2(common.mask_logits(z, mask) - lse), capped


def _score_grad(p, dp, delta, capped):
    """Gradient w.r.t. the raw scaled score: P * (dP - delta), through the softcap."""
    ds = p * (dp - delta)
    return ds if capped is None else ds * (1.0 - capped * capped)


def _dq(cfg: Static, q, k, v, q_ids, kv_ids, d_out, lse, delta):
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk, Dp = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq, cfg.head_dim_padded
    seg_lo = seg_hi = None
    if q_ids is not None:
        (seg_lo, seg_hi), _ = segment_block_ranges(q_ids, kv_ids, bq, bk)
    q_tile = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, S, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    row_stat = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    per_q_block = lambda i, b, h: (b, i)
    seg = q_ids is not None
    in_specs = [
        q_tile, kv_all, kv_all,
        pl.BlockSpec((None, bq), per_q_block) if seg else None,
        pl.BlockSpec((None, S), lambda i, b, h: (b, 0)) if seg else None,
        pl.BlockSpec((None, None), per_q_block) if seg else None,
        pl.BlockSpec((None, None), per_q_block) if seg else None,
        q_tile, row_stat, row_stat,
    ]
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(pl.cdiv(T, bq), B, Hq),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.compiler_params(backward=True),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, q_ids, kv_ids, seg_lo, seg_hi, d_out, lse, delta)


def _dq_kernel(q_ref, k_ref, v_ref, qid_ref, kid_ref, lo_ref, hi_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, cfg: Static):
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    q_block = pl.program_id(0)
    q_start = q_block * bq
    rows_ok = common.seq_ok(q_start, bq, cfg.q_len)
    dims_ok = cfg.dims_ok()
    q = common.load(q_ref, rows_ok, dims_ok)
    d_out = common.load(do_ref, rows_ok, dims_ok)
    lse = common.load(lse_ref, rows_ok, other=jnp.inf)[:, None]
    delta = common.load(delta_ref, rows_ok)[:, None]
    rows = common.iota(q_start, bq)[:, None]
    q_ids = None if qid_ref is None else common.load(qid_ref, rows_ok, other=-1)[:, None]

    lo, hi = kv_block_range(cfg.band, q_block, bq, bk, cfg.q_len, cfg.kv_len)
    if lo_ref is not None:
        lo, hi = jnp.maximum(lo, lo_ref[...]), jnp.minimum(hi, hi_ref[...])

    def step(j, dq):
        k_start = j * bk
        keys = pl.ds(k_start, bk)
        cols_ok = common.seq_ok(k_start, bk, cfg.kv_len)
        k = common.load(k_ref.at[keys, :], cols_ok, dims_ok)
        v = common.load(v_ref.at[keys, :], cols_ok, dims_ok)
        kv_ids = None if kid_ref is None else common.load(kid_ref.at[keys], cols_ok, other=-1)
        mask = visible(cfg.band, rows, common.iota(k_start, bk)[None, :],
                       kv_len=None if cols_ok is None else cfg.kv_len, q_ids=q_ids,
                       kv_ids=None if kv_ids is None else kv_ids[None, :])
        p, capped = _probabilities(cfg, q, k, lse, mask)
        ds = _score_grad(p, common.dot(d_out, v, trans_b=True), delta, capped)
        return dq + common.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo, hi, step, jnp.zeros((bq, cfg.head_dim_padded), jnp.float32))
    common.store(dq_ref, dq * cfg.scale, rows_ok, dims_ok)


def _dkv(cfg: Static, q, k, v, q_ids, kv_ids, d_out, lse, delta):
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk, Dp = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv, cfg.head_dim_padded
    seg_lo = seg_hi = None
    if q_ids is not None:
        _, (seg_lo, seg_hi) = segment_block_ranges(q_ids, kv_ids, bq, bk)
    kv_tile = pl.BlockSpec((None, bk, None, Dp), lambda j, b, n: (b, j, n, 0))
    q_group = pl.BlockSpec((None, T, G, Dp), lambda j, b, n: (b, 0, n, 0))
    group_stat = pl.BlockSpec((None, G, T), lambda j, b, n: (b, n, 0))
    per_k_block = lambda j, b, n: (b, j)
    seg = q_ids is not None
    in_specs = [
        q_group, kv_tile, kv_tile,
        pl.BlockSpec((None, T), lambda j, b, n: (b, 0)) if seg else None,
        pl.BlockSpec((None, bk), per_k_block) if seg else None,
        pl.BlockSpec((None, None), per_k_block) if seg else None,
        pl.BlockSpec((None, None), per_k_block) if seg else None,
        q_group, group_stat, group_stat,
    ]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, group=G),
        grid=(pl.cdiv(S, bk), B, Hkv),
        in_specs=in_specs,
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cfg.compiler_params(backward=True),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, q_ids, kv_ids, seg_lo, seg_hi, d_out, lse, delta)


def _dkv_kernel(q_ref, k_ref, v_ref, qid_ref, kid_ref, lo_ref, hi_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, cfg: Static, group: int):
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    k_block = pl.program_id(0)
    k_start = k_block * bk
    cols_ok = common.seq_ok(k_start, bk, cfg.kv_len)
    dims_ok = cfg.dims_ok()
    k = common.load(k_ref, cols_ok, dims_ok)
    v = common.load(v_ref, cols_ok, dims_ok)
    cols = common.iota(k_start, bk)[:, None]
    kv_ids = None if kid_ref is None else common.load(kid_ref, cols_ok, other=-1)[:, None]

    lo, hi = q_block_range(cfg.band, k_block, bq, bk, cfg.q_len, cfg.kv_len)
    if lo_ref is not None:
        lo, hi = jnp.maximum(lo, lo_ref[...]), jnp.minimum(hi, hi_ref[...])

    def step(i, carry, head):
        dk, dv = carry
        q_start = i * bq
        queries = pl.ds(q_start, bq)
        rows_ok = common.seq_ok(q_start, bq, cfg.q_len)
        q = common.load(q_ref.at[queries, head, :], rows_ok, dims_ok)
        d_out = common.load(do_ref.at[queries, head, :], rows_ok, dims_ok)
        lse = common.load(lse_ref.at[head, queries], rows_ok, other=jnp.inf)[None, :]
        delta = common.load(delta_ref.at[head, queries], rows_ok)[None, :]
        q_ids = None if qid_ref is None else common.load(qid_ref.at[queries], rows_ok, other=-1)
        mask = visible(cfg.band, common.iota(q_start, bq)[None, :], cols,
                       q_len=None if rows_ok is None else cfg.q_len,
                       q_ids=None if q_ids is None else q_ids[None, :], kv_ids=kv_ids)
        p_t, capped = _probabilities(cfg, k, q, lse, mask)
        dv = dv + common.dot(p_t.astype(d_out.dtype), d_out)
        ds_t = _score_grad(p_t, common.dot(v, d_out, trans_b=True), delta, capped)
        dk = dk + common.dot(ds_t.astype(q.dtype), q)
        return dk, dv

    def per_head(head, carry):
        return lax.fori_loop(lo, hi, functools.partial(step, head=head), carry)

    zeros = jnp.zeros((bk, cfg.head_dim_padded), jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    common.store(dk_ref, dk * cfg.scale, cols_ok, dims_ok)
    common.store(dv_ref, dv, cols_ok, dims_ok)
