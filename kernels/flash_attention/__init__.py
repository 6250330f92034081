"""Flash attention in Pallas (Triton lowering) with GQA, segments, windows, sinks and softcap.

`flash_attention` is the fused kernel with a Pallas backward; `reference_attention` is the
plain-jnp truth it is tested against; `flash_attention_lse` also returns each row's
log-sum-exp (blocks merged by context parallelism); `BlockSizes` tunes tiles and Triton launch parameters.
"""
from kernels.flash_attention.api import flash_attention, flash_attention_lse
from kernels.flash_attention.reference import reference_attention
from kernels.flash_attention.tuning import BlockSizes, tuned_block_sizes

__all__ = ["BlockSizes", "flash_attention", "flash_attention_lse", "reference_attention",
           "tuned_block_sizes"]
