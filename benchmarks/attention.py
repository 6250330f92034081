"""Attention TFLOP/s: our Pallas flash kernel vs cuDNN vs the XLA reference, fwd and fwd+bwd.

    python benchmarks/attention.py [--dtype bf16] [--iters 20] [--warmup 3] [--json out.json]
    python benchmarks/attention.py --shape 2x8192x32x8x128 --window 4096 --sinks
    python benchmarks/attention.py --smoke        # tiny shapes, runs on CPU (interpret mode)

Shapes are BxTxHqxHkvxD with S = T. FLOPs count the (query, key) pairs that are visible:
forward = 4 * B * Hq * D * pairs, where pairs = T * S without masking, about half of that
for causal attention (T * (T + 1) / 2), less again with a window; backward = 2.5 x forward,
so fwd+bwd = 3.5 x forward. Each cell is the median of --iters timed calls after --warmup
calls. "xla" is the jnp reference under jit (it materializes the score matrix, so long
sequences may run out of memory); "cudnn" is jax.nn.dot_product_attention(implementation=
"cudnn"), which has no sinks or softcap and runs only on NVIDIA GPUs. A cell that cannot
run shows why, shortened.
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
    B: int
    T: int
    Hq: int
    Hkv: int
    D: int
    window: int | None = None
    sinks: bool = False

    @property
    def label(self) -> str:
        extra = (f" w={self.window}" if self.window else "") + (" sinks" if self.sinks else "")
        return f"{self.B}x{self.T}x{self.Hq}x{self.Hkv}x{self.D}{extra}"


# About 32k tokens per call, sequence 1k-32k, head dims 64/128, GQA 1-8, window and sinks.
DEFAULT_SHAPES = [
    Shape(32, 1024, 32, 32, 128), Shape(16, 2048, 32, 8, 128), Shape(8, 4096, 32, 8, 128),
    Shape(4, 8192, 32, 8, 128), Shape(2, 16384, 32, 8, 128), Shape(1, 32768, 32, 8, 128),
    Shape(8, 4096, 32, 32, 64), Shape(8, 4096, 64, 8, 64),
    Shape(4, 8192, 32, 8, 128, window=4096), Shape(4, 8192, 64, 8, 64, window=128, sinks=True),
]
SMOKE_SHAPES = [Shape(1, 64, 2, 1, 32), Shape(1, 96, 4, 2, 32, window=32, sinks=True)]
IMPLS = ("flash", "cudnn", "xla")


def visible_pairs(T: int, S: int, causal: bool, window: int | None) -> int:
    """Number of (query, key) pairs that attend (queries aligned at the end of the keys)."""
    import numpy as np
    pos = np.arange(T, dtype=np.int64) + (S - T)
    hi = np.minimum(pos, S - 1) if causal else np.full(T, S - 1)
    lo = np.maximum(pos - window + 1, 0) if window else np.zeros(T, np.int64)
    return int(np.maximum(hi - lo + 1, 0).sum())


def _attention_fn(impl: str, shape: Shape, causal: bool):
    """(q, k, v, sinks) -> out for one implementation."""
    import jax

    from kernels.flash_attention import flash_attention, reference_attention

    if impl == "flash":
        return lambda q, k, v, s: flash_attention(
            q, k, v, causal=causal, sliding_window=shape.window, sinks=s, interpret=None)
    if impl == "xla":
        return lambda q, k, v, s: reference_attention(q, k, v, causal=causal,
                                                      sliding_window=shape.window, sinks=s)
    if shape.sinks:
        raise NotImplementedError("cuDNN attention has no sinks")
    window = None if shape.window is None else (shape.window - 1, 0 if causal else shape.window - 1)
    return lambda q, k, v, s: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn")



def measure(impl: str, shape: Shape, dtype, causal: bool, warmup: int, iters: int) -> dict:
    """TFLOP/s forward and forward+backward for one implementation and shape."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(keys[0], (shape.B, shape.T, shape.Hq, shape.D), dtype)
    k = jax.random.normal(keys[1], (shape.B, shape.T, shape.Hkv, shape.D), dtype)
    v = jax.random.normal(keys[2], (shape.B, shape.T, shape.Hkv, shape.D), dtype)
    cot = jax.random.normal(keys[3], q.shape, dtype)
    sinks = jax.random.normal(keys[4], (shape.Hq,), jnp.float32) if shape.sinks else None
    flops = 4 * shape.B * shape.Hq * shape.D * visible_pairs(shape.T, shape.T, causal,
                                                              shape.window)
    row = {"impl": impl, "shape": shape.label, **dataclasses.asdict(shape),
           "dtype": jnp.dtype(dtype).name, "causal": causal, "fwd_flops": flops}
    try:
        attend = _attention_fn(impl, shape, causal)
        forward = jax.jit(attend)

        @jax.jit
        def forward_backward(q, k, v, sinks):
            out, vjp = jax.vjp(attend, q, k, v, sinks)
            return out, vjp(cot)

        fwd_s = median_seconds(forward, (q, k, v, sinks), warmup, iters)
        both_s = median_seconds(forward_backward, (q, k, v, sinks), warmup, iters)
    except Exception as err:  # noqa: BLE001 - a cell that cannot run is reported, not fatal
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:60]}"
        return row
    row.update(fwd_ms=fwd_s * 1e3, fwd_bwd_ms=both_s * 1e3, fwd_tflops=flops / fwd_s / 1e12,
               fwd_bwd_tflops=3.5 * flops / both_s / 1e12)
    return row


