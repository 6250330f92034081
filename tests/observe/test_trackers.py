"""Trackers: each writes the rows' metrics where its own reader finds them; the switches."""
import json
import logging
import math

import pytest
from observe_helpers import make_row, tb_scalars, wandb_history, wandb_runs

from jaxtrain.config import ConfigError
from jaxtrain.metrics import MetricsLog
from jaxtrain.observe import Observers, enabled_trackers, trackers


def _feed(observers, steps, **extra):
    for step in steps:
        observers.write(make_row(step, **extra))
    observers.close()


def test_tensorboard_scalars_read_back_with_tags_and_steps(cfg, tmp_path):
    c = cfg("disable_tensorboard=false")
    observers = Observers.from_config(c, tmp_path / "run", True)
    log = MetricsLog(tmp_path / "run", logging.getLogger("t"), 3, observers=observers)
    for step in (1, 2, 3):
        log.write(make_row(step))
    observers.close()
    got = tb_scalars(tmp_path / "run" / "tensorboard")
    assert got["loss"] == [(1, 4.0), (2, 2.0), (3, pytest.approx(4 / 3))]
    assert [s for s, _ in got["lr"]] == [1, 2, 3] and got["lr"][1][1] == pytest.approx(2e-3)
    for tag in ("grad_norm", "loss_scale", "global_batch_size", "step_time_s", "tokens_per_s",
                "mfu"):
        assert tag in got, tag
    assert "memory_gib" not in got  # None values and (by default) memory are not written


def test_tensorboard_on_by_directory_and_off_by_default(cfg, tmp_path):
    assert enabled_trackers(cfg()) == {}
    c = cfg(f"tensorboard_dir={tmp_path / 'tb'}")
    assert enabled_trackers(c) == {"tensorboard": (True, "tensorboard_dir")}
    _feed(Observers.from_config(c, tmp_path / "run", True), [1, 2])
    assert [s for s, _ in tb_scalars(tmp_path / "tb")["loss"]] == [1, 2]
    off = cfg(f"tensorboard_dir={tmp_path / 'tb2'}", "disable_tensorboard=true")
    assert not Observers.from_config(off, tmp_path / "run", True)


