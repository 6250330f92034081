"""The gated delta rule: tokens/s of the chunked form (its walk across chunks by lax.scan, and
on a GPU by the Pallas kernel) against the token-by-token recurrence.

    python benchmarks/gated_delta.py [--lengths 256,1024,4096] [--chunk 64] [--batch 1]
        [--recurrent-up-to 4096] [--per-channel]

Forward and forward+backward of one Gated DeltaNet head group (Qwen3-Next's per-head widths,
4 value heads over 2 key heads by default) at each sequence length, jitted, best of 5 timed runs
after a warm-up. On a CPU this compares the two plain-JAX forms (the Pallas kernel's
interpret mode is not a speed figure, so it runs on GPUs only). Prints one row per length:
tokens/s of each form, forward and forward+backward, and the chunked forms' ratios to the
recurrence (the recurrence runs up to --recurrent-up-to tokens: its backward keeps every
step's [Dk, Dv] state, 65 GB at 4 x 16k tokens; longer rows show "-" there), and on a GPU the
kernel's ratio to the lax walk.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _best(fn, args, repeats=5) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--key-heads", type=int, default=2)
    ap.add_argument("--value-heads", type=int, default=4)
    ap.add_argument("--key-dim", type=int, default=128)
    ap.add_argument("--value-dim", type=int, default=128)
    ap.add_argument("--recurrent-up-to", type=int, default=4096)
    ap.add_argument("--per-channel", action="store_true",
                    help="a decay per key channel (Kimi Delta Attention) instead of per head")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels.gated_delta import (chunk_scan, chunked_gated_delta_rule,
                                     recurrent_gated_delta_rule)

    B, Hk, Hv, Dk, Dv = args.batch, args.key_heads, args.value_heads, args.key_dim, args.value_dim
    forms = {"chunked": lambda *a: chunked_gated_delta_rule(*a, chunk_size=args.chunk)[0],
             "recurrent": lambda *a: recurrent_gated_delta_rule(*a)[0]}
    if jax.default_backend() != "cpu":
        forms["kernel"] = lambda *a: chunked_gated_delta_rule(*a, chunk_size=args.chunk,
                                                              scan=chunk_scan)[0]
    print(f"device {jax.devices()[0].device_kind}; B={B} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} "
          f"chunk={args.chunk}, a decay per {'key channel' if args.per_channel else 'head'}; "
          f"tokens/s (higher is better), fwd | fwd+bwd")
    ratios = [n for n in forms if n != "recurrent"]
    print(f"{'T':>6} " + " ".join(f"{n + ' fwd':>14} {n + ' fwd+bwd':>18}" for n in forms)
          + " " + " ".join(f"{n + '/recurrent':>20}" for n in ratios)
          + (f" {'kernel/chunked':>20}" if "kernel" in forms else ""))
    for T in (int(t) for t in args.lengths.split(",")):
        rng = np.random.default_rng(0)
        q, k = (jnp.asarray(rng.normal(size=(B, T, Hk, Dk)), jnp.float32) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(B, T, Hv, Dv)), jnp.float32)
        g_shape = (B, T, Hv, Dk) if args.per_channel else (B, T, Hv)
        g = -jnp.abs(jnp.asarray(rng.normal(size=g_shape), jnp.float32))
        beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(B, T, Hv)), jnp.float32))
        ins = (q, k, v, g, beta)
        row = {}
        for name, f in forms.items():
            if name == "recurrent" and T > args.recurrent_up_to:
                continue
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a)), argnums=(0, 1, 2, 3, 4)))
            row[name] = (B * T / _best(fwd, ins), B * T / _best(grad, ins))
        cells = [f"{row[n][0]:>14.0f} {row[n][1]:>18.0f}" if n in row else f"{'-':>14} {'-':>18}"
                 for n in forms]

        def over(a, b, row=row):
            """a's tokens/s over b's, fwd and fwd+bwd ("-" where b did not run)."""
            if b not in row:
                return f"{'-':>9} {'-':>10}"
            return f"{row[a][0] / row[b][0]:>9.2f} {row[a][1] / row[b][1]:>10.2f}"

        print(f"{T:>6} " + " ".join(cells) + " " + " ".join(over(n, "recurrent") for n in ratios)
              + (" " + over("kernel", "chunked") if "kernel" in forms else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
