"""Collectives of the compiled train step: how many of each kind, and the bytes they move.

    python benchmarks/collectives.py CONFIG --devices N [key=value ...] [--json OUT]
    python benchmarks/collectives.py --cp-matrix [--devices 8]

The train step is compiled for N fake CPU devices from abstract state (as ``aot_memory.py``
does) and its optimised HLO read: each all-gather, all-reduce, reduce-scatter, all-to-all and
collective-permute instruction, with the bytes of its result per device. Instructions inside a
loop body (scanned layers, microbatch loops) are counted once: compile with
``scan_layers=false`` and one microbatch for per-step totals. The CPU compiler's partitioning
is the one read here; a GPU compile partitions the same way but may combine or make
collectives asynchronous (``-start``/``-done`` pairs, counted once).

``--cp-matrix`` prints the table for context parallelism (issue #23): a 2-layer model at
sequence 1024 with each cp_comm_type at CP 4 (and a2a+p2p as 2 x 2), against CP 1.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"= (?P<type>\S.*?) (?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n * _BYTES[dtype]


def count(hlo: str) -> dict:
    """{kind: {"count": n, "bytes": b}} of the collectives in optimised HLO text: the bytes of
    each instruction's result (an async start's largest buffer, its output)."""
    out = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        sizes = [_bytes(*s) for s in _SHAPE.findall(m["type"])]
        out[m["op"]]["count"] += 1
        out[m["op"]]["bytes"] += max(sizes) if m["start"] else sum(sizes)
    return dict(out)


def analyse(config: str | None, overrides: list[str], devices: int) -> dict:
    """Collectives of the train step compiled for ``devices`` devices."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from aot_memory import compile_step

    run, _, compiled = compile_step(config, overrides, devices)
    return {"mesh": {k: v for k, v in run.layout.mesh.shape.items() if v > 1},
            "collectives": count(compiled.as_text())}


CP_MODEL = ["mock_data=true", "vocab_size=256", "seq_length=1024",
            "max_position_embeddings=1024", "num_layers=2", "hidden_size=256",
            "num_attention_heads=8", "group_query_attention=true", "num_query_groups=4", "ffn_hidden_size=512", "micro_batch_size=1", "bf16=false",
            "attention_dropout=0", "hidden_dropout=0", "scan_layers=false",
            "use_distributed_optimizer=false", "train_iters=1", "lr_warmup_iters=0"]
CP_RUNS = {
    "cp1": [],
    "p2p": ["context_parallel_size=4", "cp_comm_type=p2p"],
    "all_gather": ["context_parallel_size=4", "cp_comm_type=all_gather"],
    "a2a": ["context_parallel_size=4", "cp_comm_type=a2a"],
    "a2a+p2p 2x2": ["context_parallel_size=4", "cp_comm_type=a2a+p2p",
                    "hierarchical_context_parallel_sizes=[2,2]"],
}


def cp_matrix(devices: int) -> dict:
    """The CP table: one microbatch per data-parallel replica, layers unrolled."""
    out = {}
    for name, extra in CP_RUNS.items():
        cp = int(extra[0].split("=")[1]) if extra else 1
        out[name] = analyse(None, [*CP_MODEL, f"global_batch_size={devices // cp}", *extra],
                            devices)
    return out


def _table(results: dict) -> str:
    lines = [f"{'run':14s} " + " ".join(f"{k:>24s}" for k in KINDS)]
    for name, r in results.items():
        cells = [r["collectives"].get(k, {"count": 0, "bytes": 0}) for k in KINDS]
        lines.append(f"{name:14s} " + " ".join(
            f"{c['count']:>6d} x {c['bytes'] / 2 ** 20:>10.3f} MiB  " for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cp-matrix", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.cp_matrix:
        results = cp_matrix(args.devices)
    else:
        config = args.config if args.config and "=" not in args.config else None
        overrides = args.overrides if config else [*filter(None, [args.config]),
                                                   *args.overrides]
        results = {"run": analyse(config, overrides, args.devices)}
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
