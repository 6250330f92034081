"""Context parallelism's attention (issue #23): one sequence split over a mesh axis.

Each device holds a slice of the sequence's tokens with their indices in the sequence (and
segment ids); keys are visible by index, so any token layout works. The model uses
:func:`balanced_order` (Megatron's causal load balancing: 2·CP chunks, device i holding
chunks i and 2·CP−1−i, so every device has the same share of the causal triangle) or the
striped order (:data:`REORDERS`, :func:`model_layout`).

Inside a ``shard_map`` over the context axis, per device:

- :func:`ring_attention` (Megatron ``cp_comm_type: p2p``): K/V blocks travel around the ring
  with ``ppermute``; each step's block attention is merged into the running output by its
  log-sum-exp. The backward is JAX's transpose of the ring (dK/dV travel back).
- :func:`allgather_attention` (``all_gather``): K/V gathered once; their gradients come back
  reduce-scattered.
- :func:`a2a_attention` (``a2a``, Ulysses): all-to-all from sequence-sharded to head-sharded,
  full-sequence attention on a share of the heads, and back. Heads (and K/V heads) must divide
  by the all-to-all size. :func:`hierarchical_attention` (``a2a+p2p``): the all-to-all inside
  groups of neighbouring devices, a ring across the groups.

:func:`block_attention` is the per-block computation: causal, sliding window, segment ids
from explicit token indices, soft-capping; sinks join the softmax once, after the merge.

:func:`sharded_attention` is the model's entry: under an active layout whose mesh has a
``context`` axis, q/k/v (sharded by their logical names), token indices and segment ids go
into a ``shard_map`` over the whole mesh running the chosen strategy.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.ops import dropout_keep, key_words
from jaxtrain.parallel.sharding import active_layout, nested_mesh, spec_for

NEG = -1e30   # a masked score: finite, so fully masked blocks merge away without NaN


def balanced_order(length: int, cp: int) -> np.ndarray:
    """Token order of the load-balanced layout (:func:`balance` of 0..length-1): device i's
    slice (``length / cp`` tokens) is chunks i and 2·cp−1−i of 2·cp equal chunks.
    ``x[..., order]`` lays a sequence out; ``np.argsort(order)`` undoes it."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {cp} equal "
                         f"chunks")
    with jax.ensure_compile_time_eval():   # a constant, also when called under jit
        return np.asarray(balance(np.arange(length)[None], cp))[0]