def format_table(rows: list[dict]) -> str:
    header = (f"{'shape':<28} {'impl':<6} {'fwd ms':>9} {'fwd TF/s':>9} {'f+b ms':>9} "
              f"{'f+b TF/s':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:<28} {r['impl']:<6} {r['error']}")
        else:
            lines.append(f"{r['shape']:<28} {r['impl']:<6} {r['fwd_ms']:>9.3f} "
                         f"{r['fwd_tflops']:>9.3f} {r['fwd_bwd_ms']:>9.3f} "
                         f"{r['fwd_bwd_tflops']:>9.3f}")
    return "\n".join(lines)


def _parse_shape(text: str) -> Shape:
    try:
        B, T, Hq, Hkv, D = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want BxTxHqxHkvxD") from None
    return Shape(B, T, Hq, Hkv, D)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=_parse_shape, action="append",
                    help="BxTxHqxHkvxD (repeatable); default: a grid of 1k-32k sequences")
    ap.add_argument("--window", type=int, help="sliding window for --shape entries")
    ap.add_argument("--sinks", action="store_true", help="attention sinks for --shape entries")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, 1 warm-up and 2 timed calls: checks the script on CPU")
    args = ap.parse_args(argv)

    import jax

    if args.smoke:
        shapes, args.warmup, args.iters = SMOKE_SHAPES, 1, 2
    elif args.shape:
        shapes = [dataclasses.replace(s, window=args.window, sinks=args.sinks) for s in args.shape]
    else:
        shapes = DEFAULT_SHAPES
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - set(IMPLS)
    if unknown:
        ap.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    device = jax.devices()[0].device_kind
    print(f"device: {device} ({jax.default_backend()}), dtype {args.dtype}, "
          f"{'non-causal' if args.non_causal else 'causal'}, median of {args.iters} after "
          f"{args.warmup} warm-up", flush=True)
    rows = []
    print(format_table([]))
    for shape in shapes:
        for impl in impls:
            rows.append(measure(impl, shape, args.dtype, not args.non_causal, args.warmup,
                                args.iters))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)  # a row as it comes
    if args.json:
        args.json.write_text(json.dumps({"device": device, "backend": jax.default_backend(),
                                         "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
