"""The training run: build model, data, optimizer and step from the config, then loop.

``train(cfg)`` expects a config resolved with the world size (the device count). Steps are
dispatched ahead; each step's metrics are read one step later, so the host never waits on the
device except to log and check.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import dpo, dpo_reference, models
from jaxtrain.averaging import WeightAveraging
from jaxtrain.checkpoint import Checkpointer, hf_init
from jaxtrain.checks import BuildError, Checks, TrainingError
from jaxtrain.config.errors import ConfigError
from jaxtrain.data.batches import global_batches
from jaxtrain.data.sources import training_data
from jaxtrain.dpo_eval import PreferenceEvaluator
from jaxtrain.evaluation import Evaluator
from jaxtrain.logs import run_dir
from jaxtrain.metrics import Meter, MetricsLog
from jaxtrain.models.moe import moe_pattern, trainable, upcycle
from jaxtrain.observe import (MemoryProfile, MemoryReport, Observers, ProfileWindow,
                              ProgressLog, Stragglers, Timers, check_trackers)
from jaxtrain.observe.health import Health
from jaxtrain.optim.optimizers import (HOST_MEMORY, OptimConfig, build_optimizer,
                                       with_opt_state_memory_kind)
from jaxtrain.optim.schedules import (ScheduleConfig, batch_size_at, ga_ramp_sizes,
                                      make_lr_schedule,
                                      make_weight_decay_schedule, rampup_train_iters)
from jaxtrain.parallel.mesh import MeshConfig, make_mesh
from jaxtrain.parallel.replicas import replica_mismatches
from jaxtrain.parallel.sharding import Layout
from jaxtrain.parallel import pipeline, stages
from jaxtrain.step import (TrainState, abstract_state, create_state, device_memory,
                           make_train_step, memory_movers, state_shardings)
from jaxtrain.train_config import TrainConfig

log = logging.getLogger("jaxtrain.loop")


def total_steps(tcfg, num_samples: int) -> int:
    """Steps of the run: train_iters, train_samples / global batch (with the ramp-up's smaller
    early batches counted), or pgs epochs; MaxText's num_epoch ends it sooner when the data
    runs out first."""
    steps = _planned_steps(tcfg, num_samples)
    if tcfg.data_epochs is not None:
        steps = min(steps, tcfg.data_epochs * num_samples // tcfg.global_batch_size)
    return steps


def _planned_steps(tcfg, num_samples: int) -> int:
    if tcfg.train_iters is not None:
        return tcfg.train_iters
    if tcfg.train_samples is not None:
        if tcfg.rampup:
            return rampup_train_iters(tcfg.train_samples, tcfg.global_batch_size, tcfg.rampup)
        return tcfg.train_samples // tcfg.global_batch_size
    return tcfg.epochs * max(1, num_samples // tcfg.global_batch_size)


def _host_memory_kind(device) -> str | None:
    """Pinned host memory, where the backend offers it (parameter offload)."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memory kinds keeps state on device
        return None
    return HOST_MEMORY if HOST_MEMORY in kinds else None


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


def train(cfg, logger: logging.Logger | None = None, devices=None) -> dict:
    """Run training on ``devices`` (default: all of the job's); returns the last metrics row."""
    logger = logger or log
    tcfg = TrainConfig.from_config(cfg)
    check_trackers(cfg)
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision",
                      MATMUL_PRECISION[cfg["memory.float32_matmul_precision"]])
    if tcfg.manual_gc:
        gc.disable()
    try:
        return _train(cfg, tcfg, logger, list(devices or jax.devices()))
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
        if tcfg.manual_gc:
            gc.enable()


