"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

`recurrent_gated_delta_rule` is the token-by-token truth (also the decode step);
`chunked_gated_delta_rule` is the chunked form for training, in plain jnp, whose walk across
chunks is `chunk_recurrence` (``lax.scan``) or the Pallas kernel `chunk_scan` (scan.py).
"""
from kernels.gated_delta.reference import (chunk_recurrence, chunked_gated_delta_rule,
                                           l2_normalize, recurrent_gated_delta_rule)
from kernels.gated_delta.scan import chunk_scan

__all__ = ["chunk_recurrence", "chunk_scan", "chunked_gated_delta_rule", "l2_normalize",
           "recurrent_gated_delta_rule"]
