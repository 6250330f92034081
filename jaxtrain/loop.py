"""The training run: build model, data, optimizer and step from the config, then loop.

``train(cfg)`` expects a config resolved with the world size (the device count). Steps are
dispatched ahead; each step's metrics are read one step later, so the host never waits on the
device except to log and check.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import models
from jaxtrain.checkpoint import Checkpointer
from jaxtrain.checks import Checks
from jaxtrain.data.batches import global_batches
from jaxtrain.data.sources import training_data
from jaxtrain.logs import run_dir
from jaxtrain.metrics import Meter, MetricsLog
from jaxtrain.optim.optimizers import OptimConfig, build_optimizer, opt_state_memory_kind
from jaxtrain.optim.schedules import (ScheduleConfig, batch_size_at, make_lr_schedule,
                                      make_weight_decay_schedule, rampup_train_iters)
from jaxtrain.step import init_state, make_train_step
from jaxtrain.train_config import TrainConfig

log = logging.getLogger("jaxtrain.loop")


def total_steps(tcfg, num_samples: int) -> int:
    """Steps of the run: train_iters, train_samples / global batch (with the ramp-up's smaller
    early batches counted), or pgs epochs."""
    if tcfg.train_iters is not None:
        return tcfg.train_iters
    if tcfg.train_samples is not None:
        if tcfg.rampup:
            return rampup_train_iters(tcfg.train_samples, tcfg.global_batch_size, tcfg.rampup)
        return tcfg.train_samples // tcfg.global_batch_size
    return tcfg.epochs * max(1, num_samples // tcfg.global_batch_size)


def _opt_state_memory(mesh, opt_cfg):
    """(to_device, to_host) movers when the optimizer state lives in host memory, else None."""
    kind = opt_state_memory_kind(opt_cfg, mesh.devices.flat[0])
    if kind is None:
        return None

    def mover(memory_kind):
        sharding = NamedSharding(mesh, P(), memory_kind=memory_kind)
        return lambda tree: jax.tree.map(lambda x: jax.device_put(x, sharding), tree)

    return mover("device"), mover(kind)


class _StopFlag:
    """SIGTERM sets it (with ``exit_signal_handler``); the loop saves and exits after the
    current step. The handler stays installed until the final save has finished, so a second
    SIGTERM cannot interrupt a checkpoint being written; ``restore()`` puts the previous one back.
    """

    def __init__(self, enabled: bool):
        self.raised = False
        self.previous = signal.signal(signal.SIGTERM, self._handle) if enabled else None

    def _handle(self, signum, frame):
        self.raised = True

    def restore(self):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


# pgs's memory.float32_matmul_precision names (PyTorch's) -> JAX's default matmul precision.
MATMUL_PRECISION = {"highest": "float32", "high": "tensorfloat32", "medium": "bfloat16"}


def train(cfg, logger: logging.Logger | None = None) -> dict:
    """Run training; returns the last metrics row."""
    logger = logger or log
    tcfg = TrainConfig.from_config(cfg)
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision",
                      MATMUL_PRECISION[cfg["memory.float32_matmul_precision"]])
    if tcfg.manual_gc:
        gc.disable()
    try:
        return _train(cfg, tcfg, logger)
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
        if tcfg.manual_gc:
            gc.enable()


def _train(cfg, tcfg, logger) -> dict:
    data = training_data(cfg)
    model_cfg = models.ModelConfig.from_config({**cfg, "vocab_size": data.vocab_size})
    steps = total_steps(tcfg, data.num_samples)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    batch_sharding = NamedSharding(mesh, P(None, "data"))
    key = jax.random.key(tcfg.seed)
    params = models.init(model_cfg, jax.random.fold_in(key, 0),
                         jax.tree.map(lambda _: NamedSharding(mesh, P()),
                                      models.abstract(model_cfg)))
    sched_cfg = ScheduleConfig.from_config(cfg, total_steps=steps)
    schedule = make_lr_schedule(sched_cfg)
    opt_cfg = OptimConfig.from_config(cfg)
    optimizer = build_optimizer(
        opt_cfg, schedule, models.logical_axes(model_cfg),
        wd_schedule=make_weight_decay_schedule(sched_cfg),
        decoupled_lr_schedule=(make_lr_schedule(sched_cfg, decoupled=True)
                               if sched_cfg.has_decoupled_lr else None))
    state = init_state(params, optimizer, tcfg, jax.random.fold_in(key, 1))
    memory = _opt_state_memory(mesh, opt_cfg)
    if memory:
        state = dataclasses.replace(state, opt_state=memory[1](state.opt_state))
    step_fn = jax.jit(make_train_step(model_cfg, tcfg, optimizer, schedule, memory),
                      donate_argnums=0)
    meter = Meter(model_cfg, params, tcfg.seq_length, devices)
    directory = run_dir(cfg)
    ckpt = Checkpointer.from_config(cfg, directory, model_cfg, logger)
    restored = ckpt.restore(state)
    first, consumed = 1, 0
    if restored is not None:
        state, consumed = restored
        first = int(state.step) + 1
    metrics_log = MetricsLog(directory, logger, steps, throughput=cfg["log_throughput"])
    report = _Reporter(Checks(tcfg, logger), meter, metrics_log, tcfg)
    stop = _StopFlag(tcfg.exit_signal_handler)
    logger.info("training %s: %d steps of %d x %d tokens on %d %s device(s); %.1fM parameters; "
                "metrics in %s", data.name, steps, tcfg.global_batch_size, tcfg.seq_length,
                len(devices), devices[0].platform,
                sum(x.size for x in jax.tree.leaves(params)) / 1e6, metrics_log.path)
    try:
        return _loop(state, step_fn, batch_sharding, data, tcfg, steps, first, consumed, ckpt,
                     report, stop, logger)
    finally:
        ckpt.close()  # waits for an async save: nothing is left half written
        stop.restore()


def _loop(state, step_fn, batch_sharding, data, tcfg, steps, first, consumed, ckpt, report,
          stop, logger) -> dict:
    """Steps ``first``..``steps``; saves every save_interval steps, at exits and at the end."""
    start, pending = time.perf_counter(), None
    sizes = None
    if tcfg.rampup:
        sizes = functools.partial(batch_size_at, global_batch_size=tcfg.global_batch_size,
                                  rampup=tcfg.rampup,
                                  micro_times_dp=tcfg.micro_batch_size * tcfg.data_parallel_size,
                                  decrease_if_needed=tcfg.decrease_batch_size_if_needed)
    batches = global_batches(data, tcfg, seed=tcfg.seed, batch_size=sizes, consumed=consumed)
    it, exiting = first - 1, False
    for it in range(first, steps + 1):
        host = next(batches)
        batch = jax.device_put({k: jnp.asarray(v) for k, v in host.items()}, batch_sharding)
        consumed += host["tokens"].shape[0] * host["tokens"].shape[1]
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        if pending is not None:
            report.finish(*pending)
        pending = (it, metrics, t0, host["tokens"].size)
        ckpt.maybe_save(it, state, consumed)
        if tcfg.manual_gc and tcfg.manual_gc_interval and it % tcfg.manual_gc_interval == 0:
            gc.collect()
        elapsed_min = (time.perf_counter() - start) / 60
        if tcfg.exit_interval and it % tcfg.exit_interval == 0:
            logger.info("exit_interval %d reached at step %d", tcfg.exit_interval, it)
            exiting = True
            break
        if tcfg.exit_duration_in_mins and elapsed_min >= tcfg.exit_duration_in_mins:
            logger.info("exit_duration_in_mins %s reached at step %d", tcfg.exit_duration_in_mins,
                        it)
            exiting = True
            break
        if stop.raised:
            logger.info("SIGTERM: stopping after step %d", it)
            exiting = True
            break
    if pending is not None:
        report.finish(*pending, force=True)
    if it >= first and (exiting or ckpt.ccfg.save_last):
        ckpt.maybe_save(it, state, consumed, force=True)
    if not exiting:
        ckpt.export_final(state.params)
    return report.last_row


class _Reporter:
    """Checks each step's metrics (waiting for them) and logs every log_interval steps.

    A step's time runs from when the device could start it (its dispatch, or the previous
    step's completion if later) to its completion.
    """

    def __init__(self, checks, meter, metrics_log, tcfg):
        self.checks, self.meter, self.log, self.tcfg = checks, meter, metrics_log, tcfg
        self.last_done, self.last_row = 0.0, None
        self.recent, self.warm = [], False  # step times in the running average (Primus)

    def finish(self, it: int, metrics: dict, dispatched: float, tokens: int,
               force: bool = False):
        values = jax.device_get(metrics)
        done = time.perf_counter()
        step_time, self.last_done = done - max(dispatched, self.last_done), done
        self.checks(it, values)
        if it % self.tcfg.log_interval and it != 1 and not force:
            return
        row = {"step": it, **{k: (v.item() if hasattr(v, "item") else v)
                              for k, v in values.items()},
               "global_batch_size": tokens // self.tcfg.seq_length,
               **self.meter.row(step_time, float(tokens))}
        row["step_time_avg_s"] = self._average(it, step_time)
        row["tokens_per_s_avg"] = tokens / row["step_time_avg_s"]
        self.log.write(row)
        self.last_row = row

    def _average(self, it: int, step_time: float) -> float:
        """Primus's running average: the first ``log_avg_skip_iterations`` steps (compilation)
        leave it once passed, and it restarts after ``log_avg_reset_interval`` entries."""
        if (not self.warm and it > self.tcfg.log_avg_skip_iterations) or (
                len(self.recent) >= self.tcfg.log_avg_reset_interval):
            self.recent.clear()
            self.warm = self.warm or it > self.tcfg.log_avg_skip_iterations
        self.recent.append(step_time)
        return sum(self.recent) / len(self.recent)
