"""Validation of a DPO run (``dpo.enabled`` with ``data.eval_dataset``): pgs's preference metrics
on a fixed set of held-out pairs.

The set is the eval file's first ``data.eval_samples`` usable pairs, each run covers all of it
in the same order. A jitted step gives each row's score ``s = sum_t a[t] log pi(y_t)`` (the
scored-token mask ``a``, LD-DPO-weighted as in training) and its length ``sum_t a[t]``; the
reference's scores come from the same step on the frozen reference parameters once, at the
first run, and are kept on the host (the reference never changes), so later runs run the
policy only (when a run reads ``eval_iters`` batches onwards instead of the whole set, the
reference runs on each window). With ``dpo.precompute_reference`` the rows carry their
reference scores (:mod:`jaxtrain.dpo_reference`) and the reference never runs here. Per pair, with the training formulas (:func:`jaxtrain.dpo.pair_losses`):

- ``val_loss``: the mean preference loss (what ``save_best`` tracks);
- ``val/rewards/chosen``, ``val/rewards/rejected``: mean ``beta (s - ref)`` of each side;
- ``val/rewards/margins``, ``val/rewards/accuracies``: their mean difference, and the share of
  pairs whose chosen reward is the larger; ``val/logps/chosen``, ``val/logps/rejected``;
- ``val_pairs``: the number of pairs.
"""
from __future__ import annotations

import contextlib
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import dpo
from jaxtrain.evaluation import EvalSet, Evaluator
from jaxtrain.models.transformer import hidden_states


def make_score_step(model_cfg, ld_alpha: float, *, loss_chunks: int = 0,
                    half_precision: bool = False, layout=None, params_memory=None):
    """``(params, batch [M,B,T], quant_state=None) -> (scores, lengths, ref_scores)``, each
    [M,B] float32 and replicated, so every process reads the whole batch's numbers;
    ``ref_scores`` are the batch's precomputed reference scores (zeros without them)."""
    to_device = params_memory[0] if params_memory else (lambda t: t)

    def micro(params, quant_state, m):
        hidden_BTD = hidden_states(params, m["tokens"], model_cfg, quant_state=quant_state,
                                   positions=m.get("positions"),
                                   segment_ids=m.get("segment_ids"))
        logp_BT = dpo.token_logps(params, hidden_BTD, m["targets"], model_cfg, loss_chunks,
                                  half_precision)
        a_BT = dpo.score_weights(m["loss_mask"] > 0, ld_alpha)
        refs = (m["ref_scores"][:, 0] if "ref_scores" in m
                else jnp.zeros(a_BT.shape[:1], jnp.float32))
        return jnp.sum(logp_BT * a_BT, axis=1), jnp.sum(a_BT, axis=1), refs

    def step(params, batch, quant_state=None):
        params = to_device(params)
        with layout.activations() if layout is not None else contextlib.nullcontext():
            out = jax.lax.map(lambda m: micro(params, quant_state, m), batch)
        if layout is not None:
            out = tuple(jax.lax.with_sharding_constraint(x, layout.replicated()) for x in out)
        return out

    return step


@functools.lru_cache(maxsize=4)
def jitted_score_step(model_cfg, ld_alpha: float, loss_chunks: int = 0,
                      half_precision: bool = False, layout=None, params_memory=None):
    return jax.jit(make_score_step(model_cfg, ld_alpha, loss_chunks=loss_chunks,
                                   half_precision=half_precision, layout=layout,
                                   params_memory=params_memory))


