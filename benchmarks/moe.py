"""MoE grouped GEMM TFLOP/s: our Pallas kernel vs lax.ragged_dot, forward and fwd+bwd.

    python benchmarks/moe.py [--dtype bfloat16] [--iters 20] [--warmup 3] [--json out.json]
    python benchmarks/moe.py --shape 8192x4096x14336x8x2 --tiling 128,64,128,8,3
    python benchmarks/moe.py --smoke      # tiny shapes, runs on CPU (interpret mode)

Shapes are TxHxFxExK: tokens, hidden size, expert FFN size, experts, top-k. Each shape times
the two grouped GEMMs of a SwiGLU expert layer on T*K routed rows sorted by expert:
"gate_up" [T*K, H] x [E, H, 2F] and "down" [T*K, F] x [E, F, H]. Group sizes come from
uniform random top-k routing (K distinct experts per token). FLOPs count the useful work,
2 * T*K * k_dim * n_dim forward; forward+backward (input and weight gradients) is 3x that.
Each cell is the median of --iters timed calls after --warmup calls; "err" is the forward
max |gmm - ragged_dot| / max |ragged_dot|. "gmm" is kernels.grouped_gemm (Triton Pallas on
GPU); "ragged_dot" is jax.lax.ragged_dot, which XLA on GPU expands to a dense dot doing E x
the FLOPs unless XLA_FLAGS holds --xla_gpu_experimental_use_ragged_dot_fusion=true (cuDNN,
NVIDIA) or --xla_gpu_experimental_use_ragged_dot_grouped_gemm=true
--xla_gpu_enable_cublaslt=true (hipBLASLt, MI300); set them to measure those paths. A cell
that cannot run (for example out of memory) shows why, shortened.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxtrain.observe.timers import median_seconds  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    name: str = ""

    @property
    def label(self) -> str:
        dims = f"{self.tokens}x{self.hidden}x{self.ffn}x{self.experts}x{self.topk}"
        return f"{self.name} {dims}" if self.name else dims

    def gemms(self):
        """(projection, k_dim, n_dim) of the expert layer's two grouped GEMMs."""
        return [("gate_up", self.hidden, 2 * self.ffn), ("down", self.ffn, self.hidden)]


# Expert layers of public MoE models at 8k tokens (DeepSeek-V3: the 32 experts one device
# holds under 8-way expert parallelism, 4k tokens).
DEFAULT_SHAPES = [
    Shape(8192, 4096, 14336, 8, 2, "mixtral-8x7b"),
    Shape(8192, 2048, 768, 128, 8, "qwen3-30b-a3b"),
    Shape(8192, 2880, 2880, 32, 4, "gpt-oss-20b"),
    Shape(8192, 2048, 1024, 64, 8, "olmoe-1b-7b"),
    Shape(4096, 7168, 2048, 32, 8, "deepseek-v3/ep8"),
]
SMOKE_SHAPES = [Shape(40, 24, 40, 6, 3, "tiny")]
IMPLS = ("gmm", "ragged_dot")


def route(shape: Shape, seed: int = 0):
    """Rows per expert [E] int32 for uniform random top-k routing of shape.tokens tokens."""
    import numpy as np
    rng = np.random.default_rng(seed)
    scores = rng.random((shape.tokens, shape.experts))
    chosen = np.argpartition(scores, -shape.topk, axis=1)[:, -shape.topk:]
    return np.bincount(chosen.ravel(), minlength=shape.experts).astype(np.int32)


def _matmul_fn(impl: str, tiling):
    from jax import lax

    from kernels.grouped_gemm import grouped_matmul

    if impl == "gmm":
        return lambda x, w, sizes: grouped_matmul(x, w, sizes, tiling=tiling, interpret=None)
    return lambda x, w, sizes: lax.ragged_dot(x, w, sizes)



