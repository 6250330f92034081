"""Pallas kernels for the sequential part of the chunked gated delta rule: the state carried
across chunks, forward and backward.

The chunked rule (reference.py) prepares every chunk in parallel (the triangular inverse and
the matmuls that give u, w, the intra-chunk scores and the decayed q and k) and then walks the
chunks in order with the state S [Dk, Dv]:

    v_new = u - w S,    o = q_read S + A v_new,    S <- diag(f) S + k_write^T v_new

with f the chunk's decay, one per head (Gated DeltaNet) or one per key channel (Kimi Delta
Attention); a decay per head walks as the same one on every channel.

That walk is what a GPU cannot parallelise across chunks; here one program per (sequence, head,
block of S's columns) keeps its columns of S in registers for the whole walk instead of writing
S to memory between chunks (``lax.scan``), and writes the state entering each chunk for the
backward walk, which runs the chunks in reverse:

    dv_new = A^T do + k_write dS'          dA = do v_new^T       dq_read = do S^T
    dk_write = v_new dS'^T                 df = rowsum(S * dS')  du = dv_new
    dw = -dv_new S^T                       dS = q_read^T do + diag(f) dS' - w^T dv_new

S's columns (value channels) never mix in the forward walk, nor in dS, du and dv_new, so they
split into blocks when there are few (sequence, head) rows to fill the GPU
(:func:`value_blocks`); dw, dA, dq_read, dk_write and df sum over the columns, so each block
writes its part and the parts are added after the kernel. Packed-sequence resets need nothing
here: the preparation zeroes f and the decays across a sequence start. Triton (NVIDIA and AMD)
loads power-of-two tiles of at least 16, so Dk and Dv are zero-padded up (zeros stay zeros
through the walk) and the chunk length must be one; on a CPU the kernels run in the Pallas
interpreter.

Legend: R = B·H rows (sequence, head), N chunks, C chunk length, Dk key width, Dv value width,
V blocks of BV = Dv / V value columns.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32


def _dot(a, b, trans_a=False, trans_b=False):
    if trans_a:
        a = a.T
    if trans_b:
        b = b.T
    return jnp.dot(a, b, preferred_element_type=_F32)


def _params(interpret: bool):
    return None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1)


def _pad_to(x, size: int):
    pad = size - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _width(d: int) -> int:
    return max(16, pl.next_power_of_2(d))


# Programs enough to occupy a current GPU's multiprocessors with one walk each (H100/H200: 132).
_PROGRAMS = 128


def value_blocks(rows: int, dv: int) -> int:
    """How many blocks S's (padded, power-of-two) dv columns split into for ``rows`` (sequence,
    head) rows: the fewest that give ``_PROGRAMS`` programs, each at least 16 columns wide."""
    blocks = 1
    while rows * blocks < _PROGRAMS and dv // (2 * blocks) >= 16:
        blocks *= 2
    return blocks


def _forward_kernel(u_ref, w_ref, a_ref, qr_ref, kw_ref, f_ref, s0_ref,
                    o_ref, st_ref, h_ref, *, N: int, C: int, Dk: int):
    def body(n, S):
        rows = pl.ds(n * C, C)
        h_ref[pl.ds(n * Dk, Dk), :] = S
        v_new = u_ref[rows, :].astype(_F32) - _dot(w_ref[rows, :], S)
        o_ref[rows, :] = _dot(qr_ref[rows, :], S) + _dot(a_ref[rows, :], v_new)
        f = f_ref[pl.ds(n * Dk, Dk)]
        return f[:, None] * S + _dot(kw_ref[rows, :], v_new, trans_a=True)

    st_ref[...] = lax.fori_loop(0, N, body, s0_ref[...].astype(_F32))


def _backward_kernel(u_ref, w_ref, a_ref, qr_ref, kw_ref, f_ref, h_ref, do_ref, dst_ref,
                     du_ref, dw_ref, da_ref, dqr_ref, dkw_ref, df_ref, ds0_ref,
                     *, N: int, C: int, Dk: int):
    def body(i, dS):
        n = N - 1 - i
        rows = pl.ds(n * C, C)
        S = h_ref[pl.ds(n * Dk, Dk), :]
        w, kw, qr = w_ref[rows, :], kw_ref[rows, :], qr_ref[rows, :]
        v_new = u_ref[rows, :].astype(_F32) - _dot(w, S)
        do = do_ref[rows, :].astype(_F32)
        dv_new = _dot(a_ref[rows, :], do, trans_a=True) + _dot(kw, dS)
        du_ref[rows, :] = dv_new
        dw_ref[rows, :] = -_dot(dv_new, S, trans_b=True)
        da_ref[rows, :] = _dot(do, v_new, trans_b=True)
        dqr_ref[rows, :] = _dot(do, S, trans_b=True)
        dkw_ref[rows, :] = _dot(v_new, dS, trans_b=True)
        df_ref[pl.ds(n * Dk, Dk)] = jnp.sum(S * dS, axis=1)
        f = f_ref[pl.ds(n * Dk, Dk)]
        return _dot(qr, do, trans_a=True) + f[:, None] * dS - _dot(w, dv_new, trans_a=True)

    ds0_ref[...] = lax.fori_loop(0, N, body, dst_ref[...].astype(_F32))


def _row_spec(*shape):
    """One row's whole block; the value-block index does not move it."""
    return pl.BlockSpec((None, *shape), lambda r, v: (r,) + (0,) * len(shape))


