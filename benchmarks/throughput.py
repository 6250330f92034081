"""Throughput of a config through the real training loop.

    python benchmarks/throughput.py CONFIG [key=value ...] [--steps 20] [--warmup 5]

Runs warmup + steps training steps (logging every step into a temporary run directory) and
reports the median over the timed steps of: step time, tokens/s, model TFLOP/s per device and
MFU (FLOPs per token = 6 * N_matmul + 12 * L * T * heads * head_dim, see jaxtrain/metrics.py;
MFU against the device's dense bf16 peak, none on CPU), plus peak device memory where the
backend reports it. On CPU compare ratios between runs in one session; absolute numbers only
mean something on a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)

    import jax

    from jaxtrain.config import load_config
    from jaxtrain.logs import setup_logging
    from jaxtrain.loop import train
    from jaxtrain.runtime import select_platform

    with tempfile.TemporaryDirectory() as tmp:
        extra = [f"train_iters={args.warmup + args.steps}", "log_interval=1",
                 f"workspace={tmp}", "exp_name=bench", "lr_warmup_iters=0",
                 "stderr_sink_level=WARNING"]
        cfg = load_config(args.config, [*args.overrides, *extra])
        select_platform(cfg)
        cfg = load_config(args.config, [*args.overrides, *extra], world_size=jax.device_count())
        train(cfg, setup_logging(cfg))
        with open(f"{tmp}/bench/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f][args.warmup:]
    summary = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
               "timed_steps": len(rows)}
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "memory_gib"):
        values = [r[key] for r in rows if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
