"""The real CLI as a 2-process job (2 CPU devices each, gloo, explicit coordinator) against
one process with 4 devices: the same losses, and metrics written once."""
import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CONFIG = """\
mock_data: true
vocab_size: 128
make_vocab_size_divisible_by: 32
seq_length: 8
max_position_embeddings: 8
num_layers: 2
hidden_size: 32
num_attention_heads: 4
micro_batch_size: 1
global_batch_size: 8
train_iters: 4
lr_warmup_iters: 0
bf16: false
hidden_dropout: 0.0
attention_dropout: 0.0
log_interval: 1
tensor_model_parallel_size: 2
exp_name: run
swiglu: true
add_bias_linear: false
normalization: RMSNorm
position_embedding_type: rope
train.save_final: true
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("JAX_", "XLA_", "MASTER_", "SLURM_", "OMPI_", "PMI_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**keep, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
            "PYTHONPATH": str(ROOT), "XLA_FLAGS": "--xla_backend_optimization_level=0", **extra}


def _launch(tmp_path, name: str, processes: int, devices: int):
    config = tmp_path / "config.yml"
    config.write_text(CONFIG)
    port = _free_port()
    procs = []
    for rank in range(processes):
        extra = {} if processes == 1 else {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
            "JAX_PROCESS_ID": str(rank)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxtrain.train", str(config), f"workspace={tmp_path / name}",
             f"save={tmp_path / name / 'run'}"],
            cwd=tmp_path, env=_env(devices, **extra), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return tmp_path / name / "run", [err for _, err in outs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    return _launch(tmp, "single", 1, 4), _launch(tmp, "multi", 2, 2)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(runs):
    (single, _), (multi, logs) = runs
    one, two = _rows(single), _rows(multi)
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # written once, by process 0 only
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=2e-6)
    assert "process 0 of 2 (explicit)" in logs[0] and "process 1 of 2 (explicit)" in logs[1]
    assert "tensor 2" in logs[0] and "data 2" in logs[0]


def test_only_process_zero_writes_the_run_directory(runs):
    (_, _), (multi, logs) = runs
    log_lines = (multi / "jaxtrain.log").read_text()
    assert "process 0 of 2" in log_lines and "process 1 of 2" not in log_lines
    assert "loss" not in logs[1].split("process 1 of 2")[-1]  # no metrics lines on process 1


def test_final_hugging_face_export_gathers_every_shard(runs):
    """train.save_final in a 2-process job: the shards of both processes, written once."""
    from safetensors.numpy import load_file

    (single, _), (multi, _) = runs
    one = load_file(single / "final" / "model.safetensors")
    two = load_file(multi / "final" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        assert two[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name
