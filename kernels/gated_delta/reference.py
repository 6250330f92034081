"""The gated delta rule (Gated DeltaNet, Yang et al. 2024) in plain jnp: a token-by-token
recurrence (the truth) and the chunked form training uses.

Per value head, with a state S [Dk, Dv], decay g_t <= 0 (log space) and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

q and k are L2-normalised first (``l2_qk``) and q is scaled by Dk^-1/2. Key heads are shared by
Hv/Hk consecutive value heads (``jnp.repeat``, as the Hugging Face models do).

Kimi Delta Attention (KDA, Kimi Linear) decays each key channel on its own: g [B,T,H,Dk] and
S_t = Diag(exp(g_t)) S_{t-1} + ...; every function here takes either form of g. Within a
chunk, the per-channel decays between two tokens are exp(G_i - G_j) of the cumulative log
decays G; they are formed so that no exponent is positive (`_channel_scores`).

Packed sequences: ``segment_ids`` [B,T]; a token whose segment differs from the previous
token's starts from a zero state, as if its sequence ran alone.

Legend: B batch, T length, Hk key heads, Hv value heads, Dk key width, Dv value width,
C chunk length, N chunks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the FLA / HF convention)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + eps)


def starts(segment_ids, T: int, B: int):
    """[B,T] bool: the tokens that begin a new sequence (the first token is not one: it
    starts from the initial state)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    s = jnp.asarray(segment_ids)
    return jnp.concatenate([jnp.zeros((B, 1), bool), s[:, 1:] != s[:, :-1]], 1)


def sequence_numbers(segment_ids, T: int, B: int):
    """[B,T] int32 ordinal of each token's sequence (a new one wherever the segment changes),
    or None without segments."""
    if segment_ids is None:
        return None
    return jnp.cumsum(starts(segment_ids, T, B).astype(jnp.int32), 1)


def _prepare(q, k, v, g, beta, l2_qk: bool):
    """float32 inputs with key heads repeated to the value heads and q scaled."""
    r = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(x, r, axis=2) if r > 1 else x for x in (q, k))
    if l2_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q.astype(jnp.float32) * q.shape[-1] ** -0.5
    return (q, k.astype(jnp.float32), v.astype(jnp.float32), g.astype(jnp.float32),
            beta.astype(jnp.float32))