def balance(x, cp: int):
    """``x`` [B, T, ...] from natural order to :func:`balanced_order` along the sequence, as
    reshapes and a reversal (so the partitioner moves chunks, it does not gather them)."""
    B, T = x.shape[:2]
    c = x.reshape(B, 2 * cp, T // (2 * cp), *x.shape[2:])
    return jnp.stack([c[:, :cp], c[:, cp:][:, ::-1]], axis=2).reshape(x.shape)


def unbalance(x, cp: int):
    """The inverse of :func:`balance`: balanced order back to natural order."""
    B, T = x.shape[:2]
    c = x.reshape(B, cp, 2, T // (2 * cp), *x.shape[2:])
    return jnp.concatenate([c[:, :, 0], c[:, ::-1, 1]], axis=1).reshape(x.shape)


def stripe(x, cp: int):
    """Striped order (MaxText/Transformer Engine ``striped``): device i holds tokens i, i + cp,
    i + 2·cp, ..."""
    B, T = x.shape[:2]
    return jnp.swapaxes(x.reshape(B, T // cp, cp, *x.shape[2:]), 1, 2).reshape(x.shape)


def unstripe(x, cp: int):
    """The inverse of :func:`stripe`."""
    B, T = x.shape[:2]
    return jnp.swapaxes(x.reshape(B, cp, T // cp, *x.shape[2:]), 1, 2).reshape(x.shape)


REORDERS = {"dual_chunk_swap": (balance, unbalance), "striped": (stripe, unstripe)}


class TokenLayout(NamedTuple):
    """How the model lays a sequence over ``cp`` context devices: ``reorder`` one of
    :data:`REORDERS` (None: natural order, contiguous slices)."""

    cp: int
    reorder: str | None

    def apply(self, x):
        return x if self.reorder is None else REORDERS[self.reorder][0](x, self.cp)

    def undo(self, x):
        return x if self.reorder is None else REORDERS[self.reorder][1](x, self.cp)


def model_layout(cfg) -> TokenLayout | None:
    """The token layout of the model's context-parallel attention under the active mesh
    layout, or None when the attention is not context-parallel."""
    layout = active_layout()
    cp = layout.mesh_shape.get("context", 1) if layout is not None else 1
    if cfg.cp_comm_type is None or cp <= 1:
        return None
    return TokenLayout(cp, cfg.cp_reorder)


def _visible(q_pos, k_pos, q_seg, k_seg, causal: bool, window):
    """[B, 1, 1, T, S] visibility from global positions [B, T] / [B, S] and segment ids."""
    t, s = q_pos[:, :, None], k_pos[:, None, :]
    ok = jnp.ones(t.shape[:1] + (t.shape[1], s.shape[2]), bool)
    if causal:
        ok = ok & (s <= t)
    if window is not None:
        ok = ok & (t - s < window)
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == k_seg[:, None, :])
    return ok[:, None, None]


class Dropout(NamedTuple):
    """Attention dropout inside the shard_map: the rate, the key's words and this device's
    global batch rows [B] and heads [N] (with the tokens' indices they pick the mask of
    :func:`jaxtrain.ops.dropout_keep`, the unsplit attention's)."""
    rate: float
    words: jax.Array
    rows: jax.Array
    heads: jax.Array


def block_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, causal=True,
                    window=None, softcap=None, scale=None, dropout: Dropout | None = None):
    """(out [B,T,N,Hv] normalised over this block, lse [B,N,T] float32) of q [B,T,N,H] over
    one block k [B,S,K,H], v [B,S,K,Hv] (grouped-query). ``dropout``: the block's share of
    the dropped probabilities (the merge by log-sum-exp keeps each probability's scale)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    scores = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, G, H), k,
                        preferred_element_type=jnp.float32) * scale
    if softcap:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(_visible(q_pos, k_pos, q_seg, k_seg, causal, window), scores, NEG)
    lse = jax.nn.logsumexp(scores, axis=-1)                                 # [B,K,G,T]
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    if dropout is not None:
        keep = dropout_keep(dropout.words, dropout.rate, dropout.rows, dropout.heads, q_pos,
                            k_pos).reshape(scores.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout.rate), 0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, v.shape[-1]), lse.reshape(B, N, T)


def _merge(out, lse, out_b, lse_b):
    new = jnp.logaddexp(lse, lse_b)
    w_old = jnp.exp(lse - new).transpose(0, 2, 1)[..., None]                # [B,T,N,1]
    w_new = jnp.exp(lse_b - new).transpose(0, 2, 1)[..., None]
    return out * w_old + out_b * w_new, new


def _with_sinks(out, lse, sinks):
    """The sink columns join the softmax's denominator: out scaled by exp(lse - lse')."""
    if sinks is None:
        return out
    N = out.shape[2]
    total = jnp.logaddexp(lse, sinks.astype(jnp.float32).reshape(1, N, 1))
    return out * jnp.exp(lse - total).transpose(0, 2, 1)[..., None]


def _kernel_block(kernel: dict, q, k, v, q_seg, k_seg, *, causal, softcap, scale):
    """(out, lse) of one block by the flash kernel (``kernel``: its block_sizes and interpret
    options): the kernel masks by position within the block, which on the load-balanced
    layout is exact for the blocks the ring forms (the own block causal, the others whole)."""
    from kernels.flash_attention import flash_attention_lse

    seg = None if q_seg is None else (q_seg, k_seg)
    out, lse = flash_attention_lse(q, k, v, causal=causal, segment_ids=seg, logit_softcap=softcap,
                                   scale=scale, **kernel)
    return out.astype(jnp.float32), lse


def _block_or_skip(q, k, v, q_pos, k_pos, q_seg, k_seg, kernel=None, **kw):
    """`block_attention` when any query of the block sees any key; else a fully masked result
    (zero output, lse NEG) without the block's matmuls: blocks that a sliding window or packed
    documents hide entirely cost nothing. ``kernel``: the block is wholly visible but for
    segments, and the flash kernel attends it."""
    def attend():
        if kernel is not None:
            return _kernel_block(kernel, q, k, v, q_seg, k_seg, causal=False,
                                 softcap=kw.get("softcap"), scale=kw.get("scale"))
        return block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, **kw)

    def empty():
        B, T, N = q.shape[:3]
        return (jnp.zeros((B, T, N, v.shape[-1]), jnp.float32),
                jnp.full((B, N, T), NEG, jnp.float32))

    if kw.get("window") is None and q_seg is None:
        return attend()
    seen = jnp.any(_visible(q_pos, k_pos, q_seg, k_seg, kw.get("causal", True),
                            kw.get("window")))
    return jax.lax.cond(seen, attend, empty)


def _balanced_step(q, block, q_pos, q_seg, first: bool, kernel=None, **kw):
    """One ring step on Megatron's load-balanced layout, where this device holds chunks i and
    2·cp−1−i and the arriving block came from device j ≠ i: when j < i only the block's first
    chunk (j) is visible, to every query; when j > i only the second query chunk (2·cp−1−i) sees
    anything, and it sees the whole block. Either way half the block's work (``first``: j < i)."""
    k, v, k_pos, k_seg = block
    h = q.shape[1] // 2
    half = lambda x: None if x is None else x[:, :h]   # noqa: E731
    late = lambda x: None if x is None else x[:, h:]   # noqa: E731

    def early_keys():
        return _block_or_skip(q, half(k), half(v), q_pos, half(k_pos), q_seg, half(k_seg),
                              kernel, **kw)

    def late_queries():
        out, lse = _block_or_skip(late(q), k, v, late(q_pos), k_pos, late(q_seg), k_seg,
                                  kernel, **kw)
        return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                jnp.concatenate([jnp.full_like(lse, NEG), lse], axis=2))

    return jax.lax.cond(first, early_keys, late_queries)


def ring_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str, causal=True,
                   window=None, softcap=None, scale=None, sinks=None, balanced=False,
                   ring=None, kernel=None, dropout=None):
    """Ring attention over mesh axis ``axis`` (call inside a ``shard_map``): this device's
    queries against every device's K/V block, the blocks rotating one hop per step.

    Each step sends the block on before attending to it, so the transfer of the next block can
    overlap this block's compute (the steps are unrolled: ``cp − 1`` collective-permutes
    forward). ``balanced``: the tokens are in :func:`balanced_order` (positions its indices) and
    the mask causal, so each step after the first does half a block (`_balanced_step`).
    ``ring``: (size, stride) of a ring inside the axis (hierarchical CP: the devices stride
    apart), default the whole axis. ``kernel``: options of the flash kernel
    (:func:`kernels.flash_attention.flash_attention_lse`), used for the blocks on the balanced
    layout without a window; None (or another layout) attends with the XLA `block_attention`.
    """
    cp, stride = ring if ring is not None else (jax.lax.axis_size(axis), 1)
    total = cp * stride
    perm = [(j, (j + stride) % total) for j in range(total)]
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, dropout=dropout)
    balanced = balanced and causal and ring is None
    if kernel is not None and dropout is not None:
        raise ValueError("the flash kernel has no attention dropout")
    kernel = kernel if balanced and window is None else None
    rank = jax.lax.axis_index(axis) // stride
    block = (k, v, k_pos, k_seg)
    out = lse = None
    for s in range(cp):
        nxt = jax.lax.ppermute(block, axis, perm) if s < cp - 1 else None
        if s == 0 and kernel is not None:   # own chunks in increasing order: causal by place
            out, lse = _kernel_block(kernel, q, k, v, q_seg, k_seg, causal=True,
                                     softcap=softcap, scale=scale)
        elif s == 0:
            out, lse = block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, **kw)
        else:
            if balanced:
                out_b, lse_b = _balanced_step(q, block, q_pos, q_seg, s <= rank, kernel, **kw)
            else:
                out_b, lse_b = _block_or_skip(q, *block[:2], q_pos, block[2], q_seg, block[3],
                                              **kw)
            out, lse = _merge(out, lse, out_b, lse_b)
        block = nxt
    return _with_sinks(out, lse, sinks).astype(q.dtype)