@dataclasses.dataclass
class Setup:
    """Everything a run is made of, built from the config before the first step."""

    data: Any
    model_cfg: Any
    tcfg: TrainConfig
    steps: int
    layout: Layout
    schedule: Any
    optimizer: Any
    abstract: TrainState          # shapes and dtypes of the state
    shardings: TrainState         # where each part of the state lives
    state: TrainState | None      # the initial state, already sharded
    step_fn: Any                  # the jitted train step (state, batch[, frozen])
    frozen: dict | None = None    # parameter trees the step reads but never trains
    averaging: WeightAveraging | None = None   # pgs train.ema / train.base_merge, between steps
    saves_reference: bool = False  # checkpoints keep frozen["ref"] (DPO without a named reference)

    @property
    def rows(self) -> int:
        """Rows B of every [M, B, T] batch: micro batch x data-parallel size."""
        return self.tcfg.micro_batch_size * self.tcfg.data_parallel_size

    def put_batch(self, host: dict) -> dict:
        return self.layout.put_batch(host, self.rows)


def build(cfg, devices=None, tcfg: TrainConfig | None = None, materialize: bool = True
          ) -> Setup:
    """Data, model, mesh, optimizer, the sharded initial state and the jitted step.

    ``materialize=False`` creates no state (``state`` is None): enough to lower and compile the
    step ahead of time from ``abstract`` and ``shardings`` (see benchmarks/aot_memory.py)."""
    tcfg = tcfg or TrainConfig.from_config(cfg)
    devices = list(devices or jax.devices())
    data = training_data(cfg)
    model_cfg = models.ModelConfig.from_config({**cfg, "vocab_size": data.vocab_size})
    steps = total_steps(tcfg, data.num_samples)
    if steps < _planned_steps(tcfg, data.num_samples):
        log.info("num_epoch %d: the training data (%d samples) runs out after %d steps of "
                 "%d sequences; the run ends there", tcfg.data_epochs, data.num_samples, steps,
                 tcfg.global_batch_size)
    mcfg = MeshConfig.from_config(cfg, len(devices))
    layout = Layout(make_mesh(mcfg, devices), mcfg)
    tcfg = dataclasses.replace(tcfg, pipeline=stages.plan(
        cfg, model_cfg.num_layers, tcfg.microbatch_counts()))
    if tcfg.pipeline is not None and jax.process_index() == 0:
        _report_pipeline(tcfg.pipeline, tcfg.num_microbatches, model_cfg, run_dir(cfg))
    sched_cfg = ScheduleConfig.from_config(cfg, total_steps=steps)
    schedule = make_lr_schedule(sched_cfg)
    opt_cfg = OptimConfig.from_config(cfg)
    optimizer = build_optimizer(
        opt_cfg, schedule, trainable(models.logical_axes(model_cfg)),
        wd_schedule=make_weight_decay_schedule(sched_cfg),
        decoupled_lr_schedule=(make_lr_schedule(sched_cfg, decoupled=True)
                               if sched_cfg.has_decoupled_lr else None))
    abstract = abstract_state(model_cfg, optimizer, tcfg)
    shardings = state_shardings(
        layout, model_cfg, abstract,
        params_memory_kind=_host_memory_kind(devices[0]) if mcfg.offload_params else None)
    shardings = dataclasses.replace(shardings, opt_state=with_opt_state_memory_kind(
        shardings.opt_state, opt_cfg, devices[0], abstract.opt_state))
    state = (create_state(jax.random.key(tcfg.seed), model_cfg, optimizer, tcfg, shardings)
             if materialize else None)
    train_step = make_train_step(
        model_cfg, tcfg, optimizer, schedule, memory_movers(shardings.opt_state), layout=layout,
        grad_shardings=layout.grads(models.logical_axes(model_cfg), abstract.params),
        params_memory=memory_movers(shardings.params))
    in_shardings = (shardings, layout.batch())
    if dpo.frozen_key(tcfg):   # pre_rl's frozen base / DPO's reference, a third argument
        in_shardings += ({dpo.frozen_key(tcfg): jax.tree.map(device_memory, shardings.params)},)
    step_fn = jax.jit(train_step, in_shardings=in_shardings,
                      out_shardings=(shardings, layout.replicated()), donate_argnums=0)
    return Setup(data, model_cfg, tcfg, steps, layout, schedule, optimizer, abstract, shardings,
                 state, step_fn)


