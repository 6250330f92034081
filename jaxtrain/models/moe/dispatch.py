"""Token dispatch: bringing each device's routed tokens to their experts and the outputs back.

:func:`experts_local` runs the routed experts for one device's tokens. When every expert rank
holds all of its tokens (no expert parallelism, or experts split over an axis the tokens are not
split over) it runs its local experts and sums over the expert ranks. When the tokens are split
over the expert axis too, the ``allgather`` dispatcher gathers the expert group's tokens, runs
its local experts on them and reduce-scatters the outputs back (Megatron's
MoEAllGatherTokenDispatcher); the ``alltoall`` dispatcher sends each token only to the devices
owning its experts and back (``all_to_all`` with fixed slots of the worst-case size, or
capacity-sized slots with pad_to_capacity: ``ragged_all_to_all`` has no CPU lowering).

Legend: N tokens, k top-k, D hidden, E experts, ep expert-parallel ranks, E_loc = E / ep,
C capacity, S = N·k slots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.moe.comm import LOCAL, Comm, _psum
from jaxtrain.models.moe.experts import _buffer_ffn, _combine, _ffn_buffers, _sorted_ffn


def experts_local(pe, x, probs, idx, keep, slots, cfg, comm: Comm = LOCAL):
    """The routed experts' output [N, D] for one device's tokens x [N, D] (the whole batch
    without a layout), dispatching over ``comm.expert`` when the experts are split."""
    m = cfg.moe
    N, D = x.shape
    k = idx.shape[1]
    E, ep = m.num_experts, comm.ep
    E_loc = E // ep
    dt = cfg.compute_dtype
    w = (probs * keep).astype(jnp.float32)
    if ep == 1 or not comm.tokens_split:
        # every expert rank holds all of its tokens: run the local experts, sum over ranks
        e0 = comm.rank() * E_loc
        if slots is not None and m.pad_to_capacity:
            s, sw = (jax.lax.dynamic_slice_in_dim(a, e0, E_loc) for a in slots)
            y = _buffer_ffn(pe, x, s, sw, cfg, m, comm.tensor)
        else:
            ids = (idx - e0).reshape(-1)
            ids = jnp.where((ids >= 0) & keep.reshape(-1), ids, E_loc)
            y = _sorted_ffn(pe, x[jnp.arange(N * k) // k], ids, w.reshape(-1), E_loc, cfg, m,
                            comm.tensor)
            y = _combine(y, N, k)
        return _psum(y, comm.expert).astype(dt) if ep > 1 else y.astype(dt)
    if m.dispatcher == "alltoall":
        return _alltoall(pe, x, w, idx, keep, slots, cfg, comm).astype(dt)
    return _allgather(pe, x, w, idx, keep, slots, cfg, comm).astype(dt)


def _allgather(pe, x, w, idx, keep, slots, cfg, comm: Comm):
    """Gather the expert group's tokens, run the local experts on all of them, reduce-scatter
    the partial outputs back to their devices (Megatron's allgather dispatcher)."""
    m = cfg.moe
    N, k = idx.shape
    E_loc = m.num_experts // comm.ep
    e0 = comm.rank() * E_loc
    gather = lambda a: jax.lax.all_gather(a, comm.expert, tiled=True)  # noqa: E731
    X = gather(x)
    if slots is not None and m.pad_to_capacity:
        s, sw = slots                                                        # [E, C]
        offset = jnp.arange(comm.ep)[:, None, None] * N
        S = jax.lax.all_gather(s, comm.expert) + offset                      # [ep, E, C]
        SW = jax.lax.all_gather(sw, comm.expert)
        take = lambda a: jnp.moveaxis(jax.lax.dynamic_slice_in_dim(a, e0, E_loc, axis=1),
                                      1, 0).reshape(E_loc, -1)  # noqa: E731
        y = _buffer_ffn(pe, X, take(S), take(SW), cfg, m, comm.tensor)
    else:
        ids = (gather(idx) - e0).reshape(-1)
        ids = jnp.where((ids >= 0) & gather(keep).reshape(-1), ids, E_loc)
        M = X.shape[0]
        y = _sorted_ffn(pe, X[jnp.arange(M * k) // k], ids, gather(w).reshape(-1), E_loc, cfg, m,
                        comm.tensor)
        y = _combine(y, M, k)
    return jax.lax.psum_scatter(y, comm.expert, scatter_dimension=0, tiled=True)


def _alltoall(pe, x, w, idx, keep, slots, cfg, comm: Comm):
    """Send each (token, expert) pair to the device owning the expert in fixed-size slots
    (all_to_all), run the experts there, send the outputs back and combine them."""
    m = cfg.moe
    N, k = idx.shape
    ep, E_loc = comm.ep, m.num_experts // comm.ep
    a2a = lambda a: jax.lax.all_to_all(a, comm.expert, 0, 0, tiled=False)  # noqa: E731
    if slots is not None and m.pad_to_capacity:
        s, sw = slots                                                        # [E, C]
        C = s.shape[1]
        recv = a2a(x[s].reshape(ep, E_loc, C, -1))                           # [ep_src, E_loc, C, D]
        xe = jnp.moveaxis(recv, 0, 1).reshape(E_loc, ep * C, -1)
        y = _psum(_ffn_buffers(pe, xe, cfg, m), comm.tensor)
        if "bo" in pe:
            y = y + pe["bo"].astype(y.dtype)[:, None, :]
        back = a2a(jnp.moveaxis(y.reshape(E_loc, ep, C, -1), 1, 0))          # [ep_dst, E_loc, C, D]
        y = back.reshape(m.num_experts, C, -1) * sw.astype(y.dtype)[..., None]
        return jnp.zeros((N, y.shape[-1]), y.dtype).at[s.reshape(-1)].add(
            y.reshape(-1, y.shape[-1]))
    # dropless: pair p = (token p // k, expert idx); slot = rank among pairs for that device
    flat, live = idx.reshape(-1), keep.reshape(-1)
    dest = jnp.where(live, flat // E_loc, ep)
    order = jnp.argsort(dest, stable=True)
    sent = jnp.sum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0)       # pairs per device
    start = jnp.cumsum(sent) - sent
    S = N * k                                                                # worst case
    d_sorted = dest[order]
    pos = jnp.arange(S) - start[jnp.minimum(d_sorted, ep - 1)]
    buf = jnp.zeros((ep + 1, S), jnp.int32).at[d_sorted, pos].set(order, mode="drop")[:ep]
    used = jnp.zeros((ep + 1, S), jnp.bool_).at[d_sorted, pos].set(True, mode="drop")[:ep]
    xs = jnp.where(used[..., None], x[buf // k], 0).astype(cfg.compute_dtype)  # [ep, S, D]
    ids = jnp.where(used, flat[buf] % E_loc, E_loc)
    rx, rids = a2a(xs), a2a(ids)                                             # from each source
    y = _sorted_ffn(pe, rx.reshape(ep * S, -1), rids.reshape(-1),
                    jnp.ones((ep * S,), jnp.float32), E_loc, cfg, m, comm.tensor)
    y = a2a(y.reshape(ep, S, -1))                                            # back to sources
    pairs = jnp.zeros((N * k + 1, y.shape[-1]), y.dtype).at[
        jnp.where(used, buf, N * k).reshape(-1)].add(y.reshape(ep * S, -1))[:N * k]
    return _combine(pairs * w.reshape(-1)[:, None].astype(y.dtype), N, k)
