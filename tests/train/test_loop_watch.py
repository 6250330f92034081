"""The loop's wiring to the evaluator and the observers, end to end through ``loop.train``:
validation rows and the final validation/test row, the evaluator's position across a resume,
skip_train, TensorBoard, a profile window, timers and progress.txt.

Two tiny runs serve most tests: ``watched`` (validation every 2 of 4 steps, checkpoints, and
every observer on) and ``plain`` (the same run with all of them off), so each feature is seen
both present and absent. A persistent XLA compilation cache makes the later runs cheap.
"""
import json
import pathlib
import time

import numpy as np
import pytest

from jaxtrain import evaluation, loop
from jaxtrain.config import load_config, registry
from jaxtrain.config.knob import HONORED
from tests.data import helpers
from tests.observe.observe_helpers import tb_scalars

TINY = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=1", "hidden_size=16", "num_attention_heads=2", "micro_batch_size=2",
        "global_batch_size=4", "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0",
        "attention_dropout=0", "log_interval=1", "exp_name=run"]
EVAL = ["train_iters=4", "eval_interval=2", "eval_iters=1"]
VAL_TOKENS = 1 * 4 * 8  # eval_iters x global batch x seq_length
WATCH = ["timing_log_level=1", "log_progress=true", "profile=true", "profile_step_start=1",
         "profile_step_end=2"]


pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def config(*extra):
    return load_config(None, [*TINY, *extra], world_size=1, enforce_status=False)


def rows(directory) -> list[dict]:
    path = pathlib.Path(directory) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_rows(directory) -> list[dict]:
    return [r for r in rows(directory) if "loss" in r]


def eval_rows(directory) -> list[dict]:
    return [r for r in rows(directory) if "val_loss" in r or "test_loss" in r]


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """4 steps, validation at 2 and 4, checkpoints at 2 and 4 (the run directory is ``save``),
    TensorBoard, a profile window over step 2, level-1 timers and progress.txt."""
    root = tmp_path_factory.mktemp("watched")
    last = loop.train(config(*EVAL, *WATCH, f"save={root}", "save_interval=2",
                             f"tensorboard_dir={root / 'tb'}"))
    return root, last


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same 4 steps with validation, profiling, timers, progress and trackers off."""
    root = tmp_path_factory.mktemp("plain")
    loop.train(config("train_iters=4", "eval_interval=2", "eval_iters=0", f"workspace={root}"))
    return root / "run"


# ---------------------------------------------------------------- 1. validation in the loop

@pytest.mark.slow
def test_validation_rows_every_eval_interval_and_at_the_end(watched, plain):
    root, last = watched
    assert [r["step"] for r in train_rows(root)] == [1, 2, 3, 4] and last == train_rows(root)[-1]
    # in order: the row of step 2, its validation, steps 3 and 4, validation, final val + test
    assert [(r["step"], "loss" in r, "val_loss" in r, "test_loss" in r)
            for r in rows(root)] == [(1, True, False, False), (2, True, False, False),
                                     (2, False, True, False), (3, True, False, False),
                                     (4, True, False, False), (4, False, True, False),
                                     (4, False, True, True)]
    periodic2, periodic4, final = eval_rows(root)
    for r in (periodic2, periodic4, final):
        assert r["val_tokens"] == VAL_TOKENS and np.isfinite(r["val_loss"])
        assert r["val_ppl"] == pytest.approx(np.exp(r["val_loss"]))
    assert final["test_tokens"] == VAL_TOKENS and np.isfinite(final["test_loss"])
    # each run reads on from where the previous one stopped: other samples, other losses
    assert periodic4["val_loss"] != final["val_loss"]
    assert not eval_rows(plain)
    assert [r["step"] for r in rows(plain)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_validation_on_megatron_indexed_splits(tmp_path):
    """data_path + split: the validation and test splits of an indexed dataset."""
    prefix = helpers.write_indexed(tmp_path / "docs", helpers.random_docs(200, vocab=60, seed=4))
    got = loop.train(config("mock_data=false", f"data_path={prefix}", "split=80,10,10",
                            "tokenizer_type=NullTokenizer", "vocab_size=63",
                            "dataloader_type=single", *EVAL, f"workspace={tmp_path}"))
    run = tmp_path / "run"
    assert got["step"] == 4
    assert [r["step"] for r in eval_rows(run)] == [2, 4, 4]
    assert "test_loss" in eval_rows(run)[-1] and eval_rows(run)[-1]["test_tokens"] == VAL_TOKENS


# ---------------------------------------------------------------- 2. resume keeps the position

@pytest.mark.slow
def test_resume_continues_validation_where_the_checkpoint_left_it(watched, tmp_path,
                                                                   monkeypatch):
    root, _ = watched
    common = [*EVAL, f"save={tmp_path}", "save_interval=2", "log_progress=true"]
    loop.train(config(*common, "exit_interval=2"))
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2]
    meta = json.loads((tmp_path / "step_2" / "meta" / "metadata").read_text())
    assert meta["extra"] == {"eval": {"valid_consumed": {"mock_data validation": 4}},
                             "best": None}   # save_hf's best validation so far (none: off)

    def no_fallback(self, step):
        raise AssertionError("the checkpoint holds the evaluator's position; skip_to is only "
                             "for checkpoints without one")

    monkeypatch.setattr(evaluation.Evaluator, "skip_to", no_fallback)
    loop.train(config(*common, "auto_continue_train=true"))
    assert [r["step"] for r in train_rows(tmp_path)] == [1, 2, 3, 4]
    assert [r["loss"] for r in train_rows(tmp_path)] == [r["loss"] for r in train_rows(root)]
    assert eval_rows(tmp_path) == eval_rows(root)  # steps 2, 4 and the final row, exactly
    progress = (tmp_path / "progress.txt").read_text()
    assert [line.split("\t")[3:5] for line in progress.splitlines()
            if "Starting job" in line or "Job finished" in line] == [
        ["Starting job", "Iteration: 0"], ["Job finished", "Iteration: 2"],
        ["Starting job", "Iteration: 2"], ["Job finished", "Iteration: 4"]]


# ---------------------------------------------------------------- 3. skip_train

@pytest.fixture(scope="module")
def skipped(watched, tmp_path_factory):
    """skip_train runs: from the watched run's step-4 checkpoint (the full state, and with
    finetune's params-only load) and from fresh parameters."""
    root, _ = watched
    out = {}
    for name, extra in [("loaded", [f"load={root}", "finetune=false", "log_progress=true"]),
                        ("params", [f"load={root}", "finetune=true"]), ("fresh", [])]:
        directory = tmp_path_factory.mktemp(name)
        out[name] = (loop.train(config(*EVAL, "skip_train=true", f"workspace={directory}",
                                       *extra)), directory / "run")
    return out


