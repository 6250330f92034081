"""Scoring micro-batches: rollouts as padded arrays, a teacher's features, the student's loss.

A micro-batch holds up to ``train.score_micro_seqs`` rollouts of one teacher. The student reads
``prompt + completion[:-1]`` (right-padded) and is scored at the rows predicting the completion
(gathered into [N] rows, N a power of two: one compile per bucket); the teacher reads its own
render of the prompt plus the completion in its tokens. Token weights carry the batch's
normalisation (1 / the batch's completion tokens over every teacher, or with ``length_norm``
1 / (length x sequences)), so micro-batch gradients add up to the batch's.

:func:`features` is what the teacher contributes (its hidden rows for ``full_rkl``, whose
output layer then runs slice by slice inside the student's loss; otherwise its log-probs of
the tokens, top-k or draws, and for ``xtok`` each chunk's log-prob). :func:`student_loss` is
(loss, sums of stats) for one micro-batch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.distill import losses as L
from jaxtrain.distill import teacher as T
from jaxtrain.distill.align import Chunks
from jaxtrain.distill.rollout import Rollout, bucket
from jaxtrain.models.transformer import hidden_states

SLICE_ROWS = 256          # output-layer rows at once in the full-distribution losses


@dataclasses.dataclass
class Item:
    """A rollout prepared for its teacher."""

    rollout: Rollout
    completion: list[int]              # the student's ids, cut for this teacher
    behaviour: list[float]             # rollout log-probs of those ids
    teacher_prompt: list[int]
    teacher_completion: list[int]      # the completion in the teacher's ids
    chunks: Chunks | None = None       # xtok


def prepare(rollout: Rollout, teacher, teacher_prompt: list[int]) -> Item | None:
    """``rollout`` cut and mapped for ``teacher`` (a TeacherPlan); None when nothing is left."""
    completion = teacher.clean(rollout.completion)
    if not completion:
        return None
    behaviour = rollout.logprobs[:len(completion)]
    if teacher.bridge is not None:
        return Item(rollout, completion, behaviour, teacher_prompt,
                    teacher.bridge.to_teacher(completion))
    ids, chunks = teacher.chunks.view(completion)
    return Item(rollout, completion, behaviour, teacher_prompt, ids, chunks)


def pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _pack(seqs: list[list[int]], starts: list[int], counts: list[int], S: int):
    """tokens [S, T] (right-padded) and the flat rows predicting each sequence's ``counts``
    tokens after ``starts`` (row ``i * T + start - 1 + j``)."""
    T_ = bucket(max(len(s) for s in seqs))
    tokens = np.zeros((S, T_), np.int32)
    rows = []
    for i, (s, start, n) in enumerate(zip(seqs, starts, counts)):
        tokens[i, :len(s)] = s
        rows += [i * T_ + start - 1 + j for j in range(n)]
    return tokens, rows


def _padded(values, n: int, fill=0, dtype=np.int32):
    out = np.full((n,), fill, dtype)
    out[:len(values)] = values
    return out


def micro_batch(items: list[Item], weights: list[list[float]], S: int, xtok: bool) -> dict:
    """The arrays of one micro-batch (host numpy); ``weights`` per item per token."""
    seqs = [it.rollout.ids + it.completion[:-1] for it in items]
    tokens, rows = _pack(seqs, [len(it.rollout.ids) for it in items],
                         [len(it.completion) for it in items], S)
    t_seqs = [it.teacher_prompt + it.teacher_completion[:-1] for it in items]
    t_tokens, t_rows = _pack(t_seqs, [len(it.teacher_prompt) for it in items],
                             [len(it.teacher_completion) for it in items], S)
    N = pow2(len(rows))
    flat = lambda f: [x for it in items for x in f(it)]   # noqa: E731
    out = {"tokens": tokens, "rows": _padded(rows, N),
           "targets": _padded(flat(lambda it: it.completion), N),
           "weights": _padded([w for ws in weights for w in ws], N, 0.0, np.float32),
           "behaviour": _padded(flat(lambda it: it.behaviour), N, 0.0, np.float32),
           "valid": _padded([True] * len(rows), N, False, bool),
           "t_tokens": t_tokens}
    if not xtok:
        out["t_rows"] = _padded(t_rows, N)
        out["t_targets"] = _padded(flat(lambda it: it.teacher_completion), N)
        return out
    N_t = pow2(len(t_rows))
    chunk, t_chunk, keep, base = [], [], [], 0
    dense = np.full((N,), -1, np.int32)    # one-to-one chunks: the teacher row of a student row
    s_off = t_off = 0
    for it in items:
        c = it.chunks
        chunk += [base + x if x >= 0 else -1 for x in c.student]
        t_chunk += [base + x if x >= 0 else -1 for x in c.teacher]
        keep += c.keep
        base += len(c.keep)
        for i, j in c.one_to_one:
            dense[s_off + i] = t_off + j
        s_off, t_off = s_off + len(it.completion), t_off + len(it.teacher_completion)
    C = pow2(base)
    out.update(t_rows=_padded(t_rows, N_t),
               t_targets=_padded(flat(lambda it: it.teacher_completion), N_t),
               chunk=_padded(chunk, N, -1), t_chunk=_padded(t_chunk, N_t, -1),
               keep=_padded(keep, C, False, bool), dense=dense)
    return out


def _slices(n: int) -> int:
    return max(1, n // SLICE_ROWS)


def _rows_of(h, rows):
    return h.reshape(-1, h.shape[-1])[rows]


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "top_k", "rounds", "temperature",
                                              "shared"))
def features(params, batch: dict, key, *, cfg, kind: str, top_k: int = 0, rounds: int = 0,
             temperature: float = 1.0, shared: int = 0, to_student=None) -> dict:
    """What a JAX teacher gives ``kind``'s loss for a micro-batch (no gradient); xtok with
    ``to_student`` (the teacher -> student id map) adds the dense term's top-k."""
    h = _rows_of(hidden_states(params, batch["t_tokens"], cfg), batch["t_rows"])
    if kind == "full_rkl":
        return {"t_h": h}
    dense = kind == "xtok" and to_student is not None
    got = T.score(params, h, batch["t_targets"], cfg,
                  top_k=top_k if kind == "topk_kl" or dense else 0,
                  rounds=rounds if kind == "rs_kd" else 0, temperature=temperature, key=key,
                  num_slices=_slices(h.shape[0]))
    return finish(got, batch, kind, shared, to_student)


