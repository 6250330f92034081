"""Context parallelism's attention (issue #23, first part): one sequence split over a mesh axis.

Each device holds a slice of the sequence's tokens with their global positions (and segment
ids); keys are visible by position, so any token layout works. :func:`balanced_order` is
Megatron's causal load balancing: the sequence in 2·CP chunks, device i holding chunks i and
2·CP−1−i, so every device has the same share of the causal triangle.

Inside a ``shard_map`` over the context axis, per device:

- :func:`ring_attention` (Megatron ``cp_comm_type: p2p``): K/V blocks travel around the ring
  with ``ppermute``; each step's block attention is merged into the running output by its
  log-sum-exp. The backward is JAX's transpose of the ring (dK/dV travel back).
- :func:`allgather_attention` (``all_gather``): K/V gathered once; their gradients come back
  reduce-scattered.
- :func:`a2a_attention` (``a2a``, Ulysses): all-to-all from sequence-sharded to head-sharded,
  full-sequence attention on a share of the heads, and back. Heads (and K/V heads) must divide
  by the axis size.

:func:`block_attention` is the per-block XLA computation: causal, sliding window, segment ids
from explicit positions, soft-capping; sinks join the softmax once, after the merge. Not yet
wired into the load-balanced data layout yet: a run keeps the natural token order, which is
exact but leaves the causal work uneven across the context devices.

:func:`sharded_attention` is the model's entry: under an active layout whose mesh has a
``context`` axis, q/k/v (sharded by their logical names), positions and segment ids go into a
``shard_map`` over the whole mesh running the chosen strategy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.sharding import spec_for

NEG = -1e30   # a masked score: finite, so fully masked blocks merge away without NaN


def balanced_order(length: int, cp: int) -> np.ndarray:
    """Token order of the load-balanced layout: device i's slice (``length / cp`` tokens) is
    chunks i and 2·cp−1−i of 2·cp equal chunks. ``x[..., order]`` lays a sequence out;
    ``np.argsort(order)`` undoes it."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {cp} equal "
                         f"chunks")
    chunk = length // (2 * cp)
    parts = []
    for i in range(cp):
        parts += [np.arange(i * chunk, (i + 1) * chunk),
                  np.arange((2 * cp - 1 - i) * chunk, (2 * cp - i) * chunk)]
    return np.concatenate(parts)


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


def block_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, causal=True,
                    window=None, softcap=None, scale=None):
    """(out [B,T,N,Hv] normalised over this block, lse [B,N,T] float32) of q [B,T,N,H] over
    one block k [B,S,K,H], v [B,S,K,Hv] (grouped-query)."""
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


def ring_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str, causal=True,
                   window=None, softcap=None, scale=None, sinks=None):
    """Ring attention over mesh axis ``axis`` (call inside a ``shard_map``): this device's
    queries against every device's K/V block, the blocks rotating one hop per step."""
    cp = jax.lax.axis_size(axis)
    perm = [(j, (j + 1) % cp) for j in range(cp)]
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    out, lse = block_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, **kw)
    block = (k, v, k_pos, k_seg)

    def step(carry, _):
        out, lse, block = carry
        block = jax.lax.ppermute(block, axis, perm)
        out_b, lse_b = block_attention(q, *block[:2], q_pos, block[2], q_seg, block[3], **kw)
        out, lse = _merge(out, lse, out_b, lse_b)
        return (out, lse, block), None

    (out, lse, _), _ = jax.lax.scan(step, (out, lse, block), None, length=cp - 1)
    return _with_sinks(out, lse, sinks).astype(q.dtype)


def _gather(x, axis: str):
    """The sequence dimension (1) gathered from every device along ``axis`` (None stays)."""
    return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def allgather_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str,
                        causal=True, window=None, softcap=None, scale=None, sinks=None):
    """This device's queries over the K/V of every device, gathered along ``axis``."""
    gather = functools.partial(_gather, axis=axis)
    out, lse = block_attention(q, gather(k), gather(v), q_pos, gather(k_pos), q_seg,
                               gather(k_seg), causal=causal, window=window, softcap=softcap,
                               scale=scale)
    return _with_sinks(out, lse, sinks).astype(q.dtype)


def a2a_attention(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *, axis: str, causal=True,
                  window=None, softcap=None, scale=None, sinks=None):
    """Ulysses: heads split over ``axis`` and the whole sequence on each device for them."""
    cp = jax.lax.axis_size(axis)
    N, K = q.shape[2], k.shape[2]
    if N % cp or K % cp:
        raise ValueError(f"a2a context parallelism splits the heads: {N} query and {K} key/value "
                         f"heads must divide by the context-parallel size {cp}")
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)    # noqa: E731
    gather = functools.partial(_gather, axis=axis)
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    pos = gather(q_pos)
    seg = gather(q_seg)
    out, lse = block_attention(qh, kh, vh, pos, gather(k_pos), seg, gather(k_seg),
                               causal=causal, window=window, softcap=softcap, scale=scale)
    if sinks is not None:   # this device's share of the heads
        share = N // cp
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axis) * share, share)
    out = _with_sinks(out, lse, sinks)
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True).astype(q.dtype)


STRATEGIES = {"p2p": ring_attention, "allgather": allgather_attention, "all_gather":
              allgather_attention, "a2a": a2a_attention}


def sharded_attention(layout, strategy: str, q, k, v, positions, segment_ids=None, sinks=None,
                      window=None, *, softcap=None, scale=None):
    """Context-parallel attention of the model's q [B,T,N,H], k/v [B,T,K,H] (global arrays
    sharded by their logical names) over ``layout``'s ``context`` axis by ``strategy``.
    ``positions`` [B,T] order the tokens for the causal mask and windows (the tokens' indices
    in the sequence, not RoPE's positions, which may restart at document boundaries)."""
    rules, shape = layout.rules, layout.mesh_shape
    qs = spec_for(("act_batch", "act_seq", "act_heads", "act_kv"), q.shape, rules, shape)
    ks = spec_for(("act_batch", "act_seq", "act_kv_heads", "act_kv"), k.shape, rules, shape)
    if "context" not in (qs[1] if isinstance(qs[1], tuple) else (qs[1],)):
        raise ValueError(f"context-parallel attention needs the sequence ({q.shape[1]}) split "
                         f"over the context axis ({shape.get('context')})")
    tok = P(qs[0], qs[1])
    sink_spec = P(qs[2])
    fn = STRATEGIES[strategy]
    has_seg, has_sinks, has_window = (segment_ids is not None, sinks is not None,
                                      window is not None)

    def body(q, k, v, pos, seg, sinks, window):
        return fn(q, k, v, pos, pos, seg if has_seg else None, seg if has_seg else None,
                  axis="context", causal=True, window=window if has_window else None,
                  softcap=softcap, scale=scale, sinks=sinks if has_sinks else None)

    zero = jnp.zeros((), jnp.int32)
    args = (q, k, v, positions, segment_ids if has_seg else positions,
            sinks if has_sinks else jnp.zeros((q.shape[2],), jnp.float32),
            jnp.asarray(window, jnp.int32) if has_window else zero)
    return jax.shard_map(body, mesh=layout.mesh,
                         in_specs=(qs, ks, ks, tok, tok, sink_spec, P()), out_specs=qs,
                         check_vma=False)(*args)