def _column_spec(n: int, bv: int):
    """One row's [n, bv] block of value columns."""
    return pl.BlockSpec((None, n, bv), lambda r, v: (r, 0, v))


def _part_spec(*shape):
    """One value block's part of a row's [*shape] gradient (summed over blocks afterwards)."""
    return pl.BlockSpec((None, None, *shape), lambda r, v: (v, r) + (0,) * len(shape))


def _forward(u, w, a, qr, kw, f, s0, *, C: int, interpret: bool):
    """Padded row-major inputs -> (o [R,NC,Dv], final state [R,Dk,Dv], entering states
    [R,N·Dk,Dv]); all float32."""
    R, NC, Dv = u.shape
    Dk, N = w.shape[-1], NC // C
    V = value_blocks(R, Dv)
    BV = Dv // V
    shape = lambda *s: jax.ShapeDtypeStruct((R, *s), _F32)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_forward_kernel, N=N, C=C, Dk=Dk),
        grid=(R, V),
        in_specs=[_column_spec(NC, BV), _row_spec(NC, Dk), _row_spec(NC, C), _row_spec(NC, Dk),
                  _row_spec(NC, Dk), _row_spec(N * Dk), _column_spec(Dk, BV)],
        out_specs=[_column_spec(NC, BV), _column_spec(Dk, BV), _column_spec(N * Dk, BV)],
        out_shape=[shape(NC, Dv), shape(Dk, Dv), shape(N * Dk, Dv)],
        compiler_params=_params(interpret), interpret=interpret, name="gated_delta_scan_fwd",
    )(u, w, a, qr, kw, f, s0)


def _backward(u, w, a, qr, kw, f, h, do, dst, *, C: int, interpret: bool):
    """Gradients of :func:`_forward`'s walk; dw, da, dqr, dkw and df come back as [V, ...]
    parts, one per value block, to be summed."""
    R, NC, Dv = u.shape
    Dk, N = w.shape[-1], NC // C
    V = value_blocks(R, Dv)
    BV = Dv // V
    shape = lambda *s: jax.ShapeDtypeStruct((R, *s), _F32)  # noqa: E731
    parts = lambda *s: jax.ShapeDtypeStruct((V, R, *s), _F32)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_backward_kernel, N=N, C=C, Dk=Dk),
        grid=(R, V),
        in_specs=[_column_spec(NC, BV), _row_spec(NC, Dk), _row_spec(NC, C), _row_spec(NC, Dk),
                  _row_spec(NC, Dk), _row_spec(N * Dk), _column_spec(N * Dk, BV),
                  _column_spec(NC, BV), _column_spec(Dk, BV)],
        out_specs=[_column_spec(NC, BV), _part_spec(NC, Dk), _part_spec(NC, C),
                   _part_spec(NC, Dk), _part_spec(NC, Dk), _part_spec(N * Dk),
                   _column_spec(Dk, BV)],
        out_shape=[shape(NC, Dv), parts(NC, Dk), parts(NC, C), parts(NC, Dk), parts(NC, Dk),
                   parts(N * Dk), shape(Dk, Dv)],
        compiler_params=_params(interpret), interpret=interpret, name="gated_delta_scan_bwd",
    )(u, w, a, qr, kw, f, h, do, dst)