def finish(got: dict, batch: dict, kind: str, shared: int, to_student=None) -> dict:
    """Teacher scores -> the loss's inputs: topk_kl's support, xtok's chunk log-probs (and with
    ``to_student`` the dense term's teacher top-k at one-to-one chunks, in student ids)."""
    if kind == "topk_kl":
        ids, lp, valid = L.topk_support(got["topk_ids"], got["topk_lp"], batch["t_targets"],
                                        got["token_lp"], shared)
        return {"token_lp": got["token_lp"], "support": ids, "support_lp": lp,
                "support_valid": valid}
    if kind == "xtok":
        C = batch["keep"].shape[0]
        seg = jnp.where(batch["t_chunk"] >= 0, batch["t_chunk"], C)
        out = {"chunk_lp": jax.ops.segment_sum(got["token_lp"], seg, num_segments=C + 1)[:C]}
        if to_student is not None:
            at = jnp.maximum(batch["dense"], 0)
            ids = jnp.asarray(to_student)[got["topk_ids"][at]]          # [N, K] student ids
            out.update(dense_ids=jnp.maximum(ids, 0), dense_lp=got["topk_lp"][at],
                       dense_valid=(ids >= 0) & jnp.isfinite(got["topk_lp"][at])
                       & (batch["dense"] >= 0)[:, None])
        return out
    return got


def target_logps(params, h_ND, targets_N, cfg, temperature: float):
    """log q(y) [N] of the sampled tokens, a slice of rows at a time (under remat)."""
    def one(args):
        h, t = args
        return jnp.take_along_axis(L.row_logps(params, h, cfg, temperature), t[:, None], 1)[:, 0]

    n = h_ND.shape[0]
    return jax.lax.map(jax.checkpoint(one), L.slices((h_ND, targets_N), _slices(n))).reshape(n)