def test_tensorboard_log_interval(cfg, tmp_path):
    c = cfg("disable_tensorboard=false", "tensorboard_log_interval=2")
    observers = Observers.from_config(c, tmp_path / "run", True)
    assert [observers.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    _feed(observers, range(1, 7))
    assert [s for s, _ in tb_scalars(tmp_path / "run" / "tensorboard")["loss"]] == [2, 4, 6]


def test_tensorboard_queue_size(cfg, tmp_path):
    on_disk = {}
    for queue in (1, 1000):
        logdir = tmp_path / str(queue)
        c = cfg("disable_tensorboard=false", f"tensorboard_dir={logdir}",
                f"tensorboard_queue_size={queue}")
        observers = Observers.from_config(c, tmp_path / "run", True)
        for step in (1, 2, 3):
            observers.write(make_row(step))
        on_disk[queue] = [s for s, _ in tb_scalars(logdir).get("loss", [])]
        observers.close()
        assert [s for s, _ in tb_scalars(logdir)["loss"]] == [1, 2, 3]
    assert on_disk == {1: [1, 2, 3], 1000: []}


@pytest.mark.parametrize("knob, keys", [
    ("log_timers_to_tensorboard", {"step_time_s", "step_time_avg_s", "time/batch"}),
    ("log_batch_size_to_tensorboard", {"global_batch_size"}),
    ("log_learning_rate_to_tensorboard", {"lr"}),
    ("log_loss_scale_to_tensorboard", {"loss_scale"}),
    ("logging.log_grad_norm", {"grad_norm"}),
])
def test_metric_switches_on_by_default(cfg, tmp_path, knob, keys):
    row = make_row(1, **{"time/batch": 0.01})
    on = Observers.from_config(cfg(), tmp_path, True).scalars(row)
    off = Observers.from_config(cfg(f"{knob}=false"), tmp_path, True).scalars(row)
    assert keys <= set(on) and not keys & set(off)
    assert on["loss"] == off["loss"] == 4.0


def test_metric_switches_off_by_default(cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "device_memory_stats",
                        lambda: {"mem_bytes_in_use": 2 ** 30, "mem_peak_bytes_in_use": 2 ** 31})
    row = make_row(1, val_loss=3.0, memory_gib=1.5, **{"val/wiki/loss": 2.0,
                                                      "val/wiki/ppl": math.exp(2.0)})
    default = Observers.from_config(cfg(), tmp_path, True).scalars(row)
    assert not {"val_ppl", "val/wiki/ppl", "world_size", "memory_gib",
                "mem_bytes_in_use"} & set(default)
    assert default["val_loss"] == 3.0 and default["val/wiki/loss"] == 2.0
    on = Observers.from_config(cfg("log_validation_ppl_to_tensorboard=true",
                                   "log_world_size_to_tensorboard=true",
                                   "log_memory_to_tensorboard=true"), tmp_path, True).scalars(row)
    assert on["val_ppl"] == pytest.approx(math.exp(3.0))
    assert on["val/wiki/ppl"] == pytest.approx(math.exp(2.0))
    assert on["world_size"] == 1.0
    assert on["memory_gib"] == 1.5 and on["mem_peak_bytes_in_use"] == 2 ** 31
    capped = Observers.from_config(cfg("log_validation_ppl_to_tensorboard=true"), tmp_path,
                                   True).scalars(make_row(1, val_loss=50.0))
    assert capped["val_ppl"] == pytest.approx(math.exp(20.0))  # Megatron's cap


def test_wandb_offline_run_has_the_metrics(cfg, tmp_path):
    c = cfg("disable_wandb=false", "wandb_project=proj", "wandb_exp_name=first",
            "wandb_entity=team", f"wandb_save_dir={tmp_path / 'wb'}")
    _feed(Observers.from_config(c, tmp_path / "run", True), [1, 2, 3])
    history = wandb_history(tmp_path / "wb")
    assert sorted(history) == [1, 2, 3]
    assert history[2]["loss"] == 2.0 and history[3]["lr"] == pytest.approx(3e-3)
    (run,) = wandb_runs(tmp_path / "wb")
    assert (run.project, run.display_name, run.entity) == ("proj", "first", "team")
    ids = json.loads((tmp_path / "run" / "trackers.json").read_text())
    assert ids["wandb"] == run.run_id


def test_wandb_save_dir_defaults_to_the_run_directory(cfg, tmp_path):
    _feed(Observers.from_config(cfg("wandb_project=p"), tmp_path / "run", True), [1])
    assert sorted(wandb_history(tmp_path / "run" / "wandb")) == [1]


def test_wandb_run_id_continues_on_resume(cfg, tmp_path):
    c = cfg("disable_wandb=false", f"wandb_save_dir={tmp_path / 'wb'}")
    first = Observers.from_config(c, tmp_path / "run", True)
    run_id = first.trackers[0].run_id
    _feed(first, [1, 2])
    _feed(Observers.from_config(c, tmp_path / "run", True, resume=True), [3, 4])
    assert {r.run_id for r in wandb_runs(tmp_path / "wb")} == {run_id}
    fresh = Observers.from_config(c, tmp_path / "run", True)
    assert fresh.trackers[0].run_id != run_id
    fresh.close()


def test_pgs_use_wandb_and_project(cfg, tmp_path, write):
    path = write("pgs.yml", """
        model: {name_or_path: null}
        train: {learning_rate: 1.0e-4}
        logging: {project: pgsproj, run_name: "", use_trackio: false}
        """)
    c = cfg(f"wandb_save_dir={tmp_path / 'wb'}", file=path)
    assert enabled_trackers(c) == {"wandb": (False, "logging.use_wandb")}
    _feed(Observers.from_config(c, tmp_path / "run", True), [1])
    (run,) = wandb_runs(tmp_path / "wb")
    assert run.project == "pgsproj"
    c = cfg("--logging.use_wandb", "false", file=path)
    assert enabled_trackers(c) == {}


def test_mlflow_local_store_has_the_metrics(cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    c = cfg("disable_mlflow=false", "mlflow_experiment_name=exp", "mlflow_run_name=r1",
            "lr=0.01")
    observers = Observers.from_config(c, tmp_path / "run", True)
    run_id = observers.trackers[0].run_id
    _feed(observers, [1, 2, 3])
    client = MlflowClient((tmp_path / "run" / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [
        (1, 4.0), (2, 2.0), (3, pytest.approx(4 / 3))]
    assert run.data.params["lr"] == "0.01"
    resumed = Observers.from_config(c, tmp_path / "run", True, resume=True)
    assert resumed.trackers[0].run_id == run_id
    _feed(resumed, [4])
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4]


def test_trackio_has_the_metrics(cfg, tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    c = cfg("--logging.use_trackio", "true", "--logging.project", "tkproj",
            "--logging.run_name", "tk1", "disable_wandb=true")
    assert enabled_trackers(c) == {"trackio": (True, "logging.use_trackio")}
    _feed(Observers.from_config(c, tmp_path / "run", True), [1, 2])
    _feed(Observers.from_config(c, tmp_path / "run", True, resume=True), [3])
    logs = SQLiteStorage.get_logs("tkproj", "tk1")
    assert [(r["step"], r["loss"]) for r in logs] == [(1, 4.0), (2, 2.0), (3, pytest.approx(4 / 3))]


def test_only_the_main_process_writes(cfg, tmp_path):
    c = cfg("disable_tensorboard=false", "disable_mlflow=false")
    observers = Observers.from_config(c, tmp_path / "run", False)
    assert not observers and not observers.due(1)
    _feed(observers, [1])
    assert not (tmp_path / "run").exists()


class _Broken(trackers.Tracker):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def log(self, step, scalars):
        self.calls += 1
        raise RuntimeError("tracker backend is down")


class _Kept(trackers.Tracker):
    name = "kept"

    def __init__(self):
        self.steps = []

    def log(self, step, scalars):
        self.steps.append(step)


def test_a_broken_tracker_warns_once_and_training_goes_on(caplog):
    broken, kept = _Broken(), _Kept()
    observers = Observers([broken, kept])
    with caplog.at_level(logging.WARNING, "jaxtrain.observe"):
        for step in (1, 2, 3):
            observers.write(make_row(step))
    assert broken.calls == 1 and kept.steps == [1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert warned == [("broken tracker failed at step 1 and is off for the rest of the run: "
                       "RuntimeError: tracker backend is down")]


def test_a_tracker_that_cannot_start_is_skipped(cfg, tmp_path, monkeypatch, caplog):
    def fail(*a, **k):
        raise OSError("no route to the tracking server")

    monkeypatch.setattr(trackers, "MLflow", fail)
    c = cfg("disable_mlflow=false", "disable_tensorboard=false")
    with caplog.at_level(logging.WARNING, "jaxtrain.observe"):
        observers = Observers.from_config(c, tmp_path / "run", True)
    assert [t.name for t in observers.trackers] == ["tensorboard"]
    assert "mlflow tracker could not start" in caplog.text
    observers.close()


def test_missing_package_is_a_config_error_naming_knob_and_package(cfg, monkeypatch, caplog,
                                                                  write):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name: None if name in ("wandb", "trackio") else real(name))
    with pytest.raises(ConfigError) as e:
        trackers.check_trackers(cfg("disable_wandb=false"))
    assert "disable_wandb" in str(e.value) and "pip install wandb" in str(e.value)
    with pytest.raises(ConfigError, match="pip install trackio"):
        trackers.check_trackers(cfg("--logging.use_trackio", "true"))
    # pgs defaults: W&B and trackio
    path = write("pgs.yml", "model: {name_or_path: null}\ntrain: {learning_rate: 1.0e-4}\n")
    with caplog.at_level(logging.WARNING, "jaxtrain.observe"):
        assert trackers.check_trackers(cfg(file=path)) == []
    assert "pip install wandb" in caplog.text and "pip install trackio" in caplog.text
