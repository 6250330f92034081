"""Low-precision storage of optimizer moments: what is kept between steps, and how it is read back.

Every update reads a moment back to float32 (:func:`decode`), does its arithmetic in float32 and
stores the new value again (:func:`encode`). Three storage formats:

- **plain cast** (``float32``, ``bfloat16``): the moment itself in that dtype.
- **per-tensor scaled** (``float16``, ``float8_e4m3fn``), :class:`Scaled`: Transformer Engine's
  ``FusedAdam`` with ``exp_avg_dtype``/``exp_avg_sq_dtype`` fp16 or fp8 (Megatron's
  precision-aware optimizer) stores ``x / s`` with ``s = absmax(x) / range``, range 32752 for
  fp16 (``finfo.max / 2``) and 448 for E4M3. Megatron's "tensor" is one layer's weight, so the
  absmax is taken per layer: over every axis except the stacked ``batch_axes``.
- **8-bit blockwise dynamic** (bitsandbytes' ``*8bit`` optimizers), :class:`Quantized8`: blocks
  of ``BLOCK`` (256) consecutive elements along the last non-batch axis, each normalised by its
  absmax and rounded to the *nearest* of 256 values of bitsandbytes' dynamic map
  (:func:`dynamic_map`: signed for first moments, unsigned for second moments; a dynamic
  exponent gives ~7 decades of range, which a linear int8 code would not have for Adam's
  second moment). Codes are ``uint8`` in the parameter's own shape, so the state shards like the
  parameter; the block absmax is one float32 per block (1/64 byte per element). Like
  bitsandbytes (``min_8bit_size`` 4096), tensors smaller than that (per layer) keep float32.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 256  # bitsandbytes' block size for its blockwise 8-bit optimizer states
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep float32 states

_SCALED_RANGE = {jnp.dtype(jnp.float16): float(np.finfo(np.float16).max) / 2.0,
                 jnp.dtype(jnp.float8_e4m3fn): 448.0}


class Scaled(NamedTuple):
    """A moment stored as ``data * scale`` (``scale`` float32, one per layer)."""
    data: jax.Array
    scale: jax.Array


class Quantized8(NamedTuple):
    """A moment stored as 8-bit dynamic-map codes (parameter shape) and per-block absmax."""
    codes: jax.Array
    absmax: jax.Array


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: 256
    sorted values in [-1, 1] (signed) or [0, 1] (unsigned). Exponent ``e`` (10^-6 .. 10^0)
    carries ``2^e`` (signed) or ``2^(e+1)`` (unsigned) linearly spaced fractions in [0.1, 1]."""
    values: list[float] = []
    for i in range(7):
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = np.linspace(0.1, 1.0, n)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += list(10.0 ** (-6 + i) * means)
        if signed:
            values += list(-(10.0 ** (-6 + i)) * means)
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    code = np.sort(np.asarray(values, dtype=np.float64)).astype(np.float32)
    assert code.shape == (256,)
    return code


def _midpoints(signed: bool) -> np.ndarray:
    code = dynamic_map(signed).astype(np.float64)
    return ((code[1:] + code[:-1]) / 2.0).astype(np.float32)


def _block_axis(ndim: int, batch_axes: tuple[int, ...]) -> int:
    """The last axis that is not a stacked (layer/expert) axis: blocks run along it."""
    for ax in range(ndim - 1, -1, -1):
        if ax not in batch_axes:
            return ax
    return ndim - 1


def _to_blocks(x: jax.Array, axis: int, block: int) -> tuple[jax.Array, int]:
    """Move ``axis`` last, pad it to a multiple of ``block`` and split it: (..., nb, block)."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    nb = -(-n // block)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)])
    return x.reshape(x.shape[:-1] + (nb, block)), n


def _from_blocks(x: jax.Array, n: int, axis: int) -> jax.Array:
    x = x.reshape(x.shape[:-2] + (-1,))[..., :n]
    return jnp.moveaxis(x, -1, axis)


def quantize_blockwise(x: jax.Array, signed: bool, batch_axes: tuple[int, ...] = (),
                       block: int = BLOCK) -> Quantized8:
    """Round ``x`` (float32) to the nearest dynamic-map value of its block's absmax."""
    axis = _block_axis(x.ndim, batch_axes)
    xb, n = _to_blocks(x.astype(jnp.float32), axis, block)
    absmax = jnp.max(jnp.abs(xb), axis=-1)
    normed = xb / jnp.where(absmax > 0, absmax, 1.0)[..., None]
    codes = jnp.searchsorted(jnp.asarray(_midpoints(signed)), normed, side="left",
                             method="scan").astype(jnp.uint8)
    return Quantized8(_from_blocks(codes, n, axis), absmax)


def dequantize_blockwise(q: Quantized8, signed: bool, batch_axes: tuple[int, ...] = (),
                         block: int = BLOCK) -> jax.Array:
    axis = _block_axis(q.codes.ndim, batch_axes)
    cb, n = _to_blocks(q.codes, axis, block)
    values = jnp.asarray(dynamic_map(signed))[cb.astype(jnp.int32)] * q.absmax[..., None]
    return _from_blocks(values, n, axis)


class Codec(NamedTuple):
    """How one kind of moment is stored: ``kind`` is 'cast', 'scaled' or '8bit'."""
    kind: str
    dtype: Any = jnp.float32
    signed: bool = True  # 8-bit: signed map (first moments) or unsigned (second moments)
    min_size: int = MIN_8BIT_SIZE

    @staticmethod
    def for_dtype(dtype) -> "Codec":
        dtype = jnp.dtype(dtype)
        return Codec("scaled", dtype) if dtype in _SCALED_RANGE else Codec("cast", dtype)


FP32 = Codec("cast", jnp.float32)


def encode(codec: Codec, x: jax.Array, batch_axes: tuple[int, ...] = ()):
    """Store float32 ``x`` in ``codec``'s format (the state leaf kept between steps)."""
    x = x.astype(jnp.float32)
    if codec.kind == "cast":
        return x.astype(codec.dtype)
    if codec.kind == "scaled":
        reduce = tuple(a for a in range(x.ndim) if a not in batch_axes)
        amax = jnp.max(jnp.abs(x), axis=reduce, keepdims=True)
        scale = jnp.where(amax > 0, amax / _SCALED_RANGE[jnp.dtype(codec.dtype)], 1.0)
        return Scaled((x / scale).astype(codec.dtype), scale)
    if codec.kind == "8bit":
        per_tensor = math.prod(n for a, n in enumerate(x.shape) if a not in batch_axes)
        if per_tensor < codec.min_size:  # bitsandbytes' rule, per layer of a stacked leaf
            return x
        return quantize_blockwise(x, codec.signed, batch_axes)
    raise ValueError(f"unknown moment storage {codec.kind!r}")


def decode(codec: Codec, stored, batch_axes: tuple[int, ...] = ()) -> jax.Array:
    """The float32 value of a stored moment."""
    if isinstance(stored, Scaled):
        return stored.data.astype(jnp.float32) * stored.scale
    if isinstance(stored, Quantized8):
        return dequantize_blockwise(stored, codec.signed, batch_axes)
    return stored.astype(jnp.float32)


def state_nbytes(tree) -> int:
    """Bytes held by the arrays of a (state) tree."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
