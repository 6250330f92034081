"""KV-cache quantization (MaxText ``quantize_kvcache`` / ``kv_quant_axis`` / ``kv_quant_dtype``).

Keys and values are quantized alike, symmetrically, one scale per slice of the reduced axes:

    kv_quant_axis    reduced axes of k/v [B,S,K,H]    scale shape
    dkv              H (head dim)                     [B,S,K,1]: per token and kv head
    heads_and_dkv    K and H                          [B,S,1,1]: per token

The stored scale is the slice's absolute maximum m (kept in the dtype of the keys/values);
an element x is stored as round_half_even(x * Q / m) with Q = 127.5 for int8 and 7.5 for int4
(MaxText's constants), clipped to the integer range (only +-Q rounds outside it, to 128 or 8),
and read back as q * m / Q. A slice that is all zeros stores zeros (MaxText would divide 0 by 0).
"""
from __future__ import annotations

import jax.numpy as jnp

KV_QUANT_AXES = ("dkv", "heads_and_dkv")
KV_QUANT_DTYPES = {"int8": (jnp.int8, 127.5), "int4": (jnp.int4, 7.5)}


def _reduced(axis: str, ndim: int) -> tuple[int, ...]:
    if axis == "dkv":
        return (ndim - 1,)
    if axis == "heads_and_dkv":
        return (ndim - 2, ndim - 1)
    raise ValueError(f"kv_quant_axis {axis!r} is not one of {KV_QUANT_AXES}")


def _dtype(name: str):
    if name not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_quant_dtype {name!r} is not one of {tuple(KV_QUANT_DTYPES)}")
    return KV_QUANT_DTYPES[name]


def scale_shape(shape: tuple[int, ...], axis: str) -> tuple[int, ...]:
    """The scale's shape for keys or values of ``shape`` [..., K, H]."""
    reduced = _reduced(axis, len(shape))
    return tuple(1 if d in reduced else n for d, n in enumerate(shape))


def quantize_kv(x, axis: str, dtype: str):
    """(integers of type ``dtype``, scale) for keys or values x [..., K, H]; see the module."""
    int_dtype, qmax = _dtype(dtype)
    scale = jnp.max(jnp.abs(x), axis=_reduced(axis, x.ndim), keepdims=True)
    info = jnp.iinfo(int_dtype)
    x32, s32 = x.astype(jnp.float32), scale.astype(jnp.float32)
    q = jnp.round(x32 * (qmax / jnp.where(s32 == 0, 1.0, s32)))
    return jnp.clip(q, int(info.min), int(info.max)).astype(int_dtype), scale


def dequantize_kv(q, scale, dtype: str, out_dtype):
    """Keys or values in ``out_dtype`` from ``quantize_kv``'s integers and scale."""
    _, qmax = _dtype(dtype)
    return (q.astype(jnp.float32) * (scale.astype(jnp.float32) / qmax)).astype(out_dtype)
