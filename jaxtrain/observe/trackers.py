"""Experiment trackers fed by the metrics rows: TensorBoard, Weights & Biases, MLflow, trackio.

Every tracker takes ``(step, {name: number})`` and the row's keys are the metric names, so the
four show the same curves under the same names. :class:`Observers` picks the trackers from the
config, filters each row the way Megatron's ``log_*_to_tensorboard`` switches do (they apply to
every writer, as in Megatron), and keeps training alive when a tracker breaks: the first error
is logged once and that tracker is dropped. Only the main process writes.

Run ids are kept in ``trackers.json`` in the run directory; a resumed run reuses them, so the
curves continue in the same W&B / MLflow / trackio run.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import pathlib
import time

import jax

from jaxtrain.config.errors import ConfigError
from jaxtrain.observe.memory import device_memory_stats

log = logging.getLogger("jaxtrain.observe")
RUN_IDS = "trackers.json"
DEFAULT_PROJECT = "jaxtrain"
PPL_CAP = 20.0  # Megatron caps the loss at 20 before exponentiating it into a perplexity

# Row keys each log_*_to_tensorboard switch governs (prefixes end with "/" or "_").
TIMER_KEYS = ("step_time_s", "step_time_avg_s", "time/")
MEMORY_KEYS = ("memory_gib", "mem_")
LR_KEYS = ("lr", "decoupled_lr")
EVAL_KEYS = ("val_", "val/", "test_")  # the evaluator's rows; their *ppl keys follow the switch


class Tracker:
    """One experiment tracker: ``log`` a step's scalars, ``close`` at the end."""

    name = ""
    run_id: str | None = None

    def log(self, step: int, scalars: dict[str, float]):
        raise NotImplementedError

    def close(self):
        """Flush and end the run."""


class TensorBoard(Tracker):
    """Scalar event files (written with ``tensorboardX``'s record writer). As in TensorFlow's
    writer, events are held until ``queue_size`` are pending or ``flush_s`` seconds have
    passed, then written and flushed to disk together."""

    name = "tensorboard"

    def __init__(self, logdir: pathlib.Path, queue_size: int, flush_s: float = 120.0):
        from tensorboardX.event_file_writer import EventsWriter

        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.queue_size, self.flush_s = max(1, queue_size), flush_s
        self.events = EventsWriter(str(self.logdir / "events"))
        self.pending, self.flushed_at = [], time.monotonic()

    def log(self, step, scalars):
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        now = time.time()
        self.pending += [Event(wall_time=now, step=step, summary=Summary(
            value=[Summary.Value(tag=key, simple_value=value)])) for key, value in scalars.items()]
        if (len(self.pending) >= self.queue_size
                or time.monotonic() - self.flushed_at >= self.flush_s):
            self.flush()

    def flush(self):
        for event in self.pending:
            self.events.write_event(event)
        self.events.flush()
        self.pending, self.flushed_at = [], time.monotonic()

    def close(self):
        self.flush()
        self.events.close()