def _report_pipeline(plan, microbatches: int, model_cfg, directory) -> None:
    """debug_scheduler_table: log the schedule's table; dump_pp_data: write the lowered
    program's ops (rank, tick, stage, microbatch) to pp_schedule.json in the run directory."""
    sched = plan.build(microbatches)
    if plan.print_table:
        log.info("pipeline schedule (%s, %d microbatches):\n%s", plan.schedule, microbatches,
                 sched.table())
    if plan.dump:
        prog = pipeline.lower(sched, model_cfg, stages.bounds(plan.counts))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "pp_schedule.json").write_text(json.dumps(pipeline.events(prog)))


def upcycled_state(run: Setup, ckpt: Checkpointer, logger) -> TrainState:
    """moe_use_upcycling (Megatron): the dense checkpoint at load (else pretrained_checkpoint)
    is read with the dense model's structure (this model without MoE), turned into this MoE
    model's parameters by :func:`jaxtrain.models.moe.upcycle`, and training starts from them
    at iteration 0 with a fresh optimizer state, like a pretrained start. The caller saves the
    converted state as step 0 when there is a save directory (Megatron saves the upcycled model
    before training too); a later run continues from there without the knob."""
    mc = run.model_cfg
    if mc.moe is None or not any(moe_pattern(mc.moe, mc.num_layers)):
        raise ConfigError("moe_use_upcycling turns a dense checkpoint into an MoE model, but "
                          "this model has no MoE layers (num_experts, moe_layer_freq)")
    dense = mc.replace(moe=None)
    root, step = ckpt.upcycle_source()
    abstract = models.abstract(dense)
    shardings = run.layout.params(models.logical_axes(dense), abstract)

    def zeros(a, sharding):   # built shard by shard (no compile): the restore's target
        def shard(index):
            return np.zeros([len(range(*i.indices(n))) for i, n in zip(index, a.shape)],
                            a.dtype)
        return jax.make_array_from_callback(a.shape, sharding, shard)

    template = jax.tree.map(zeros, abstract, shardings)
    reader = Checkpointer(dataclasses.replace(ckpt.ccfg, final_dir=None), dense, ckpt.config,
                          ckpt.dialect, logger)
    try:
        loaded, _ = reader.restore_from(root, step, dataclasses.replace(run.state,
                                                                        params=template),
                                        mode="params")
    finally:
        reader.close()
    on_device = jax.tree.map(device_memory, run.shardings)
    key = jax.random.fold_in(jax.random.key(run.tcfg.seed), 2)

    def convert(dense_params, key):
        params = upcycle(dense_params, mc, key)
        return params, run.optimizer.init(trainable(params))

    try:
        params, opt_state = jax.jit(convert, out_shardings=(
            on_device.params, on_device.opt_state))(loaded.params, key)
    except ValueError as e:
        raise ConfigError(f"moe_use_upcycling: {e}") from None
    state = dataclasses.replace(run.state, params=params, opt_state=opt_state)
    if on_device != run.shardings:
        state = jax.device_put(state, run.shardings)
    logger.info("moe_use_upcycling: %s (step %d) upcycled into %d experts per MoE layer; "
                "training starts at iteration 0 with a fresh optimizer", reader.where(root, step),
                step, mc.moe.num_experts)
    return state