def measure(shape: Shape, dtype, impls, tiling, warmup: int, iters: int) -> list[dict]:
    """Rows (one per projection and implementation) of ms and TFLOP/s, fwd and fwd+bwd."""
    import jax
    import jax.numpy as jnp

    sizes = jnp.asarray(route(shape))
    rows_total = shape.tokens * shape.topk
    out = []
    for proj, k_dim, n_dim in shape.gemms():
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        x = jax.random.normal(keys[0], (rows_total, k_dim), dtype)
        w = (jax.random.normal(keys[1], (shape.experts, k_dim, n_dim), dtype)
             * k_dim ** -0.5).astype(dtype)
        cot = jax.random.normal(keys[2], (rows_total, n_dim), dtype)
        flops = 2 * rows_total * k_dim * n_dim
        results = {}
        for impl in impls:
            row = {"impl": impl, "shape": shape.label, "proj": proj,
                   **dataclasses.asdict(shape), "dtype": jnp.dtype(dtype).name,
                   "fwd_flops": flops}
            try:
                matmul = _matmul_fn(impl, tiling)
                forward = jax.jit(matmul)

                @jax.jit
                def forward_backward(x, w, sizes, cot, matmul=matmul):
                    y, vjp = jax.vjp(lambda a, b: matmul(a, b, sizes), x, w)
                    return y, vjp(cot)

                results[impl] = forward(x, w, sizes)
                fwd_s = median_seconds(forward, (x, w, sizes), warmup, iters)
                both_s = median_seconds(forward_backward, (x, w, sizes, cot), warmup, iters)
            except Exception as err:  # noqa: BLE001 - a cell that cannot run is reported
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"
                out.append(row)
                continue
            row.update(fwd_ms=fwd_s * 1e3, fwd_bwd_ms=both_s * 1e3,
                       fwd_tflops=flops / fwd_s / 1e12, fwd_bwd_tflops=3 * flops / both_s / 1e12)
            out.append(row)
        if {"gmm", "ragged_dot"} <= results.keys():
            ref = results["ragged_dot"].astype(jnp.float32)
            err = jnp.max(jnp.abs(results["gmm"].astype(jnp.float32) - ref))
            for row in out[-len(impls):]:
                if row["impl"] == "gmm" and "error" not in row:
                    row["err"] = float(err / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
    return out


def format_table(rows: list[dict]) -> str:
    header = (f"{'shape':<34} {'proj':<8} {'impl':<10} {'fwd ms':>9} {'fwd TF/s':>9} "
              f"{'f+b ms':>9} {'f+b TF/s':>9} {'err':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        head = f"{r['shape']:<34} {r['proj']:<8} {r['impl']:<10}"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
            continue
        err = f"{r['err']:>8.1e}" if "err" in r else f"{'':>8}"
        lines.append(f"{head} {r['fwd_ms']:>9.3f} {r['fwd_tflops']:>9.3f} "
                     f"{r['fwd_bwd_ms']:>9.3f} {r['fwd_bwd_tflops']:>9.3f} {err}")
    return "\n".join(lines)


def _parse_shape(text: str) -> Shape:
    try:
        tokens, hidden, ffn, experts, topk = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want TxHxFxExK") from None
    if topk > experts:
        raise argparse.ArgumentTypeError(f"shape {text!r}: top-k above the expert count")
    return Shape(tokens, hidden, ffn, experts, topk)


def _parse_tiling(text: str):
    from kernels.grouped_gemm import Tiling
    try:
        values = [int(x) for x in text.split(",")]
        return Tiling(*values)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(
            f"tiling {text!r}: want block_m,block_k,block_n[,num_warps[,num_stages]] "
            f"({err})") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=_parse_shape, action="append",
                    help="TxHxFxExK (repeatable); default: expert layers of public MoE models")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--tiling", type=_parse_tiling,
                    help="gmm tiles for both kernels: block_m,block_k,block_n[,warps[,stages]] "
                         "(default: kernels.grouped_gemm.tuned_tiling)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, 1 warm-up and 2 timed calls: checks the script on CPU")
    args = ap.parse_args(argv)

    import jax

    if args.smoke:
        shapes, args.warmup, args.iters = SMOKE_SHAPES, 1, 2
    else:
        shapes = args.shape or DEFAULT_SHAPES
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    device = jax.devices()[0].device_kind
    print(f"device: {device} ({jax.default_backend()}), dtype {args.dtype}, median of "
          f"{args.iters} after {args.warmup} warm-up", flush=True)
    rows = []
    for shape in shapes:
        rows += measure(shape, args.dtype, impls, args.tiling, args.warmup, args.iters)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": device, "backend": jax.default_backend(),
                                         "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