class PreferenceEvaluator(Evaluator):
    """:class:`jaxtrain.evaluation.Evaluator` for DPO: the same sets and schedule, pgs's
    preference metrics instead of the cross-entropy. :meth:`attach_reference` gives it the
    frozen reference parameters before the first run."""

    reference = None
    _ref_scores: dict

    @classmethod
    def from_config(cls, cfg, model_cfg, *, tcfg=None, layout=None, params_memory=None,
                    **kw) -> PreferenceEvaluator:
        ev = super().from_config(cfg, model_cfg, tcfg=tcfg, layout=layout,
                                 params_memory=params_memory, **kw)
        d = ev.tcfg.dpo
        ev.step_fn = jitted_score_step(model_cfg, d.ld_alpha, ev.tcfg.loss_chunks,
                                       ev.tcfg.half_precision_loss, layout, params_memory)
        ev.dpo, ev._ref_scores = d, {}
        return ev

    def attach_reference(self, ref_params):
        self.reference = ref_params

    def run(self, params, step: int, quant_state=None) -> dict:
        if not self.sets:
            return {}
        collect = self.tcfg.manual_gc and self.tcfg.manual_gc_eval
        if collect:
            gc.collect()
        out = {}
        for s in self.sets:
            prefix = f"val/{s.name}/" if self.multiple else "val/"
            metrics = self._metrics(s, params, quant_state)
            out.update({("val_" + k if k in ("loss", "pairs") and not self.multiple
                         else prefix + k): v for k, v in metrics.items()})
        self.log.info("validation at step %d | %s", step,
                      " | ".join(f"{k} {v:.4f}" for k, v in out.items()
                                 if isinstance(v, float)))
        if collect:
            gc.collect(generation=0)
        return out

    def test(self, params, step: int, quant_state=None) -> dict:
        """Preference data has no test split (pgs and MaxText evaluate held-out pairs only)."""
        return {}

    def _scores(self, s, params, quant_state) -> tuple[np.ndarray, ...]:
        """(scores, lengths, precomputed reference scores) of the rows a run of ``s`` reads,
        in order, each [rows] float64."""
        got = [self.step_fn(params, self.put_batch(host), quant_state)
               for host in self._batches(s)]
        return tuple(np.concatenate([np.asarray(g[i], np.float64).reshape(-1) for g in got])
                     for i in range(3))

    def score_all(self, data, params) -> np.ndarray:
        """Every row's score under ``params``, in the data's order, [N] (the reference scores
        :mod:`jaxtrain.dpo_reference` precomputes)."""
        return self._scores(EvalSet("score", data, None), params, None)[0][:data.num_samples]

    def _metrics(self, s, params, quant_state) -> dict:
        if self.dpo.precompute_reference:
            pol, lengths, ref = self._scores(s, params, quant_state)
            return self._summary(pol, ref, lengths)
        ref = self._ref_scores.get(s.name)
        if ref is None:   # a fixed set keeps its reference scores; a moving window recomputes
            if self.reference is None:
                raise ValueError("DPO validation needs the frozen reference (attach_reference)")
            start = s.consumed
            ref = self._scores(s, self.reference, quant_state)[0]
            s.consumed = start
            if s.iters is None:
                self._ref_scores[s.name] = ref
        pol, lengths, _ = self._scores(s, params, quant_state)
        return self._summary(pol, ref, lengths)

    def _summary(self, pol, ref, lengths) -> dict:
        real = (lengths[0::2] > 0).repeat(2)      # filler rows of the last batch score nothing
        pol, ref, lengths = pol[real], ref[real], lengths[real]
        d = self.dpo
        losses = np.asarray(dpo.pair_losses(jnp.asarray(pol), jnp.asarray(ref),
                                            jnp.asarray(lengths), d), np.float64)
        rewards = d.beta * (pol - ref)
        rc, rr = rewards[0::2], rewards[1::2]
        return {"loss": float(losses.mean()), "rewards/chosen": float(rc.mean()),
                "rewards/rejected": float(rr.mean()), "rewards/margins": float((rc - rr).mean()),
                "rewards/accuracies": float((rc > rr).mean()),
                "logps/chosen": float(pol[0::2].mean()), "logps/rejected": float(pol[1::2].mean()),
                "pairs": int(rc.size)}
