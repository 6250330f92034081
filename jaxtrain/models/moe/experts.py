"""The routed experts' FFN on one device's rows: grouped matmuls, activation, down projection.

Rows sorted by expert run as one grouped matmul (:func:`jaxtrain.ops.grouped_matmul`:
``lax.ragged_dot`` (tiles on a CPU), or the Pallas kernel with ``grouped_gemm`` on a GPU; the
quantized form with ``cfg.quant``, :func:`jaxtrain.quant.grouped_project`) and are unsorted
afterwards;
``pad_to_capacity`` instead runs fixed [E, capacity] buffers through an einsum (the same
numbers, static shapes; under ``cfg.quant`` as E groups of C rows of the quantized grouped
matmul). The experts' FFN dimension is split over the tensor axis (expert tensor
parallelism = TP), with a psum after the down projection; ETP = 1 keeps whole experts on every
tensor rank. ``swiglu_oai`` is GPT-OSS's clamped GLU.

Legend: M rows, D hidden, F expert FFN hidden, L = E_loc local experts, C capacity.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain import quant
from jaxtrain.models.layers import activation, glu
from jaxtrain.models.moe.comm import _psum
from jaxtrain.models.moe.config import MoEConfig
from jaxtrain.ops import grouped_matmul


def _glu(h0, h1, m: MoEConfig, cfg):
    """The gated unit: GPT-OSS's clamped GLU, or the model's (`layers.glu`), clamped at
    ``glu_limit`` without a model clamp (the experts only: MaxText's deepseek4)."""
    if m.activation == "swiglu_oai":
        limit = m.glu_limit if m.glu_limit is not None else 7.0
        h0 = jnp.minimum(h0, limit)
        h1 = jnp.clip(h1, -limit, limit)
        return h0 * jax.nn.sigmoid(1.702 * h0) * (h1 + 1.0)
    return glu(h0, h1, cfg, m.glu_limit)


def _ffn_rows(pe, x_MD, key_M, sizes_L, cfg, m: MoEConfig):
    """Rows x [M, D] sorted by local expert (``key`` [M], E_loc for none; ``sizes`` [E_loc])
    through their experts: grouped matmuls, activation, down projection -> [M, D]."""
    dt = cfg.compute_dtype
    gmm = _expert_matmul(pe, sizes_L, cfg, m)
    act = functools.partial(activation, cfg.activation)
    E_loc = sizes_L.shape[0]
    live_M = key_M < E_loc
    safe_M = jnp.where(live_M, key_M, 0)

    def bias(name):   # each row's expert's bias [M, F], 0 for rows without a local expert
        b = pe.get(name)
        return 0.0 if b is None else jnp.where(live_M[:, None], b.astype(dt)[safe_M], 0.0)

    x_MD = x_MD.astype(dt)
    if cfg.gated_linear_unit:
        h0_MF = gmm(x_MD, "wi_0") + bias("bi_0")
        h1_MF = gmm(x_MD, "wi_1") + bias("bi_1")
        unit = lambda a, b: _glu(a, b, m, cfg)  # noqa: E731
        h_MF = _maybe_remat_act(unit, cfg)(h0_MF, h1_MF)
    else:
        h_MF = _maybe_remat_act(act, cfg)(gmm(x_MD, "wi") + bias("bi"))
    return gmm(h_MF.astype(dt), "wo")


def _expert_matmul(pe, sizes, cfg, m: MoEConfig):
    """(rows, weight name) -> the grouped matmul with that expert weight, quantized when the
    config quantizes the projections (jaxtrain.quant)."""
    dt = cfg.compute_dtype
    # the Pallas kernel only runs interpreted on a CPU: there XLA's ragged_dot computes it
    kernel = m.grouped_gemm and jax.default_backend() != "cpu"
    if getattr(cfg, "quant", None) is not None:
        return lambda x, name: quant.grouped_project(x, pe[name], sizes, cfg, kernel=kernel)
    return lambda x, name: grouped_matmul(x.astype(dt), pe[name].astype(dt), sizes,
                                          kernel=kernel)


def _ffn_buffers(pe, x_LCD, cfg, m: MoEConfig):
    """Fixed buffers x [E_loc, C, D] through their experts (pad_to_capacity) -> [E_loc, C, D]."""
    dt = cfg.compute_dtype
    E, C, _ = x_LCD.shape
    if getattr(cfg, "quant", None) is not None:   # the buffers as E groups of C rows
        gmm = _expert_matmul(pe, jnp.full((E,), C, jnp.int32), cfg, m)
        mm = lambda x, n: gmm(x.reshape(E * C, -1), n).reshape(E, C, -1)  # noqa: E731
    else:
        mm = lambda x, n: jnp.einsum("ecd,edf->ecf", x.astype(dt),  # noqa: E731
                                     pe[n].astype(dt))
    bias = lambda n: 0.0 if n not in pe else pe[n].astype(dt)[:, None, :]  # noqa: E731
    act = functools.partial(activation, cfg.activation)
    if cfg.gated_linear_unit:
        h0_LCF, h1_LCF = mm(x_LCD, "wi_0") + bias("bi_0"), mm(x_LCD, "wi_1") + bias("bi_1")
        unit = lambda a, b: _glu(a, b, m, cfg)  # noqa: E731
        h_LCF = _maybe_remat_act(unit, cfg)(h0_LCF, h1_LCF)
    else:
        h_LCF = _maybe_remat_act(act, cfg)(mm(x_LCD, "wi") + bias("bi"))
    return mm(h_LCF, "wo")


def _maybe_remat_act(fn, cfg):
    return jax.checkpoint(fn) if "moe_act" in cfg.recompute_modules else fn


def _down_bias(pe, ids_M, live_M, dt):
    """Each row's expert down-projection bias (``bo``) [M, D], 0 for rows without a local
    expert."""
    if "bo" not in pe:
        return 0.0
    return jnp.where(live_M[:, None], pe["bo"].astype(dt)[jnp.where(live_M, ids_M, 0)], 0.0)


def _sorted_ffn(pe, x_MD, ids_M, weights_M, E_loc, cfg, m, tensor):
    """Token rows x [M, D] with one local expert id each (ids [M]; ids >= E_loc: none) and
    routing weights [M]: sort by expert, grouped FFN (summed over ``tensor``), unsort ->
    weighted outputs [M, D]."""
    live_M = ids_M < E_loc
    key_M = jnp.where(live_M, ids_M, E_loc)
    order_M = jnp.argsort(key_M, stable=True)
    sizes_L = jnp.sum(jax.nn.one_hot(key_M, E_loc, dtype=jnp.int32), axis=0)
    y_MD = _psum(_ffn_rows(pe, x_MD[order_M], key_M[order_M], sizes_L, cfg, m), tensor)
    y_MD = y_MD[jnp.argsort(order_M)] + _down_bias(pe, ids_M, live_M, y_MD.dtype)
    return y_MD * (weights_M * live_M).astype(y_MD.dtype)[:, None]


def _combine(y_slots, N, k):
    """Sum the k expert outputs of each token: [N*k, D] -> [N, D] (fixed order)."""
    return y_slots.reshape(N, k, -1).sum(1)


def _buffer_ffn(pe, x_MD, slots_LC, weights_LC, cfg, m, tensor):
    """pad_to_capacity compute: x [M, D], slots [E_loc, C] token ids, weights [E_loc, C]
    -> the weighted outputs scattered back to [M, D]."""
    dt = cfg.compute_dtype
    y_LCD = _psum(_ffn_buffers(pe, x_MD[slots_LC], cfg, m), tensor)
    if "bo" in pe:
        y_LCD = y_LCD + pe["bo"].astype(dt)[:, None, :]
    y_LCD = y_LCD * weights_LC.astype(dt)[..., None]
    return jnp.zeros((x_MD.shape[0], y_LCD.shape[-1]), dt).at[slots_LC.reshape(-1)].add(
        y_LCD.reshape(-1, y_LCD.shape[-1]))
