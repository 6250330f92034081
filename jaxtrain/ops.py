"""Array operations below the models, the quantized matmuls and context parallelism.

:func:`grouped_matmul` is the MoE experts' grouped GEMM: the experts call it directly, and
``jaxtrain.quant`` calls it for the layers that stay unquantized and inside the quantized
grouped GEMM's backward pass. Neither package imports the other for it.

:func:`dropout_keep` is attention dropout's mask, drawn alike by the model's attention and by
context parallelism's blocks (``jaxtrain.parallel.context``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def grouped_matmul(lhs, rhs, group_sizes, *, kernel: bool = False):
    """``lax.ragged_dot`` semantics: rows of lhs [M, K] in consecutive groups of
    ``group_sizes`` [G] times rhs [G, K, N]; rows past the groups give zeros. ``kernel`` takes
    the Pallas grouped GEMM (``kernels.grouped_gemm``, Megatron's moe_grouped_gemm); on a CPU
    the XLA form is :func:`tiled_grouped_matmul`."""
    if kernel:
        # Pallas and its Triton lowering load only when the kernel is selected
        from kernels.grouped_gemm import grouped_matmul as pallas_grouped_matmul
        return pallas_grouped_matmul(lhs, rhs, group_sizes)
    if jax.default_backend() == "cpu":
        return tiled_grouped_matmul(lhs, rhs, group_sizes)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def tiled_grouped_matmul(lhs, rhs, group_sizes, tile: int | None = None):
    """``lax.ragged_dot`` as a batched matmul over row tiles, each tile inside one group.

    XLA's CPU backend computes ragged_dot as G dense matmuls over all M rows (G times the
    work). Here each group's rows are padded to whole tiles of ``tile`` rows (at most
    ceil(M/tile) + G tiles, a static bound), every tile is multiplied by its group's weight,
    and each row reads its result back: (M + G·tile)·K·N multiply-adds instead of G·M·K·N.
    ``tile`` defaults to M/(4G) rounded up to a power of two, within [8, 128]."""
    M, K = lhs.shape
    G, _, N = rhs.shape
    if tile is None:
        tile = min(128, max(8, 1 << max(0, math.ceil(math.log2(max(1, M // (4 * G)))))))
    n_tiles = -(-M // tile) + G
    sizes_G = group_sizes.astype(jnp.int32)
    ends_G = jnp.cumsum(sizes_G)
    starts_G = ends_G - sizes_G
    padded_G = -(-sizes_G // tile) * tile
    pad_ends_G = jnp.cumsum(padded_G)
    pad_starts_G = pad_ends_G - padded_G
    slot_S = jnp.arange(n_tiles * tile, dtype=jnp.int32)          # S = n_tiles * tile slots
    group_S = jnp.minimum(jnp.searchsorted(pad_ends_G, slot_S, side="right"), G - 1)
    offset_S = slot_S - pad_starts_G[group_S]
    live_S = offset_S < sizes_G[group_S]
    x_S = jnp.where(live_S[:, None], lhs[jnp.where(live_S, starts_G[group_S] + offset_S, 0)],
                    0)
    y_TtN = jnp.einsum("Ttk,Tkn->Ttn", x_S.reshape(n_tiles, tile, K),
                       rhs[group_S.reshape(n_tiles, tile)[:, 0]],
                       preferred_element_type=jnp.float32)
    row_M = jnp.arange(M, dtype=jnp.int32)
    group_M = jnp.minimum(jnp.searchsorted(ends_G, row_M, side="right"), G - 1)
    live_M = row_M < ends_G[-1]
    y_MN = y_TtN.reshape(-1, N)[pad_starts_G[group_M] + row_M - starts_G[group_M]]
    return jnp.where(live_M[:, None], y_MN, 0).astype(lhs.dtype)


def key_words(rng):
    """Two uint32 words of a PRNG key (typed or raw) that seed :func:`dropout_keep`."""
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    words = jnp.ravel(rng).astype(jnp.uint32)
    return jnp.stack([words[0], words[-1]])


def _mix(x):
    """A 32-bit integer finaliser (xor-shift-multiply): each input bit flips about half the
    output bits."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(words, rate: float, rows_B, heads_N, q_T, k_S):
    """Which attention probabilities dropout keeps, [B,N,T,S] bool (each with probability
    1 - rate): a hash of the key ``words`` (:func:`key_words`) and each probability's batch
    row, head, query index and key index. ``q_T`` / ``k_S``: the tokens' indices in the
    sequence, [T] or [B,T]. Any split of rows, heads or tokens (tensor and context parallelism's
    blocks) draws the same mask as the whole array."""
    u = lambda a: jnp.asarray(a).astype(jnp.uint32)   # noqa: E731
    q_BT = jnp.broadcast_to(u(q_T), (rows_B.shape[0], q_T.shape[-1]))
    k_BS = jnp.broadcast_to(u(k_S), (rows_B.shape[0], k_S.shape[-1]))
    h_BN = _mix(_mix(words[0] + u(rows_B)[:, None]) ^ (u(heads_N)[None, :] + words[1]))
    h_BNT = _mix(h_BN[:, :, None] ^ q_BT[:, None, :])
    bits = _mix(h_BNT[..., None] + _mix(k_BS ^ words[1])[:, None, None, :])
    return bits >= jnp.uint32(min(int(rate * 2 ** 32), 2 ** 32 - 1))
