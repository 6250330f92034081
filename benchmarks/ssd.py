"""Mamba-2's state-space scan: tokens/s of the chunked form (SSD: masked C.B^T products within
chunks, lax.scan across them) against the token-by-token recurrence.

    python benchmarks/ssd.py [--lengths 256,1024,4096] [--chunk 128] [--batch 1]

Forward and forward+backward of one Mamba-2 layer's scan (Nemotron-H 8B's per-layer shape
divided by 8: 16 heads of 64, one group, state 128 by default) at each sequence length, jitted,
best of 5 timed runs after a warm-up. Prints one row per length: tokens/s of each form,
forward and forward+backward, and the chunked form's ratio to the recurrence.
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
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--state", type=int, default=128)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels.ssd import chunked_ssd, recurrent_ssd

    B, H, P, G, N = args.batch, args.heads, args.head_dim, args.groups, args.state
    forms = {"chunked": lambda *a: chunked_ssd(*a, chunk_size=args.chunk)[0],
             "recurrent": lambda *a: recurrent_ssd(*a)[0]}
    print(f"device {jax.devices()[0].device_kind}; B={B} H={H} P={P} G={G} N={N} "
          f"chunk={args.chunk}; tokens/s (higher is better), fwd | fwd+bwd")
    print(f"{'T':>6} " + " ".join(f"{n + ' fwd':>14} {n + ' fwd+bwd':>18}" for n in forms)
          + f" {'chunked/recurrent':>20}")
    for T in (int(t) for t in args.lengths.split(",")):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(B, T, H, P)), jnp.float32)
        dt = jax.nn.softplus(jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32))
        A = -jnp.exp(jnp.asarray(rng.uniform(0, 2, size=H), jnp.float32))
        Bm, Cm = (jnp.asarray(rng.normal(size=(B, T, G, N)), jnp.float32) for _ in range(2))
        ins = (x, dt, A, Bm, Cm)
        row = {}
        for name, f in forms.items():
            fwd = jax.jit(f)
            grad = jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a)), argnums=(0, 1, 2, 3, 4)))
            row[name] = (B * T / _best(fwd, ins), B * T / _best(grad, ins))
        c, r = row["chunked"], row["recurrent"]
        print(f"{T:>6} " + " ".join(f"{a:>14.0f} {b:>18.0f}" for a, b in row.values())
              + f" {c[0] / r[0]:>9.1f} {c[1] / r[1]:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
