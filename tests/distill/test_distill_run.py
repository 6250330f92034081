"""Distillation runs end to end on the CPU: a tiny teacher (fine-tuned on the number task) and a
smaller random student; the held-out reverse KL falls and the student's greedy accuracy rises;
resume_from: auto after SIGKILL continues exactly; max_staleness samples from older weights;
checkpoints hold the model in Hugging Face format; palingenesis's own file runs unchanged."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from distill_helpers import number_task, prompt_rows, train_teacher, write_jsonl, write_pair

from jaxtrain import train

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "pgs"

RUN = """\
model: {{student: {root}/student}}
teachers:
  big: {{model: {teacher}}}
sources:
  numbers: {{path: {root}/train.jsonl, dev_path: {root}/dev.jsonl, max_new_tokens: 6}}
rollout: {{batch_prompts: 16, temperature: 1.0}}
train: {{output_dir: {out}, steps: {steps}, learning_rate: 3.0e-3, lr_scheduler: constant,
        warmup_steps: 5, score_micro_seqs: 16, eval_every: {eval_every}, eval_samples: 16,
        save_steps: {save_steps}}}
logging: {{log_every: 1}}
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_run")
    teacher, _ = write_pair(root)
    rows = prompt_rows(number_task(64))
    write_jsonl(root / "train.jsonl", rows)
    write_jsonl(root / "dev.jsonl", rows[:16])
    return root, teacher


def _write(root, teacher, out, steps=6, eval_every=0, save_steps=0):
    path = root / f"{out}.yaml"
    path.write_text(RUN.format(root=root, teacher=teacher, out=root / out, steps=steps,
                               eval_every=eval_every, save_steps=save_steps))
    return path


def _rows(out):
    return [json.loads(x) for x in (pathlib.Path(out) / "metrics.jsonl").read_text().splitlines()]


def _final(out):
    import safetensors.numpy

    return safetensors.numpy.load_file(str(pathlib.Path(out) / "final" / "model.safetensors"))


@pytest.mark.slow
def test_the_student_learns_the_teachers_answers(task):
    root, random_teacher = task
    teacher = train_teacher(root, random_teacher)
    out = root / "learn"
    assert train.main([str(_write(root, teacher, "learn", steps=300, eval_every=100)),
                       "dtype=float32"]) == 0
    evals = [r for r in _rows(out) if "dev_kl/numbers" in r]
    first, last = evals[0], evals[-1]
    print("dev reverse KL %.3f -> %.3f (exact %.3f -> %.3f); greedy accuracy %.2f -> %.2f" % (
        first["dev_kl/numbers"], last["dev_kl/numbers"], first["dev_kl_full/numbers"],
        last["dev_kl_full/numbers"], first["dev_acc/numbers"], last["dev_acc/numbers"]))
    assert [r["step"] for r in evals] == [0, 100, 200, 300]
    assert last["dev_kl_full/numbers"] < first["dev_kl_full/numbers"] / 5
    assert first["dev_acc/numbers"] <= 0.125 and last["dev_acc/numbers"] >= 0.75


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(task, tmp_path):
    root, teacher = task
    assert train.main([str(_write(root, teacher, "whole", save_steps=2)), "dtype=float32"]) == 0
    cfg = _write(root, teacher, "killed", save_steps=2)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, str(HERE / "kill_worker.py"), "4", str(cfg),
                          "dtype=float32"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    killed = root / "killed"
    assert (killed / "step_4").is_dir() and not (killed / "final").exists()
    # hf model beside each checkpoint (pgs keeps step_N as a loadable model)
    assert (killed / "step-4" / "model" / "config.json").is_file()
    assert train.main([str(cfg), "--train.resume_from", "auto", "dtype=float32"]) == 0
    whole = {r["step"]: r for r in _rows(root / "whole") if "loss" in r}
    resumed = {r["step"]: r for r in _rows(killed) if "loss" in r}
    for step in (5, 6):
        for key in ("loss", "grad_norm", "completion_len", "kl/big"):
            assert resumed[step][key] == whole[step][key], (step, key)
    a, b = _final(root / "whole"), _final(killed)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # keep_checkpoints (pgs default 3): the newest three of step_2, step_4, step_6
    assert sorted(p.name for p in killed.iterdir() if p.name.startswith("step_")) == [
        "step_2", "step_4", "step_6"]


@pytest.mark.slow
def test_max_staleness_samples_from_older_weights(task):
    root, teacher = task
    cfg = _write(root, teacher, "stale", steps=5)
    assert train.main([str(cfg), "--rollout.max_staleness", "2", "dtype=float32"]) == 0
    rows = [r for r in _rows(root / "stale") if "loss" in r]
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2]
    assert all(r["dropped_samples"] == 0 for r in rows)


@pytest.mark.slow
def test_published_distill_math_runs_unchanged(tmp_path, monkeypatch):
    """palingenesis configs/distill_math.yaml as published (vLLM rollouts: jaxtrain's sampler)
    in a folder holding tiny stand-ins for the models and GSM8K-style data it names, shortened
    from the command line as pgs allows (its 60 steps of 64 x 512-token rollouts take about
    15 minutes on two CPU cores)."""
    write_pair(tmp_path / "Qwen", "Qwen3-1.7B", "Qwen3-0.6B")
    rows = prompt_rows(number_task(64))
    write_jsonl(tmp_path / "data" / "gsm8k_train.jsonl", rows)
    write_jsonl(tmp_path / "data" / "gsm8k_test200.jsonl", rows[:16])
    shutil.copy(DATA / "distill_math.yaml", tmp_path / "distill_math.yaml")
    monkeypatch.chdir(tmp_path)
    assert train.main(["distill_math.yaml", "--train.steps", "4", "--train.eval_every", "2",
                       "--train.eval_samples", "4", "--sources.gsm8k.max_new_tokens", "48"]) == 0
    out = tmp_path / "runs" / "distill_math"
    rows = _rows(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "dev_kl/gsm8k" in r] == [0, 2, 4]
    assert all(r["rollout_tokens"] > 64 for r in rows if "loss" in r)   # 64 prompts a step
    assert (out / "final" / "model.safetensors").is_file()