def student_loss(params, batch: dict, feats: dict, head, *, cfg, kind: str, loss,
                 temperature: float, vocab: L.SharedVocab | None = None, teacher_cfg=None):
    """(``sum_t w_t loss_t``, stats summed over the micro-batch's real tokens)."""
    h = _rows_of(hidden_states(params, batch["tokens"], cfg), batch["rows"])
    n, valid = h.shape[0], batch["valid"]
    w = batch["weights"]
    if loss.token_weighting != "none":
        entropy = (L.token_entropy(params, h, cfg, _slices(n), temperature)
                   if loss.token_weighting == "entropy" else None)
        w = L.token_weighting(w, loss.token_weighting, behaviour_N=batch["behaviour"],
                              entropy_N=entropy, sure_alpha=loss.sure_alpha,
                              entropy_keep=loss.entropy_keep, valid_N=valid)
    w = jax.lax.stop_gradient(w)
    if kind in ("full_rkl", "topk_kl", "rs_kd"):
        rows = {"valid": valid, "t_targets": batch["t_targets"], **feats}

        def fn(lq, r):
            if kind == "full_rkl":
                lp = L.row_logps(head, r["t_h"], teacher_cfg)[:, :vocab.size]
                kl, k1, residual = L.full_rkl_rows(lq, lp, r["t_targets"], vocab)
                stats = {"kl": kl, "k1": k1, "residual": residual}
            elif kind == "topk_kl":
                kl, k1 = L.topk_kl_rows(lq, r["support"], r["support_lp"], r["support_valid"],
                                        r["token_lp"], r["t_targets"], vocab, loss.beta)
                stats = {"kl": kl, "k1": k1}
            else:
                kl, k1 = L.rs_kd_rows(lq, r["sample_ids"], r["sample_weights"], r["sample_lp"],
                                      r["token_lp"], r["t_targets"], vocab)
                stats = {"kl": kl, "k1": k1}
            return kl, {k: jnp.where(r["valid"], v, 0.0) for k, v in stats.items()}

        value, stats = L.over_rows(params, h, cfg, w, rows, fn, _slices(n), temperature)
    else:
        lq = target_logps(params, h, batch["targets"], cfg, temperature)
        if kind == "sampled_rkl":
            value, stats = L.sampled_rkl(lq, feats["token_lp"], w, batch["behaviour"],
                                         loss.is_low, loss.is_high)
            k1 = jnp.sum(jnp.where(valid, jax.lax.stop_gradient(lq) - feats["token_lp"], 0.0))
            stats = {**stats, "kl": k1, "k1": k1}
        else:
            value, stats = L.xtok(lq, batch["chunk"], feats["chunk_lp"], batch["keep"], w,
                                  batch["behaviour"], loss.xtok_spread, loss.is_low,
                                  loss.is_high)
            if "dense_ids" in feats:
                dense, dense_stats = _dense(params, h, cfg, w, feats, loss, temperature)
                value = value + loss.xtok_dense_weight * dense
                stats = {**stats, **dense_stats}
    return value, {**stats, "tokens": jnp.sum(valid).astype(jnp.float32)}


def _dense(params, h, cfg, w, feats, loss, temperature):
    """xtok's dense term: at chunks of one token on each side, the top-k KL between the
    student and the teacher's top-k (mapped to student ids; a tail bucket holds the rest)."""
    on = jnp.any(feats["dense_valid"], -1)
    rows = {k: feats[k] for k in ("dense_ids", "dense_lp", "dense_valid")}

    def fn(lq, r):
        lq_k = jnp.take_along_axis(lq, r["dense_ids"], 1)
        kl = L.coarse_kl(lq_k, r["dense_lp"], r["dense_valid"], loss.beta)
        live = jnp.any(r["dense_valid"], -1)
        return jnp.where(live, kl, 0.0), {"dense_kl": jnp.where(live, kl, 0.0)}

    value, stats = L.over_rows(params, h, cfg, w * on, rows, fn, _slices(h.shape[0]),
                               temperature)
    return value, {**stats, "dense_rows": jnp.sum(on).astype(jnp.float32)}
