"""Quantized projections: ``qeinsum(eq, x, w, qc, meta)`` for two-operand einsums.

Forward ``y = x . w`` with x and w quantized to ``qc.x`` / ``qc.w``; backward (a custom VJP)
``dx = g . w^T`` with the output gradient quantized to ``qc.g``, and ``dw = x^T . g`` quantized
too unless ``qc.wgrad`` is off (then in the compute dtype, as Transformer Engine's
``override_linear_precision`` for wgrad). Per-tensor recipes quantize each operand once and
reuse it; block recipes quantize each operand along the dimension its GEMM contracts, so the
backward GEMMs requantize along theirs (as Transformer Engine keeps row- and column-wise
copies); blockwise weights use 128x128 blocks, which serve both directions.

Delayed scaling threads its state as Flax's fp8 ops do: ``meta`` is an input of the custom VJP
whose cotangent is the *updated* state (overwrite-with-gradient). The train step differentiates
with respect to the state alongside the parameters and takes that "gradient" as the new state;
the optimizer never sees it.

The ``qwix`` recipe (MaxText int8/int4/fp8_full..., pgs rowwise float8) runs qwix's
``dot_general_qt``: per-channel current scales, straight-through gradients.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.quant import numerics as nx
from jaxtrain.quant.config import QuantConfig

_BLOCK = {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}
_KIND = {"blockwise": "pow2", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}


def _specs(eq: str) -> tuple[str, str, str]:
    ins, out = eq.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    for s in (xs, ws, out):
        if len(set(s)) != len(s) or "." in s:
            raise ValueError(f"quantized einsum {eq!r}: no repeated labels or ellipses")
    if set(xs) - set(ws) - set(out) or set(ws) - set(xs) - set(out):
        raise ValueError(f"quantized einsum {eq!r}: every input label must be contracted or "
                         "kept")
    return xs, ws, out


def _contracted(a: str, b: str, out: str) -> str:
    """Labels the einsum ``a,b->out`` sums over, in a's order."""
    return "".join(c for c in a if c in b and c not in out)


def _fmt(qc: QuantConfig, name):
    return None if name is None else nx.element_dtype(name, qc.fnuz)


def _qdq_blocked(x, spec: str, contract: str, dtype, recipe: str, weight: bool = False):
    """Block quantize-dequantize ``x`` (labels ``spec``) as its GEMM sees it: the contracted
    labels merged into one trailing K axis (the others into one leading axis), blocks along K
    (and, for blockwise weights, 128 along the other axis too)."""
    free = "".join(c for c in spec if c not in contract)
    perm = [spec.index(c) for c in free + contract]
    xt = jnp.transpose(x, perm)
    shp = xt.shape
    m = 1
    for n in shp[:len(free)]:
        m *= n
    xt = xt.reshape(m, -1)
    b = _BLOCK[recipe]
    blocks = {1: b, 0: b} if (weight and recipe == "blockwise") else {1: b}
    q = nx.qdq_blocks(xt, blocks, dtype, _KIND[recipe]).reshape(shp)
    return jnp.transpose(q, [perm.index(i) for i in range(len(perm))])


def _qdq(x, spec, contract, fmt, qc: QuantConfig, scale=None, weight=False):
    """One operand quantize-dequantized by qc's recipe (``scale``: a delayed scale)."""
    if qc.recipe in _BLOCK:
        return _qdq_blocked(x, spec, contract, fmt, qc.recipe, weight)
    if scale is None:
        scale = nx.current_scale(nx.amax(x), fmt)
    return nx.qdq_tensor(x, fmt, scale)


def _dot(eq, a, b, dtype):
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qeinsum(eq: str, qc: QuantConfig, x, w, meta):
    return _fwd(eq, qc, x, w, meta)[0]


def _fwd(eq, qc, x, w, meta):
    xs, ws, out = _specs(eq)
    fx, fw = _fmt(qc, qc.x), _fmt(qc, qc.w)
    new = None
    if meta is not None:  # delayed: this call uses the stored scales, then the state moves on
        xq = nx.qdq_tensor(x, fx, meta["x"]["scale"])
        wq = nx.qdq_tensor(w, fw, meta["w"]["scale"])
        upd = functools.partial(nx.delayed_update, margin=qc.margin, algo=qc.amax_algo)
        new = {"x": upd(meta["x"], nx.amax(x), fx), "w": upd(meta["w"], nx.amax(w), fw)}
    else:
        xq = _qdq(x, xs, _contracted(xs, ws, out), fx, qc)
        wq = _qdq(w, ws, _contracted(ws, xs, out), fw, qc, weight=True)
    # Named for remat: MaxText's *_with_quantization policies keep the quantized operands.
    xq, wq = checkpoint_name(xq, "quantization"), checkpoint_name(wq, "quantization")
    y = _dot(eq, xq, wq, x.dtype)
    per_tensor = qc.recipe not in _BLOCK
    keep_x = x if (not qc.wgrad or not per_tensor) else None
    keep_w = w if qc.recipe in ("mxfp8", "nvfp4") else None
    return y, (xq if per_tensor else None, wq, keep_x, keep_w, meta, new)


