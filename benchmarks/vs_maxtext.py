"""jaxtrain vs MaxText on the same model and machine, run in pairs: the ratio table.

    python benchmarks/vs_maxtext.py [--maxtext-python mt/bin/python] [--runs 3] [--steps 12]
        [--cases llama_fp32_full,...] [--json OUT]

MaxText 0.2.5 needs its own Python >= 3.12 virtual environment (``--maxtext-python`` or
``$MAXTEXT_PYTHON``; the install line is in ``shared/notes/perf-recipe.md`` and
docs/performance.md). Each case runs both trainers ``--runs`` times, alternating, as separate
processes on synthetic data, and reports per trainer:

- ``step_s``: the median step time over steps 3..N of each run (MaxText's ``completed step``
  seconds, jaxtrain's ``step_time_s``), then the median over runs;
- ``first_step_s``: wall seconds from process start to the first step's completion (start-up,
  compilation and the step), each run on an empty compilation cache; ``restart_first_step_s``
  the same for one more run that restarts on the previous run's cache;
- ``rss_gib``: the process's peak resident memory;
- ``ratio``: MaxText's step time / jaxtrain's (above 1: jaxtrain is faster).

The base case is the tiny Llama of issue 26 (4 layers, d 256, 4 heads of 64, SwiGLU 1024,
vocab 32000, seq 256, batch 4, fp32, full remat, scanned layers, dot-product attention); the
other cases change one thing. MaxText has no "no remat" policy: the ``none`` case gives it its
cheapest, ``minimal_with_context``. On this 2-core machine only ratios mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(HERE, "configs", "tiny_llama.yml")

MAXTEXT_BASE = [
    "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
    "per_device_batch_size=4", "max_target_length=256", "base_emb_dim=256",
    "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=1024",
    "base_num_decoder_layers=4", "head_dim=64", "vocab_size=32000", "enable_checkpointing=false",
    "attention=dot_product", "dtype=float32", "weight_dtype=float32", "remat_policy=full",
    "scan_layers=true", "enable_tensorboard=false"]

# name: (jaxtrain overrides, MaxText overrides), each on top of the base case
CASES = {
    "llama_fp32_full": ([], []),
    "llama_bf16_full": (["bf16=true"], ["dtype=bfloat16"]),
    "llama_fp32_none": (["recompute_granularity=null"], ["remat_policy=minimal_with_context"]),
    "llama_fp32_seq1024": (
        ["seq_length=1024", "max_position_embeddings=1024", "micro_batch_size=1",
         "global_batch_size=1"],
        ["max_target_length=1024", "per_device_batch_size=1"]),
    "moe_fp32_full": (
        ["num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=1024",
         "moe_router_load_balancing_type=aux_loss", "moe_aux_loss_coeff=0.01",
         "moe_grouped_gemm=true"],
        ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "megablox=false",
         "sparse_matmul=true", "capacity_factor=-1", "load_balance_loss_weight=0.01",
         "base_moe_mlp_dim=1024"]),
}

_MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")
_JAXTRAIN_STEP = re.compile(r"step (\d+)/\d+ \|")


def _run(cmd: list[str], first_step: re.Pattern, first_index: str, cwd: str, env: dict
         ) -> tuple[str, float | None, float]:
    """(output, seconds to the first step's line, peak RSS GiB) of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=cwd, env=env)
    lines, first = [], None
    for line in proc.stdout:
        lines.append(line)
        m = first_step.search(line)
        if first is None and m and m.group(1) == first_index:
            first = time.perf_counter() - start
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{out[-3000:]}")
    return out, first, usage.ru_maxrss / 2**20


def run_maxtext(python: str, overrides: list[str], steps: int, tmp: str, cache: str) -> dict:
    package = subprocess.run(
        [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True, text=True, check=True).stdout.strip()
    cmd = [python, "-m", "maxtext.trainers.pre_train.train", f"{package}/configs/base.yml",
           "run_name=vs", f"base_output_directory={tmp}/maxtext", f"steps={steps}",
           f"jax_cache_dir={cache}", *MAXTEXT_BASE, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    out, first, rss = _run(cmd, _MAXTEXT_STEP, "0", tmp, env)
    times = [float(s) for i, s in _MAXTEXT_STEP.findall(out) if int(i) >= 2]
    return {"step_s": statistics.median(times), "first_step_s": first, "rss_gib": rss}


def run_jaxtrain(overrides: list[str], steps: int, tmp: str, cache: str) -> dict:
    cmd = [sys.executable, "-m", "jaxtrain.train", CONFIG, f"workspace={tmp}/jaxtrain",
           "exp_name=vs", f"train_iters={steps}", "log_interval=1", f"jax_cache_dir={cache}",
           *overrides]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    _, first, rss = _run(cmd, _JAXTRAIN_STEP, "1", ROOT, env)
    with open(f"{tmp}/jaxtrain/vs/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    times = [r["step_time_s"] for r in rows if r["step"] >= 3]
    return {"step_s": statistics.median(times), "first_step_s": first, "rss_gib": rss}


def compare(python: str, cases: list[str], runs: int, steps: int) -> dict:
    table = {}
    runners = {"maxtext": lambda o, t, c: run_maxtext(python, o, steps, t, c),
               "jaxtrain": lambda o, t, c: run_jaxtrain(o, steps, t, c)}
    for name in cases:
        overrides = dict(zip(("jaxtrain", "maxtext"), CASES[name]))
        results = {"jaxtrain": [], "maxtext": []}
        with tempfile.TemporaryDirectory() as caches:
            for i in range(runs + 1):   # the last run restarts on the previous run's cache
                for who, runner in runners.items():
                    cache = f"{caches}/{who}{min(i, runs - 1)}"   # a cold cache per run
                    with tempfile.TemporaryDirectory() as tmp:
                        results[who].append(runner(overrides[who], tmp, cache))
        row = {who: {k: round(statistics.median(r[k] for r in rs[:runs]), 3)
                     for k in ("step_s", "first_step_s", "rss_gib")}
               for who, rs in results.items()}
        for who, rs in results.items():
            row[who]["restart_first_step_s"] = round(rs[runs]["first_step_s"], 3)
        row["ratio"] = round(row["maxtext"]["step_s"] / row["jaxtrain"]["step_s"], 2)
        row["paired_ratios"] = [round(t["step_s"] / o["step_s"], 2) for t, o in
                                zip(results["maxtext"][:runs], results["jaxtrain"][:runs])]
        table[name] = row
        _print_row(name, row)
    return table


def _print_row(name: str, row: dict):
    j, m = row["jaxtrain"], row["maxtext"]
    print(f"{name:<20} step {j['step_s']:.3f} s vs {m['step_s']:.3f} s  ratio {row['ratio']:.2f} "
          f"{row['paired_ratios']} | first step {j['first_step_s']:.1f} s vs "
          f"{m['first_step_s']:.1f} s, restarted {j['restart_first_step_s']:.1f} s vs "
          f"{m['restart_first_step_s']:.1f} s | peak RSS {j['rss_gib']:.2f} vs "
          f"{m['rss_gib']:.2f} GiB",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", "mt/bin/python"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args(argv)
    if not os.path.exists(args.maxtext_python):
        raise SystemExit(f"no MaxText Python at {args.maxtext_python}: pass --maxtext-python "
                         "(a Python >= 3.12 venv with maxtext==0.2.5; see perf-recipe)")
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    print("jaxtrain vs MaxText (step: jaxtrain vs MaxText; ratio = MaxText / jaxtrain)")
    table = compare(args.maxtext_python, args.cases.split(","), args.runs, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
