"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5).

`recurrent_gated_delta_rule` is the token-by-token truth (also the decode step);
`chunked_gated_delta_rule` is the chunked form for training, in plain jnp.
"""
from kernels.gated_delta.reference import (chunked_gated_delta_rule, l2_normalize,
                                           recurrent_gated_delta_rule)

__all__ = ["chunked_gated_delta_rule", "l2_normalize", "recurrent_gated_delta_rule"]
