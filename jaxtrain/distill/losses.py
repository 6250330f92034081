"""Distillation losses on the student's completion tokens, as pgs distill defines them.

Rows are the completion tokens of a micro-batch, flattened: [N] targets (the sampled ids),
[N, D] student hidden states. Every loss is ``sum_t w[t] * loss[t]``; the caller puts the
normalisation in ``w`` (1 / tokens, or 1 / (length x sequences) with ``loss.length_norm``), so
micro-batches add up to the batch's loss. Each returns (loss, stats), stats being sums over
tokens, with ``k1 = sum(log q(y) - log p(y))``, the sampled reverse-KL estimate every loss can
report. q is the student, p the teacher.

- ``full_rkl``: exact reverse KL ``sum_v q(v) (log q(v) - log p(v))`` over the shared
  vocabulary; the student's mass outside it is reported as ``residual``.
- ``topk_kl``: :func:`coarse_kl` over the teacher's top-k plus the realised token, each side's
  remaining mass in one tail bucket; ``beta`` weighs reverse against forward KL.
- ``sampled_rkl``: REINFORCE on the per-token reward ``log p(y) - log q(y)`` (stopped), with an
  importance ratio ``q / mu`` to the rollout policy zeroed outside ``[is_low, is_high]``
  (ICE-POP); without ``mu`` the ratio is 1 (plain REINFORCE).
- ``xtok``: the same with one advantage per text chunk, ``l_T(c) - l_S(c)`` (chunk
  log-probabilities summed over each side's tokens), spread evenly over the chunk's tokens
  (``chunk``) or in proportion to each token's log-prob (``proportional``).
- ``rs_kd``: forward KL to R ids drawn from the teacher, importance-weighted
  (``sum_k w_k (log p(v_k) - log q(v_k))``).

The full-distribution losses run the output layer a slice of rows at a time under
``jax.checkpoint`` (:func:`over_rows`): one slice's [rows, V] logits exist at once, for the
student and (``full_rkl``) the teacher. The sampled losses need only ``log q(y)`` [N].
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtrain.models.transformer import logits_head

TAIL_FLOOR = 1e-6   # a tail bucket's least probability: log(0) would make the KL infinite


@dataclasses.dataclass(frozen=True)
class SharedVocab:
    """Student log-probs seen in the teacher's vocabulary: ids below ``size`` are the same token
    in both; ``swap`` ((student id, teacher id), ...) adds a student-only terminator's mass to
    the teacher's terminator."""

    size: int
    swap: tuple[tuple[int, int], ...] = ()

    def project(self, logp_RV):
        out = logp_RV[:, :self.size]
        for src, dst in self.swap:
            out = out.at[:, dst].set(jnp.logaddexp(out[:, dst], logp_RV[:, src]))
        return out