def _bwd(eq, qc, res, g):
    xq, wq, x, w, meta, new = res
    xs, ws, out = _specs(eq)
    fg = _fmt(qc, qc.g)
    dx_eq, dw_eq = f"{out},{ws}->{xs}", f"{xs},{out}->{ws}"
    x_dtype = (xq if xq is not None else x).dtype
    if meta is not None:
        gq = nx.qdq_tensor(g, fg, meta["g"]["scale"])
        new = {**new, "g": nx.delayed_update(meta["g"], nx.amax(g), fg, qc.margin,
                                             qc.amax_algo)}
    else:
        gq = _qdq(g, out, _contracted(out, ws, xs), fg, qc)
    w_dx = wq
    if w is not None:  # 1-D blocks along the forward's K: requantize along dgrad's K
        w_dx = _qdq(w, ws, _contracted(ws, out, xs), _fmt(qc, qc.w), qc)
    dx = _dot(dx_eq, gq, w_dx, x_dtype)
    if not qc.wgrad:
        dw = _dot(dw_eq, x, g, wq.dtype)
    elif xq is not None:
        dw = _dot(dw_eq, xq, gq, wq.dtype)
    else:
        x_dw = _qdq(x, xs, _contracted(xs, out, ws), _fmt(qc, qc.x), qc)
        g_dw = _qdq(g, out, _contracted(out, xs, ws), fg, qc)
        dw = _dot(dw_eq, x_dw, g_dw, wq.dtype)
    return dx, dw, new


_qeinsum.defvjp(_fwd, _bwd)


# ------------------------------------------------------------------ qwix and native paths

def _dimension_numbers(eq: str):
    """(dot_general dimension numbers, the transpose to the einsum's output order)."""
    xs, ws, out = _specs(eq)
    batch = [c for c in xs if c in ws and c in out]
    con = [c for c in xs if c in ws and c not in out]
    dn = (([xs.index(c) for c in con], [ws.index(c) for c in con]),
          ([xs.index(c) for c in batch], [ws.index(c) for c in batch]))
    natural = batch + [c for c in xs if c not in ws] + [c for c in ws if c not in xs]
    return dn, tuple(natural.index(c) for c in out)


def _qwix(eq, x, w, qc: QuantConfig):
    # qwix's quantized-training dot_general (what its QtProvider puts in place of dots);
    # qwix is slow to import and only its recipes need it
    from qwix._src.core import dot_general_qt as qt

    def dtype(name):
        if name is None:
            return None
        return {"int8": jnp.int8, "int4": jnp.int4}.get(name) or nx.element_dtype(name, qc.fnuz)

    config = qt.DotGeneralQtConfig(
        lhs_qtype=dtype(qc.x), rhs_qtype=dtype(qc.w),
        dlhs_grad_qtype=dtype(qc.g), drhs_grad_qtype=dtype(qc.g) if qc.wgrad else None)
    dn, perm = _dimension_numbers(eq)
    y = qt.dot_general_qt(x, w, dn, config)
    return jnp.transpose(y, perm).astype(x.dtype)


@functools.cache
def native_block_scaled() -> bool:
    """Whether the backend runs MXFP8 GEMMs natively (cuDNN on NVIDIA compute capability 10+,
    through ``jax.nn.scaled_dot_general``); elsewhere block scaling is emulated exactly."""
    if jax.default_backend() != "gpu":
        return False
    cap = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cap is not None and float(cap) >= 10.0
    except ValueError:
        return False


def _native_mxfp8(eq, x, w, qc: QuantConfig):
    cfg = functools.partial(jax.nn.get_scaled_dot_general_config, "mxfp8")
    grad = jax.nn.get_scaled_dot_general_config("mxfp8")
    if qc.g == "e5m2":
        grad = dataclasses.replace(grad, data_type=jnp.float8_e5m2)
    dn, perm = _dimension_numbers(eq)
    y = jax.nn.scaled_dot_general(x, w, dn, preferred_element_type=x.dtype,
                                  configs=[cfg(), cfg(), grad])
    return jnp.transpose(y, perm)


def qeinsum(eq: str, x, w, qc: QuantConfig, meta=None):
    """``einsum(eq, x, w)`` under ``qc``; x and w already in the compute dtype. ``meta`` is a
    projection's delayed-scaling state ({'x','w','g'} -> {'amax_history','scale'}); without
    it the delayed recipe scales each call by its current amax (evaluation, research code)."""
    if qc.recipe == "qwix":
        return _qwix(eq, x, w, qc)
    if qc.recipe == "mxfp8" and qc.wgrad and not qc.fnuz and native_block_scaled():
        return _native_mxfp8(eq, x, w, qc)
    return _qeinsum(eq, qc, x, w, meta if qc.recipe == "delayed" else None)
