"""The distillation run (``python -m jaxtrain.train distill.yaml`` on a pgs distill file).

Each step draws ``rollout.batch_prompts`` prompts, samples ``group_size`` completions of each
from the student, has every rollout scored by its source's teacher, and takes one AdamW step on
the distillation loss accumulated over scoring micro-batches. Dev metrics (sampled-completion
reverse KL to the teacher, greedy accuracy on rows with answers, mcqa letter accuracy) run
before training, every ``eval_every`` steps and at the end. Checkpoints every ``save_steps``
hold the parameters, the optimizer, the policy version, the prompt RNG and (Hugging Face
format) the model; ``resume_from: auto`` continues from the newest one exactly.

With ``rollout.max_staleness`` s >= 1 a producer thread builds batch k + s (prompt draws,
chat templates, generation, cutting and re-tokenising completions, padding, the teacher's
scores) from the weights step k trains on, while step k trains: the batch step k trains on
was sampled from weights at most s versions old. Without it each batch is sampled from the
weights it trains.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain import models
from jaxtrain.checkpoint import Checkpointer, hf_init
from jaxtrain.checks import BuildError, TrainingError
from jaxtrain.config.errors import ConfigError
from jaxtrain.distill import scoring
from jaxtrain.distill.plan import plan as make_plan
from jaxtrain.distill.rollout import Sampler, recorded, render
from jaxtrain.distill.sources import McqaSource, TracesSource
from jaxtrain.distill.teachers import HFTeacher, ServerTeacher
from jaxtrain.logs import run_dir
from jaxtrain.metrics import MetricsLog
from jaxtrain.models.moe import merge_trainable, trainable
from jaxtrain.observe import Observers
from jaxtrain.optim.optimizers import OptimConfig, build_optimizer
from jaxtrain.optim.schedules import ScheduleConfig, make_lr_schedule
from jaxtrain.parallel.mesh import MeshConfig, make_mesh
from jaxtrain.parallel.sharding import Layout
from jaxtrain.step import abstract_state, create_state, device_memory, state_shardings
from jaxtrain.train_config import TrainConfig

log = logging.getLogger("jaxtrain.distill")
EVAL_MCQA_TOKENS = 8      # greedy letter answers (pgs)


@dataclasses.dataclass
class Batch:
    """One step's scored rollouts, ready to train on."""

    index: int                       # the step it is for
    version: int                     # the weights it was sampled from
    rng_before: list                 # the prompt RNG's state before it was drawn
    parts: dict                      # teacher -> [(micro-batch arrays, loss inputs, items)]
    samples: int = 0
    tokens: int = 0
    stopped: int = 0
    dropped: int = 0
    times: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)   # per-source metrics (format_ok)


