"""Token dispatch: bringing each device's routed tokens to their experts and the outputs back.

:func:`experts_local` runs the routed experts for one device's tokens. When every expert rank
holds all of its tokens (no expert parallelism, or experts split over an axis the tokens are not
split over) it runs its local experts and sums over the expert ranks. When the tokens are split
over the expert axis too, the ``allgather`` dispatcher gathers the expert group's tokens, runs
its local experts on them and reduce-scatters the outputs back (Megatron's
MoEAllGatherTokenDispatcher); the ``alltoall`` dispatcher sends each token only to the devices
owning its experts and back (``all_to_all`` with fixed slots of the worst-case size, or
capacity-sized slots with pad_to_capacity: ``ragged_all_to_all`` has no CPU lowering).

Legend: N tokens, k top-k, D hidden, E experts, P = ep expert-parallel ranks, L = E_loc = E / P
local experts, C capacity, S = N·k slots, M = P·N gathered tokens.
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
    w_Nk = (probs * keep).astype(jnp.float32)
    if ep == 1 or not comm.tokens_split:
        # every expert rank holds all of its tokens: run the local experts, sum over ranks
        e0 = comm.rank() * E_loc
        if slots is not None and m.pad_to_capacity:
            slots_LC, weights_LC = (jax.lax.dynamic_slice_in_dim(a, e0, E_loc) for a in slots)
            y_ND = _buffer_ffn(pe, x, slots_LC, weights_LC, cfg, m, comm.tensor)
        else:
            ids_S = (idx - e0).reshape(-1)
            ids_S = jnp.where((ids_S >= 0) & keep.reshape(-1), ids_S, E_loc)
            y_SD = _sorted_ffn(pe, x[jnp.arange(N * k) // k], ids_S, w_Nk.reshape(-1), E_loc,
                               cfg, m, comm.tensor)
            y_ND = _combine(y_SD, N, k)
        return _psum(y_ND, comm.expert).astype(dt) if ep > 1 else y_ND.astype(dt)
    if m.dispatcher == "alltoall":
        return _alltoall(pe, x, w_Nk, idx, keep, slots, cfg, comm).astype(dt)
    return _allgather(pe, x, w_Nk, idx, keep, slots, cfg, comm).astype(dt)


def _allgather(pe, x_ND, w_Nk, idx_Nk, keep_Nk, slots, cfg, comm: Comm):
    """Gather the expert group's tokens, run the local experts on all of them, reduce-scatter
    the partial outputs back to their devices (Megatron's allgather dispatcher)."""
    m = cfg.moe
    N, k = idx_Nk.shape
    E_loc = m.num_experts // comm.ep
    e0 = comm.rank() * E_loc
    gather = lambda a: jax.lax.all_gather(a, comm.expert, tiled=True)  # noqa: E731
    x_MD = gather(x_ND)
    if slots is not None and m.pad_to_capacity:
        slots_EC, weights_EC = slots
        offset_P11 = jnp.arange(comm.ep)[:, None, None] * N
        slots_PEC = jax.lax.all_gather(slots_EC, comm.expert) + offset_P11
        weights_PEC = jax.lax.all_gather(weights_EC, comm.expert)
        # [P, E, C] -> the local experts' [L, P·C]
        take = lambda a: jnp.moveaxis(jax.lax.dynamic_slice_in_dim(a, e0, E_loc, axis=1),
                                      1, 0).reshape(E_loc, -1)  # noqa: E731
        y_MD = _buffer_ffn(pe, x_MD, take(slots_PEC), take(weights_PEC), cfg, m, comm.tensor)
    else:
        ids = (gather(idx_Nk) - e0).reshape(-1)                              # [M·k]
        ids = jnp.where((ids >= 0) & gather(keep_Nk).reshape(-1), ids, E_loc)
        M = x_MD.shape[0]
        y = _sorted_ffn(pe, x_MD[jnp.arange(M * k) // k], ids, gather(w_Nk).reshape(-1), E_loc,
                        cfg, m, comm.tensor)                                  # [M·k, D]
        y_MD = _combine(y, M, k)
    return jax.lax.psum_scatter(y_MD, comm.expert, scatter_dimension=0, tiled=True)


def _alltoall(pe, x_ND, w_Nk, idx_Nk, keep_Nk, slots, cfg, comm: Comm):
    """Send each (token, expert) pair to the device owning the expert in fixed-size slots
    (all_to_all), run the experts there, send the outputs back and combine them."""
    m = cfg.moe
    N, k = idx_Nk.shape
    ep, E_loc = comm.ep, m.num_experts // comm.ep
    a2a = lambda a: jax.lax.all_to_all(a, comm.expert, 0, 0, tiled=False)  # noqa: E731
    if slots is not None and m.pad_to_capacity:
        slots_EC, weights_EC = slots
        C = slots_EC.shape[1]
        recv_PLCD = a2a(x_ND[slots_EC].reshape(ep, E_loc, C, -1))           # from each source
        x_LPCD = jnp.moveaxis(recv_PLCD, 0, 1).reshape(E_loc, ep * C, -1)  # [L, P·C, D]
        y = _psum(_ffn_buffers(pe, x_LPCD, cfg, m), comm.tensor)           # [L, P·C, D]
        if "bo" in pe:
            y = y + pe["bo"].astype(y.dtype)[:, None, :]
        back_PLCD = a2a(jnp.moveaxis(y.reshape(E_loc, ep, C, -1), 1, 0))   # to each source
        y_ECD = back_PLCD.reshape(m.num_experts, C, -1) * weights_EC.astype(y.dtype)[..., None]
        return jnp.zeros((N, y_ECD.shape[-1]), y_ECD.dtype).at[slots_EC.reshape(-1)].add(
            y_ECD.reshape(-1, y_ECD.shape[-1]))
    # dropless: pair p = (token p // k, expert idx); slot = rank among pairs for that device
    flat_S, live_S = idx_Nk.reshape(-1), keep_Nk.reshape(-1)
    dest_S = jnp.where(live_S, flat_S // E_loc, ep)
    order_S = jnp.argsort(dest_S, stable=True)
    sent_P = jnp.sum(jax.nn.one_hot(dest_S, ep, dtype=jnp.int32), axis=0)  # pairs per device
    start_P = jnp.cumsum(sent_P) - sent_P
    S = N * k                                                               # worst case
    dest_sorted_S = dest_S[order_S]
    pos_S = jnp.arange(S) - start_P[jnp.minimum(dest_sorted_S, ep - 1)]
    buf_PS = jnp.zeros((ep + 1, S), jnp.int32).at[dest_sorted_S, pos_S].set(
        order_S, mode="drop")[:ep]
    used_PS = jnp.zeros((ep + 1, S), jnp.bool_).at[dest_sorted_S, pos_S].set(
        True, mode="drop")[:ep]
    x_PSD = jnp.where(used_PS[..., None], x_ND[buf_PS // k], 0).astype(cfg.compute_dtype)
    ids_PS = jnp.where(used_PS, flat_S[buf_PS] % E_loc, E_loc)
    recv_PSD, recv_ids_PS = a2a(x_PSD), a2a(ids_PS)                         # from each source
    y = _sorted_ffn(pe, recv_PSD.reshape(ep * S, -1), recv_ids_PS.reshape(-1),
                    jnp.ones((ep * S,), jnp.float32), E_loc, cfg, m, comm.tensor)
    y_PSD = a2a(y.reshape(ep, S, -1))                                       # back to sources
    pairs_SD = jnp.zeros((N * k + 1, y_PSD.shape[-1]), y_PSD.dtype).at[
        jnp.where(used_PS, buf_PS, N * k).reshape(-1)].add(y_PSD.reshape(ep * S, -1))[:N * k]
    return _combine(pairs_SD * w_Nk.reshape(-1)[:, None].astype(y_PSD.dtype), N, k)
