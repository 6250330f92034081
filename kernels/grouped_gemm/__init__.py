"""Grouped GEMM for MoE experts in Pallas (Triton lowering): `lax.ragged_dot` semantics.

`grouped_matmul` (gmm: [m,k] x [g,k,n] -> [m,n]) and `transposed_grouped_matmul` (tgmm,
its weight gradient: -> [g,k,n]) are Pallas kernels with custom VJPs built from each other;
the references are `lax.ragged_dot` and a masked einsum; `Tiling` holds tiles and launch
parameters, `tuned_tiling` the per-vendor/dtype defaults.
"""
from kernels.grouped_gemm.api import grouped_matmul, transposed_grouped_matmul
from kernels.grouped_gemm.groups import group_bounds, work_list
from kernels.grouped_gemm.reference import (
    reference_grouped_matmul,
    reference_transposed_grouped_matmul,
)
from kernels.grouped_gemm.tuning import Tiling, tuned_tiling

__all__ = ["Tiling", "group_bounds", "grouped_matmul", "reference_grouped_matmul",
           "reference_transposed_grouped_matmul", "transposed_grouped_matmul", "tuned_tiling",
           "work_list"]
