"""Public entry points: argument checks, static config, and the custom VJPs tying the kernels."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.grouped_gemm import kernels
from kernels.grouped_gemm.tuning import Tiling, tuned_tiling


@dataclasses.dataclass(frozen=True)
class _Static:
    out_dtype: jnp.dtype
    tiling: Tiling
    interpret: bool


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None,
                   tiling: Tiling | None = None, interpret: bool | None = None):
    """lhs [m,k] x rhs [g,k,n] -> [m,n] with `lax.ragged_dot` semantics.

    Rows of lhs are grouped consecutively: the first group_sizes[0] rows use rhs[0], the
    next group_sizes[1] rows rhs[1], and so on; rows past sum(group_sizes) give zeros (and
    groups reaching past m are cut at m). group_sizes: [g] ints (on device; no host sync).
    Output dtype: preferred_element_type, else ragged_dot's result dtype. Accumulation is
    fp32. Differentiable in lhs and rhs: d lhs = grouped_matmul(d out, rhs^T) and
    d rhs = transposed_grouped_matmul(lhs, d out), both Pallas kernels.
    tiling: tiles and launch parameters (default: `tuned_tiling` for the input dtype).
    interpret: run the Pallas interpreter; None means "when the default backend is cpu".
    """
    out = jax.eval_shape(functools.partial(lax.ragged_dot,
                                           preferred_element_type=preferred_element_type),
                         lhs, rhs, group_sizes)
    cfg = _config(out.dtype, tiling, interpret, lhs, rhs)
    group_sizes = group_sizes.astype(jnp.int32)
    if 0 in lhs.shape + rhs.shape:
        return jnp.zeros(out.shape, out.dtype)
    return _gmm(cfg, lhs, rhs, group_sizes)


def transposed_grouped_matmul(lhs, grad, group_sizes, *, preferred_element_type=None,
                              tiling: Tiling | None = None, interpret: bool | None = None):
    """lhs [m,k], grad [m,n] -> [g,k,n]: out[i] = lhs[rows of i].T @ grad[rows of i].

    The weight gradient of `grouped_matmul` (tgmm); rows are grouped as there, empty groups
    give zeros and rows past sum(group_sizes) are ignored. g = len(group_sizes). Output
    dtype: preferred_element_type, else the promotion of the input dtypes. Differentiable in
    lhs and grad (through grouped_matmul kernels). Other arguments as in `grouped_matmul`.
    """
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"lhs {lhs.shape} and grad {grad.shape} must be [m, k] and [m, n]")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be a 1-D int array, got {group_sizes.dtype}"
                         f"{list(group_sizes.shape)}")
    out_dtype = jnp.dtype(preferred_element_type or jnp.promote_types(lhs.dtype, grad.dtype))
    cfg = _config(out_dtype, tiling, interpret, lhs, grad)
    shape = (group_sizes.shape[0], lhs.shape[1], grad.shape[1])
    if 0 in shape or lhs.shape[0] == 0:
        return jnp.zeros(shape, out_dtype)
    return _tgmm(cfg, lhs, grad, group_sizes.astype(jnp.int32))


def _config(out_dtype, tiling, interpret, a, b) -> _Static:
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"output dtype {out_dtype}: the kernels produce floating point only")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    tiling = tiling or tuned_tiling(jnp.promote_types(a.dtype, b.dtype))
    return _Static(jnp.dtype(out_dtype), tiling, bool(interpret))


def _kw(cfg: _Static, out_dtype):
    return {"out_dtype": out_dtype, "tiling": cfg.tiling, "interpret": cfg.interpret}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_vjp(cfg, lhs, rhs, group_sizes):
    return kernels.gmm(lhs, rhs, group_sizes, **_kw(cfg, cfg.out_dtype))


def _gmm_fwd(cfg, lhs, rhs, group_sizes):
    return _gmm_vjp(cfg, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_lhs = kernels.gmm(d_out, rhs, group_sizes, transpose_rhs=True, **_kw(cfg, lhs.dtype))
    d_rhs = kernels.tgmm(lhs, d_out, group_sizes, **_kw(cfg, rhs.dtype))
    return d_lhs, d_rhs, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)
_gmm = jax.jit(_gmm_vjp, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tgmm_vjp(cfg, lhs, grad, group_sizes):
    return kernels.tgmm(lhs, grad, group_sizes, **_kw(cfg, cfg.out_dtype))


def _tgmm_fwd(cfg, lhs, grad, group_sizes):
    return _tgmm_vjp(cfg, lhs, grad, group_sizes), (lhs, grad, group_sizes)


def _tgmm_bwd(cfg, residuals, d_out):
    # out[i] = X_i.T @ G_i, so dX_i = G_i @ d_out[i].T and dG_i = X_i @ d_out[i].
    lhs, grad, group_sizes = residuals
    d_lhs = kernels.gmm(grad, d_out, group_sizes, transpose_rhs=True, **_kw(cfg, lhs.dtype))
    d_grad = kernels.gmm(lhs, d_out, group_sizes, **_kw(cfg, grad.dtype))
    return d_lhs, d_grad, None


_tgmm_vjp.defvjp(_tgmm_fwd, _tgmm_bwd)
_tgmm = jax.jit(_tgmm_vjp, static_argnums=0)
