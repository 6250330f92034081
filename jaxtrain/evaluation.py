"""Validation and test passes over held-out data, as Megatron's ``evaluate`` runs them.

A validation run evaluates ``eval_iters`` global batches of each validation set with dropout
off and no gradients, continuing from where the previous run stopped (the position is each
set's count of samples read, which a checkpoint stores through :meth:`Evaluator.state`). With
``full_validation`` every run covers the whole split exactly once, in the set's own order; its
last batch is padded with rows whose loss mask is zero, so every batch has the training shape
and the step compiles once. With ``skip_train`` the runs start from the first sample, as
Megatron builds its validation loader at sample 0 then.

The loss of a run is the token-weighted mean over everything it read (the sum of the masked
token losses over the token count, whatever ``calculate_per_token_loss`` says), and the
perplexity is ``exp(min(20, loss))`` as Megatron logs it. With ``multiple_validation_sets``
each set reports ``val/<name>/loss`` and ``val/<name>/ppl``; ``val_loss`` then pools the tokens
of all sets. (Megatron takes several sets only with ``full_validation``; here each set keeps
its own position, so ``eval_iters`` may also give one count per set.) The test pass (:meth:`Evaluator.test`) reads the test split from its start:
``eval_iters`` batches (the largest per-set count when they differ), or all of it with
``full_validation``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import sft
from jaxtrain.data.batches import TokenData, global_batches, longest_row, make_batch, trim
from jaxtrain.data.sources import heldout_test_data, validation_data
from jaxtrain.loss import model_loss
from jaxtrain.train_config import TrainConfig

log = logging.getLogger("jaxtrain.evaluation")

PPL_LOSS_CAP = 20.0


def perplexity(loss: float) -> float:
    """Megatron's logged perplexity: exp of the loss capped at 20."""
    return math.exp(min(PPL_LOSS_CAP, loss))


def make_eval_step(model_cfg, *, loss_chunks: int = 0, half_precision: bool = False,
                   layout=None, params_memory=None):
    """The pure eval step ``(params, batch [M,B,T], quant_state=None) -> (loss sum, token
    count)`` in float32: the training loss (:func:`jaxtrain.loss.model_loss`) forward only,
    dropout off, microbatch by microbatch under ``lax.scan``. ``quant_state`` is the train
    state's quantization state (``TrainState.quant_state``), read as the training forward
    reads it, so FP8 delayed scaling evaluates with the training scales. ``loss_chunks``,
    ``half_precision``, ``layout`` and ``params_memory`` (to_device, to_host) mean what they
    mean for the train step."""
    to_device = params_memory[0] if params_memory else (lambda t: t)

    def micro(params, quant_state, m):
        mask = m["loss_mask"].astype(jnp.float32)
        total, _ = model_loss(params, m, mask, model_cfg, quant_state=quant_state,
                              num_chunks=loss_chunks, half_precision=half_precision)
        return total, jnp.sum(mask)

    def step(params, batch, quant_state=None):
        params = to_device(params)
        with layout.activations() if layout is not None else contextlib.nullcontext():
            def body(carry, m):
                s, c = micro(params, quant_state, m)
                return (carry[0] + s, carry[1] + c), None

            zero = jnp.float32(0.0)
            (total, count), _ = jax.lax.scan(body, (zero, zero), batch)
        return total, count

    return step


@functools.lru_cache(maxsize=8)
def jitted_eval_step(model_cfg, loss_chunks: int = 0, half_precision: bool = False,
                     layout=None, params_memory=None):
    """:func:`make_eval_step` under ``jax.jit``, shared by evaluators of the same model, so a
    rebuilt evaluator does not compile again."""
    return jax.jit(make_eval_step(model_cfg, loss_chunks=loss_chunks,
                                  half_precision=half_precision, layout=layout,
                                  params_memory=params_memory))


@dataclasses.dataclass
class EvalSet:
    """One held-out set: its data, batches per run (None: all of it) and samples read."""

    name: str
    data: TokenData
    iters: int | None
    consumed: int = 0


def _default_put(host: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in host.items()}