def recurrent_gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                               l2_qk: bool = True):
    """Token-by-token gated delta rule: (o [B,T,Hv,Dv] in v's dtype, final state
    [B,Hv,Dk,Dv] float32). q, k [B,T,Hk,Dk]; v [B,T,Hv,Dv]; beta [B,T,Hv]; g [B,T,Hv], or
    [B,T,Hv,Dk] for a decay per key channel (KDA)."""
    B, T, Hv, Dv = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2_qk)
    reset = starts(segment_ids, T, B)
    S0 = (jnp.zeros((B, Hv, k.shape[-1], Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    per_channel = g.ndim == 4

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs
        decay = jnp.where(r_t[:, None, None] if per_channel else r_t[:, None], 0.0,
                          jnp.exp(g_t))
        S = S * (decay[..., None] if per_channel else decay[..., None, None])
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", S, k_t)) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, reset))
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(dtype), S


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: A is nilpotent, so the inverse is
    the finite series sum_m (-A)^m = (I - A)(I + A^2)(I + A^4)... (log2 C matmul pairs). Plain
    matmuls: XLA:CPU runs batched triangular solves' gradients very slowly inside scans."""
    C = A.shape[-1]
    out = jnp.eye(C, dtype=A.dtype) - A
    power = A
    for _ in range(max(C - 1, 1).bit_length() - 1):
        power = power @ power
        out = out + out @ power
    return out


def chunked_gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                             l2_qk: bool = True, chunk_size: int = 64, scan=None):
    """The gated delta rule a chunk at a time (the WY/UT form): within a chunk the C updates
    become one unit-triangular solve and a few matmuls; a scan carries the state across chunks.
    Same arguments and results as :func:`recurrent_gated_delta_rule`; T need not divide by
    ``chunk_size`` (the tail is padded with tokens that change nothing). ``scan``: the walk
    across chunks, :func:`chunk_recurrence` (``lax.scan``) or the Pallas kernel's
    ``kernels.gated_delta.chunk_scan`` (same arguments)."""
    B, T, Hv, Dv = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2_qk)
    Dk = k.shape[-1]
    C = chunk_size
    pad = -T % C
    # c: each token's sequence number; two tokens interact only within one sequence
    c = sequence_numbers(segment_ids, T, B)
    c = jnp.zeros((B, T), jnp.int32) if c is None else c
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in (g, beta))
        c = jnp.pad(c, ((0, 0), (0, pad)), mode="edge")
    N = (T + pad) // C

    def chunks(a):   # [B,T,H,...] -> [N,B,H,C,...]
        a = a.reshape(B, N, C, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    q, k, v = chunks(q), chunks(k), chunks(v)
    per_channel = g.ndim == 4
    g = chunks(g) if per_channel else chunks(g[..., None])[..., 0]
    beta = chunks(beta[..., None])[..., 0]
    c = jnp.moveaxis(c.reshape(B, N, C), 1, 0)[:, :, None, :]           # [N,B,1,C]
    c_prev = jnp.concatenate([c[:1, ..., :1], c[:-1, ..., -1:]], 0)     # before each chunk
    G = jnp.cumsum(g, 3)                                                # [N,B,H,C(,Dk)]
    lower = jnp.tril(jnp.ones((C, C), bool))
    same = (c[..., :, None] == c[..., None, :]) & lower
    kb = k * beta[..., None]
    if per_channel:
        A = _channel_scores(kb, k, G) * (same & ~jnp.eye(C, dtype=bool))
        attn = _channel_scores(q, k, G) * same
    else:
        D = jnp.where(same, jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], 0.0)),
                      0.0)
        A = jnp.einsum("nbhik,nbhjk->nbhij", kb, k) * D * (1 - jnp.eye(C))
        attn = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * D
        G = G[..., None]
    c, c_prev = c[..., None], c_prev[..., None]   # broadcast over the key channels
    # decays from the chunk's start to each token, from each token to the chunk's end, and
    # of the whole chunk (zero across a sequence start)
    from_start = jnp.where(c == c_prev, jnp.exp(G), 0.0)
    to_end = jnp.where(c == c[..., -1:, :], jnp.exp(G[..., -1:, :] - G), 0.0)
    carry = jnp.where(c[..., -1, :] == c_prev[..., 0, :], jnp.exp(G[..., -1, :]), 0.0)
    if not per_channel:
        carry = carry[..., 0]                                           # [N,B,H]

    T_inv = unit_lower_inverse(A)
    u = T_inv @ (v * beta[..., None])
    w = T_inv @ (kb * from_start)
    q_read = q * from_start
    k_write = k * to_end

    S0 = (jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    o, S = (scan or chunk_recurrence)(u, w, attn, q_read, k_write, carry, S0)
    o = jnp.moveaxis(o, 0, 1)                                  # [B,N,H,C,Dv]
    o = jnp.moveaxis(o, 2, 3).reshape(B, N * C, Hv, Dv)[:, :T]
    return o.astype(dtype), S


def chunk_recurrence(u, w, a, q_read, k_write, f, s0):
    """The walk across chunks with ``lax.scan``: per chunk v_new = u - w S,
    o = q_read S + a v_new, S <- f S + k_write^T v_new. u [N,B,H,C,Dv]; w, q_read, k_write
    [N,B,H,C,Dk]; a [N,B,H,C,C]; f [N,B,H] (or [N,B,H,Dk]: a decay per key channel);
    s0 [B,H,Dk,Dv] -> (o [N,B,H,C,Dv], final state)."""
    def step(S, xs):
        u_n, w_n, a_n, qr_n, kw_n, f_n = xs
        v_new = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, S)
        o = jnp.einsum("bhck,bhkv->bhcv", qr_n, S) + jnp.einsum("bhij,bhjv->bhiv", a_n, v_new)
        decay = f_n[..., None, None] if f_n.ndim == 2 else f_n[..., None]
        S = S * decay + jnp.einsum("bhck,bhcv->bhkv", kw_n, v_new)
        return S, o

    S, o = jax.lax.scan(step, s0, (u, w, a, q_read, k_write, f))
    return o, S


def _channel_scores(x, y, G, block: int = 16):
    """[..., C, C]: sum_d x_i[d] y_j[d] exp(G_i[d] - G_j[d]) for i >= j (0 above the diagonal),
    with x, y, G [..., C, Dk] and G non-increasing along C (cumulative log decays). Rows go a
    block at a time: keys before the block are scaled to its first token (exp(G_a - G_j) <= 1)
    and its queries from it (exp(G_i - G_a) <= 1); within the block the pairs are formed one
    by one. No exponent is positive, however strong the decay."""
    C = x.shape[-2]
    rows = []
    for a in range(0, C, block):
        b = min(a + block, C)
        Gi = G[..., a:b, :]
        tri = jnp.tril(jnp.ones((b - a, b - a), bool))[..., None]
        diff = Gi[..., :, None, :] - Gi[..., None, :, :]
        pair = jnp.where(tri, jnp.exp(jnp.where(tri, diff, 0.0)), 0.0)
        parts = [jnp.einsum("...ik,...jk,...ijk->...ij", x[..., a:b, :], y[..., a:b, :], pair)]
        if a:
            ref = G[..., a:a + 1, :]
            xq = x[..., a:b, :] * jnp.exp(Gi - ref)
            yk = y[..., :a, :] * jnp.exp(ref - G[..., :a, :])
            parts.insert(0, jnp.einsum("...ik,...jk->...ij", xq, yk))
        if b < C:
            parts.append(jnp.zeros((*x.shape[:-2], b - a, C - b), x.dtype))
        rows.append(jnp.concatenate(parts, -1))
    return jnp.concatenate(rows, -2)
