"""The router: gating, scores, top-k (group-limited, expert bias, sinkhorn), capacity, and the
balancing losses, for one rank's tokens (:func:`route`).

The order is Megatron's TopKRouter (megatron/core/transformer/moe/router.py and moe_utils.py in
Megatron-LM): input jitter (router input only; applied by the block) -> gating in
``router_dtype`` -> forced-uniform random logits (straight-through) -> Primus soft-cap
(differentiable here) -> z-loss -> routing (top-k, group limit, expert bias, sinkhorn) ->
capacity dropping -> aux losses -> expert-load counting -> forced-even round-robin slots
(Primus: the real top-k weights on slots (n·k + j) mod E). Capacity ``position`` keeps each
expert's earliest tokens (Megatron's tie order there is unspecified).

Formulas (T a rank's tokens, E experts, k top-k; the coefficients weigh the losses into
``stats["objective"]``):

- softmax: top-k on the logits then a softmax over the k (``pre_softmax``: softmax over all
  experts, then top-k); sigmoid / sqrtsoftplus: scores in fp32, selection on score + expert
  bias, the unbiased scores as probabilities, renormalised when k > 1; then
  ``topk_scaling_factor``.
- group-limited routing: a group's score is the sum of its top ``topk // group_topk`` scores
  (or ``group_score_topk``); the best ``group_topk`` groups stay, the rest are masked.
- switch (aux) loss: E/(k·T²)·Σ_i P_i·c_i with P_i the summed probabilities and c_i the routed
  counts of expert i, both from unbiased scores over all experts with their own top-k map
  (``aux_softmax_biased``: P from softmax(score + bias), c the routing's own counts);
  ``seq_aux_loss`` per sequence, averaged; ``global_aux_loss`` over all ranks with running
  counts over the global batch.
- z-loss: mean(logsumexp(logits)²), training only.
- capacity: ceil(T·k/E·factor), at most T (MaxText's per-sequence form with
  ``capacity_per_sequence``).
- sinkhorn (training): top-k of sinkhorn(exp(logits)); probabilities are the sigmoid (k = 1) or
  softmax of the raw logits at the chosen experts.

The losses are reported without their coefficients as ``moe_aux_loss``, ``moe_seq_aux_loss``,
``moe_global_aux_loss``, ``moe_z_loss`` (:func:`jaxtrain.models.moe.step.metrics`).

Legend: N tokens, E experts, k top-k, G expert groups, g = E/G experts per group, C capacity,
s sequences.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxtrain.models.moe.comm import LOCAL, Comm
from jaxtrain.models.moe.config import LOSS_METRICS, SINKHORN_MAX_ITERS, SINKHORN_TOL, MoEConfig


def _gate(p, x, m: MoEConfig, cfg):
    dt = jnp.dtype(m.router_dtype) if m.router_dtype else cfg.compute_dtype
    logits_NE = jnp.einsum("nd,de->ne", x.astype(dt), p["w"].astype(dt))
    if "bias" in p:
        logits_NE = logits_NE + p["bias"].astype(dt)
    return logits_NE


def _score(fn: str, logits):
    x_NE = logits.astype(jnp.float32)
    if fn == "softmax":
        return jax.nn.softmax(x_NE, axis=-1)
    if fn == "sigmoid":
        return jax.nn.sigmoid(x_NE)
    return jnp.sqrt(jax.nn.softplus(x_NE))


def group_score_topk(m: MoEConfig) -> int:
    """How many of a group's best scores make its score (Megatron: topk // group_topk)."""
    return m.group_score_topk if m.group_score_topk is not None else m.topk // m.group_topk