def _gather(x, axis: str, groups=None):
    """The sequence dimension (1) gathered from every device along ``axis`` (None stays)."""
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True,
                                                     axis_index_groups=groups)


def allgather_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str,
                        causal=True, window=None, softcap=None, scale=None, sinks=None,
                        balanced=False, dropout=None):
    """This device's queries over the K/V of every device, gathered along ``axis``."""
    gather = functools.partial(_gather, axis=axis)
    out, lse = block_attention(q, gather(k), gather(v), q_pos, gather(k_pos), q_seg,
                               gather(k_seg), causal=causal, window=window, softcap=softcap,
                               scale=scale, dropout=dropout)
    return _with_sinks(out, lse, sinks).astype(q.dtype)


def a2a_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str, causal=True,
                  window=None, softcap=None, scale=None, sinks=None, balanced=False,
                  inner=None, dropout=None):
    """Ulysses: heads split over ``axis`` and the whole sequence on each device for them.

    ``inner`` (hierarchical, Megatron ``a2a+p2p``): the all-to-all runs inside groups of
    ``inner`` consecutive devices, each group then holding its devices' tokens for a share of
    the heads, and a ring (:func:`ring_attention`) joins the groups."""
    cp = jax.lax.axis_size(axis)
    size = cp if inner is None else inner
    groups = None if inner is None else [list(range(g, g + inner)) for g in range(0, cp, inner)]
    N, K = q.shape[2], k.shape[2]
    if N % size or K % size:
        raise ValueError(f"a2a context parallelism splits the heads: {N} query and {K} key/value "
                         f"heads must divide by the all-to-all size {size}")
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True,   # noqa: E731
                                            axis_index_groups=groups)
    gather = functools.partial(_gather, axis=axis, groups=groups)
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    share = N // size   # this device's share of the heads
    mine = lambda x: jax.lax.dynamic_slice_in_dim(   # noqa: E731
        x, jax.lax.axis_index(axis) % size * share, share)
    sinks = None if sinks is None else mine(sinks)
    dropout = None if dropout is None else dropout._replace(heads=mine(dropout.heads))
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale, dropout=dropout)
    if inner is None:
        out, lse = block_attention(qh, kh, vh, gather(q_pos), gather(k_pos), gather(q_seg),
                                   gather(k_seg), **kw)
        out = _with_sinks(out, lse, sinks)
    else:
        out = ring_attention(qh, kh, vh, gather(q_pos), gather(k_pos), gather(q_seg),
                             gather(k_seg), axis=axis, sinks=sinks, ring=(cp // inner, inner),
                             **kw)
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True, axis_index_groups=groups
                              ).astype(q.dtype)