def log1mexp(x):
    """log(1 - exp(x)) for x <= 0, held at or above about log(TAIL_FLOOR)."""
    x = jnp.minimum(x, -TAIL_FLOOR)
    return jnp.where(x > -math.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def coarse_kl(student_lp_RK, teacher_lp_RK, valid_RK, beta: float):
    """``beta KL(q||p) + (1 - beta) KL(p||q)`` [R] over K support tokens and a tail bucket per
    side holding the mass outside its valid entries."""
    low = jnp.finfo(student_lp_RK.dtype).min
    lq = jnp.where(valid_RK, student_lp_RK, low)
    lp = jnp.where(valid_RK, teacher_lp_RK, low)
    lq = jnp.concatenate([lq, log1mexp(jax.nn.logsumexp(lq, -1, keepdims=True))], -1)
    lp = jnp.concatenate([lp, log1mexp(jax.nn.logsumexp(lp, -1, keepdims=True))], -1)
    mask = jnp.concatenate([valid_RK, jnp.ones_like(valid_RK[:, :1])], -1)
    diff = jnp.where(mask, lq - lp, 0.0)
    reverse = jnp.sum(jnp.exp(lq) * diff, -1)
    forward = jnp.sum(jnp.exp(lp) * -diff, -1)
    return beta * reverse + (1.0 - beta) * forward


def _pick(x_RV, ids_R):
    return jnp.take_along_axis(x_RV, ids_R[:, None], axis=1)[:, 0]


# ----------------------------------------------------------- full-distribution losses, per row


def full_rkl_rows(lq_RV, lp_RS, targets_R, vocab: SharedVocab):
    """(kl, k1, residual) [R] from the student's log-softmax [R, V_s] and the teacher's
    log-probs over the shared vocabulary [R, size]; targets in the teacher's vocabulary."""
    lq = vocab.project(lq_RV)
    q = jnp.exp(lq)
    kl = jnp.sum(q * (lq - lp_RS), -1)
    k1 = _pick(lq, targets_R) - _pick(lp_RS, targets_R)
    return kl, k1, 1.0 - jnp.sum(q, -1)


def topk_kl_rows(lq_RV, support_RK, teacher_lp_RK, valid_RK, teacher_token_lp_R, targets_R,
                 vocab: SharedVocab, beta: float):
    """(kl, k1) [R]: :func:`coarse_kl` at the teacher's support ids (shared vocabulary)."""
    lq_all = vocab.project(lq_RV)
    lq = jnp.take_along_axis(lq_all, jnp.maximum(support_RK, 0), axis=1)
    kl = coarse_kl(lq, teacher_lp_RK, valid_RK, beta)
    return kl, _pick(lq_all, targets_R) - teacher_token_lp_R


def rs_kd_rows(lq_RV, sample_ids_RS, sample_w_RS, sample_lp_RS, teacher_token_lp_R, targets_R,
               vocab: SharedVocab):
    """(kl, k1) [R]: the importance-weighted forward KL to the teacher's draws; draws outside
    the shared vocabulary carry no weight."""
    lq = vocab.project(lq_RV)
    valid = sample_ids_RS < vocab.size
    ids = jnp.minimum(sample_ids_RS, vocab.size - 1)
    w = jnp.where(valid, sample_w_RS, 0.0)
    kl = jnp.sum(w * (sample_lp_RS - jnp.take_along_axis(lq, ids, axis=1)), -1)
    return kl, _pick(lq, targets_R) - teacher_token_lp_R


def row_logps(params, h_RD, model_cfg, temperature: float = 1.0):
    """log-softmax [R, V] (float32) of the output layer on hidden-state rows [R, D], the
    logits divided by ``temperature`` (the rollout's: the student as it was sampled)."""
    logits = logits_head(params, h_RD[None], model_cfg)[0].astype(jnp.float32)
    return jax.nn.log_softmax(logits if temperature == 1.0 else logits / temperature, -1)


def slices(tree, num_slices: int):
    """Every [N, ...] leaf of ``tree`` as [num_slices, N / num_slices, ...] (for ``lax.map``)."""
    N = jax.tree.leaves(tree)[0].shape[0]
    if N % num_slices:
        raise ValueError(f"{N} completion rows are not divisible into {num_slices} slices")
    return jax.tree.map(lambda x: x.reshape(num_slices, N // num_slices, *x.shape[1:]), tree)


def over_rows(params, hidden_ND, model_cfg, weights_N, rows: dict,
              fn: Callable[[jax.Array, dict], tuple[jax.Array, dict]], num_slices: int = 1,
              temperature: float = 1.0):
    """``sum_t w[t] loss[t]`` and the stats' sums, ``fn(log_softmax(student logits /
    temperature) [R, V], rows slice) -> (loss [R], {name: [R]})`` run one slice of rows at a
    time (N divisible by ``num_slices``) under ``jax.checkpoint``; ``rows`` holds [N, ...]
    arrays sliced alike."""
    def one(args):
        h_RD, w_R, r = args
        loss_R, stats = fn(row_logps(params, h_RD, model_cfg, temperature), r)
        return jnp.sum(w_R * loss_R), {k: jnp.sum(v) for k, v in stats.items()}

    args = slices((hidden_ND, weights_N, rows), num_slices)
    if num_slices == 1:
        return one(jax.tree.map(lambda x: x[0], args))
    losses, stats = jax.lax.map(jax.checkpoint(one), args)
    return jnp.sum(losses), jax.tree.map(jnp.sum, stats)


# ----------------------------------------------------------------- sampled losses, on log q(y)


def policy_gradient(lq_N, advantage_N, behaviour_N=None, is_low: float = 0.5,
                    is_high: float = 2.0):
    """(loss, kept, |log ratio|) [N]: ``-ratio * advantage`` with ratio ``q / mu`` zeroed
    outside [is_low, is_high]; without ``mu`` the ratio is ``exp(lq - sg(lq))`` = 1."""
    if behaviour_N is None:
        ratio = jnp.exp(lq_N - jax.lax.stop_gradient(lq_N))
        return -ratio * advantage_N, jnp.ones(lq_N.shape, bool), jnp.zeros_like(lq_N)
    log_ratio = lq_N - behaviour_N
    ratio = jnp.exp(log_ratio)
    r = jax.lax.stop_gradient(ratio)
    kept = (r >= is_low) & (r <= is_high)
    return (-(ratio * advantage_N) * kept, kept,
            jnp.abs(jax.lax.stop_gradient(log_ratio)))


def sampled_rkl(lq_N, teacher_token_lp_N, weights_N, behaviour_N=None, is_low: float = 0.5,
                is_high: float = 2.0):
    """REINFORCE on ``log p(y) - log q(y)``; ``lq_N`` = log q(y) of the sampled tokens."""
    advantage = jax.lax.stop_gradient(teacher_token_lp_N - lq_N)
    loss, kept, alr = policy_gradient(lq_N, advantage, behaviour_N, is_low, is_high)
    live = weights_N != 0
    stats = {"kl": -jnp.sum(advantage * live), "k1": -jnp.sum(advantage * live),
             "is_dropped": jnp.sum(~kept & live), "abs_log_ratio": jnp.sum(alr * live)}
    return jnp.sum(weights_N * loss), stats


def xtok(lq_N, chunk_N, teacher_chunk_lp_C, keep_C, weights_N, behaviour_N=None,
         spread: str = "chunk", is_low: float = 0.5, is_high: float = 2.0):
    """Cross-tokenizer REINFORCE with chunk advantages ``A_c = sg[l_T(c) - l_S(c)]``.

    ``chunk_N``: each student token's chunk id (-1: none), ids into ``teacher_chunk_lp_C`` (the
    teacher's log-prob of each chunk's text) and ``keep_C`` (chunks that carry loss)."""
    if spread not in ("chunk", "proportional"):
        raise ValueError(f"loss.xtok_spread {spread!r}: chunk or proportional")
    C = teacher_chunk_lp_C.shape[0]
    keep = jnp.concatenate([keep_C, jnp.zeros((1,), bool)])
    safe = jnp.where(chunk_N >= 0, chunk_N, C)          # off tokens go to a scratch chunk C
    on = keep[safe]
    safe = jnp.where(on, safe, C)
    lq = jax.lax.stop_gradient(lq_N)
    student_chunk = jax.ops.segment_sum(lq, safe, num_segments=C + 1)
    count = jax.ops.segment_sum(jnp.ones_like(lq), safe, num_segments=C + 1)
    teacher_chunk = jnp.concatenate([teacher_chunk_lp_C.astype(lq.dtype), jnp.zeros((1,))])
    advantage = (teacher_chunk - student_chunk)[safe]
    if spread == "proportional":
        sc = student_chunk[safe]
        advantage = advantage * jnp.where(sc < 0, lq / jnp.where(sc < 0, sc, 1.0),
                                          1.0 / count[safe])
    advantage = advantage * on
    loss, kept, alr = policy_gradient(lq_N, advantage, behaviour_N, is_low, is_high)
    present = jax.ops.segment_max(on.astype(jnp.int32), safe, num_segments=C + 1)[:C] > 0
    k1 = jnp.sum(jnp.where(present, (student_chunk - teacher_chunk)[:C], 0.0))
    stats = {"kl": k1, "k1": k1, "is_dropped": jnp.sum(~kept & on),
             "abs_log_ratio": jnp.sum(alr * on), "supervised": jnp.sum(on)}
    return jnp.sum(weights_N * loss * on), stats


# ------------------------------------------------------------------- weights and topk support


def sequence_weights(lengths, length_norm: bool):
    """Each completion token's weight [sum(lengths)], as one batch's loss normalises: 1 / the
    batch's tokens, or with ``loss.length_norm`` 1 / (its sequence's length x the batch's
    sequences) (mean per sequence, then over sequences). Host-side: ``lengths`` concrete."""
    lengths = jnp.asarray(lengths)
    per_seq = (1.0 / (lengths * lengths.shape[0]) if length_norm
               else jnp.full(lengths.shape, 1.0 / jnp.sum(lengths)))
    return jnp.repeat(per_seq, lengths)


def token_weighting(weights_N, mode: str, *, behaviour_N=None, entropy_N=None,
                    sure_alpha: float = 1.0, entropy_keep: float = 0.2, valid_N=None):
    """``loss.token_weighting``'s factors on ``weights_N`` (held fixed): ``sure`` multiplies by
    ``1 + sure_alpha (1 - p)``, p the rollout's probability of the sampled token; ``entropy``
    keeps the ``entropy_keep`` share of the micro-batch's tokens with the highest student
    entropy (ties at the threshold kept) and zeroes the rest; ``none`` leaves them.
    ``valid_N``: the real tokens of a padded micro-batch (the share counts only them)."""
    if mode == "none":
        return weights_N
    if mode == "sure":
        if behaviour_N is None:
            raise ValueError("loss.token_weighting sure needs the rollout's log-probs of the "
                             "sampled tokens")
        return weights_N * (1.0 + sure_alpha * (1.0 - jnp.exp(behaviour_N)))
    if mode == "entropy":
        if valid_N is None:
            valid_N = jnp.ones(entropy_N.shape, bool)
        count = jnp.sum(valid_N)
        keep = jnp.maximum(1, jnp.ceil(entropy_keep * count - 1e-6)).astype(jnp.int32)
        ranked = jnp.sort(jnp.where(valid_N, entropy_N, -jnp.inf))[::-1]
        threshold = ranked[jnp.minimum(keep, count) - 1]
        return weights_N * ((entropy_N >= threshold) & valid_N)
    raise ValueError(f"loss.token_weighting {mode!r}: none, sure or entropy")


def token_entropy(params, hidden_ND, model_cfg, num_slices: int = 1, temperature: float = 1.0):
    """The student's entropy at each row [N] (float32, no gradient), a slice of rows at a
    time."""
    def one(h_RD):
        lp = row_logps(params, h_RD, model_cfg, temperature)
        return -jnp.sum(jnp.exp(lp) * lp, -1)

    out = jax.lax.map(one, slices(hidden_ND, num_slices))
    return jax.lax.stop_gradient(out.reshape(hidden_ND.shape[0]))


def topk_support(topk_ids_NK, topk_lp_NK, teacher_ids_N, token_lp_N, shared: int):
    """topk_kl's support as pgs builds it: the teacher's top-k plus the realised token (valid
    only when not already among them), entries outside the shared vocabulary or with a
    non-finite log-prob invalid. Returns (ids clipped to the vocabulary, log-probs, valid)."""
    in_topk = jnp.any(topk_ids_NK == teacher_ids_N[:, None], 1, keepdims=True)
    support = jnp.concatenate([topk_ids_NK, teacher_ids_N[:, None]], 1)
    lp = jnp.concatenate([topk_lp_NK, token_lp_N[:, None]], 1)
    valid = jnp.concatenate([jnp.isfinite(topk_lp_NK), ~in_topk], 1) & (support < shared)
    return jnp.minimum(support, shared - 1), lp, valid
