"""Pieces shared by the forward and backward kernels: static config, masked tiles, logits.

Kernels work in base 2 (exp2/log2, with log2(e) folded into the score scale) as FlashAttention
does; the saved logsumexp is therefore log2-sum-exp2 of the base-2 logits.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.flash_attention.masking import Band
from kernels.flash_attention.tuning import BlockSizes

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything the kernels need besides the arrays; hashable, so it keys jit caches."""
    band: Band
    scale: float
    softcap: float | None
    q_len: int
    kv_len: int
    head_dim: int
    blocks: BlockSizes
    interpret: bool

    @property
    def head_dim_padded(self) -> int:
        """Triton loads power-of-two tiles, so the head dim is padded (and masked) up."""
        return max(16, pl.next_power_of_2(self.head_dim))

    def dims_ok(self):
        """[Dp] mask of real head-dim columns, or None when D is already a power of two."""
        if self.head_dim == self.head_dim_padded:
            return None
        return jnp.arange(self.head_dim_padded) < self.head_dim

    def compiler_params(self, backward: bool):
        """Explicit Triton params: they select Pallas' Triton lowering (CUDA and ROCm)."""
        b = self.blocks
        if backward:
            return plgpu.CompilerParams(num_warps=b.num_warps_bwd, num_stages=b.num_stages_bwd)
        return plgpu.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages)


def iota(start, size: int):
    """start, start+1, ..., start+size-1 as int32."""
    return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def load(ref, rows_ok=None, cols_ok=None, other=0.0):
    """Load a 1-D or 2-D tile, replacing entries outside the masks with `other`."""
    mask = _tile_mask(ref, rows_ok, cols_ok)
    return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=other)


def store(ref, value, rows_ok=None, cols_ok=None):
    """Store a 1-D or 2-D tile, skipping entries outside the masks."""
    value = value.astype(ref.dtype)
    mask = _tile_mask(ref, rows_ok, cols_ok)
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)


def _tile_mask(ref, rows_ok, cols_ok):
    """Full-shape mask from per-row and per-column masks (either may be None)."""
    if ref.ndim == 1 or cols_ok is None:
        mask = rows_ok if ref.ndim == 1 or rows_ok is None else rows_ok[:, None]
    else:
        mask = cols_ok[None, :] if rows_ok is None else rows_ok[:, None] & cols_ok[None, :]
    return None if mask is None else jnp.broadcast_to(mask, ref.shape)


def dot(a, b, *, trans_b=False):
    """a @ b (or a @ b.T) with fp32 accumulation."""
    contract = (1,) if trans_b else (0,)
    return lax.dot_general(a, b, (((1,), contract), ((), ())),
                           preferred_element_type=jnp.float32)


def logits(scores, cfg: Static):
    """Raw q.k scores -> (base-2 logits, tanh of the softcap or None)."""
    if cfg.softcap is None:
        return scores * (cfg.scale * LOG2E), None
    capped = jnp.tanh(scores * (cfg.scale / cfg.softcap))
    return capped * (cfg.softcap * LOG2E), capped


def mask_logits(z, mask):
    """Masked logits become -inf, so exp2 sends them to exactly zero."""
    return z if mask is None else jnp.where(mask, z, -jnp.inf)


def seq_ok(start, size: int, length: int):
    """[size] mask of indices start.. below length, or None when blocks tile length exactly."""
    if length % size == 0:
        return None
    return iota(start, size) < length
