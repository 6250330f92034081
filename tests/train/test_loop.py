"""The training loop end to end on tiny mock runs: metrics rows, exits, NaN stop, data."""
import json
import os
import signal

import jax
import numpy as np
import pytest

from jaxtrain import loop
from jaxtrain.checks import TrainingError
from jaxtrain.config import load_config

TINY = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=1", "hidden_size=16", "num_attention_heads=2", "micro_batch_size=2",
        "global_batch_size=4", "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0",
        "attention_dropout=0", "log_interval=1", "exp_name=run"]


def config(tmp_path, *extra):
    return load_config(None, [*TINY, f"workspace={tmp_path}", *extra], world_size=1,
                       enforce_status=False)


def rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]


@pytest.mark.slow
def test_metrics_rows(tmp_path):
    last = loop.train(config(tmp_path, "train_iters=3", "log_params_norm=true"))
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3] and last == got[-1]
    for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
                "tflops_per_device", "mfu", "params_norm"):
        assert key in got[0], key
    assert got[0]["tflops_per_device"] > 0 and got[0]["mfu"] is None  # no peak known for CPU


@pytest.mark.slow
def test_log_interval_and_exit_interval(tmp_path):
    loop.train(config(tmp_path, "train_iters=10", "log_interval=2", "exit_interval=4"))
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 4]  # step 1 is always logged


@pytest.mark.slow
def test_exit_duration(tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 31))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(clock)))
    loop.train(config(tmp_path, "train_iters=50", "exit_duration_in_mins=1"))
    assert rows(tmp_path)[-1]["step"] < 50


