"""Tile sizes and Triton launch parameters, with a small per-vendor / head-dim / dtype table.

The table holds starting points taken from FlashAttention-2 practice (Triton tutorial
configs for A100/H100, AMD's Triton FA configs for MI300). They have not been measured on
our hardware yet; `benchmarks/attention.py` is the tool to revise them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels.tiles import check_blocks, default_vendor, pow2_at_least


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles (query rows x key rows) per kernel, and Triton warps / pipeline stages.

    block_q/block_k tile the forward kernel; the dq kernel uses block_q_dq x block_k_dq and
    the dk/dv kernel block_q_dkv x block_k_dkv (None: the forward tiles). Every block is a
    power of two >= 16. num_warps/num_stages apply to the forward kernel and the *_bwd
    fields to both backward kernels (None: Triton's default).
    """
    block_q: int = 64
    block_k: int = 64
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None

    def __post_init__(self):
        check_blocks(self, ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv",
                            "block_k_dkv"))

    def fit(self, q_len: int, kv_len: int) -> BlockSizes:
        """All backward tiles filled in, each shrunk to the padded sequence it tiles."""
        q_cap, kv_cap = pow2_at_least(q_len), pow2_at_least(kv_len)
        return BlockSizes(
            block_q=min(self.block_q, q_cap),
            block_k=min(self.block_k, kv_cap),
            block_q_dq=min(self.block_q_dq or self.block_q, q_cap),
            block_k_dq=min(self.block_k_dq or self.block_k, kv_cap),
            block_q_dkv=min(self.block_q_dkv or self.block_q, q_cap),
            block_k_dkv=min(self.block_k_dkv or self.block_k, kv_cap),
            num_warps=self.num_warps, num_stages=self.num_stages,
            num_warps_bwd=self.num_warps_bwd, num_stages_bwd=self.num_stages_bwd)


def _sizes(fwd, dq, dkv, warps, stages, warps_bwd, stages_bwd):
    return BlockSizes(block_q=fwd[0], block_k=fwd[1], block_q_dq=dq[0], block_k_dq=dq[1],
                      block_q_dkv=dkv[0], block_k_dkv=dkv[1], num_warps=warps,
                      num_stages=stages, num_warps_bwd=warps_bwd, num_stages_bwd=stages_bwd)


# (vendor, 16-bit inputs) -> [(largest padded head dim, sizes)], ascending head dim.
# Tiles are (query rows, key rows): forward, dq, dk/dv. The dk/dv kernel keeps two fp32
# [block_k_dkv, D] accumulators in registers, hence its small tiles at large D.
_TABLE = {
    ("cuda", True): [
        (64, _sizes((128, 64), (128, 32), (32, 128), 8, 3, 8, 2)),
        (128, _sizes((128, 64), (64, 32), (32, 64), 8, 2, 8, 2)),
        (256, _sizes((64, 32), (32, 32), (32, 32), 8, 2, 8, 1)),
    ],
    ("cuda", False): [
        (64, _sizes((64, 32), (64, 32), (32, 64), 4, 2, 4, 2)),
        (128, _sizes((32, 32), (32, 32), (32, 32), 4, 2, 4, 1)),
        (256, _sizes((16, 16), (16, 16), (16, 16), 4, 1, 4, 1)),
    ],
    ("rocm", True): [
        (64, _sizes((128, 64), (64, 64), (64, 64), 4, 1, 4, 1)),
        (128, _sizes((128, 64), (64, 32), (32, 64), 4, 1, 4, 1)),
        (256, _sizes((64, 16), (32, 16), (16, 32), 8, 1, 8, 1)),
    ],
    ("rocm", False): [
        (64, _sizes((64, 32), (64, 32), (32, 64), 4, 1, 4, 1)),
        (128, _sizes((32, 32), (32, 32), (32, 32), 4, 1, 4, 1)),
        (256, _sizes((16, 16), (16, 16), (16, 16), 4, 1, 4, 1)),
    ],
}


def tuned_block_sizes(head_dim: int, dtype, vendor: str | None = None) -> BlockSizes:
    """Table entry for this head dim (padded to a power of two) and input dtype.

    vendor: 'cuda' or 'rocm' (default: the running backend; CPU interpret runs use 'cuda').
    """
    vendor = vendor or default_vendor()
    if vendor == "cpu":
        vendor = "cuda"
    rows = _TABLE[(vendor, jnp.dtype(dtype).itemsize <= 2)]
    padded = pow2_at_least(head_dim)
    for max_dim, sizes in rows:
        if padded <= max_dim:
            return sizes
    raise ValueError(f"head_dim={head_dim} is above the largest tuned head dim {rows[-1][0]}")
