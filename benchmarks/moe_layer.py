"""Tokens/s of one MoE layer (router, dispatch, experts, combine), forward and forward+backward.

    python benchmarks/moe_layer.py [--dtype bfloat16] [--iters 20] [--warmup 3] [--json out.json]
    python benchmarks/moe_layer.py --shape 8192x4096x14336x8x2
    python benchmarks/moe_layer.py --smoke      # tiny shapes, runs on CPU

Shapes are TxHxFxExK as in benchmarks/moe.py (tokens, hidden, expert FFN, experts, top-k); the
layer is `jaxtrain.models.moe.moe_block` with SwiGLU experts and a softmax top-k router, the
tokens a [T/2048, 2048, H] batch (one sequence when T < 2048). Modes: "ragged_dot" (dropless,
XLA's grouped matmul), "gmm" (dropless, the Pallas grouped GEMM: moe_grouped_gemm), "padded"
(capacity factor 1, fixed [E, capacity] buffers: moe_pad_expert_input_to_capacity). Each cell
is the median of --iters timed calls after --warmup calls, on one device (no expert
parallelism). A cell that cannot run shows why, shortened.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxtrain.observe.timers import median_seconds  # noqa: E402

SHAPES = ["8192x4096x14336x8x2", "8192x2048x1024x64x8", "8192x7168x2048x256x8"]
SMOKE = ["256x64x128x8x2"]
MODES = {"ragged_dot": {}, "gmm": {"grouped_gemm": True},
         "padded": {"capacity_factor": 1.0, "pad_to_capacity": True}}



def measure(shape: str, dtype: str, warmup: int, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxtrain.models import ModelConfig
    from jaxtrain.models.moe import MoEConfig, moe_block
    from jaxtrain.models.params import init

    T, H, F, E, K = (int(v) for v in shape.split("x"))
    seq = min(T, 2048)
    rows = []
    for mode, kw in MODES.items():
        row = {"shape": shape, "mode": mode}
        try:
            cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=1, kv_channels=8,
                              ffn_hidden_size=F, vocab_size=128, dtype=dtype,
                              weight_dtype=dtype,
                              moe=MoEConfig(num_experts=E, topk=K, **kw))
            p = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0)[0],
                             init(cfg, jax.random.key(0))["moe_layers"]["moe"])
            x = jax.random.normal(jax.random.key(1), (T // seq, seq, H), jnp.dtype(dtype))

            def fwd(p, x):
                return moe_block(p, x, cfg, train=True)[0]

            def fwd_bwd(p, x):
                return jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32)),
                                argnums=(0, 1))(p, x)

            for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                seconds = median_seconds(jax.jit(fn), (p, x), warmup, iters)
                row[f"{name}_tokens_per_s"] = T / seconds
        except Exception as e:  # noqa: BLE001 - report the cell and go on
            row["error"] = f"{type(e).__name__}: {e}"[:120]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="TxHxFxExK (repeatable)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    shapes = args.shape or (SMOKE if args.smoke else SHAPES)
    rows = [r for s in shapes for r in measure(s, args.dtype, args.warmup, args.iters)]
    for r in rows:
        cells = r.get("error") or "  ".join(
            f"{k[:-13]} {r[k]:,.0f} tok/s" for k in ("fwd_tokens_per_s", "fwd_bwd_tokens_per_s"))
        print(f"{r['shape']:>24}  {r['mode']:>10}  {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    raise SystemExit(cli.run(main))
