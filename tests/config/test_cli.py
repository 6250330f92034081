"""python -m jaxtrain.train --dry-run/--help, and the dry-run output as a config again."""
import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT, run_module
from jaxtrain.config import load_config, registry

DATA = "mock_data: true\nvocab_size: 64\n"   # the dry run checks the data a run would read


def test_help(cli):
    code, out, _ = cli("--help")
    assert code == 0 and "usage: python -m jaxtrain.train [CONFIG]" in out


def test_dry_run_prints_every_canonical_key(write, cli):
    path = write("run.yml", f"steps: 1000\nstderr_sink_level: WARNING\n{DATA}")
    code, out, err = cli(path, "--dry-run", "--train.learning_rate", "2.0e-5")
    assert code == 0, err
    values = yaml.safe_load(out)
    plain = {k.key for k in registry() if not k.templated}
    assert set(values) == plain
    assert values["train_iters"] == 1000 and values["stderr_sink_level"] == "WARNING"
    assert "stderr_sink_level: WARNING  # " in out and "lr: 2.0e-05  # command line" in out


def test_dry_run_output_loads_back_to_the_same_config(write, cli):
    path = write("run.yml", "exp_name: trial\nfile_sink_level: INFO\nframework: maxtext\n"
                 "dataset_type: synthetic\n")
    code, out, err = cli(path, "--dry-run", "--world-size", "2")
    assert code == 0, err
    again = write("again.yml", out)
    first, second = load_config(path, world_size=2), load_config(again, world_size=2)
    assert dict(first) == dict(second) and first.derived == second.derived


def test_dry_run_touches_no_device(write):
    path = write("run.yml", f"stderr_sink_level: INFO\n{DATA}")
    code = ("import sys, runpy; sys.argv=['jaxtrain.train', %r, '--dry-run'];"
            "import jaxtrain.train as t; rc=t.main(sys.argv[1:]);"
            "from jax._src import xla_bridge;"   # the dry run builds configs, not a backend
            "assert not xla_bridge.backends_are_initialized(), 'backend started';"
            "raise SystemExit(rc)") % str(path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "train_iters: 1000" in result.stdout


def test_inert_knob_warns_on_stderr(write, cli):
    path = write("run.yml", f"bias_dropout_fusion: false\n{DATA}")
    code, _, err = cli(path, "--dry-run")
    assert code == 0 and "bias_dropout_fusion has no effect under JAX/XLA" in err


def test_knobs_cli_text_and_markdown():
    result = run_module("jaxtrain.knobs", "--key", "learning_rate")
    assert result.returncode == 0 and "lr " in result.stdout
    result = run_module("jaxtrain.knobs", "--area", "families", "--markdown")
    assert result.returncode == 0 and "## families" in result.stdout