def _train(cfg, tcfg, logger, devices) -> dict:
    directory = run_dir(cfg)
    try:
        run = build(cfg, devices, tcfg)
        ckpt = Checkpointer.from_config(cfg, directory, run.model_cfg, logger)
        evaluator = (PreferenceEvaluator if tcfg.dpo is not None else Evaluator).from_config(
            cfg, run.model_cfg, tcfg=tcfg, put_batch=run.put_batch,
            rows=run.layout.local_rows(run.rows), layout=run.layout,
            params_memory=memory_movers(run.shardings.params), logger=logger)
    except (ConfigError, TrainingError):
        raise
    except Exception as e:  # noqa: BLE001 - reported as a bug, with the cause kept
        raise BuildError(f"{type(e).__name__}: {e}") from e
    state, steps, mcfg = run.state, run.steps, run.layout.mcfg
    restored = None
    run.averaging = WeightAveraging.for_run(run, devices[0], logger)
    if cfg.get("moe_use_upcycling"):
        state = upcycled_state(run, ckpt, logger)
        ckpt.maybe_save(0, state, 0, force=True, extra=_extra(evaluator, ckpt))
    else:
        restored = ckpt.restore(state, items=_side_templates(run, cfg))
        hf_dir = hf_init.model_dir(cfg) if restored is None else None
        if hf_dir is not None:
            state = hf_init.start_from_hf(state, hf_dir, run.model_cfg, run.optimizer,
                                          run.abstract, run.shardings,
                                          jax.tree.map(device_memory, run.shardings))
            logger.info("weights from %s (model.name_or_path)", hf_dir)
    if tcfg.objective.needs_base:   # pgs pre_rl: the starting weights, frozen, for the KL
        on_device = jax.tree.map(device_memory, run.shardings)
        run.frozen = {"base": hf_init.load_params(hf_init.model_dir(cfg), run.model_cfg,
                                                  run.abstract.params, on_device.params)}
    elif tcfg.dpo is not None and tcfg.dpo.precompute_reference:   # scores, then no reference
        dpo_reference.attach(cfg, run.data, evaluator, run.model_cfg, directory,
                             lambda: _dpo_reference(run, cfg, restored, state, ckpt, logger),
                             logger)
    elif tcfg.dpo is not None:   # DPO: the frozen reference policy
        run.frozen = {"ref": _dpo_reference(run, cfg, restored, state, ckpt, logger)}
        evaluator.attach_reference(run.frozen["ref"])
    first, consumed = 1, 0
    if restored is not None:
        state, consumed = restored
        first = int(state.step) + 1
        ckpt.best = ckpt.restored_extra.get("best")   # save_hf's best model so far
        if "eval" in ckpt.restored_extra:
            evaluator.restore(ckpt.restored_extra["eval"])
        else:
            evaluator.skip_to(first - 1)
    if run.averaging is not None:   # the EMA starts from (or resumes with) these weights
        run.averaging.start(state.params, ckpt.restored_items, hf_init.model_dir(cfg),
                            (run.frozen or {}).get("base"))
    watch = _Watch.from_config(cfg, directory, devices, first, restored is not None, logger,
                               steps, Meter(run.model_cfg, run.abstract.params, tcfg.seq_length,
                                            devices))
    watch.progress.job_start(first - 1, consumed * tcfg.seq_length * watch.meter.flops_per_token)
    watch.health = Health.from_config(cfg, run.model_cfg, tcfg, run.layout,
                                      memory_movers(run.shardings.params))
    if tcfg.skip_train:
        row = {"step": first - 1, **evaluator.evaluate_only(state.params, first - 1,
                                                               quant_state=state.quant_state)}
        watch.log.write_eval(row)
        ckpt.close()
        watch.close(first - 1, consumed * tcfg.seq_length)
        return row
    report = _Reporter(Checks(tcfg, logger), watch, tcfg)
    stop = _StopFlag(tcfg.exit_signal_handler)
    logger.info("training %s: %d steps of %d x %d tokens on %d %s device(s) (%s; %s); %.1fM "
                "parameters; metrics in %s", run.data.name, steps, tcfg.global_batch_size,
                tcfg.seq_length, len(devices), devices[0].platform,
                " x ".join(f"{k} {v}" for k, v in mcfg.shape.items() if v > 1) or "one device",
                mcfg.sharding, sum(x.size for x in jax.tree.leaves(run.abstract.params)) / 1e6,
                watch.log.path)
    last = (first - 1, consumed)
    try:
        last = _loop(run, state, first, consumed, ckpt, evaluator, report, stop, logger)
        return report.last_row
    except BaseException as e:
        watch.memory_profile.on_error(e)
        raise
    finally:
        ckpt.close()  # waits for an async save: nothing is left half written
        stop.restore()
        watch.close(last[0], last[1] * tcfg.seq_length)