class Distiller:
    """Student, teachers, sources and optimizer of one run."""

    def __init__(self, cfg, devices, logger):
        self.cfg, self.log = cfg, logger
        if jax.process_count() > 1:
            raise ConfigError("a pgs distill run uses the devices of one process (rollouts and "
                              "scoring batches are built on its host); start it as a single "
                              "process, as pgs distill runs")
        self.plan = make_plan(cfg)
        s = self.settings = self.plan.settings
        self.tcfg = TrainConfig.from_config(cfg)
        self.steps = int(cfg["train_iters"])
        self.model_cfg = models.ModelConfig.from_config(cfg)
        mcfg = MeshConfig.from_config(cfg, len(devices))
        self.layout = Layout(make_mesh(mcfg, devices), mcfg)
        self.schedule = make_lr_schedule(ScheduleConfig.from_config(cfg, total_steps=self.steps))
        self.optimizer = build_optimizer(OptimConfig.from_config(cfg), self.schedule,
                                         trainable(models.logical_axes(self.model_cfg)))
        self.abstract = abstract_state(self.model_cfg, self.optimizer, self.tcfg)
        self.shardings = state_shardings(self.layout, self.model_cfg, self.abstract)
        self.sampler = Sampler(self.model_cfg, self.plan.tokenizer, self.plan.stop_ids,
                               s.rollout.micro_seqs, s.chat_template_kwargs)
        for source in self.plan.prompts.sources.values():
            if isinstance(source, TracesSource):   # turns past max_context tokens are not drawn
                source.length = self.sampler.length
        teacher_dtype = cfg.get("dtype") or "bfloat16"
        self.teachers = {
            name: (HFTeacher(tp, self.layout, teacher_dtype, s.loss) if tp.spec.backend == "hf"
                   else ServerTeacher(tp, s.loss))
            for name, tp in self.plan.teachers.items()}
        self.key = jax.random.key(self.tcfg.seed)
        self.grad_fns, self.value_fns = {}, {}
        self._apply = jax.jit(self._update, donate_argnums=(0,))

    # ------------------------------------------------------------------ state

    def initial_state(self):
        return create_state(jax.random.fold_in(self.key, 7), self.model_cfg, self.optimizer,
                            self.tcfg, self.shardings)

    def from_hf(self, state):
        on_device = jax.tree.map(device_memory, self.shardings)
        return hf_init.start_from_hf(state, hf_init.model_dir(self.cfg), self.model_cfg,
                                     self.optimizer, self.abstract, self.shardings, on_device)

    def _update(self, state, grads):
        grad_norm = optax.tree.norm(grads)
        lr = self.schedule(state.opt_step)
        trained = trainable(state.params)
        updates, opt_state = self.optimizer.update(trainable(grads), state.opt_state, trained)
        params = merge_trainable(state.params, optax.apply_updates(trained, updates))
        return dataclasses.replace(state, params=params, opt_state=opt_state,
                                   step=state.step + 1, opt_step=state.opt_step + 1), {
            "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32)}

    # ------------------------------------------------------------------ batches

    def _items(self, rollouts) -> dict:
        """teacher -> prepared items (empty completions left out), and the number dropped."""
        by_teacher, rendered, dropped = {}, {}, 0
        for r in rollouts:
            name = r.prompt.teacher
            tp = self.plan.teachers[name]
            key = (name, id(r.prompt))
            if key not in rendered:
                rendered[key] = render(tp.tokenizer, r.prompt.messages,
                                       self.settings.chat_template_kwargs, r.prompt.tools)
            item = scoring.prepare(r, tp, rendered[key])
            if item is None:
                dropped += 1
                continue
            by_teacher.setdefault(name, []).append(item)
        return by_teacher, dropped

    def _parts(self, by_teacher: dict, weight_of, key) -> dict:
        """teacher -> [(arrays, loss inputs, items)] over micro-batches of score_micro_seqs."""
        S = self.settings.score_micro_seqs
        parts = {}
        for t, name in enumerate(self.plan.teachers):
            items = sorted(by_teacher.get(name, []), key=lambda it: len(it.completion))
            if not items:
                continue
            chunks = [items[i:i + S] for i in range(0, len(items), S)]
            xtok = self.plan.teachers[name].loss == "xtok"
            arrays = [scoring.micro_batch(c, [weight_of(it) for it in c], S, xtok)
                      for c in chunks]
            feats = self.teachers[name].features(arrays, jax.random.fold_in(key, t), chunks)
            parts[name] = list(zip(arrays, feats, chunks))
        return parts

    def produce(self, index: int, params, version: int) -> Batch:
        """Batch ``index``: prompts drawn, rollouts from ``params`` (weights ``version``),
        scored by their teachers."""
        r = self.settings.rollout
        times = {}
        before = self.plan.prompts.state()
        t0 = time.perf_counter()
        prompts = self.plan.prompts.draw(r.batch_prompts)
        key = jax.random.fold_in(self.key, index)
        rollouts = self.sampler.run(params, prompts, jax.random.fold_in(key, 0), r.temperature,
                                    r.group_size)
        times["time/rollout"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        kd = self.settings.loss.trace_kd_weight
        if kd > 0:   # agent_traces: the recorded turns, scored off-policy beside the branches
            rollouts = rollouts + [x for x in (
                recorded(self.plan.tokenizer, p, self.settings.chat_template_kwargs,
                         self.plan.stop_ids) for p in prompts if p.recorded is not None) if x]
        by_teacher, dropped = self._items(rollouts)
        items = [it for v in by_teacher.values() for it in v]
        weight_of = self._weights(items, kd)

        times["time/align"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        parts = self._parts(by_teacher, weight_of, jax.random.fold_in(key, 1))
        times["time/teacher"] = time.perf_counter() - t2
        sampled = [it for it in items if not it.rollout.recorded]
        return Batch(index, version, before, parts, len(sampled),
                     sum(len(it.completion) for it in sampled),
                     sum(r_.stopped for r_ in rollouts if not r_.recorded), dropped, times,
                     self._format_ok(rollouts))

    def _format_ok(self, rollouts) -> dict:
        """mcqa sources: the share of fast rollouts whose first letter is an option's
        (pgs ``format_ok/<source>``)."""
        seen: dict[str, list[bool]] = {}
        for r in rollouts:
            source = self.plan.prompts.sources.get(r.prompt.source)
            if isinstance(source, McqaSource) and not r.prompt.cot and not r.recorded:
                text = self.plan.tokenizer.decode(r.completion, skip_special_tokens=True)
                seen.setdefault(r.prompt.source, []).append(source.format_ok(r.prompt, text))
        return {f"format_ok/{k}": float(np.mean(v)) for k, v in seen.items()}

    def _weights(self, items, kd: float):
        """Each item's token weights: 1 / the batch's sampled tokens (length_norm: 1 / (length
        x sequences)); recorded agent turns share ``kd`` / their tokens."""
        sampled = [it for it in items if not it.rollout.recorded]
        total = sum(len(it.completion) for it in sampled)
        total_kd = sum(len(it.completion) for it in items if it.rollout.recorded)
        length_norm = self.settings.loss.length_norm

        def weight_of(it):
            n = len(it.completion)
            if it.rollout.recorded:
                return [kd / total_kd] * n
            return [1.0 / (n * len(sampled)) if length_norm else 1.0 / total] * n
        return weight_of

    # ------------------------------------------------------------------ scoring

    def _fn(self, name: str, grad: bool):
        cache = self.grad_fns if grad else self.value_fns
        if name not in cache:
            tp, teacher = self.plan.teachers[name], self.teachers[name]
            fn = functools.partial(
                scoring.student_loss, cfg=self.model_cfg, kind=tp.loss, loss=self.settings.loss,
                temperature=self.settings.rollout.temperature,
                vocab=tp.bridge.vocab if tp.bridge is not None else None,
                teacher_cfg=teacher.cfg)
            cache[name] = jax.jit(jax.value_and_grad(fn, has_aux=True) if grad else fn)
        return cache[name]

    def train_step(self, state, batch: Batch):
        """One optimizer step on ``batch``; (state, metrics on the host)."""
        grads = jax.tree.map(jnp.zeros_like, state.params)
        loss, per_teacher = 0.0, {}
        for name, micro in batch.parts.items():
            fn, head = self._fn(name, True), self.teachers[name].head
            sums = {}
            for arrays, feats, _ in micro:
                (value, stats), g = fn(state.params, jax.tree.map(jnp.asarray, arrays), feats,
                                       head)
                grads = _add(grads, g)
                loss = loss + value
                sums = {k: sums.get(k, 0.0) + v for k, v in stats.items()}
            per_teacher[name] = sums
        if not batch.parts:
            return state, None
        state, upd = self._apply(state, grads)
        host = jax.device_get({"loss": loss, "teachers": per_teacher, **upd})
        return state, host

    def evaluate(self, params, step: int) -> dict:
        """Dev metrics of every source (pgs names: dev_kl/<source>, dev_len, dev_kl_full,
        dev_acc)."""
        n, row = self.settings.eval_samples, {}
        key = jax.random.fold_in(jax.random.fold_in(self.key, 10**9), step)
        for s_i, name in enumerate(self.plan.prompts.sources):
            prompts = self.plan.prompts.dev(name, n)
            if not prompts:
                continue
            rollouts = self.sampler.run(params, prompts, jax.random.fold_in(key, s_i),
                                        self.settings.rollout.temperature)
            by_teacher, _ = self._items(rollouts)
            parts = self._parts(by_teacher, lambda it: [1.0] * len(it.completion),
                                jax.random.fold_in(key, 1000 + s_i))
            full = all(self.plan.teachers[t].loss == "full_rkl" for t in parts)
            sums = {"k1": 0.0, "kl": 0.0, "tokens": 0.0}
            for t, micro in parts.items():
                fn = self._fn(t, False)
                for arrays, feats, _ in micro:
                    _, stats = fn(params, jax.tree.map(jnp.asarray, arrays), feats,
                                  self.teachers[t].head)
                    sums = {k: v + stats[k] for k, v in sums.items()}
            k1, kl, tokens = (float(v) for v in jax.device_get(list(sums.values())))
            samples = sum(len(v) for v in by_teacher.values())
            source = self.plan.prompts.sources[name]
            row[f"dev_kl/{name}"] = k1 / tokens if tokens else float("nan")
            row[f"dev_len/{name}"] = tokens / samples if samples else 0.0
            if isinstance(source, TracesSource):
                row[f"dev_stop_rate/{name}"] = float(np.mean([r.stopped for r in rollouts]))
            if full and tokens:
                row[f"dev_kl_full/{name}"] = kl / tokens
            graded = [p for p in prompts if p.answer is not None]
            if graded:
                row[f"dev_acc/{name}"] = self._accuracy(
                    params, graded, key,
                    EVAL_MCQA_TOKENS if isinstance(source, McqaSource) else None)
            if isinstance(source, McqaSource) and source.spec.cot_fraction > 0:
                row[f"dev_acc_cot/{name}"] = self._accuracy(
                    params, source.cot_dev(source.dev[:n], source.spec.teacher), key,
                    source.spec.cot_max_new_tokens)
        return row

    def _accuracy(self, params, prompts, key, budget: int) -> float:
        """Greedy accuracy of graded prompts with ``budget`` new tokens."""
        greedy = self.sampler.run(params, prompts, key, 0.0, max_new_tokens=budget)
        texts = [self.plan.tokenizer.decode(g.completion, skip_special_tokens=True)
                 for g in greedy]
        return float(np.mean([self.plan.prompts.correct(p, t) for p, t in zip(prompts, texts)]))


@functools.partial(jax.jit, donate_argnums=(0,))
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def train(cfg, logger=None, devices=None) -> dict:
    """Run distillation; returns the last metrics row."""
    logger = logger or log
    devices = list(devices or jax.devices())
    try:
        d = Distiller(cfg, devices, logger)
    except (ConfigError, TrainingError):
        raise
    except Exception as e:  # noqa: BLE001 - reported as a bug, with the cause kept
        raise BuildError(f"{type(e).__name__}: {e}") from e
    directory = run_dir(cfg)
    ckpt = Checkpointer.from_config(cfg, directory, d.model_cfg, logger)
    ckpt.ccfg = dataclasses.replace(ckpt.ccfg, hf_steps=ckpt.ccfg.save_dir is not None)
    state = d.initial_state()
    restored = ckpt.restore(state)
    if restored is None:
        state, first = d.from_hf(state), 1
        logger.info("distilling into %s", hf_init.model_dir(cfg))
    else:
        state, first = restored[0], int(restored[0].step) + 1
        extra = ckpt.restored_extra
        d.plan.prompts.restore(extra["prompts_rng"])
        logger.info("resumed at step %d (policy version %d)", first - 1,
                    extra.get("policy_version", first - 1))
    dropped = int(ckpt.restored_extra.get("dropped", 0)) if restored is not None else 0
    main = jax.process_index() == 0
    observers = Observers.from_config(cfg, directory, main, resume=restored is not None)
    metrics = MetricsLog(directory, logger, d.steps, throughput=False, observers=observers,
                         main=main)
    eval_every = cfg.get("eval_interval") or 0
    if eval_every and restored is None:
        _eval(d, state.params, 0, metrics, logger)
    staleness = d.settings.rollout.max_staleness
    pool = concurrent.futures.ThreadPoolExecutor(1) if staleness else None
    pending: dict[int, concurrent.futures.Future] = {}
    start_version = first - 1

    def submit(index: int, params, version: int):
        if index <= d.steps and index not in pending:
            pending[index] = pool.submit(d.produce, index, params, version)

    last, it = None, first - 1
    started = time.perf_counter()
    try:
        if pool is not None:
            for index in range(first, first + staleness):
                submit(index, _copy(state.params), start_version)
        for it in range(first, d.steps + 1):
            t0 = time.perf_counter()
            if pool is None:
                batch = d.produce(it, state.params, it - 1)
            else:
                submit(it + staleness, _copy(state.params), it - 1)
                batch = pending.pop(it).result()
            waited = time.perf_counter() - t0
            t1 = time.perf_counter()
            state, host = d.train_step(state, batch)
            dropped += batch.dropped
            if host is not None:
                row = _row(d, it, batch, host, dropped, waited, time.perf_counter() - t1,
                           time.perf_counter() - t0, started)
                if it % d.tcfg.log_interval == 0 or it in (first, d.steps):
                    metrics.write(row)
                last = row
            if eval_every and it % eval_every == 0 and it < d.steps:
                _eval(d, state.params, it, metrics, logger)
            every = ckpt.ccfg.save_interval
            if every and it % every == 0:
                nxt = pending[it + 1].result() if it + 1 in pending else None
                ckpt.maybe_save(it, state, it, extra={
                    "prompts_rng": nxt.rng_before if nxt is not None else d.plan.prompts.state(),
                    "policy_version": it, "dropped": dropped})
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if it >= first and ckpt.ccfg.save_interval:   # save_steps 0: the final export only
            ckpt.maybe_save(it, state, it, force=True, extra={
                "prompts_rng": d.plan.prompts.state(), "policy_version": it,
                "dropped": dropped})
        if eval_every:
            _eval(d, state.params, d.steps, metrics, logger)
        ckpt.export_final(state.params)
    finally:   # an error leaves no producer running and no save half written
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        ckpt.close()
        observers.close()
    return last or {}


def _row(d: Distiller, it: int, batch: Batch, host: dict, dropped: int, waited: float,
         trained: float, step_time: float, started: float) -> dict:
    teachers = host["teachers"]
    row = {"step": it, "loss": float(host["loss"]), "lr": float(host["lr"]),
           "grad_norm": float(host["grad_norm"]), "staleness": it - 1 - batch.version,
           "dropped_samples": dropped, "completion_len": batch.tokens / max(1, batch.samples),
           "stop_rate": batch.stopped / max(1, batch.samples), "rollout_tokens": batch.tokens,
           "rollout_tok_s": batch.tokens / max(batch.times.get("time/rollout", 0.0), 1e-9),
           "time/wait_batch": waited, "time/train": trained, "step_time_s": step_time,
           "elapsed": time.perf_counter() - started, **batch.times, **batch.sources}
    k1 = tokens = 0.0
    for name, s in teachers.items():
        n = float(s["tokens"])
        k1, tokens = k1 + float(s["k1"]), tokens + n
        row[f"tokens/{name}"] = n
        row[f"kl/{name}"] = float(s["kl"]) / max(n, 1.0)
        row[f"k1/{name}"] = float(s["k1"]) / max(n, 1.0)
        if "residual" in s:
            row[f"residual_mass/{name}"] = float(s["residual"]) / max(n, 1.0)
        if "dense_rows" in s:
            row[f"dense_kl/{name}"] = float(s["dense_kl"]) / max(float(s["dense_rows"]), 1.0)
            row[f"dense_fraction/{name}"] = float(s["dense_rows"]) / max(n, 1.0)
        if "is_dropped" in s:
            row[f"is_dropped/{name}"] = float(s["is_dropped"]) / max(n, 1.0)
            row[f"abs_log_ratio/{name}"] = float(s["abs_log_ratio"]) / max(n, 1.0)
    row["k1"] = k1 / max(tokens, 1.0)
    return row


def _eval(d: Distiller, params, step: int, metrics: MetricsLog, logger) -> dict:
    t0 = time.perf_counter()
    row = d.evaluate(params, step)
    logger.info("eval %d | %s | %.1f s", step, " ".join(f"{k}={v:.4f}" for k, v in row.items()),
                time.perf_counter() - t0)
    metrics.write_eval({"step": step, **row})
    return row
