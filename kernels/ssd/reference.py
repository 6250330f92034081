"""Mamba-2's scalar-decay state-space recurrence in plain jnp: a token-by-token scan (the
truth) and the chunked form (SSD) training uses.

Per head, with a state S [P,N], step size dt_t > 0 and decay rate A < 0:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t

B and C [.., G, N] are shared by H/G consecutive heads (head h reads group h // (H/G), as
``repeat_interleave`` in the Hugging Face and mamba_ssm code). The skip term D x and the gate
are the caller's.

Packed sequences: ``segment_ids`` [B,T]; a token whose segment differs from the previous one
starts from a zero state.

Legend: B batch, T length, H heads, P head width, G groups, N state width, C chunk length,
K chunks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.gated_delta.reference import sequence_numbers, starts


def _prepare(x, dt, A, Bm, Cm):
    """float32 inputs with heads split into (groups, heads per group)."""
    Bsz, T, H, P = x.shape
    G = Bm.shape[2]
    x = x.astype(jnp.float32).reshape(Bsz, T, G, H // G, P)
    dt = dt.astype(jnp.float32).reshape(Bsz, T, G, H // G)
    a = dt * A.astype(jnp.float32).reshape(G, H // G)
    return x, dt, a, Bm.astype(jnp.float32), Cm.astype(jnp.float32)


def recurrent_ssd(x, dt, A, Bm, Cm, *, segment_ids=None, initial_state=None):
    """Token by token: (y [B,T,H,P] in x's dtype, final state [B,H,P,N] float32).
    x [B,T,H,P]; dt [B,T,H] (after softplus); A [H]; Bm, Cm [B,T,G,N]."""
    Bsz, T, H, P = x.shape
    dtype, N = x.dtype, Bm.shape[-1]
    x, dt, a, Bm, Cm = _prepare(x, dt, A, Bm, Cm)
    G = Bm.shape[2]
    reset = starts(segment_ids, T, Bsz)
    S0 = (jnp.zeros((Bsz, H, P, N), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def step(S, xs):
        x_t, dt_t, a_t, b_t, c_t, r_t = xs
        decay = jnp.where(r_t[:, None, None], 0.0, jnp.exp(a_t))             # [B,G,R]
        S = S * decay[..., None, None] + jnp.einsum(
            "bgrp,bgn->bgrpn", x_t * dt_t[..., None], b_t)
        return S, jnp.einsum("bgrpn,bgn->bgrp", S, c_t)

    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (x, dt, a, Bm, Cm, reset))
    S, y = jax.lax.scan(step, S0.reshape(Bsz, G, H // G, P, N), xs)
    return jnp.moveaxis(y, 0, 1).reshape(Bsz, T, H, P).astype(dtype), S.reshape(Bsz, H, P, N)


def chunked_ssd(x, dt, A, Bm, Cm, *, segment_ids=None, initial_state=None,
                chunk_size: int = 128, state_dtype=None):
    """The recurrence a chunk at a time: within a chunk the outputs are a masked, decayed
    C.B^T "attention" over the chunk plus the decayed read of the state entering it; a scan
    carries the state across chunks. Arguments and results as :func:`recurrent_ssd`; T need
    not divide by ``chunk_size`` (the tail is padded with tokens of zero step, which change
    nothing). ``state_dtype``: the states entering each chunk are stored in it (mamba_ssm's
    ``state_dtype``, Megatron's mamba_training_ssm_states_dtype); the carry across chunks
    stays float32."""
    Bsz, T, H, P = x.shape
    dtype, N = x.dtype, Bm.shape[-1]
    x, dt, a, Bm, Cm = _prepare(x, dt, A, Bm, Cm)
    G, R = Bm.shape[2], H // Bm.shape[2]
    C = chunk_size
    pad = -T % C
    c = sequence_numbers(segment_ids, T, Bsz)
    c = jnp.zeros((Bsz, T), jnp.int32) if c is None else c
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        dt, a = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (dt, a))
        Bm, Cm = (jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (Bm, Cm))
        c = jnp.pad(c, ((0, 0), (0, pad)), mode="edge")
    K = (T + pad) // C

    def chunks(t):   # [B,T,...] -> [K,B,C,...]
        return jnp.moveaxis(t.reshape(Bsz, K, C, *t.shape[2:]), 1, 0)

    x, dt, a, Bm, Cm = (chunks(t) for t in (x, dt, a, Bm, Cm))
    c = chunks(c)                                                     # [K,B,C]
    c_prev = jnp.concatenate([c[:1, :, :1], c[:-1, :, -1:]], 0)       # before each chunk
    cum = jnp.cumsum(a, 2)                                            # [K,B,C,G,R]
    lower = jnp.tril(jnp.ones((C, C), bool))
    same = ((c[..., :, None] == c[..., None, :]) & lower)[..., None, None]   # [K,B,C,C,1,1]
    gap = cum[:, :, :, None] - cum[:, :, None, :]                     # [K,B,l,s,G,R]
    decay = jnp.where(same, jnp.exp(jnp.where(same, gap, 0.0)), 0.0)
    scores = jnp.einsum("kblgn,kbsgn->kblsg", Cm, Bm)[..., None] * decay
    xdt = x * dt[..., None]
    y_in = jnp.einsum("kblsgr,kbsgrp->kblgrp", scores, xdt)
    # decays from the chunk's start to each token, from each token to the chunk's end and of
    # the whole chunk (zero across a sequence start)
    from_start = jnp.where((c == c_prev)[..., None, None], jnp.exp(cum), 0.0)
    to_end = jnp.where((c == c[..., -1:])[..., None, None], jnp.exp(cum[:, :, -1:] - cum), 0.0)
    carry = jnp.where((c[..., -1] == c_prev[..., 0])[..., None, None],
                      jnp.exp(cum[:, :, -1]), 0.0)                    # [K,B,G,R]
    written = jnp.einsum("kbsgr,kbsgrp,kbsgn->kbgrpn", to_end, xdt, Bm)

    S0 = (jnp.zeros((Bsz, H, P, N), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32)).reshape(Bsz, G, R, P, N)

    def step(S, xs):
        written_k, carry_k = xs
        return S * carry_k[..., None, None] + written_k, S

    S, entering = jax.lax.scan(step, S0, (written, carry))
    if state_dtype is not None:
        entering = entering.astype(state_dtype).astype(jnp.float32)
    y = y_in + jnp.einsum("kblgn,kbgrpn->kblgrp", Cm, entering) * from_start[..., None]
    y = jnp.moveaxis(y, 0, 1).reshape(Bsz, K * C, H, P)[:, :T]
    return y.astype(dtype), S.reshape(Bsz, H, P, N)
