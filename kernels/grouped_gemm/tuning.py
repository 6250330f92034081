"""Tiles and Triton launch parameters for the grouped GEMM kernels, with a small table.

The table entries are starting points taken from Triton matmul practice (the Triton tutorial
configs for A100/H100, AMD's Triton GEMM configs for MI300) shrunk for MoE groups of a few
hundred rows. They have not been measured on our hardware yet; `benchmarks/moe.py` is the
tool to revise them, and tests/kernels/test_grouped_gemm_triton_compile.py checks that every
entry compiles for sm_90 and gfx942 without spilling.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels.tiles import check_blocks, default_vendor, pow2_at_least


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tiles and Triton warps / pipeline stages for the gmm and tgmm kernels.

    gmm (the forward and the lhs gradient) computes [block_m, block_n] output tiles and
    steps over the contraction in block_k pieces. tgmm (the rhs gradient) computes
    [tgmm_block_k, tgmm_block_n] tiles of one group's weight gradient and steps over that
    group's rows in tgmm_block_m pieces. tgmm_* fields left None take the gmm values; None
    warps/stages mean Triton's defaults. Every block is a power of two >= 16.
    """
    block_m: int = 64
    block_k: int = 64
    block_n: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    tgmm_block_m: int | None = None
    tgmm_block_k: int | None = None
    tgmm_block_n: int | None = None
    tgmm_num_warps: int | None = None
    tgmm_num_stages: int | None = None

    def __post_init__(self):
        check_blocks(self, ("block_m", "block_k", "block_n", "tgmm_block_m", "tgmm_block_k",
                            "tgmm_block_n"))

    def gmm(self, rows: int, contract: int, cols: int) -> tuple[int, int, int]:
        """(block_m, block_k, block_n) shrunk to the padded problem dims."""
        return (min(self.block_m, pow2_at_least(rows)),
                min(self.block_k, pow2_at_least(contract)),
                min(self.block_n, pow2_at_least(cols)))

    def tgmm(self, rows: int, k: int, n: int) -> tuple[int, int, int]:
        """(tgmm_block_m, tgmm_block_k, tgmm_block_n) shrunk to the padded problem dims."""
        return (min(self.tgmm_block_m or self.block_m, pow2_at_least(rows)),
                min(self.tgmm_block_k or self.block_k, pow2_at_least(k)),
                min(self.tgmm_block_n or self.block_n, pow2_at_least(n)))

    def launch(self, tgmm: bool) -> tuple[int | None, int | None]:
        """(num_warps, num_stages) of one kernel."""
        if tgmm:
            return (self.tgmm_num_warps or self.num_warps,
                    self.tgmm_num_stages or self.num_stages)
        return self.num_warps, self.num_stages


# (vendor, 16-bit inputs) -> Tiling. gmm tiles are (rows, contraction, output columns);
# tgmm tiles are (rows per step, k, n). MI300 has 64 KiB of LDS, hence its smaller k steps.
_TABLE = {
    ("cuda", True): Tiling(128, 64, 128, 8, 3, tgmm_block_m=64, tgmm_block_k=128,
                           tgmm_block_n=128, tgmm_num_warps=8, tgmm_num_stages=3),
    ("cuda", False): Tiling(64, 32, 64, 4, 3, tgmm_block_m=32, tgmm_block_k=64,
                            tgmm_block_n=64, tgmm_num_warps=4, tgmm_num_stages=3),
    ("rocm", True): Tiling(128, 32, 128, 8, 2, tgmm_block_m=32, tgmm_block_k=128,
                           tgmm_block_n=128, tgmm_num_warps=8, tgmm_num_stages=2),
    ("rocm", False): Tiling(64, 32, 64, 4, 1, tgmm_block_m=32, tgmm_block_k=64,
                            tgmm_block_n=64, tgmm_num_warps=4, tgmm_num_stages=1),
}


def tuned_tiling(dtype, vendor: str | None = None) -> Tiling:
    """Table entry for this input dtype. vendor: 'cuda' or 'rocm' (default: the running
    backend; CPU interpret runs use the 'cuda' entry)."""
    vendor = vendor or default_vendor()
    if vendor == "cpu":
        vendor = "cuda"
    if vendor not in ("cuda", "rocm"):
        raise ValueError(f"vendor={vendor!r}: want 'cuda' or 'rocm'")
    return _TABLE[(vendor, jnp.dtype(dtype).itemsize <= 2)]