class WandB(Tracker):
    """A Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk under ``save_dir``)."""

    name = "wandb"

    def __init__(self, project: str, entity: str | None, run_name: str | None,
                 save_dir: pathlib.Path, run_id: str | None, config: dict):
        import wandb

        save_dir = pathlib.Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, entity=entity, name=run_name, dir=str(save_dir),
                              id=run_id, resume="allow" if run_id else None, config=config,
                              reinit="create_new", settings=wandb.Settings(console="off"))
        self.run_id = self.run.id

    def log(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


class MLflow(Tracker):
    """An MLflow run through ``MlflowClient``; without ``MLFLOW_TRACKING_URI`` the store is a
    local file store in the run directory."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None,
                 run_id: str | None, params: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self.client.create_experiment(experiment))
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self.client.log_batch(run_id, params=[Param(k, str(v)[:6000])
                                                  for k, v in sorted(params.items())])
        self.run_id = run_id

    def log(self, step, scalars):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in scalars.items()])

    def close(self):
        self.client.set_terminated(self.run_id)


class Trackio(Tracker):
    """A trackio run (a local SQLite database under ``TRACKIO_DIR``); the run name is its id."""

    name = "trackio"

    def __init__(self, project: str, run_name: str | None, run_id: str | None, config: dict):
        import trackio

        self.run = trackio.init(project=project, name=run_id or run_name,
                                resume="allow" if run_id else "never", config=config,
                                auto_log_cpu=False, auto_log_gpu=False)
        self.run_id = self.run.name

    def log(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


# tracker -> (pip package, importable module)
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow-skinny", "mlflow"), "trackio": ("trackio", "trackio")}


def enabled_trackers(cfg) -> dict[str, tuple[bool, str]]:
    """Tracker name -> (explicitly asked for, the knob that asked), for the trackers on.

    TensorBoard: ``disable_tensorboard: false``, or (Megatron) a ``tensorboard_dir``. W&B:
    ``disable_wandb: false``, ``logging.use_wandb`` (on by default in pgs files), or (Megatron)
    a ``wandb_project``; an explicit ``disable_wandb: true`` wins. MLflow: ``disable_mlflow:
    false``. trackio: ``logging.use_trackio`` (on by default in pgs-train files).
    """
    on = {}
    if cfg.is_set("disable_tensorboard"):
        if not cfg["disable_tensorboard"]:
            on["tensorboard"] = (True, "disable_tensorboard")
    elif cfg["tensorboard_dir"]:
        on["tensorboard"] = (True, "tensorboard_dir")
    if cfg.is_set("disable_wandb"):
        if not cfg["disable_wandb"]:
            on["wandb"] = (True, "disable_wandb")
    elif cfg.is_set("logging.use_wandb") or cfg["logging.use_wandb"]:
        if cfg["logging.use_wandb"]:
            on["wandb"] = (cfg.is_set("logging.use_wandb"), "logging.use_wandb")
    elif cfg.is_set("wandb_project") and cfg["wandb_project"]:
        on["wandb"] = (True, "wandb_project")
    if not cfg["disable_mlflow"]:
        on["mlflow"] = (True, "disable_mlflow")
    if cfg["logging.use_trackio"]:
        on["trackio"] = (cfg.is_set("logging.use_trackio"), "logging.use_trackio")
    return on


def check_trackers(cfg) -> list[str]:
    """Raise ConfigError when a tracker asked for in the config has no package installed;
    return the names of the trackers that will run. A tracker that is on only by a pgs default
    is skipped with a warning instead."""
    problems, ready = [], []
    for name, (explicit, knob) in enabled_trackers(cfg).items():
        package, module = PACKAGES[name]
        if importlib.util.find_spec(module) is not None:
            ready.append(name)
        elif explicit:
            problems.append(f"{knob} = {cfg[knob]!r} turns on {name}, but its package is not "
                            f"installed: pip install {package} (or pip install "
                            f"'jaxtrain[trackers]')")
        else:
            log.warning("%s is on by default in pgs configs but %s is not installed; metrics go "
                        "to metrics.jsonl only (pip install %s, or set %s: false)",
                        knob, name, package, knob)
    if problems:
        raise ConfigError(problems)
    return ready


def _jsonable(cfg) -> dict:
    out = {}
    for key, value in cfg.items():
        try:
            json.dumps(value)
        except TypeError:
            value = str(value)
        out[key] = value
    return out


class Observers:
    """Fans metrics rows out to the configured trackers, every ``tensorboard_log_interval``
    steps, with Megatron's per-metric switches applied."""

    def __init__(self, trackers=(), interval: int = 1, include: dict | None = None,
                 world_size: int | None = None, run_ids_path: pathlib.Path | None = None):
        self.trackers = list(trackers)
        self.interval = max(1, interval)
        self.include = {"timers": True, "batch_size": True, "learning_rate": True,
                        "validation_ppl": False, "memory": False, "world_size": False,
                        "loss_scale": True, "grad_norm": True, **(include or {})}
        self.world_size = world_size
        self.run_ids_path = run_ids_path
        self._save_run_ids()

    @classmethod
    def from_config(cls, cfg, run_dir, is_main_process: bool, resume: bool = False
                    ) -> Observers:
        """The trackers the config turns on (none off the main process). ``resume`` reuses the
        run ids stored in the run directory, so a resumed run continues its curves."""
        names = check_trackers(cfg)
        include = {"timers": cfg["log_timers_to_tensorboard"],
                   "batch_size": cfg["log_batch_size_to_tensorboard"],
                   "learning_rate": cfg["log_learning_rate_to_tensorboard"],
                   "validation_ppl": cfg["log_validation_ppl_to_tensorboard"],
                   "memory": cfg["log_memory_to_tensorboard"],
                   "world_size": cfg["log_world_size_to_tensorboard"],
                   "loss_scale": cfg["log_loss_scale_to_tensorboard"],
                   "grad_norm": cfg["logging.log_grad_norm"]}
        interval = cfg["tensorboard_log_interval"]
        if not is_main_process or not names:
            return cls([], interval, include, jax.device_count())
        run_dir = pathlib.Path(run_dir)
        ids_path = run_dir / RUN_IDS
        ids = json.loads(ids_path.read_text()) if resume and ids_path.exists() else {}
        trackers = []
        for name in names:
            try:
                trackers.append(_build(name, cfg, run_dir, ids.get(name)))
            except Exception as e:  # noqa: BLE001 - a tracker failing to start never stops training
                log.warning("%s tracker could not start and is off for this run: %s: %s",
                            name, type(e).__name__, e)
        return cls(trackers, interval, include, jax.device_count(), ids_path)

    def __bool__(self):
        return bool(self.trackers)

    def due(self, step: int) -> bool:
        """Whether a row for ``step`` would be written (the loop may build one just for this)."""
        return bool(self.trackers) and step % self.interval == 0

    def scalars(self, row: dict) -> dict[str, float]:
        """The numbers of ``row`` that the per-metric switches let through, plus the added
        world size, validation perplexity (``exp(min(20, val_loss))`` when the row has none)
        and device memory statistics."""
        inc = self.include
        out = {}
        for key, value in row.items():
            if key == "step" or value is None or isinstance(value, (str, dict, list)):
                continue
            if ((key.startswith(TIMER_KEYS) and not inc["timers"])
                    or (key == "global_batch_size" and not inc["batch_size"])
                    or (key in LR_KEYS and not inc["learning_rate"])
                    or (key.startswith(MEMORY_KEYS) and not inc["memory"])
                    or (key == "loss_scale" and not inc["loss_scale"])
                    or (key == "grad_norm" and not inc["grad_norm"])
                    or (key.startswith(EVAL_KEYS) and key.endswith("ppl")
                        and not inc["validation_ppl"])):
                continue
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                continue
        if inc["validation_ppl"] and "val_loss" in out and "val_ppl" not in out:
            out["val_ppl"] = math.exp(min(PPL_CAP, out["val_loss"]))
        if inc["world_size"] and self.world_size:
            out["world_size"] = float(self.world_size)
        if inc["memory"] and not any(k.startswith("mem_") for k in out):
            out.update({k: float(v) for k, v in device_memory_stats().items()})
        return out

    def write(self, row: dict):
        """Send the row to every tracker if its step is due; a failing tracker is dropped."""
        if not self.due(row["step"]):
            return
        scalars = self.scalars(row)
        for tracker in list(self.trackers):
            try:
                tracker.log(int(row["step"]), scalars)
            except Exception as e:  # noqa: BLE001 - a broken tracker never stops training
                log.warning("%s tracker failed at step %s and is off for the rest of the run: "
                            "%s: %s", tracker.name, row["step"], type(e).__name__, e)
                self.trackers.remove(tracker)
                self._close_quietly(tracker)

    def close(self):
        for tracker in self.trackers:
            self._close_quietly(tracker)
        self.trackers = []

    def _close_quietly(self, tracker):
        try:
            tracker.close()
        except Exception as e:  # noqa: BLE001
            log.warning("%s tracker failed to close: %s: %s", tracker.name, type(e).__name__, e)

    def _save_run_ids(self):
        ids = {t.name: t.run_id for t in self.trackers if t.run_id}
        if self.run_ids_path is not None and ids:
            self.run_ids_path.parent.mkdir(parents=True, exist_ok=True)
            self.run_ids_path.write_text(json.dumps(ids, indent=1) + "\n")


def _build(name: str, cfg, run_dir: pathlib.Path, run_id: str | None) -> Tracker:
    project = cfg["wandb_project"] or DEFAULT_PROJECT
    run_name = cfg["wandb_exp_name"]
    if name == "tensorboard":
        return TensorBoard(pathlib.Path(cfg["tensorboard_dir"] or run_dir / "tensorboard"),
                           cfg["tensorboard_queue_size"])
    if name == "wandb":
        return WandB(project, cfg["wandb_entity"], run_name,
                     pathlib.Path(cfg["wandb_save_dir"] or run_dir / "wandb"), run_id,
                     _jsonable(cfg))
    if name == "mlflow":
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store only behind this opt-in; the local store needs it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        return MLflow(uri, cfg["mlflow_experiment_name"] or DEFAULT_PROJECT,
                      cfg["mlflow_run_name"] or run_name or run_dir.name, run_id,
                      {k: cfg[k] for k in cfg if cfg.is_set(k)})
    return Trackio(project, run_name, run_id, _jsonable(cfg))