class Evaluator:
    """Runs validation every ``eval_interval`` steps and the final validation/test passes.

    ``put_batch`` turns a host batch into device arrays (the loop passes its sharding);
    ``rows`` = (lo, hi) makes each process read only its rows of every microbatch, as the
    training batches do.
    """

    def __init__(self, sets: list[EvalSet], step_fn, tcfg, *, test: EvalSet | None = None,
                 put_batch: Callable[[dict], dict] | None = None,
                 rows: tuple[int, int] | None = None, multiple: bool = False,
                 weights: dict[str, float] | None = None,
                 floors: dict[str, float] | None = None,
                 logger: logging.Logger | None = None):
        self.sets, self.test_set, self.tcfg = sets, test, tcfg
        self.weights, self.floors = weights, floors or {}
        self.step_fn = step_fn
        self.put_batch = put_batch or _default_put
        self.rows, self.multiple = rows, multiple
        self.log = logger or log

    @classmethod
    def from_config(cls, cfg, model_cfg, *, tcfg=None, put_batch=None, rows=None, layout=None,
                    params_memory=None, logger=None) -> Evaluator:
        """The validation set(s) and test split of the config, with a jitted eval step."""
        tcfg = tcfg or TrainConfig.from_config(cfg)
        logger = logger or log
        full = tcfg.full_validation
        counts = tcfg.eval_iters if isinstance(tcfg.eval_iters, tuple) else (tcfg.eval_iters,)
        sets, test, most = [], None, max(counts)
        if full or most > 0:
            valid = validation_data(cfg) or []
            if len(counts) == 1:
                counts = counts * len(valid)
            elif len(counts) != len(valid):
                raise ConfigError(f"eval_iters lists {len(counts)} counts for {len(valid)} "
                                  "validation set(s); give one count per set")
            sets = [EvalSet(d.name, d, None if full else n)
                    for d, n in zip(valid, counts) if full or n > 0]
            test_data = heldout_test_data(cfg)
            if test_data is not None:
                test = EvalSet("test", test_data, None if full else most)
            if not valid and (cfg.is_set("eval_iters") or cfg.is_set("full_validation")):
                logger.warning("eval_iters/full_validation ask for validation, but the data has "
                               "no validation split: no validation runs")
        step = jitted_eval_step(model_cfg, tcfg.loss_chunks, tcfg.half_precision_loss, layout,
                                params_memory)
        eval_rows = _eval_rows(cfg, tcfg, layout)
        eval_batch = _eval_global_batch(cfg, tcfg)
        if eval_batch is not None and eval_rows is None:   # Megatron's eval_global_batch_size
            per = tcfg.micro_batch_size * tcfg.data_parallel_size
            tcfg = dataclasses.replace(tcfg, global_batch_size=eval_batch,
                                       num_microbatches=eval_batch // per, rampup=None)
        if eval_rows is not None:   # MaxText's eval batch: one micro-step of its own size
            tcfg = dataclasses.replace(tcfg, micro_batch_size=eval_rows // tcfg.data_parallel_size,
                                       global_batch_size=eval_rows, num_microbatches=1)
            if layout is not None:
                put_batch = functools.partial(layout.put_batch, rows=eval_rows)
                rows = layout.local_rows(eval_rows)
        sources = sft.eval_sources(cfg) if cfg["data.eval_sources"] else []
        return cls(sets, step, tcfg, test=test, put_batch=put_batch, rows=rows,
                   multiple=tcfg.multiple_validation_sets or bool(sources),
                   weights={s.name: 1.0 if s.weight is None else s.weight for s in sources}
                   or None,
                   floors={s.name: s.regression_floor for s in sources
                           if s.regression_floor is not None}, logger=logger)

    @property
    def enabled(self) -> bool:
        return bool(self.sets)

    def due(self, step: int) -> bool:
        """Whether a validation run follows training step ``step`` (every eval_interval)."""
        interval = self.tcfg.eval_interval
        return self.enabled and bool(interval) and step % interval == 0

    def run(self, params, step: int, quant_state=None) -> dict:
        """One validation run: metrics ``val_loss``, ``val_ppl``, ``val_tokens`` (and per set
        ``val/<name>/...`` with multiple_validation_sets). ``quant_state``: the train state's
        quantization state (``TrainState.quant_state``), so the run uses the training scales."""
        if not self.sets:
            return {}
        collect = self.tcfg.manual_gc and self.tcfg.manual_gc_eval
        if collect:
            gc.collect()
        out, total, count, losses = {}, 0.0, 0.0, {}
        for s in self.sets:
            s_total, s_count = self._pass(s, params, quant_state)
            total, count = total + s_total, count + s_count
            losses[s.name] = s_total / max(s_count, 1.0)
            if self.multiple:
                out.update(_metrics(f"val/{s.name}/", s_total, s_count))
            if losses[s.name] > self.floors.get(s.name, math.inf):
                self.log.warning("validation at step %d: %s loss %.4f is above its "
                                 "regression_floor %.4f", step, s.name, losses[s.name],
                                 self.floors[s.name])
        out = {**_metrics("val_", total, count), **out}
        if self.weights:
            out["val_composite"] = composite(losses, self.weights)
        self.log.info("validation at step %d | %s", step, describe(out))
        if collect:
            gc.collect(generation=0)
        return out

    def test(self, params, step: int, quant_state=None) -> dict:
        """The test pass: ``test_loss``, ``test_ppl``, ``test_tokens`` (empty without a test
        split)."""
        if self.test_set is None:
            return {}
        self.test_set.consumed = 0
        out = _metrics("test_", *self._pass(self.test_set, params, quant_state))
        self.log.info("test at step %d | %s", step, describe(out))
        return out

    def final(self, params, step: int, quant_state=None) -> dict:
        """What Megatron runs once training ends (and all that skip_train runs): a validation
        run, then the test pass."""
        return {**self.run(params, step, quant_state), **self.test(params, step, quant_state)}

    def evaluate_only(self, params, step: int, quant_state=None) -> dict:
        """``skip_train``: no training step, just :meth:`final` on ``params`` (restored or
        initial) from the first sample; a ConfigError when there is nothing to evaluate."""
        if not self.enabled and self.test_set is None:
            raise ConfigError("skip_train: nothing to evaluate: set eval_iters > 0 (or "
                              "full_validation) and give the data a validation or test split")
        return self.final(params, step, quant_state)

    def state(self) -> dict:
        """The validation sets' positions: what a checkpoint stores to resume them."""
        return {"valid_consumed": {s.name: int(s.consumed) for s in self.sets}}

    def restore(self, state: dict | None):
        """Resume each set where ``state`` says (sets it does not name start at 0). Ignored
        with full_validation or skip_train, whose runs always start at the first sample."""
        given = (state or {}).get("valid_consumed", {})
        for s in self.sets:
            s.consumed = 0 if self._from_start(s) else int(given.get(s.name, 0))

    def skip_to(self, step: int):
        """Positions of a run resumed at ``step`` from a checkpoint without evaluator state:
        (step // eval_interval) runs of eval_iters global batches (Megatron's fallback)."""
        interval = self.tcfg.eval_interval
        for s in self.sets:
            runs = step // interval if interval and not self._from_start(s) else 0
            s.consumed = runs * s.iters * self.tcfg.global_batch_size if s.iters else 0

    def _from_start(self, s: EvalSet) -> bool:
        return s.iters is None or self.tcfg.skip_train

    def _pass(self, s: EvalSet, params, quant_state=None) -> tuple[float, float]:
        results = [self.step_fn(params, self.put_batch(host), quant_state)
                   for host in self._batches(s)]
        got = jax.device_get(results)
        total = float(np.sum([r[0] for r in got], dtype=np.float64))
        count = float(np.sum([r[1] for r in got], dtype=np.float64))
        return total, count

    def _batches(self, s: EvalSet) -> Iterator[dict]:
        if s.iters is None:
            yield from self._whole(s.data)
            return
        extra = {"rows": self.rows} if self.rows is not None else {}
        it = global_batches(s.data, self.tcfg, seed=self.tcfg.seed, consumed=s.consumed, **extra)
        try:
            for _ in range(s.iters):
                yield next(it)
        finally:
            it.close()
        s.consumed += s.iters * self.tcfg.global_batch_size

    def _whole(self, data: TokenData) -> Iterator[dict]:
        """Every sample once, in the source's order; the last batch padded with masked rows."""
        per_micro = self.tcfg.micro_batch_size * self.tcfg.data_parallel_size
        gbs = self.tcfg.global_batch_size
        lo, hi = self.rows or (0, per_micro)
        n = data.num_samples
        filler = None
        for start in range(0, n, gbs):
            idx = [start + m + j for m in range(0, gbs, per_micro) for j in range(lo, hi)]
            got = [data.samples[i] for i in idx if i < n]
            if len(got) < len(idx):
                filler = filler if filler is not None else _blank(got[0])
                got += [filler] * (len(idx) - len(got))
            rows = ({k: np.stack([g[k] for g in got]) for k in got[0]}
                    if isinstance(got[0], dict) else np.stack(got))
            batch = make_batch(rows, data, hi - lo)
            real = (np.asarray(idx) < n).reshape(batch["loss_mask"].shape[:2])
            batch["loss_mask"] = batch["loss_mask"] * real[..., None]
            if data.trim:   # every process cuts to the longest row of the whole batch
                whole = [data.samples[i] for i in range(start, min(start + gbs, n))]
                batch = trim(batch, longest_row({k: np.stack([w[k] for w in whole])
                                                 for k in ("segment_ids",)}))
            yield batch


def _eval_rows(cfg, tcfg, layout) -> int | None:
    """Rows of a validation batch under MaxText's eval_per_device_batch_size (x devices), or
    None to evaluate with the training batch (the knob at 0)."""
    per_device = cfg.get("eval_per_device_batch_size") or 0
    if per_device <= 0:
        return None
    devices = layout.mesh.size if layout is not None else jax.device_count()
    rows = per_device * devices
    dp = tcfg.data_parallel_size
    if rows != int(rows) or int(rows) % dp:
        raise ConfigError(f"eval_per_device_batch_size {per_device:g} x {devices} devices = "
                          f"{rows:g} sequences, which the {dp} data-parallel replicas cannot "
                          f"share evenly; use a value that makes it a multiple of {dp}")
    return int(rows)


def _eval_global_batch(cfg, tcfg) -> int | None:
    """Rows of a validation batch under Megatron's eval_global_batch_size; unset, the training
    batch, or under a step_batch_size_schedule micro_batch_size x data-parallel size (what
    Megatron-LM's global_batch_size is then). None: the training batch."""
    rows = 2 if tcfg.dpo is not None else 1
    given = cfg.get("eval_global_batch_size")
    if given:
        return int(given) * rows
    if cfg.get("step_batch_size_schedule"):
        return tcfg.micro_batch_size * tcfg.data_parallel_size
    return None


def _blank(sample):
    """A padding sample shaped like ``sample`` (zero tokens; zero segment ids = padding)."""
    if isinstance(sample, dict):
        return {k: np.zeros_like(v) for k, v in sample.items()}
    return np.zeros_like(sample)


def composite(losses: dict[str, float], weights: dict[str, float]) -> float:
    """pgs eval_sources: the weighted mean of the sources' losses, the number best-model
    tracking minimises."""
    total = sum(weights[n] for n in losses)
    if total <= 0:
        raise ConfigError("data.eval_sources: the weights sum to 0")
    return sum(weights[n] * v for n, v in losses.items()) / total


def _metrics(prefix: str, total: float, count: float) -> dict:
    loss = total / count if count else float("nan")
    ppl = perplexity(loss) if count else float("nan")
    return {f"{prefix}loss": loss, f"{prefix}ppl": ppl, f"{prefix}tokens": int(count)}


def describe(metrics: dict) -> str:
    """A console line: each loss with its perplexity."""
    parts = []
    for key, value in metrics.items():
        if key.endswith("loss"):
            ppl = metrics.get(key[:-4] + "ppl")
            parts.append(f"{key} {value:.6E} (PPL {ppl:.6E})")
    return " | ".join(parts)