def _rows(x, C: int):
    """[N,B,H,C,X] -> [B·H, N·C, X] (a sequence's chunks one after another)."""
    N, B, H = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape(B * H, N * C, *x.shape[4:])


def _unrows(x, N: int, B: int, H: int):
    """The inverse of :func:`_rows`."""
    C = x.shape[1] // N
    return jnp.moveaxis(x.reshape(B, H, N, C, *x.shape[2:]), 2, 0)


def check_chunk(C: int):
    """The kernels' chunk lengths: powers of two of at least 16 (Triton's tile rule)."""
    if C < 16 or C & (C - 1):
        raise ValueError(f"the Pallas gated delta kernel takes chunk lengths that are powers "
                         f"of two of at least 16 (Triton tiles), got {C}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _scan(u, w, a, qr, kw, f, s0, interpret):
    return _scan_fwd(u, w, a, qr, kw, f, s0, interpret)[0]


def _prepared(u, w, a, qr, kw, f, s0):
    """Row-major, padded float32 kernel inputs from the chunk-major ones; the decays as one per
    key channel, [R, N·Dk] (a decay per head repeated)."""
    N, B, H, C = a.shape[:4]
    Dk, Dv = _width(w.shape[-1]), _width(u.shape[-1])
    rows = lambda x, d: _pad_to(_rows(x.astype(_F32), C), d)  # noqa: E731
    if f.ndim == 3:
        f = jnp.broadcast_to(f[..., None], (N, B, H, w.shape[-1]))
    f = _pad_to(jnp.moveaxis(f.astype(_F32), 0, 2), Dk).reshape(B * H, N * Dk)
    s0 = jnp.pad(s0.astype(_F32).reshape(B * H, *s0.shape[2:]),
                 ((0, 0), (0, Dk - s0.shape[-2]), (0, Dv - s0.shape[-1])))
    return (rows(u, Dv), rows(w, Dk), rows(a, C), rows(qr, Dk), rows(kw, Dk), f, s0)


def _scan_fwd(u, w, a, qr, kw, f, s0, interpret):
    N, B, H, C = a.shape[:4]
    dk, dv = w.shape[-1], u.shape[-1]
    args = _prepared(u, w, a, qr, kw, f, s0)
    o, st, h = _forward(*args, C=C, interpret=interpret)
    out = (_unrows(o[..., :dv], N, B, H), st[:, :dk, :dv].reshape(B, H, dk, dv))
    return out, (args, h, (N, B, H, C, dk, dv, f.ndim == 4))


def _scan_bwd(interpret, res, grads):
    args, h, (N, B, H, C, dk, dv, per_channel) = res
    do, dst = grads
    Dk, Dv = args[1].shape[-1], args[0].shape[-1]
    do = _pad_to(_rows(do.astype(_F32), C), Dv)
    dst = jnp.pad(dst.astype(_F32).reshape(B * H, dk, dv), ((0, 0), (0, Dk - dk), (0, Dv - dv)))
    du, dw, da, dqr, dkw, df, ds0 = _backward(*args[:6], h, do, dst, C=C, interpret=interpret)
    dw, da, dqr, dkw, df = (x.sum(0) for x in (dw, da, dqr, dkw, df))  # the value blocks' parts
    un = lambda x, d: _unrows(x[..., :d], N, B, H)  # noqa: E731
    df = jnp.moveaxis(df.reshape(B, H, N, Dk)[..., :dk], 2, 0)
    if not per_channel:
        df = df.sum(-1)
    return (un(du, dv), un(dw, dk), un(da, C), un(dqr, dk), un(dkw, dk), df,
            ds0[:, :dk, :dv].reshape(B, H, dk, dv))


_scan.defvjp(_scan_fwd, _scan_bwd)


def chunk_scan(u, w, a, q_read, k_write, f, s0, *, interpret: bool | None = None):
    """The walk across chunks: (o [N,B,H,C,Dv], final state [B,H,Dk,Dv]), float32, with
    gradients for every input. u [N,B,H,C,Dv]; w, q_read, k_write [N,B,H,C,Dk]; a [N,B,H,C,C];
    f [N,B,H] (a decay per head, Gated DeltaNet) or [N,B,H,Dk] (per key channel, Kimi Delta
    Attention); s0 [B,H,Dk,Dv]. ``interpret`` None: the interpreter on a CPU."""
    check_chunk(a.shape[3])
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _scan(u, w, a, q_read, k_write, f, s0, bool(interpret))