def test_skip_train_evaluates_the_loaded_checkpoint_only(watched, skipped):
    root, _ = watched
    (loaded, _), (params, _), (fresh, _) = (skipped[k] for k in
                                              ("loaded", "params", "fresh"))
    for row, directory in skipped.values():
        assert rows(directory) == [row]  # one validation + test row and no training row
        assert "loss" not in row and row["val_tokens"] == row["test_tokens"] == VAL_TOKENS
        assert not list(directory.glob("step_*"))
    assert loaded["step"] == 4 and params["step"] == fresh["step"] == 0  # finetune: from 0
    # the test pass reads the test split from its start: the step-4 parameters give the
    # watched run's final test loss; fresh parameters something else
    final = eval_rows(root)[-1]
    assert loaded["test_loss"] == params["test_loss"] == final["test_loss"] != fresh["test_loss"]
    # validation starts at the first sample under skip_train: the checkpoint's evaluator
    # position (restored with the full state only) is not used
    assert loaded["val_loss"] == params["val_loss"] != fresh["val_loss"]
    assert loaded["val_loss"] not in [r["val_loss"] for r in eval_rows(root)]
    assert registry().lookup("skip_train").knob.status == HONORED


def test_skip_train_progress_log(skipped):
    _, directory = skipped["loaded"]
    events = [line.split("\t")[3] for line in
              (directory / "progress.txt").read_text().splitlines()]
    assert events == ["Starting job", "Job finished"]


# ---------------------------------------------------------------- 4. TensorBoard

def test_tensorboard_gets_the_training_and_validation_rows(watched, plain):
    root, _ = watched
    scalars = tb_scalars(root / "tb")
    train, evals = train_rows(root), eval_rows(root)
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["loss"]] == pytest.approx([r["loss"] for r in train],
                                                           rel=1e-6)
    assert scalars["val_loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6))
                                   for r in evals]
    assert scalars["test_loss"] == [(4, pytest.approx(evals[-1]["test_loss"], rel=1e-6))]
    assert "val_ppl" not in scalars  # log_validation_ppl_to_tensorboard is off by default
    assert any(tag.startswith("time/batch") for tag in scalars)  # timers reach it too
    assert not list(plain.rglob("events.out.tfevents*"))


# ---------------------------------------------------------------- 5. profile window

def test_profile_window_writes_a_trace_in_the_run_directory(watched, plain):
    root, _ = watched
    traces = list((root / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1
    assert traces[0].relative_to(root).parts[:3] == ("profile", "plugins", "profile")
    assert not list(plain.rglob("*.xplane.pb")) and not (plain / "profile").exists()
    data = traces[0].read_bytes()
    for scope in (b"decoder_layer", b"attention", b"mlp", b"embed"):  # the model's named scopes
        assert scope in data, scope


# ---------------------------------------------------------------- 6. timers and progress.txt

def test_timers_and_progress_log(watched, plain):
    root, _ = watched
    train = train_rows(root)
    timed = [r for r in train if {"time/batch_min", "time/batch_max"} <= r.keys()]
    assert timed and all(0 <= r["time/batch_min"] <= r["time/batch_max"] for r in timed)
    assert any("time/save-checkpoint_max" in r for r in train)
    assert all("time/step_max" in r for r in train)
    # level 0 (the default) times the step only
    assert {k for r in rows(plain) for k in r if k.startswith("time/")} == {"time/step_min",
                                                                           "time/step_max"}
    lines = (root / "progress.txt").read_text().splitlines()
    events = [line.split("\t")[3:5] for line in lines]
    assert events == [["Starting job", "Iteration: 0"], ["Saved checkpoint", "Iteration: 2"],
                      ["Saved checkpoint", "Iteration: 4"], ["Job finished", "Iteration: 4"]]
    flops = [float(line.split("Floating-point operations: ")[1].split("\t")[0])
             for line in lines[1:]]
    assert flops[0] > 0 and flops == pytest.approx([flops[0], 2 * flops[0], 2 * flops[0]])
    assert not (plain / "progress.txt").exists()


def test_timers_land_in_their_own_steps_row(tmp_path, monkeypatch):
    real = loop.global_batches

    def batches(*args, **kw):
        for i, batch in enumerate(real(*args, **kw)):
            if i == 1:
                time.sleep(0.3)  # fetching step 2's batch is slow
            yield batch

    monkeypatch.setattr(loop, "global_batches", batches)
    loop.train(config("train_iters=4", "timing_log_level=1", f"workspace={tmp_path}"))
    got = {r["step"]: r for r in rows(tmp_path / "run")}
    assert all("time/batch_max" in r for r in got.values())
    assert got[1]["time/batch_max"] < 0.25 <= got[2]["time/batch_max"]