@dataclasses.dataclass
class _Watch:
    """What watches the run: metrics rows and trackers, profile windows, memory, timers."""

    log: MetricsLog
    observers: Any
    meter: Meter
    window: ProfileWindow
    memory_profile: MemoryProfile
    memory_report: MemoryReport
    timers: Timers
    stragglers: Stragglers
    progress: ProgressLog
    health: Health | None = None  # pgs health/* metrics, set by _train

    @classmethod
    def from_config(cls, cfg, directory, devices, first: int, resumed: bool, logger, steps,
                    meter) -> "_Watch":
        process, main = jax.process_index(), jax.process_index() == 0
        observers = Observers.from_config(cfg, directory, main, resume=resumed)
        return cls(MetricsLog.from_config(cfg, directory, logger, steps, observers=observers,
                                          main=main),
                   observers, meter,
                   ProfileWindow.from_config(cfg, directory, process, first_step=first),
                   MemoryProfile.from_config(cfg, directory, process),
                   MemoryReport.from_config(cfg), Timers.from_config(cfg),
                   Stragglers.from_config(cfg),
                   ProgressLog.from_config(cfg, directory, len(devices), main))

    def close(self, step: int, tokens: int):
        self.window.close()
        self.observers.close()
        self.progress.job_end(step, tokens, tokens * self.meter.flops_per_token)


