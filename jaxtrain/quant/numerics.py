"""Low-precision number formats and scaling: FP8 (OCP and AMD fnuz), FP4 e2m1, block scales.

Convention (Transformer Engine's): a ``scale`` multiplies a tensor before the cast, so
``q = cast(clip(x * scale, -max, max))`` and ``x ~ q / scale``. Every quantize-dequantize
(``qdq``) here returns the dequantized values in the input's dtype: the matmul then runs on
values that are exactly representable in the low-precision format, so on CPU the result is the
low-precision GEMM's up to accumulation order (the emulation), and on a GPU XLA's GEMM rewriter
turns the ``convert -> multiply -> dot`` pattern into an FP8 GEMM (the pattern Flax's fp8 ops
rely on).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes

# Element formats by name; "fnuz" variants are AMD MI300's (no negative zero, max 240 for e4m3).
_FORMATS = {
    ("e4m3", False): jnp.float8_e4m3fn, ("e4m3", True): jnp.float8_e4m3fnuz,
    ("e5m2", False): jnp.float8_e5m2, ("e5m2", True): jnp.float8_e5m2fnuz,
    ("e2m1", False): jnp.float4_e2m1fn, ("e2m1", True): jnp.float4_e2m1fn,
}


def element_dtype(name: str, fnuz: bool = False):
    """The JAX dtype of an element format ('e4m3', 'e5m2', 'e2m1'), fnuz for AMD MI300."""
    return _FORMATS[(name, bool(fnuz))]


def fmax(dtype) -> float:
    """Largest finite value of a low-precision float dtype."""
    return float(ml_dtypes.finfo(dtype).max)


def cast(x, dtype):
    """Round-to-nearest-even cast with saturation (the fp8/fp4 types have no usable inf)."""
    m = fmax(dtype)
    return jnp.clip(x, -m, m).astype(dtype)


def _varying(x) -> tuple[str, ...]:
    """The shard_map mesh axes x differs over (none outside a shard_map)."""
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return tuple(sorted(getattr(kind, "varying", ()) or ()))


def amax(x) -> jax.Array:
    """max |x| as float32 (a scalar): of the whole tensor, so inside a shard_map it is also
    maximised over the mesh axes x is split over, and every shard scales alike."""
    a = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = _varying(a)
    return jax.lax.pmax(a, axes) if axes else a


# ------------------------------------------------------------------ per-tensor scaling

def current_scale(a, dtype, margin: int = 0):
    """Current (per-call) scaling: fp8_max / amax / 2^margin; 1 where amax is 0 or not finite."""
    s = fmax(dtype) / a / (2.0 ** margin)
    return jnp.where((a > 0) & jnp.isfinite(a), s, 1.0).astype(jnp.float32)


def qdq_tensor(x, dtype, scale):
    """Quantize-dequantize x with one float32 scale (shape () or (1,))."""
    s = jnp.reshape(scale, ()).astype(jnp.float32)
    q = cast(x.astype(jnp.float32) * s, dtype)
    return q.astype(x.dtype) * (1.0 / s).astype(x.dtype)


def delayed_init(history_len: int) -> dict:
    """One tensor's delayed-scaling state: an amax ring (newest first) and the scale to use."""
    return {"amax_history": jnp.zeros((history_len,), jnp.float32),
            "scale": jnp.ones((1,), jnp.float32)}


def delayed_update(meta: dict, a, dtype, margin: int, algo: str) -> dict:
    """Delayed scaling after a call saw amax ``a`` (Transformer Engine's ``DelayedScaling``).

    The ring shifts by one and takes ``a`` at index 0 (the oldest value drops off); the amax
    read from it is its maximum (``max``) or ``a`` itself (``most_recent``); the next scale is
    ``fp8_max / amax / 2^margin``, kept unchanged while that amax is 0 or not finite. The call
    that saw ``a`` was quantized with the *previous* scale: a scale is used one call later.
    """
    hist = jnp.roll(meta["amax_history"], 1).at[0].set(a.astype(jnp.float32))
    read = jnp.max(hist) if algo == "max" else hist[0]
    new = fmax(dtype) / read / (2.0 ** margin)
    ok = (read > 0) & jnp.isfinite(read)
    return {"amax_history": hist, "scale": jnp.where(ok, new, meta["scale"]).astype(jnp.float32)}


# ------------------------------------------------------------------ block scaling

def _split(x, blocks: dict[int, int]):
    """x reshaped so each blocked axis a becomes (n_a, blocks[a]); returns (y, block axes)."""
    shape, red = [], []
    for a, n in enumerate(x.shape):
        b = blocks.get(a)
        if b is None:
            shape.append(n)
            continue
        if n % b:
            raise ValueError(f"axis {a} of size {n} does not split into blocks of {b} (block "
                             "scaling needs the contracted dimensions to be multiples of the "
                             "block size)")
        shape += [n // b, b]
        red.append(len(shape) - 1)
    return x.reshape(shape), tuple(red)


def _e8m0_up(r):
    """2^ceil(log2 r) for r > 0 (an E8M0 power of two rounded up, as cuDNN's MXFP8 quantizer);
    1 for r == 0."""
    r = jnp.where(r > 0, r, 1.0)
    return jnp.exp2(jnp.ceil(jnp.log2(r)))


def qdq_blocks(x, blocks: dict[int, int], dtype, kind: str):
    """Quantize-dequantize x with one scale per block.

    ``kind``: ``mxfp8`` (OCP MX: E8M0 power-of-two scale = 2^ceil(log2(amax/max)), blocks of
    32), ``pow2`` (Transformer Engine's ``Float8BlockScaling``: float32 power-of-two scale
    2^floor(log2(max/amax))), or ``nvfp4`` (a float32 per-tensor scale amax/(e4m3_max*6), then
    an e4m3 scale per block of 16 rounded to nearest: the two-level NVFP4 scheme).
    """
    y, red = _split(x.astype(jnp.float32), blocks)
    block_amax = jnp.max(jnp.abs(y), axis=red, keepdims=True)
    return qdq_scaled(y, block_amax, dtype, kind, amax(x)).reshape(x.shape).astype(x.dtype)


def qdq_scaled(y, block_amax, dtype, kind: str, tensor_amax=None):
    """Quantize-dequantize float32 ``y`` given each element's block amax (broadcastable to
    y) by :func:`qdq_blocks`' rules; ``tensor_amax`` is nvfp4's per-tensor amax."""
    m = fmax(dtype)
    if kind == "mxfp8":
        dq = _e8m0_up(block_amax / m)           # dequant multiplier per block
        return cast(y / dq, dtype).astype(jnp.float32) * dq
    if kind == "pow2":
        s = jnp.exp2(jnp.floor(jnp.log2(m / jnp.where(block_amax > 0, block_amax, m))))
        return cast(y * s, dtype).astype(jnp.float32) / s
    if kind == "nvfp4":
        e4m3_max = fmax(jnp.float8_e4m3fn)
        g = tensor_amax / (e4m3_max * m)
        g = jnp.where(g > 0, g, 1.0)
        bs = cast(block_amax / m / g, jnp.float8_e4m3fn).astype(jnp.float32)
        dq = bs * g
        return cast(y / jnp.where(dq > 0, dq, 1.0), dtype).astype(jnp.float32) * dq
    raise ValueError(f"unknown block scaling {kind!r}")
