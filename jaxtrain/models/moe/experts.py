"""The routed experts' FFN on one device's rows: grouped matmuls, activation, down projection.

Rows sorted by expert run as one grouped matmul (:func:`jaxtrain.ops.grouped_matmul`:
``lax.ragged_dot``, or the Pallas kernel with ``grouped_gemm``; the quantized form with
``cfg.quant``, :func:`jaxtrain.quant.grouped_project`) and are unsorted afterwards;
``pad_to_capacity`` instead runs fixed [E, capacity] buffers through an einsum (the same
numbers, static shapes; under ``cfg.quant`` as E groups of C rows of the quantized grouped
matmul). The experts' FFN dimension is split over the tensor axis (expert tensor
parallelism = TP), with a psum after the down projection; ETP = 1 keeps whole experts on every
tensor rank. ``swiglu_oai`` is GPT-OSS's clamped GLU.

Legend: M rows, D hidden, E_loc local experts, C capacity.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain import quant
from jaxtrain.models.layers import activation
from jaxtrain.models.moe.comm import _psum
from jaxtrain.models.moe.config import MoEConfig
from jaxtrain.ops import grouped_matmul


def _glu(h0, h1, act, m: MoEConfig):
    if m.activation == "swiglu_oai":
        limit = m.glu_limit if m.glu_limit is not None else 7.0
        h0 = jnp.minimum(h0, limit)
        h1 = jnp.clip(h1, -limit, limit)
        return h0 * jax.nn.sigmoid(1.702 * h0) * (h1 + 1.0)
    return act(h0) * h1


def _ffn_rows(pe, xs, key, sizes, cfg, m: MoEConfig):
    """Rows xs [M, D] sorted by local expert (``key`` [M], E_loc for none; ``sizes`` [E_loc])
    through their experts: grouped matmuls, activation, down projection -> [M, D]."""
    dt = cfg.compute_dtype
    gmm = _expert_matmul(pe, sizes, cfg, m)
    act = functools.partial(activation, cfg.activation)
    E_loc = sizes.shape[0]
    live = key < E_loc
    safe = jnp.where(live, key, 0)

    def bias(name):
        b = pe.get(name)
        return 0.0 if b is None else jnp.where(live[:, None], b.astype(dt)[safe], 0.0)

    xs = xs.astype(dt)
    if cfg.gated_linear_unit:
        h0 = gmm(xs, "wi_0") + bias("bi_0")
        h1 = gmm(xs, "wi_1") + bias("bi_1")
        h = _maybe_remat_act(lambda a, b: _glu(a, b, act, m), cfg)(h0, h1)
    else:
        h = _maybe_remat_act(act, cfg)(gmm(xs, "wi") + bias("bi"))
    return gmm(h.astype(dt), "wo")


def _expert_matmul(pe, sizes, cfg, m: MoEConfig):
    """(rows, weight name) -> the grouped matmul with that expert weight, quantized when the
    config quantizes the projections (jaxtrain.quant)."""
    dt = cfg.compute_dtype
    if getattr(cfg, "quant", None) is not None:
        return lambda x, name: quant.grouped_project(x, pe[name], sizes, cfg,
                                                     kernel=m.grouped_gemm)
    return lambda x, name: grouped_matmul(x.astype(dt), pe[name].astype(dt), sizes,
                                          kernel=m.grouped_gemm)


def _ffn_buffers(pe, xe, cfg, m: MoEConfig):
    """Fixed buffers xe [E_loc, C, D] through their experts (pad_to_capacity) -> [E_loc, C, D]."""
    dt = cfg.compute_dtype
    E, C, _ = xe.shape
    if getattr(cfg, "quant", None) is not None:   # the buffers as E groups of C rows
        gmm = _expert_matmul(pe, jnp.full((E,), C, jnp.int32), cfg, m)
        mm = lambda x, n: gmm(x.reshape(E * C, -1), n).reshape(E, C, -1)  # noqa: E731
    else:
        mm = lambda x, n: jnp.einsum("ecd,edf->ecf", x.astype(dt),  # noqa: E731
                                     pe[n].astype(dt))
    bias = lambda n: 0.0 if n not in pe else pe[n].astype(dt)[:, None, :]  # noqa: E731
    act = functools.partial(activation, cfg.activation)
    if cfg.gated_linear_unit:
        h0, h1 = mm(xe, "wi_0") + bias("bi_0"), mm(xe, "wi_1") + bias("bi_1")
        h = _maybe_remat_act(lambda a, b: _glu(a, b, act, m), cfg)(h0, h1)
    else:
        h = _maybe_remat_act(act, cfg)(mm(xe, "wi") + bias("bi"))
    return mm(h, "wo")


def _maybe_remat_act(fn, cfg):
    return jax.checkpoint(fn) if "moe_act" in cfg.recompute_modules else fn


def _down_bias(pe, ids, live, dt):
    """Each row's expert down-projection bias (``bo``), 0 for rows without a local expert."""
    if "bo" not in pe:
        return 0.0
    return jnp.where(live[:, None], pe["bo"].astype(dt)[jnp.where(live, ids, 0)], 0.0)


def _sorted_ffn(pe, x, ids, weights, E_loc, cfg, m, tensor):
    """Token rows x [M, D] with one local expert id each (ids [M]; ids >= E_loc: none) and
    routing weights [M]: sort by expert, grouped FFN (summed over ``tensor``), unsort ->
    weighted outputs [M, D]."""
    live = ids < E_loc
    key = jnp.where(live, ids, E_loc)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(key, E_loc, dtype=jnp.int32), axis=0)
    y = _psum(_ffn_rows(pe, x[order], key[order], sizes, cfg, m), tensor)
    y = y[jnp.argsort(order)] + _down_bias(pe, ids, live, y.dtype)
    return y * (weights * live).astype(y.dtype)[:, None]


def _combine(y_slots, N, k):
    """Sum the k expert outputs of each token: [N*k, D] -> [N, D] (fixed order)."""
    return y_slots.reshape(N, k, -1).sum(1)


def _buffer_ffn(pe, x, slots, weights, cfg, m, tensor):
    """pad_to_capacity compute: x [M, D], slots [E_loc, C] token ids, weights [E_loc, C]
    -> the weighted outputs scattered back to [M, D]."""
    dt = cfg.compute_dtype
    y = _psum(_ffn_buffers(pe, x[slots], cfg, m), tensor)
    if "bo" in pe:
        y = y + pe["bo"].astype(dt)[:, None, :]
    y = y * weights.astype(dt)[..., None]
    return jnp.zeros((x.shape[0], y.shape[-1]), dt).at[slots.reshape(-1)].add(
        y.reshape(-1, y.shape[-1]))
