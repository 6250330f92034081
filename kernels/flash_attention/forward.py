"""Forward kernel: one program per (query block, batch, query head), online softmax over keys.

Sinks enter as the initial softmax state (running max = sink logit, running sum = 1), so a
sink is an extra column that never contributes a value. The kernel also writes the base-2
logsumexp per row for the backward pass (+inf for rows with nothing to attend to, which
makes every recomputed probability of such a row zero).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.flash_attention import common
from kernels.flash_attention.common import LOG2E, Static
from kernels.flash_attention.masking import kv_block_range, segment_block_ranges, visible


def forward(cfg: Static, q, k, v, q_ids, kv_ids, sinks):
    """(out [B,T,Hq,D] in q's dtype, base-2 logsumexp [B,Hq,T] fp32)."""
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk, Dp = cfg.blocks.block_q, cfg.blocks.block_k, cfg.head_dim_padded
    seg_lo = seg_hi = None
    if q_ids is not None:
        (seg_lo, seg_hi), _ = segment_block_ranges(q_ids, kv_ids, bq, bk)
    per_q_block = lambda i, b, h: (b, i)
    in_specs = [
        pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, S, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
        pl.BlockSpec((None, S, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
        None if q_ids is None else pl.BlockSpec((None, bq), per_q_block),
        None if q_ids is None else pl.BlockSpec((None, S), lambda i, b, h: (b, 0)),
        None if q_ids is None else pl.BlockSpec((None, None), per_q_block),
        None if q_ids is None else pl.BlockSpec((None, None), per_q_block),
        None if sinks is None else pl.BlockSpec((None,), lambda i, b, h: (h,)),
    ]
    out_specs = [
        pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, Hq, T), jnp.float32)]
    sinks32 = None if sinks is None else sinks.astype(jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        grid=(pl.cdiv(T, bq), B, Hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=cfg.compiler_params(backward=False),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, q_ids, kv_ids, seg_lo, seg_hi, sinks32)


def _forward_kernel(q_ref, k_ref, v_ref, qid_ref, kid_ref, lo_ref, hi_ref, sink_ref,
                    o_ref, lse_ref, *, cfg: Static):
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    q_block = pl.program_id(0)
    q_start = q_block * bq
    rows_ok = common.seq_ok(q_start, bq, cfg.q_len)
    dims_ok = cfg.dims_ok()
    q = common.load(q_ref, rows_ok, dims_ok)
    rows = common.iota(q_start, bq)[:, None]
    q_ids = None if qid_ref is None else common.load(qid_ref, rows_ok, other=-1)[:, None]

    lo, hi = kv_block_range(cfg.band, q_block, bq, bk, cfg.q_len, cfg.kv_len)
    if lo_ref is not None:
        lo, hi = jnp.maximum(lo, lo_ref[...]), jnp.minimum(hi, hi_ref[...])

    def step(j, carry):
        acc, m, l = carry
        k_start = j * bk
        keys = pl.ds(k_start, bk)
        cols_ok = common.seq_ok(k_start, bk, cfg.kv_len)
        k = common.load(k_ref.at[keys, :], cols_ok, dims_ok)
        v = common.load(v_ref.at[keys, :], cols_ok, dims_ok)
        kv_ids = None if kid_ref is None else common.load(kid_ref.at[keys], cols_ok, other=-1)
        z, _ = common.logits(common.dot(q, k, trans_b=True), cfg)
        mask = visible(cfg.band, rows, common.iota(k_start, bk)[None, :],
                       kv_len=None if cols_ok is None else cfg.kv_len, q_ids=q_ids,
                       kv_ids=None if kv_ids is None else kv_ids[None, :])
        z = common.mask_logits(z, mask)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(z - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + common.dot(p.astype(v.dtype), v)
        return acc, m_new, l

    if sink_ref is None:
        m0 = jnp.full((bq,), -1e30, jnp.float32)
        l0 = jnp.zeros((bq,), jnp.float32)
    else:
        m0 = jnp.full((bq,), sink_ref[...] * LOG2E, jnp.float32)
        l0 = jnp.ones((bq,), jnp.float32)
    acc0 = jnp.zeros((bq, cfg.head_dim_padded), jnp.float32)
    acc, m, l = lax.fori_loop(lo, hi, step, (acc0, m0, l0))

    has_mass = l > 0
    out = acc / jnp.where(has_mass, l, 1.0)[:, None]
    common.store(o_ref, out, rows_ok, dims_ok)
    common.store(lse_ref, jnp.where(has_mass, m + jnp.log2(jnp.where(has_mass, l, 1.0)),
                                    jnp.inf), rows_ok)
