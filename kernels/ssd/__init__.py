"""The selective state-space scan of Mamba-2 layers (state-space duality, Dao & Gu 2024).

`recurrent_ssd` is the token-by-token truth (also the decode step); `chunked_ssd` the chunked
form training uses (plain jnp within chunks, ``lax.scan`` across them).
"""
from kernels.ssd.reference import chunked_ssd, recurrent_ssd

__all__ = ["chunked_ssd", "recurrent_ssd"]