@pytest.mark.slow
def test_sigterm_finishes_the_step_and_stops(tmp_path, monkeypatch):
    real = loop.global_batches

    def batches(*args, **kw):
        for i, b in enumerate(real(*args, **kw)):
            if i == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            yield b

    monkeypatch.setattr(loop, "global_batches", batches)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        loop.train(config(tmp_path, "train_iters=20", "exit_signal_handler=true"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rows(tmp_path)[-1]["step"] == 3


@pytest.mark.slow
def test_nan_in_loss_stops_the_run(tmp_path, monkeypatch):
    real_init = loop.models.params.init
    monkeypatch.setattr(loop.models.params, "init", lambda *a, **k: jax.tree.map(
        lambda p: p * np.nan, real_init(*a, **k)))
    with pytest.raises(TrainingError, match="NaN or Inf"):
        loop.train(config(tmp_path, "train_iters=3"))
    loop.train(config(tmp_path, "train_iters=2", "check_for_nan_in_loss_and_grad=false"))


def test_run_length_from_samples_and_epochs(tmp_path):
    tcfg = type("T", (), {"train_iters": None, "train_samples": 40, "global_batch_size": 4,
                          "epochs": None, "rampup": None, "data_epochs": None})
    assert loop.total_steps(tcfg, 1000) == 10
    tcfg.train_samples, tcfg.epochs = None, 3
    assert loop.total_steps(tcfg, 100) == 75
    tcfg.train_iters, tcfg.data_epochs = 500, 2      # MaxText num_epoch: the data runs out first
    assert loop.total_steps(tcfg, 100) == 50


@pytest.mark.slow
def test_seed_changes_init_and_data(tmp_path):
    a = loop.train(config(tmp_path / "a", "train_iters=1", "seed=1"))
    b = loop.train(config(tmp_path / "b", "train_iters=1", "seed=1"))
    c = loop.train(config(tmp_path / "c", "train_iters=1", "seed=2"))
    assert a["loss"] == b["loss"] != c["loss"]


@pytest.mark.slow
def test_rampup_batch_size_grows_the_batch(tmp_path):
    loop.train(config(tmp_path, "train_samples=40", "rampup_batch_size=[2, 2, 16]",
                      "micro_batch_size=2", "global_batch_size=6"))
    sizes = [r["global_batch_size"] for r in rows(tmp_path)]
    assert sizes[0] == 2 and sizes[-1] == 6 and sorted(sizes) == sizes
    assert sum(sizes) <= 40


def test_step_batch_size_schedule_sets_each_batch(tmp_path):
    """Megatron's step schedule (thresholds in tokens of seq_length 8): 2 sequences a step
    until 16 samples are consumed, then 4; the run is as long as Megatron's update_train_iters
    counts for train_samples 30 (16 in 8 steps, then 4 steps of 4 pass 30); validation reads
    eval_global_batch_size sequences per iteration."""
    loop.train(config(tmp_path, "train_samples=30", "step_batch_size_schedule=0:2 128:4",
                      "micro_batch_size=2", "global_batch_size=null", "lr_warmup_iters=0",
                      "eval_iters=1", "eval_interval=12", "eval_global_batch_size=6"))
    got = rows(tmp_path)
    sizes = [r["global_batch_size"] for r in got if "global_batch_size" in r]
    assert sizes == [2] * 8 + [4] * 4
    assert [r["val_tokens"] for r in got if "val_tokens" in r][0] == 6 * 8


@pytest.mark.slow
def test_manual_gc_and_matmul_precision(tmp_path, monkeypatch):
    import gc
    calls, states = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    real = loop._train

    def spy(*args):
        states.append((gc.isenabled(), jax.config.jax_default_matmul_precision))
        return real(*args)

    monkeypatch.setattr(loop, "_train", spy)
    loop.train(config(tmp_path, "train_iters=4", "manual_gc=true", "manual_gc_interval=2",
                      "memory.float32_matmul_precision=highest"))
    loop.train(config(tmp_path, "train_iters=1", "memory.float32_matmul_precision=medium"))
    assert states == [(False, "float32"), (True, "bfloat16")]
    assert len(calls) == 2 and gc.isenabled()


@pytest.mark.slow
def test_log_throughput_controls_the_console_line(tmp_path, caplog):
    import logging
    logger = logging.getLogger("loop_test_logger")
    with caplog.at_level(logging.INFO, logger="loop_test_logger"):
        loop.train(config(tmp_path, "train_iters=1", "log_throughput=false"), logger)
    line = [r.message for r in caplog.records if "loss" in r.message][-1]
    assert "tok/s" not in line and "tokens_per_s" in rows(tmp_path)[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loop_test_logger"):
        loop.train(config(tmp_path / "b", "train_iters=1", "exp_name=run"), logger)
    assert "tok/s" in [r.message for r in caplog.records if "loss" in r.message][-1]


@pytest.mark.parametrize("override", ["--train.optimizer=paged_adamw8bit",
                                      "optimizer_memory_host_offload=true"])
@pytest.mark.slow
def test_optimizer_state_in_host_memory(tmp_path, override, monkeypatch):
    calls = []  # (shardings, movers) per memory_movers call: the opt state's comes first
    real = loop.memory_movers
    monkeypatch.setattr(loop, "memory_movers",
                        lambda sh: calls.append((sh, real(sh))) or calls[-1][1])
    host = loop.train(config(tmp_path / "h", "train_iters=2", override))
    n = len(calls)
    device = loop.train(config(tmp_path / "d", "train_iters=2",
                               override.replace("paged_adamw8bit", "adamw8bit")
                               .replace("true", "false")))
    assert host["loss"] == pytest.approx(device["loss"], rel=1e-6)
    assert calls[0][1] is not None and calls[n][1] is None
    assert {s.memory_kind for s in jax.tree.leaves(calls[0][0])} == {"pinned_host"}


def test_running_throughput_average_skips_warmup_and_resets():
    tcfg = type("T", (), {"log_avg_skip_iterations": 2, "log_avg_reset_interval": 3})
    report = loop._Reporter(None, None, tcfg)
    times = {1: 50.0, 2: 40.0, 3: 1.0, 4: 2.0, 5: 3.0, 6: 7.0, 7: 9.0}
    got = [report._average(it, t) for it, t in times.items()]
    assert got == [50.0, 45.0, 1.0, 1.5, 2.0, 7.0, 8.0]


@pytest.mark.slow
def test_weight_hash_check_runs_at_its_interval(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(loop, "replica_mismatches",
                        lambda params: seen.append(1) or ([] if len(seen) < 2 else ["['wq']"]))
    with pytest.raises(TrainingError, match="step 4: the copies of 1 parameter"):
        loop.train(config(tmp_path, "train_iters=6",
                          "check_weight_hash_across_dp_replicas_interval=2"))
    assert len(seen) == 2
    loop.train(config(tmp_path / "off", "train_iters=2"))
    assert len(seen) == 2


@pytest.mark.slow
def test_reuse_example_batch_reads_one_batch(tmp_path, monkeypatch):
    real, read = loop.global_batches, []

    def counting(*args, **kw):
        for b in real(*args, **kw):
            read.append(1)
            yield b

    monkeypatch.setattr(loop, "global_batches", counting)
    loop.train(config(tmp_path, "train_iters=4", "reuse_example_batch=1"))
    assert len(read) == 1 and [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    read.clear()
    loop.train(config(tmp_path / "b", "train_iters=4"))
    assert len(read) >= 4


def test_target_eval_loss_stops_after_the_evaluation_that_reaches_it(tmp_path):
    """MaxText's target_eval_loss: the first evaluation at or under it ends the run (its
    step's due checkpoint kept, no final save); 0 never stops early."""
    ck = tmp_path / "ck"
    args = ["train_iters=6", "eval_interval=2", "eval_iters=1", "save_interval=2", f"save={ck}"]
    loop.train(config(tmp_path / "high", *args, "target_eval_loss=100"))
    got = [json.loads(line) for line in (ck / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got if "val_loss" in r] == [2]
    assert max(r["step"] for r in got) == 2
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step")) == ["step_2"]
    loop.train(config(tmp_path / "off", "train_iters=6", "eval_interval=2", "eval_iters=1"))
    assert max(r["step"] for r in rows(tmp_path / "off")) == 6
