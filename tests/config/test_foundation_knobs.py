"""The knobs this foundation honours: log sinks, run directory, hardware, framework."""
import os

import pytest

from tests.conftest import run_module
from jaxtrain.config import load_config
from jaxtrain.logs import LOG_FILE, run_dir

# A config the dry run accepts (it is checked for the smallest job, one device) that the run
# refuses once the backend is up with its two CPU devices: the batch does not split over them.
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
NOT_DIVISIBLE = "global_batch_size (2) must be divisible"


def _run(tmp_path, *overrides, env=None):
    """The real CLI, training mode, writing its run directory under tmp_path."""
    return run_module("jaxtrain.train", tmp_path / "run.yml", f"workspace={tmp_path}",
                      "exp_name=exp", *overrides, env={**TWO_DEVICES, **(env or {})})


@pytest.fixture
def config_file(tmp_path):
    (tmp_path / "run.yml").write_text("hardware: cpu\nmock_data: true\nvocab_size: 64\n"
                                      "micro_batch_size: 2\nglobal_batch_size: 2\n")
    return tmp_path


def test_run_directory_follows_primus_fields(tmp_path):
    cfg = load_config(None, [f"workspace={tmp_path}", "work_group=team", "user_name=me",
                             "exp_name=e1"])
    assert run_dir(cfg) == tmp_path / "team" / "me" / "e1"
    assert run_dir(load_config(None)) == type(tmp_path)("output")


@pytest.mark.parametrize("level, shown", [("INFO", True), ("WARNING", False)])
def test_stderr_sink_level(config_file, level, shown):
    result = _run(config_file, f"stderr_sink_level={level}")
    assert result.returncode == 2 and NOT_DIVISIBLE in result.stderr
    assert ("JAX backend cpu" in result.stderr) is shown


@pytest.mark.parametrize("level, written", [("DEBUG", True), ("ERROR", False)])
def test_file_sink_level(config_file, level, written):
    _run(config_file, f"file_sink_level={level}")
    text = (config_file / "exp" / LOG_FILE).read_text()
    assert ("JAX backend cpu" in text) is written


def test_sink_level_gates_every_sink(config_file):
    result = _run(config_file, "sink_level=WARNING", "file_sink_level=DEBUG")
    text = (config_file / "exp" / LOG_FILE).read_text()
    assert "JAX backend cpu" not in text and "JAX backend cpu" not in result.stderr


def test_dry_run_writes_nothing(config_file):
    result = _run(config_file, "--dry-run")
    assert result.returncode == 0 and not (config_file / "exp").exists()


def test_hardware_gpu_without_a_gpu_is_a_clear_error(config_file):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = run_module("jaxtrain.train", config_file / "run.yml", "hardware=gpu",
                        f"workspace={config_file}", env={**env, "JAX_PLATFORMS": ""})
    assert result.returncode == 2
    assert "hardware: gpu asks for platform(s) cuda,rocm" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_module("jaxtrain.train", config_file / "run.yml", "hardware=cpu",
                        f"workspace={config_file}", env={**env, **TWO_DEVICES,
                                                         "JAX_PLATFORMS": ""})
    assert "JAX backend cpu" in result.stderr


def test_framework_selects_maxtext_defaults():
    assert load_config(None, ["framework=maxtext"])["log_interval"] == 100
    assert load_config(None, ["framework=megatron"])["log_interval"] == 1
