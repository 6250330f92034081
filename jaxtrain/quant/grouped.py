"""Quantized grouped GEMMs for the MoE experts: ``qgrouped(x, w, sizes, qc, meta)``.

x [M, K] holds rows sorted by expert, w [G, K, N] the experts' weights, sizes [G] the rows per
expert (``lax.ragged_dot`` semantics; rows past the groups belong to no expert and give zeros).
The recipes of matmul.py apply with these scales:

- per-tensor recipes (delayed, tensorwise): one scale for all of x's rows, one for all experts
  of w and one for the output gradient (the scaling MaxText's fp8 einsum gives its stacked
  experts). Rows past the groups are zeroed first, so they never set an amax; inside the MoE
  ``shard_map`` the amax is taken over the whole tensor (``numerics.amax``).
- block recipes (blockwise, mxfp8, nvfp4): x and the gradient in blocks along the dimension
  each GEMM contracts; w per expert in blocks along K (forward) or N (dgrad; blockwise's
  128x128 weight blocks serve both). The weight-gradient GEMM contracts over rows, and there
  the blocks restart at each expert's first row, as if every expert's rows were padded to whole
  blocks (as Transformer Engine pads grouped-GEMM inputs).
- qwix (MaxText int8/int4/fp8_full, pgs rowwise float8): qwix's own ``ragged_dot_qt``
  (per-channel scales, straight-through gradients); weight-only int8w/int4w quantize the
  weights with qwix's per-output-channel scales and pass their gradient straight through.

The backward GEMMs are the grouped matmul's own derivatives taken at the quantized operands,
so the Pallas kernel (and its transposed form) serves them when ``kernel`` selects it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.ops import grouped_matmul
from jaxtrain.quant import numerics as nx
from jaxtrain.quant.config import QuantConfig
from jaxtrain.quant.matmul import _BLOCK, _KIND


def _mm(kernel: bool, x, w, sizes):
    return grouped_matmul(x, w, sizes, kernel=kernel)


def _fmt(qc: QuantConfig, name):
    return nx.element_dtype(name, qc.fnuz)


def _live(x, sizes):
    """x with the rows past the groups set to 0."""
    live = jnp.arange(x.shape[0]) < jnp.sum(sizes)
    return jnp.where(live[:, None], x, jnp.zeros((), x.dtype))


def qdq_group_rows(a, sizes, block: int, dtype, kind: str):
    """Quantize-dequantize a [M, C] in blocks of ``block`` rows per column, the blocks
    restarting at each group's first row (so no block mixes two experts' rows)."""
    M, G = a.shape[0], sizes.shape[0]
    rows = jnp.arange(M)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    group = jnp.searchsorted(ends, rows, side="right")
    safe = jnp.minimum(group, G - 1)
    nblk = (sizes + block - 1) // block
    first = jnp.cumsum(nblk) - nblk
    n = -(-M // block) + G + 1
    bid = jnp.where(group < G, first[safe] + (rows - starts[safe]) // block, n - 1)
    y = a.astype(jnp.float32)
    block_amax = jax.ops.segment_max(jnp.abs(y), bid, num_segments=n)
    return nx.qdq_scaled(y, block_amax[bid], dtype, kind, nx.amax(a)).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qgrouped(qc: QuantConfig, kernel: bool, x, w, sizes, meta):
    return _fwd(qc, kernel, x, w, sizes, meta)[0]


def _fwd(qc, kernel, x, w, sizes, meta):
    x = _live(x, sizes)
    fx, fw = _fmt(qc, qc.x), _fmt(qc, qc.w)
    new = None
    if qc.recipe in _BLOCK:
        b, kind = _BLOCK[qc.recipe], _KIND[qc.recipe]
        xq = nx.qdq_blocks(x, {1: b}, fx, kind)
        wq = nx.qdq_blocks(w, {1: b, 2: b} if qc.recipe == "blockwise" else {1: b}, fw, kind)
    else:
        ax, aw = nx.amax(x), nx.amax(w)
        if meta is not None:  # delayed: this call uses the stored scales, then they move on
            sx, sw = meta["x"]["scale"], meta["w"]["scale"]
            upd = functools.partial(nx.delayed_update, margin=qc.margin, algo=qc.amax_algo)
            new = {"x": upd(meta["x"], ax, fx), "w": upd(meta["w"], aw, fw)}
        else:
            sx, sw = nx.current_scale(ax, fx), nx.current_scale(aw, fw)
        xq, wq = nx.qdq_tensor(x, fx, sx), nx.qdq_tensor(w, fw, sw)
    return _mm(kernel, xq, wq, sizes), (x, w, xq, wq, sizes, meta, new)


def _bwd(qc, kernel, res, g):
    x, w, xq, wq, sizes, meta, new = res
    g = _live(g, sizes)
    fx, fw, fg = _fmt(qc, qc.x), _fmt(qc, qc.w), _fmt(qc, qc.g)
    if qc.recipe in _BLOCK:
        b, kind = _BLOCK[qc.recipe], _KIND[qc.recipe]
        g_dx = nx.qdq_blocks(g, {1: b}, fg, kind)
        w_dx = wq if qc.recipe == "blockwise" else nx.qdq_blocks(w, {2: b}, fw, kind)
        x_dw = qdq_group_rows(x, sizes, b, fx, kind)
        g_dw = qdq_group_rows(g, sizes, b, fg, kind)
    else:
        if meta is not None:
            sg = meta["g"]["scale"]
            new = {**new, "g": nx.delayed_update(meta["g"], nx.amax(g), fg, qc.margin,
                                                 qc.amax_algo)}
        else:
            sg = nx.current_scale(nx.amax(g), fg)
        g_dx = g_dw = nx.qdq_tensor(g, fg, sg)
        w_dx, x_dw = wq, xq
    if not qc.wgrad:
        x_dw, g_dw = x, g
    dx = jax.vjp(lambda a: _mm(kernel, a, w_dx, sizes), xq)[1](g_dx)[0]
    dw = jax.vjp(lambda v: _mm(kernel, x_dw, v, sizes), wq)[1](g_dw)[0]
    return dx, dw, None, new


_qgrouped.defvjp(_fwd, _bwd)


def _qwix(x, w, sizes, qc: QuantConfig):
    from qwix._src.core import ragged_dot_qt as rq   # slow to import: only for qwix recipes

    def dtype(name):
        if name is None:
            return None
        return {"int8": jnp.int8, "int4": jnp.int4}.get(name) or nx.element_dtype(name, qc.fnuz)

    if qc.x is None:  # weight-only: qwix's per-output-channel weight scales, straight through
        from qwix._src.core import qarray
        how = qarray.HowToQuantize(qtype=dtype(qc.w), channelwise_axes=[2])
        wq = qarray.dequantize(qarray.quantize(w, how)).astype(w.dtype)
        w = w + jax.lax.stop_gradient(wq - w)
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    config = rq.RaggedDotQtConfig(
        lhs_qtype=dtype(qc.x), rhs_qtype=dtype(qc.w), dlhs_grad_qtype=dtype(qc.g),
        drhs_grad_qtype=dtype(qc.g) if qc.wgrad else None)
    return rq.ragged_dot_qt(x, w, sizes, config, None, jnp.float32).astype(x.dtype)


def qgrouped(x, w, sizes, qc: QuantConfig, meta=None, *, kernel: bool = False):
    """The grouped matmul of x [M, K] and w [G, K, N] under ``qc``, in the compute dtype x and
    w already have. ``meta`` is the projection's delayed-scaling state ({'x','w','g'}); without
    it delayed scaling uses each call's current amax. ``kernel`` selects the Pallas GEMM."""
    sizes = sizes.astype(jnp.int32)
    if qc.recipe == "qwix":
        return _qwix(x, w, sizes, qc)
    return _qgrouped(qc, kernel, x, w, sizes, meta if qc.recipe == "delayed" else None)
