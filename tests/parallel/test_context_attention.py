"""Context-parallel attention against one device (the cases: context_cases.py), in a process of
its own with 8 CPU devices (the suite's processes keep one); the configurations it refuses;
whole runs through the CLI at CP 2, 4, 8 with each cp_comm_type (slow; context_cli_worker.py)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.models import ModelConfig

HERE = pathlib.Path(__file__).resolve().parent


def _cases(marks: str):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "python_files=context_cases.py", "-o", "addopts=", "-m", marks,
                          str(HERE / "context_cases.py")],
                         capture_output=True, text=True, env=env, cwd=HERE.parents[1],
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


def test_context_parallel_attention_cases():
    assert "22 passed, 20 deselected" in _cases("not slow")


@pytest.mark.slow
def test_context_parallel_attention_slow_cases():
    assert "20 passed, 22 deselected" in _cases("slow")


BASE = ["mock_data=true", "vocab_size=128", "seq_length=8", "max_position_embeddings=8",
        "num_layers=2", "hidden_size=32", "num_attention_heads=4", "group_query_attention=true",
        "num_query_groups=2", "global_batch_size=16", "train_iters=2", "lr_warmup_iters=0",
        "attention_dropout=0", "hidden_dropout=0"]


HIER = "hierarchical_context_parallel_sizes"


@pytest.mark.parametrize("extra, needle", [
    (["context_parallel_size=3", "seq_length=8"], "seq_length (8) must divide by "
                                                  "context_parallel_size (3)"),
    (["context_parallel_size=4", "cp_comm_type=a2a"], "num_query_groups (2) must divide by "
                                                      "context_parallel_size"),
    (["context_parallel_size=4", "cp_comm_type=a2a+p2p"], "needs hierarchical_context_parallel_"
                                                           "sizes"),
    (["context_parallel_size=4", "cp_comm_type=a2a+p2p", f"{HIER}=[2,4]"],
     "whose product is context_parallel_size (4)"),
    (["context_parallel_size=4", "cp_comm_type=a2a+p2p", f"{HIER}=[4,1]"],
     "num_query_groups (2) must divide by the all-to-all level"),
    (["context_parallel_size=2", "hierarchical_context_parallel_sizes=[1,2]"],
     "sizes the levels of cp_comm_type a2a+p2p"),
    (["context_parallel_size=2", "cp_comm_type=[p2p,a2a,p2p]"], "lists 3 kinds for num_layers"),
])
def test_context_parallel_refusals_name_the_keys(extra, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, *extra], world_size=8)
    assert needle in str(err.value), str(err.value)


def test_the_model_takes_cp_comm_type():
    cfg = load_config(None, [*BASE, "context_parallel_size=2", "cp_comm_type=all_gather"],
                      world_size=8)
    assert ModelConfig.from_config(cfg).cp_comm_type == "allgather"
    assert ModelConfig.from_config(load_config(None, BASE, world_size=8)).cp_comm_type is None


@pytest.mark.slow
def test_context_parallel_through_the_cli_same_losses_and_gradients(tmp_path):
    """CP 2, 4, 8 with each cp_comm_type (p2p, all_gather, a2a, a2a+p2p at both splits), with
    TP, FSDP and EP, each token order, a per-layer list and the flash kernel, trained through
    the CLI's entry on 8 CPU devices: every step's loss and gradient norm equal the run without
    CP (fp32), for a causal grouped-query model, a packed model with a sliding window and sinks,
    an MoE and an MLA model, hybrids of Mamba-2, Gated DeltaNet or LFM2 convolution layers on
    packed documents and DeepSeek-V4 (these mixers run in the tokens' natural order)."""
    from tests.parallel.context_cli_worker import RUNS, reference

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    run = subprocess.run([sys.executable, str(HERE / "context_cli_worker.py"), str(tmp_path),
                          ",".join(RUNS)], capture_output=True, text=True, env=env,
                         cwd=HERE.parents[1], timeout=2400)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.splitlines()[-1])
    for name in RUNS:
        want = got[reference(name)]
        assert len(got[name]["losses"]) == 4, name
        for key in ("losses", "grad_norms"):
            assert got[name][key] == pytest.approx(want[key], rel=1e-6), (name, key)


@pytest.mark.parametrize("extra, needles", [
    (["context_parallel_size=4", "seq_length=12", "max_position_embeddings=12"],
     ["seq_length (12) must be divisible by 2 x context_parallel_size (8)"]),
    (["context_parallel_size=4", "cp_comm_type=a2a"], ["cp_comm_type", "num_query_groups (2)"]),
])
def test_the_command_line_refuses_with_exit_2_naming_the_keys(extra, needles, capsys):
    from jaxtrain.train import main

    assert main([*BASE, *extra, "--dry-run", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