def _loop(run: Setup, state, first, consumed, ckpt, evaluator, report, stop, logger
          ) -> tuple[int, int]:
    """Steps ``first``..``steps``; validates every eval_interval steps; saves every
    save_interval steps, at exits and at the end. MaxText's target_eval_loss ends the run
    after the evaluation that reaches it (with that step's due checkpoint, and no final
    save or evaluation, as MaxText's StopTraining). Returns (last step, samples consumed)."""
    tcfg, steps, data, watch = run.tcfg, run.steps, run.data, report.watch
    start, pending = time.perf_counter(), None
    sizes = None
    if tcfg.rampup:
        sizes = functools.partial(batch_size_at, global_batch_size=tcfg.global_batch_size,
                                  rampup=tcfg.rampup,
                                  micro_times_dp=tcfg.micro_batch_size * tcfg.data_parallel_size,
                                  decrease_if_needed=tcfg.decrease_batch_size_if_needed)
    elif tcfg.ga_ramp_start:
        sizes = ga_ramp_sizes(tcfg.ga_ramp_start, tcfg.num_microbatches, steps,
                              tcfg.micro_batch_size * tcfg.data_parallel_size)
    batches = global_batches(data, tcfg, seed=tcfg.seed, batch_size=sizes, consumed=consumed,
                             rows=run.layout.local_rows(run.rows))
    it, exiting, reached, first_batch = first - 1, False, False, None
    for it in range(first, steps + 1):
        with watch.timers("batch", level=1):
            batch = first_batch or run.put_batch(next(batches))
        if tcfg.reuse_example_batch:   # MaxText: every step trains on the first batch again
            first_batch = batch
        consumed += batch["tokens"].shape[0] * run.rows
        if it in tcfg.iterations_to_skip:   # Megatron: the batch is read and dropped
            state = dataclasses.replace(state, step=jax.device_put(state.step + 1,
                                                                   run.shardings.step))
            logger.info("iterations_to_skip: step %d's batch read and dropped, no update", it)
            continue
        t0 = time.perf_counter()
        watch.window.step_begin(it)
        state, metrics = run.step_fn(state, batch, *([run.frozen] if run.frozen else []))
        if watch.health is not None and watch.health.due(it):
            metrics = {**metrics, **watch.health.fields(it, state.params, batch,
                                                        quant_state=state.quant_state)}
        if run.averaging is not None:
            run.averaging.after_step(it, state.params, metrics["skipped"])
        watch.window.step_end(it, block_on=metrics)
        phases = watch.timers.take()  # this step's batch time goes into this step's row
        if pending is not None:
            report.finish(*pending)
        pending = (it, metrics, t0, batch["tokens"].size, phases)
        if evaluator.due(it):
            report.finish(*pending)
            pending = None
            row = evaluator.run(state.params, it, quant_state=state.quant_state)
            watch.log.write_eval({"step": it, **row})
            ckpt.track_best(state.params, it, row)
            target = tcfg.target_eval_loss
            reached = bool(target) and row.get("val_loss", float("inf")) <= target
        if run.averaging is not None:   # after the step's evaluation, before its checkpoint
            state = dataclasses.replace(state, params=run.averaging.merge_due(it, state.params))
        with watch.timers("save-checkpoint", level=1):
            saved = ckpt.maybe_save(it, state, consumed, extra=_extra(evaluator, ckpt),
                                    items=_items(run))
        if pending is not None:  # the save belongs to this step's row too
            watch.timers.merge_into(phases)
        if saved:
            tokens = consumed * tcfg.seq_length
            watch.progress.checkpoint(it, tokens, tokens * watch.meter.flops_per_token)
        if tcfg.weight_hash_interval and it % tcfg.weight_hash_interval == 0:
            _check_replicas(state.params, it)
        if tcfg.manual_gc and tcfg.manual_gc_interval and it % tcfg.manual_gc_interval == 0:
            gc.collect()
        elapsed_min = (time.perf_counter() - start) / 60
        if reached:
            logger.info("target_eval_loss %s reached at step %d (evaluation loss %.4f): "
                        "training stops", tcfg.target_eval_loss, it, row["val_loss"])
            break
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
    if reached:
        return it, consumed
    if it >= first and (exiting or ckpt.ccfg.save_last):
        ckpt.maybe_save(it, state, consumed, force=True, extra=_extra(evaluator, ckpt),
                        items=_items(run))
    if not exiting:
        if evaluator.enabled and it >= first:
            row = evaluator.final(state.params, it, quant_state=state.quant_state)
            watch.log.write_eval({"step": it, **row})
            ckpt.track_best(state.params, it, row)
        params, what = state.params, ""
        if run.averaging is not None and ckpt.ccfg.final_dir is not None:
            params, what = run.averaging.final(state.params)   # train.ema: the EMA weights
        ckpt.export_final(params, what)
    return it, consumed


def _extra(evaluator, ckpt) -> dict:
    """What a checkpoint keeps beside the state: the validation sets' positions and the best
    validation result so far (save_hf's best/ model)."""
    return {"eval": evaluator.state(), "best": ckpt.best}


def _items(run) -> dict | None:
    """Trees a checkpoint keeps beside the state: pgs train.ema's shadow, and a DPO reference
    that no Hugging Face directory names (the weights the run started from)."""
    items = dict(run.averaging.items()) if run.averaging is not None else {}
    if run.saves_reference:
        items[dpo.REFERENCE_ITEM] = run.frozen["ref"]
    return items or None


def _side_templates(run, cfg) -> dict | None:
    """Shapes and shardings of the trees :func:`_items` saves, to restore them."""
    items = dict(run.averaging.templates()) if run.averaging is not None else {}
    d = run.tcfg.dpo
    if d is not None and not d.precompute_reference and not dpo.reference_name(cfg):
        on_device = jax.tree.map(device_memory, run.shardings.params)
        items[dpo.REFERENCE_ITEM] = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            run.abstract.params, on_device)
    return items or None