def _select(scores, m: MoEConfig):
    """Top-k (values, indices) of scores [N, E], group-limited when num_groups is set: group
    score = sum of its top :func:`group_score_topk` scores; only the best group_topk groups
    stay."""
    if not m.num_groups:
        return jax.lax.top_k(scores, m.topk)
    N, E = scores.shape
    G = m.num_groups
    scores_NGg = scores.reshape(N, G, E // G)
    group_scores_NG = jax.lax.top_k(scores_NGg, group_score_topk(m))[0].sum(-1)
    _, kept = jax.lax.top_k(group_scores_NG, m.group_topk)                 # [N, group_topk]
    keep_NG = jnp.any(jax.nn.one_hot(kept, G, dtype=jnp.bool_), axis=1)
    masked_NE = jnp.where(jnp.repeat(keep_NG, E // G, axis=1), scores, -jnp.inf)
    return jax.lax.top_k(masked_NE, m.topk)


def topk_routing(logits, m: MoEConfig, bias=None, forced=None, score_bias=None):
    """(probs [N, k] float32, experts [N, k]) from router logits [N, E] (Megatron's
    topk_routing_with_score_function). Softmax: top-k on the logits then softmax over the k
    (``pre_softmax``: softmax over all, then top-k). Sigmoid/sqrtsoftplus: scores in fp32,
    selection on score + expert bias, unbiased scores as probs, renormalised when k > 1.
    ``forced`` [N, k]: the experts of hash routing (sigmoid/sqrtsoftplus; -1 rows: selected as
    above), weighed by their scores the same way. ``score_bias`` [E] (``m.score_bias``): a
    learned bias added to the scores, which then both pick and weigh the experts."""
    if m.score_function == "softmax":
        if m.pre_softmax:
            probs_Nk, idx_Nk = _select(_score("softmax", logits), m)
            if forced is not None:   # quantile balancing's experts (every row forced)
                idx_Nk = forced.astype(idx_Nk.dtype)
                probs_Nk = jnp.take_along_axis(_score("softmax", logits), idx_Nk, axis=1)
        else:
            vals_Nk, idx_Nk = _select(logits, m)
            if forced is not None:
                idx_Nk = forced.astype(idx_Nk.dtype)
                vals_Nk = jnp.take_along_axis(logits, idx_Nk, axis=1)
            probs_Nk = jax.nn.softmax(vals_Nk.astype(jnp.float32), axis=-1)
    else:
        scores_NE = _score(m.score_function, logits)
        if score_bias is not None:
            scores_NE = scores_NE + score_bias.astype(jnp.float32)
        if bias is not None:
            _, idx_Nk = _select(scores_NE + jax.lax.stop_gradient(bias.astype(jnp.float32)), m)
            probs_Nk = jnp.take_along_axis(scores_NE, idx_Nk, axis=1)
        else:
            probs_Nk, idx_Nk = _select(scores_NE, m)
        if forced is not None:
            idx_Nk = jnp.where(forced >= 0, forced.astype(idx_Nk.dtype), idx_Nk)
            probs_Nk = jnp.take_along_axis(scores_NE, idx_Nk, axis=1)
        if m.topk > 1:
            probs_Nk = probs_Nk / (probs_Nk.sum(-1, keepdims=True) + 1e-20)
    if m.topk_scaling_factor:
        probs_Nk = probs_Nk * m.topk_scaling_factor
    return probs_Nk.astype(jnp.float32), idx_Nk


def quantile_experts(logits, beta, k: int, update: bool):
    """Megatron's quantile balancing (its qb_dual_update) on one rank's logits [N, E] (float32,
    no gradient): the top k of logits - beta per token and, when ``update``, the column
    quantile [E] that would give every expert N k / E tokens: with alpha_n the (k+1)-th
    largest of row n, the (N k / E + 1)-th largest of logits[:, e] - alpha over the tokens
    (else beta itself)."""
    x = jax.lax.stop_gradient(logits).astype(jnp.float32)
    vals, idx = jax.lax.top_k(x - beta.astype(jnp.float32), k + 1)
    if not update:
        return idx[:, :k], beta.astype(jnp.float32)
    N, E = x.shape
    target = N * k // E
    col = jax.lax.top_k((x - vals[:, k:]).T, target + 1)[0][:, target]
    return idx[:, :k], col


def margin_histogram(logits, bias, m: MoEConfig):
    """Kimi K3's statistic [E, bins] (int32 counts): each token's margins s - tau (sigmoid
    scores s, tau the (k+1)-th largest biased score s + bias) binned uniformly over
    ``m.k3_range``, the ends clamped in (Primus's compute_margin_histogram)."""
    s = jax.nn.sigmoid(jax.lax.stop_gradient(logits).astype(jnp.float32))
    N, E = s.shape
    tau = jax.lax.top_k(s + bias.astype(jnp.float32), min(m.topk + 1, E))[0][:, -1:]
    lo, hi = m.k3_range
    width = (hi - lo) / m.k3_bins
    b = jnp.clip(jnp.floor(((s - tau) - lo) / width), 0, m.k3_bins - 1).astype(jnp.int32)
    flat = (b + jnp.arange(E, dtype=jnp.int32) * m.k3_bins).reshape(-1)
    return jnp.zeros(E * m.k3_bins, jnp.int32).at[flat].add(1).reshape(E, m.k3_bins)


def sinkhorn(cost, tol: float = SINKHORN_TOL, max_iters: int = SINKHORN_MAX_ITERS):
    """Megatron's Sinkhorn on exp(cost) [N, E]: alternate d0 = 1/(N·Σ_e d1·C),
    d1 = 1/(E·Σ_n d0·C) until mean|Δd1| < tol; returns d1·C·d0 (float32, no gradient)."""
    c_NE = jnp.exp(jax.lax.stop_gradient(cost).astype(jnp.float32))
    N, E = c_NE.shape
    eps = 1e-8

    def body(state):
        d0_N, d1_E, _, it = state
        d0_N = (1.0 / N) / (jnp.sum(d1_E[None, :] * c_NE, axis=1) + eps)
        new_E = (1.0 / E) / (jnp.sum(d0_N[:, None] * c_NE, axis=0) + eps)
        return d0_N, new_E, jnp.mean(jnp.abs(new_E - d1_E)), it + 1

    def cond(state):
        return (state[2] > tol) & (state[3] < max_iters)

    d0_N, d1_E, _, _ = jax.lax.while_loop(
        cond, body, (jnp.ones(N, jnp.float32), jnp.ones(E, jnp.float32), jnp.float32(1e9), 0))
    return d1_E[None, :] * c_NE * d0_N[:, None]


def sinkhorn_routing(logits, m: MoEConfig, train: bool):
    """Training: top-k of sinkhorn(logits); probs = sigmoid (k = 1) or softmax of the raw
    logits at those experts. Evaluation: plain top-k of those probs."""
    act_NE = jax.nn.sigmoid(logits.astype(jnp.float32)) if m.topk == 1 else jax.nn.softmax(
        logits.astype(jnp.float32), axis=-1)
    _, idx_Nk = jax.lax.top_k(sinkhorn(logits) if train else act_NE, m.topk)
    return jnp.take_along_axis(act_NE, idx_Nk, axis=1), idx_Nk


def aux_scores(logits, m: MoEConfig):
    """(scores [N, E], 0/1 routing map [N, E]) for the aux losses: unbiased scores over all
    experts (softmax, or sigmoid/sqrtsoftplus sum-normalised over the experts whatever topk,
    as Megatron's compute_routing_scores_for_aux_loss) with their own top-k map."""
    scores_NE = _score(m.score_function, logits)
    if m.score_function != "softmax":
        scores_NE = scores_NE / (scores_NE.sum(-1, keepdims=True) + 1e-20)
    _, idx_Nk = jax.lax.top_k(scores_NE, m.topk)
    return scores_NE, jax.nn.one_hot(idx_Nk, scores_NE.shape[-1], dtype=jnp.float32).sum(1)


def switch_loss(probs_sum, counts, tokens, m: MoEConfig):
    """E/(k·T²)·Σ_i P_i·c_i: P_i summed probs, c_i routed counts of expert i over T tokens."""
    return jnp.sum(probs_sum * counts) * (m.num_experts / (m.topk * tokens * tokens))


def capacity(num_tokens: int, m: MoEConfig) -> int:
    """Megatron's ceil(T·k/E·factor), at most T (nothing is dropped then)."""
    cap = math.ceil(num_tokens * m.topk / m.num_experts * m.capacity_factor)
    return max(1, min(cap, num_tokens))


def sequence_capacity(seq_tokens: int, m: MoEConfig) -> int:
    """MaxText's per-sequence capacity int(max(ceil(T·k/E)·factor, factor)), at most T."""
    cap = int(max(math.ceil(seq_tokens * m.topk / m.num_experts) * m.capacity_factor,
                  m.capacity_factor))
    return max(1, min(cap, seq_tokens))


def capacity_slots(probs, idx, m: MoEConfig, seqs: int = 1):
    """Each expert's kept tokens [E, C] (token ids) and their weights [E, C]: the top-C tokens
    by routing probability (``probs``) or the first C routed tokens (``position``).
    Unrouted tokens can fill spare slots with weight 0 (what pad_to_capacity computes). With
    ``capacity_per_sequence`` each of the ``seqs`` sequences keeps its own capacity."""
    N, k = idx.shape
    if m.capacity_per_sequence and seqs > 1:
        T = N // seqs
        slots_sEC, weights_sEC = jax.vmap(lambda p, i: capacity_slots(p, i, m))(
            probs.reshape(seqs, T, k), idx.reshape(seqs, T, k))
        slots_sEC = slots_sEC + (jnp.arange(seqs) * T)[:, None, None]
        return (slots_sEC.transpose(1, 0, 2).reshape(m.num_experts, -1),
                weights_sEC.transpose(1, 0, 2).reshape(m.num_experts, -1))
    E = m.num_experts
    rows_N1 = jnp.arange(N)[:, None]
    probs_NE = jnp.zeros((N, E), jnp.float32).at[rows_N1, idx].add(probs)
    routed_NE = jnp.zeros((N, E), jnp.bool_).at[rows_N1, idx].set(True)
    if m.drop_policy == "probs":
        key_NE = jnp.where(routed_NE, probs_NE, -1.0)
    else:
        key_NE = jnp.where(routed_NE, (N - jnp.arange(N, dtype=jnp.float32))[:, None], 0.0)
    C = sequence_capacity(N, m) if m.capacity_per_sequence else capacity(N, m)
    _, slots_EC = jax.lax.top_k(key_NE.T, C)
    weights_EC = jnp.take_along_axis(probs_NE.T, slots_EC, axis=1)
    return slots_EC, weights_EC


def route(logits, m: MoEConfig, *, train: bool, bias=None, rand_logits=None,
          prev_aux_counts=None, prev_steps=None, comm: Comm = LOCAL, seqs: int = 1,
          forced=None, hashed=None, score_bias=None, qb_beta=None):
    """Routing for one rank's tokens. logits [N, E] (N = seqs sequences of N/seqs tokens).

    Returns (probs [N, k], experts [N, k], keep [N, k] bool, slots, stats): ``slots`` is
    capacity_slots' (token ids, weights) with a capacity factor, else None; ``stats`` holds
    the raw losses (``lb`` per balancing type, ``z``), the weighted ``objective``, ``counts``
    (tokens kept per expert, all ranks) and ``aux_counts`` (global_aux_loss's map).
    ``forced`` [N, k]: hash routing's experts (-1: the router's); ``hashed`` (a bool scalar,
    the same on every rank): this layer routes by hash, so its balancing losses are 0.
    ``score_bias``: :func:`topk_routing`'s. ``qb_beta`` [E]: quantile balancing's bias (the
    experts are picked over the rank's tokens, gathered from the sequence axes, and ``stats``
    gains ``qb``, the column quantile for the next bias, averaged over ranks).
    """
    N, E = logits.shape
    if rand_logits is not None:   # forced balancing 'uniform': random logits, straight-through
        logits = logits + jax.lax.stop_gradient(rand_logits.astype(logits.dtype) - logits)
    if m.router_softcap:
        logits = m.router_softcap * jnp.tanh(logits / m.router_softcap)
    f32 = jnp.float32
    stats = {"lb": jnp.zeros((len(m.load_balancing),), f32), "z": f32(0.0),
             "objective": f32(0.0)}
    if train and m.z_loss_coeff:
        lse_N = jax.nn.logsumexp(logits.astype(f32), axis=-1)
        z = comm.mean_ranks(comm.sum_seq(jnp.sum(lse_N * lse_N)) / comm.sum_seq(f32(N)))
        stats["z"], stats["objective"] = z, m.z_loss_coeff * z

    if "sinkhorn" in m.load_balancing:
        probs_Nk, idx_Nk = sinkhorn_routing(logits, m, train)
    elif m.quantile_balancing:   # the experts of the whole rank's tokens, then the scores
        full = comm.gather_seq(logits)
        idx_Nk, stats["qb"] = quantile_experts(full, qb_beta, m.topk, train)
        idx_Nk = comm.own_rows(idx_Nk, N)
        stats["qb"] = comm.mean_ranks(comm.mean_seq(stats["qb"]))   # equal on seq ranks
        probs_Nk, idx_Nk = topk_routing(logits, m, forced=idx_Nk)
    else:
        probs_Nk, idx_Nk = topk_routing(logits, m, bias, forced, score_bias)
    keep_Nk = jnp.ones(idx_Nk.shape, jnp.bool_)
    slots = None
    if m.capacity_factor is not None:
        slots = capacity_slots(probs_Nk, idx_Nk, m, seqs)   # ([E, C] token ids, [E, C] weights)
        kept_EN = jnp.zeros((E, N), jnp.bool_).at[jnp.arange(E)[:, None], slots[0]].set(True)
        keep_Nk = kept_EN.T[jnp.arange(N)[:, None], idx_Nk]

    if train and any(t in LOSS_METRICS for t in m.load_balancing):
        if m.aux_softmax_biased:   # MaxText's DeepSeek loss: softmax(score + bias), routed map
            biased_NE = _score(m.score_function, logits)
            if bias is not None:
                biased_NE = biased_NE + jax.lax.stop_gradient(bias.astype(f32))
            scores_NE = jax.nn.softmax(biased_NE, axis=-1)
            routed_NE = jax.nn.one_hot(idx_Nk, E, dtype=f32).sum(1)
        else:
            scores_NE, routed_NE = aux_scores(logits, m)
        lbs = []
        for t, c in zip(m.load_balancing, m.aux_loss_coeff):
            if t == "aux_loss":
                tokens = comm.sum_seq(f32(N))
                loss = comm.mean_ranks(switch_loss(comm.sum_seq(scores_NE.sum(0)),
                                                   comm.sum_seq(routed_NE.sum(0)), tokens, m))
            elif t == "seq_aux_loss":
                per = lambda a: comm.sum_seq(a.reshape(seqs, N // seqs, E).sum(1))  # noqa: E731
                tokens = comm.sum_seq(f32(N // seqs))
                losses_s = jax.vmap(lambda p, n: switch_loss(p, n, tokens, m))(
                    per(scores_NE), per(routed_NE))
                loss = comm.mean_ranks(jnp.mean(losses_s))
            elif t == "global_aux_loss":
                counts_E = comm.sum_all(routed_NE.sum(0))
                stats["aux_counts"] = counts_E
                prev_E = (prev_aux_counts if prev_aux_counts is not None
                          else jnp.zeros_like(counts_E))
                steps = prev_steps if prev_steps is not None else 0
                mean_counts_E = (prev_E + counts_E) / (steps + 1.0)
                loss = switch_loss(comm.sum_all(scores_NE.sum(0)), mean_counts_E,
                                   comm.sum_all(f32(N)), m)
            else:
                loss = f32(0.0)
            if hashed is not None:   # hash routing's fixed experts: nothing to balance
                loss = jnp.where(hashed, 0.0, loss)
            lbs.append(loss)
            stats["objective"] = stats["objective"] + c * loss
        stats["lb"] = jnp.stack(lbs).astype(f32)
    if "global_aux_loss" in m.load_balancing and "aux_counts" not in stats:
        stats["aux_counts"] = jnp.zeros((E,), f32)

    if m.bias_rule == "quantile":   # pooled over ranks here, over microbatches by the step
        stats["k3_hist"] = comm.sum_all(margin_histogram(logits, bias, m))
    onehot_NkE = jax.nn.one_hot(idx_Nk, E, dtype=f32) * keep_Nk[..., None]
    stats["counts"] = comm.sum_all(onehot_NkE.sum((0, 1)))
    if m.force_balancing == "even":  # Primus: round-robin slots carry the real top-k weights
        idx_Nk = ((jnp.arange(N)[:, None] * m.topk + jnp.arange(m.topk)[None]) % E
                  ).astype(idx_Nk.dtype)
        slots = None
    return probs_Nk, idx_Nk, keep_Nk, slots, stats
