"""The quantized projections the model layers call, and the weight wrapper they unwrap.

:class:`QWeight` is a projection weight with its slice of the delayed-scaling state and its
per-layer switch (:mod:`jaxtrain.models.quant_state` builds that state and wraps the weights
before the layer stacks run). :func:`project` is ``dense``'s quantized ``einsum`` and
:func:`grouped_project` the MoE experts' quantized grouped matmul; both run in the compute dtype
and fall back to the plain matmul in the layers that first_last_layers_bf16 keeps unquantized.
Nothing here knows the model's parameter tree.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.ops import grouped_matmul
from jaxtrain.quant.grouped import qgrouped
from jaxtrain.quant.matmul import qeinsum


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QWeight:
    """A projection weight with its delayed-scaling state (``meta``) and a per-layer switch
    ``on`` (bool [1]; False runs the layer unquantized: first_last_layers_bf16)."""

    w: Any
    meta: Any = None
    on: Any = None

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype


def _switched(x, w, cfg, quantized, plain):
    """``quantized(x, w, meta)`` in the compute dtype, or ``plain(x, w)`` in the layers that
    first_last_layers_bf16 keeps unquantized (w a :class:`QWeight` with a switch)."""
    dt = cfg.compute_dtype
    meta = on = None
    if isinstance(w, QWeight):
        w, meta, on = w.w, w.meta, w.on
    x, w = x.astype(dt), w.astype(dt)
    if on is None:
        return quantized(x, w, meta)
    return jax.lax.cond(jnp.reshape(on, ()), lambda a, b: quantized(a, b, None), plain, x, w)


def project(eq: str, x, w, cfg):
    """The quantized form of ``einsum(eq, x, w)`` in the compute dtype (``dense``'s hook)."""
    return _switched(x, w, cfg, lambda a, b, meta: qeinsum(eq, a, b, cfg.quant, meta),
                     lambda a, b: jnp.einsum(eq, a, b))


def grouped_project(x, w, sizes, cfg, *, kernel: bool = False):
    """The quantized grouped matmul of the MoE experts (rows x [M, K] sorted by expert, w
    [G, K, N] or its :class:`QWeight`) in the compute dtype; see jaxtrain.quant.grouped."""
    return _switched(x, w, cfg,
                     lambda a, b, meta: qgrouped(a, b, sizes, cfg.quant, meta, kernel=kernel),
                     lambda a, b: grouped_matmul(a, b, sizes, kernel=kernel))