def _dpo_reference(run, cfg, restored, state, ckpt, logger):
    """The frozen DPO reference: the Hugging Face model dpo.reference_model (else
    model.name_or_path) names; without a name (MaxText's use_dpo), the weights this run started
    from, which checkpoints keep (a resumed run reads them back; a run started from a checkpoint
    without them takes that checkpoint's weights)."""
    on_device = jax.tree.map(device_memory, run.shardings.params)
    if dpo.reference_name(cfg):
        ref_dir = dpo.reference_dir(cfg)
        logger.info("DPO reference policy from %s", ref_dir)
        return hf_init.load_params(ref_dir, run.model_cfg, run.abstract.params, on_device)
    precomputed = run.tcfg.dpo.precompute_reference
    run.saves_reference = not precomputed
    kept = ckpt.restored_items.get(dpo.REFERENCE_ITEM)
    if kept is not None:
        logger.info("DPO reference policy: the starting weights kept in the checkpoint")
        return kept
    if restored is not None and int(restored[0].step) > 0 and precomputed:
        return None   # the starting weights are gone; only the cache had their scores
    params = restored[0].params if restored is not None else state.params
    if precomputed:
        return params   # scored before the first step, never trained on meanwhile
    logger.info("DPO reference policy: a frozen copy of the starting weights")
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=on_device)(params)


def _check_replicas(params, step: int):
    """check_weight_hash_across_dp_replicas_interval: every copy of every weight agrees."""
    bad = replica_mismatches(params)
    if bad:
        raise TrainingError(f"step {step}: the copies of {len(bad)} parameter(s) differ across "
                            f"devices ({', '.join(bad[:5])}): replicas drifted apart, which "
                            "points at faulty hardware or a broken collective; check the nodes "
                            "and restart from the last checkpoint")


class _Reporter:
    """Checks each step's metrics (waiting for them) and writes a row every log_interval steps
    (console, metrics.jsonl, trackers) and every tracker interval (trackers only).

    A step's time runs from when the device could start it (its dispatch, or the previous
    step's completion if later) to its completion.
    """

    def __init__(self, checks, watch: _Watch, tcfg):
        self.checks, self.watch, self.tcfg = checks, watch, tcfg
        self.last_done, self.last_row = 0.0, None
        self.recent, self.warm = [], False  # step times in the running average (Primus)

    def finish(self, it: int, metrics: dict, dispatched: float, tokens: int,
               phases: dict | None = None, force: bool = False):
        """Step ``it``'s metrics; ``phases`` are its timers' seconds taken at its dispatch."""
        values = jax.device_get(metrics)
        if self.watch.health is not None:
            values = self.watch.health.finish(it, values)
        done = time.perf_counter()
        step_time, self.last_done = done - max(dispatched, self.last_done), done
        self.checks(it, values)
        w = self.watch
        w.timers.merge(phases or {})
        w.memory_profile.step_end(it)
        w.timers.add("step", step_time, level=0)
        extra = w.memory_report.fields(it)
        console = force or it == 1 or it % self.tcfg.log_interval == 0
        if not console and not w.observers.due(it):
            return
        row = {"step": it, **{k: (v.item() if hasattr(v, "item") else v)
                              for k, v in values.items()},
               "global_batch_size": tokens // self.tcfg.seq_length,
               **w.meter.row(step_time, float(tokens)), **extra, **w.timers.collect()}
        if not console:
            w.observers.write(row)
            return
        row["step_time_avg_s"] = self._average(it, step_time)
        row["tokens_per_s_avg"] = tokens / row["step_time_avg_s"]
        w.stragglers.report(it, step_time)
        w.log.write(row)
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
