"""Train-step time of quantized recipes against the unquantized (bf16) step.

    python benchmarks/quant.py [--recipes none,fp8-delayed,...] [--steps 10] [--json out.json]
    python benchmarks/quant.py --smoke        # tiny model, two recipes, runs on CPU

Each recipe builds the same model through the real config path (jaxtrain.loop.build: mesh,
optimizer, the jitted step with its fp8 state) and times --steps steps after --warmup on one
random batch; the table gives the median step time, tokens/s and the speedup over "none".
"fp8 GEMMs" counts the FP8 matrix multiplications in the compiled step (XLA rewrites the
quantize-dequantize-dot pattern into cuBLASLt FP8 GEMMs on Hopper and newer; 0 means the
recipe ran emulated, as always on CPU). On CPU only the plumbing means anything.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECIPES = {
    "none": [],
    "fp8-delayed": ["fp8=hybrid", "fp8_recipe=delayed"],
    "fp8-tensorwise": ["fp8=hybrid", "fp8_recipe=tensorwise"],
    "fp8-blockwise": ["fp8=e4m3", "fp8_recipe=blockwise"],
    "fp8-mxfp8": ["fp8=e4m3", "fp8_recipe=mxfp8"],
    "nvfp4": ["fp4=e2m1"],
    "int8": ["quantization=int8"],
    "fp8_full": ["quantization=fp8_full"],
}
# A 1.3B-class decoder (24 x 2048, SwiGLU 5632) at 2k tokens, 8 sequences per step.
MODEL = ["num_layers=24", "hidden_size=2048", "num_attention_heads=16",
         "ffn_hidden_size=5632", "swiglu=true", "seq_length=2048",
         "max_position_embeddings=2048", "micro_batch_size=8", "global_batch_size=8",
         "vocab_size=32000"]
SMOKE = ["num_layers=2", "hidden_size=128", "num_attention_heads=2", "ffn_hidden_size=256",
         "swiglu=true", "seq_length=128", "max_position_embeddings=128",
         "micro_batch_size=2", "global_batch_size=2", "vocab_size=256"]
COMMON = ["mock_data=true", "bf16=true", "lr_warmup_iters=0", "train_iters=1000",
          "hidden_dropout=0", "attention_dropout=0", "stderr_sink_level=WARNING"]


def fp8_gemms(hlo: str) -> int:
    """FP8 matmuls in compiled HLO: cuBLASLt FP8 custom calls, or dots taking f8 operands."""
    calls = len(re.findall(r"__cublas\$lt\$matmul\$f8", hlo))
    dots = len(re.findall(r"= [a-z0-9\[\],{}]+ dot\(f8e", hlo))
    return calls + dots


def measure(name: str, model: list[str], steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from jaxtrain.config import load_config
    from jaxtrain.loop import build

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*model, *COMMON, *RECIPES[name], f"workspace={tmp}"],
                          world_size=jax.device_count())
        run = build(cfg)
        t = run.tcfg
        M = t.global_batch_size // (t.micro_batch_size * t.data_parallel_size)
        shape = (M, run.rows, t.seq_length)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, run.model_cfg.vocab_size, shape, dtype=np.int32)
        batch = run.put_batch({"tokens": tokens, "targets": np.roll(tokens, -1, -1),
                               "loss_mask": np.ones(shape, np.float32)})
        compiled = run.step_fn.lower(run.state, batch).compile()
        state, times = run.state, []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics["loss"])
            if i >= warmup:
                times.append(time.perf_counter() - start)
        step = statistics.median(times)
        return {"recipe": name, "step_s": step, "tokens_per_s": tokens.size / step,
                "loss": float(metrics["loss"]), "fp8_gemms": fp8_gemms(compiled.as_text()),
                "quant": str(run.model_cfg.quant), "device": jax.devices()[0].device_kind}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model, none vs fp8-delayed")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = ["none", "fp8-delayed"] if args.smoke else args.recipes.split(",")
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    rows = []
    for name in names:
        try:
            rows.append(measure(name, SMOKE if args.smoke else MODEL, steps, warmup))
        except Exception as e:  # noqa: BLE001 - a recipe that cannot run shows why
            rows.append({"recipe": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    base = next((r["step_s"] for r in rows if r["recipe"] == "none" and "step_s" in r), None)
    print(f"{'recipe':16} {'step ms':>9} {'tokens/s':>11} {'vs none':>8} {'fp8 GEMMs':>9} loss")
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:16} {r['error']}")
            continue
        speedup = f"{base / r['step_s']:.2f}x" if base else "-"
        print(f"{r['recipe']:16} {1e3 * r['step_s']:9.1f} {r['tokens_per_s']:11.0f} "
              f"{speedup:>8} {r['fp8_gemms']:9d} {r['loss']:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