def hierarchical_attention(*args, inner: int, **kw):
    """Megatron ``a2a+p2p``: :func:`a2a_attention` in groups of ``inner`` devices, a ring
    across the groups."""
    return a2a_attention(*args, inner=inner, **kw)


STRATEGIES = {"p2p": ring_attention, "allgather": allgather_attention, "all_gather":
              allgather_attention, "a2a": a2a_attention, "a2a+p2p": hierarchical_attention}


def sharded_attention(layout, strategy: str, q, k, v, positions, segment_ids=None, sinks=None,
                      window=None, *, softcap=None, scale=None, balanced=False, inner=None,
                      kernel=None, dropout_rate: float = 0.0, dropout_rng=None):
    """Context-parallel attention of the model's q [B,T,N,H], k/v [B,T,K,H] (global arrays
    sharded by their logical names) over ``layout``'s ``context`` axis by ``strategy``.
    ``positions`` [B,T] order the tokens for the causal mask and windows (the tokens' indices
    in the sequence, not RoPE's positions, which may restart at document boundaries).
    ``balanced``: the tokens are in :func:`balanced_order` (the ring then skips the half blocks
    the causal mask hides). ``inner``: the all-to-all group size of ``a2a+p2p``. ``kernel``:
    the flash kernel's options for the ring's blocks (:func:`ring_attention`).
    ``dropout_rate`` / ``dropout_rng``: attention dropout, the mask the unsplit attention
    (:func:`jaxtrain.models.attention.dot_product_attention`) draws with that key."""
    rules, shape = layout.rules, layout.mesh_shape
    qs = spec_for(("act_batch", "act_seq", "act_heads", "act_kv"), q.shape, rules, shape)
    ks = spec_for(("act_batch", "act_seq", "act_kv_heads", "act_kv"), k.shape, rules, shape)
    if "context" not in (qs[1] if isinstance(qs[1], tuple) else (qs[1],)):
        raise ValueError(f"context-parallel attention needs the sequence ({q.shape[1]}) split "
                         f"over the context axis ({shape.get('context')})")
    tok = P(qs[0], qs[1])
    sink_spec = P(qs[2])
    fn = STRATEGIES[strategy]
    extra = dict(balanced=balanced) if inner is None else dict(inner=inner)
    if strategy == "p2p" and kernel is not None:
        extra["kernel"] = kernel
    has_seg, has_sinks, has_window = (segment_ids is not None, sinks is not None,
                                      window is not None)

    def body(q, k, v, pos, seg, sinks, window, words, rows, heads):
        drop = Dropout(dropout_rate, words, rows, heads) if dropout_rate > 0.0 else None
        return fn(q, k, v, pos, pos, seg if has_seg else None, seg if has_seg else None,
                  axis="context", causal=True, window=window if has_window else None,
                  softcap=softcap, scale=scale, sinks=sinks if has_sinks else None,
                  dropout=drop, **extra)

    zero = jnp.zeros((), jnp.int32)
    args = (q, k, v, positions, segment_ids if has_seg else positions,
            sinks if has_sinks else jnp.zeros((q.shape[2],), jnp.float32),
            jnp.asarray(window, jnp.int32) if has_window else zero,
            key_words(dropout_rng) if dropout_rate > 0.0 else jnp.zeros((2,), jnp.uint32),
            jnp.arange(q.shape[0], dtype=jnp.int32), jnp.arange(q.shape[2], dtype=jnp.int32))
    return jax.shard_map(body, **nested_mesh(layout),
                         in_specs=(qs, ks, ks, tok, tok, sink_spec, P(), P(), P(qs[0]),
                                   sink_spec), out_specs=qs, check_vma=False)(*args)
