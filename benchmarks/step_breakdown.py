"""Where a train step's time goes: an XLA profile of steady-state steps, as tables.

    python benchmarks/step_breakdown.py CONFIG [key=value ...] [--warmup 3] [--steps 5]
        [--json OUT]

Runs the real training loop (``jaxtrain.loop.train``: data, dispatch, metrics, logging) with
Megatron's profile window on steps warmup+1..warmup+steps, has XLA dump the compiled step's
HLO, and joins the two: every op event of the trace is looked up by its HLO instruction name,
classified by what it computes, by the named scope it came from and by the pass (forward,
backward, remat recompute, optimizer update). Times are exclusive (an op's time without the
ops nested in it), per step, summed over XLA's worker threads on a CPU; on a GPU they are the
first GPU's "XLA Ops" stream.

Tables:

- ``categories``: matmuls (dots, convolutions, GEMM library calls and the fusions around
  them), fused attention (cuDNN) and Pallas kernels on a GPU, the cross-entropy over the
  vocabulary (the ``loss`` scope, its matmuls excluded), the optimizer update, data movement
  (copies, transposes, slices, broadcasts, gathers and scatters), other elementwise ops and
  reductions, collectives, control flow and the runtime (trace events that are no HLO op);
- ``scopes``: the same time by named scope (embed, attention, mlp, decoder_layer, final_norm,
  loss, optimizer) x pass;
- ``top_ops``: the costliest ops with their shapes and category;
- ``wall``: step wall time, the time some XLA thread was busy, and the host gap (the loop's
  own work while the device waits), plus the matmul roofline: the step's matmul FLOPs (XLA
  cost analysis) over the measured peak of one large matmul on this device.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile
import time

SCOPES = ("embed", "attention", "mlp", "final_norm", "decoder_layer", "loss", "optimizer")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
MATMULS = ("dot", "convolution", "ragged-dot")
MOVEMENT = {"copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice",
            "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reverse",
            "copy-start", "copy-done", "parameter", "constant", "tuple", "get-tuple-element",
            "iota", "convert"}
CONTROL = ("while", "conditional", "call")
WAIT = "ThunkExecutor::Execute (wait for completion)"

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z][\w-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body)=%([\w.-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERANDS = re.compile(r"%([\w.-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_LHS_CONTRACTING = re.compile(r'lhs_contracting_dim(?:s=\{([\d,]*)\}|ensions":\[([\d",]*)\])')
_WRAPPED = re.compile(r"^(?:\w+\()+")
_DIMS = re.compile(r"^\w+\[([\d,]*)\]")


@dataclasses.dataclass
class Op:
    name: str
    shape: str
    opcode: str
    calls: list
    op_name: str
    operands: list
    contracting: tuple = ()   # a dot's lhs contracting dimensions
    target: str = ""          # a custom call's target (cuBLAS GEMM, cuDNN, Triton/Pallas)


def parse_hlo(text: str) -> tuple[dict, dict]:
    """({instruction name: Op}, {computation name: [instruction names]}) of an HLO module's
    text (instruction names are unique in a module)."""
    ops, computations, current = {}, collections.defaultdict(list), None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, shape, opcode = m.groups()
        op_name = _OP_NAME.search(line)
        args = line[m.end():].split(")", 1)[0]
        contracting = _LHS_CONTRACTING.search(line)
        target = _TARGET.search(line)
        ops[name] = Op(name, shape, opcode, _CALLS.findall(line),
                       op_name.group(1) if op_name else "", _OPERANDS.findall(args),
                       _ints(contracting.group(1) or contracting.group(2))
                       if contracting else (), target.group(1).lower() if target else "")
        computations[current].append(name)
    return ops, computations


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.replace('"', "").split(",") if d)


def _dims(shape: str) -> list[int]:
    """The dimensions of a shape (a tuple's first element: a GEMM call's result)."""
    m = _DIMS.match(shape.lstrip("("))
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _inner(op: Op, ops: dict, computations: dict) -> list[Op]:
    """The op itself and the instructions of the computations it calls (fusions are flat)."""
    return [op] + [ops[n] for c in op.calls for n in computations.get(c, ()) if n in ops]


def matmul_flops(op: Op | None, ops: dict, computations: dict) -> int:
    """2*M*N*K summed over the dots an executed op (a dot or a fusion holding dots) runs."""
    if op is None or op.opcode in CONTROL:
        return 0
    total = 0
    for inner in _inner(op, ops, computations):
        gemm = inner.opcode == "custom-call" and "gemm" in inner.target
        if (inner.opcode == "dot" or gemm) and inner.operands and inner.operands[0] in ops:
            lhs = _dims(ops[inner.operands[0]].shape)
            k = 1
            for d in inner.contracting:
                k *= lhs[d]
            out = 1
            for d in _dims(inner.shape):
                out *= d
            total += 2 * out * k
    return total


def scope_of(op_name: str) -> str:
    """The innermost of jaxtrain's named scopes on an op's path, or "other"."""
    for part in reversed(op_name.split("/")):
        name = _WRAPPED.sub("", part).rstrip(")")   # jvp(loss) -> loss
        if name in SCOPES:
            return name
    return "other"


def pass_of(op_name: str) -> str:
    if scope_of(op_name) == "optimizer":
        return "update"
    if "rematted_computation" in op_name:
        return "recompute"
    return "backward" if "transpose(" in op_name else "forward"


def category(op: Op | None, ops: dict, computations: dict) -> str:
    """What an executed op computes (see the module docstring's list)."""
    if op is None:
        return "runtime"
    codes = ({i.opcode for i in _inner(op, ops, computations)}
             if op.opcode in ("fusion", "custom-call") else {op.opcode})
    base = lambda c: c.removesuffix("-start").removesuffix("-done")  # noqa: E731
    if any(base(c) in COLLECTIVES for c in codes):
        return "collectives"
    targets = {i.target for i in _inner(op, ops, computations) if i.target}
    if codes & set(MATMULS) or any("gemm" in t or "matmul" in t for t in targets):
        return "matmul"
    if any("fmha" in t or "cudnn" in t for t in targets):
        return "fused attention (cuDNN)"
    if any("triton" in t or "mosaic" in t or "pallas" in t for t in targets):
        return "Pallas kernels"
    if op.opcode in CONTROL:
        return "control flow"
    scope = scope_of(op.op_name)
    if scope == "loss":
        return "cross-entropy"
    if scope == "optimizer":
        return "optimizer update"
    if codes <= MOVEMENT:
        return "data movement"
    return "elementwise/reduction"


def exclusive_times(lines) -> list[tuple[str, int, int, int]]:
    """(event name, start ns, end ns, exclusive ns) of every event on these trace lines."""
    out = []
    for events in lines:
        stack = []   # [name, start, end, child time]
        for name, start, dur in sorted(events, key=lambda e: (e[1], -e[2])):
            while stack and start >= stack[-1][2]:
                done = stack.pop()
                out.append((done[0], done[1], done[2], done[2] - done[1] - done[3]))
            if stack:
                stack[-1][3] += dur
            stack.append([name, start, start + dur, 0])
        while stack:
            done = stack.pop()
            out.append((done[0], done[1], done[2], done[2] - done[1] - done[3]))
    return out


def busy_union(intervals) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def breakdown(events, ops: dict, computations: dict, steps: int, top: int = 15) -> dict:
    """The tables (milliseconds per step) from trace events [(name, start, dur)] per line."""
    timed = exclusive_times(events)
    per_cat, per_scope, per_op = (collections.Counter() for _ in range(3))
    counted, flops = [], 0
    for name, start, end, excl in timed:
        if name == WAIT:
            continue
        op = ops.get(name)
        cat = category(op, ops, computations)
        per_cat[cat] += excl
        if op is not None:
            per_scope[(scope_of(op.op_name), pass_of(op.op_name))] += excl
            per_op[name] += excl
            flops += matmul_flops(op, ops, computations)
            counted.append((start, end))
    ms = lambda ns: round(ns / 1e6 / steps, 2)  # noqa: E731
    total = sum(per_cat.values())
    starts = [s for s, _ in counted]
    ends = [e for _, e in counted]
    span = (max(ends) - min(starts)) if counted else 0
    return {
        "categories": {k: {"ms": ms(v), "share": round(v / total, 3)}
                       for k, v in per_cat.most_common()},
        "scopes": {f"{s}/{p}": ms(v) for (s, p), v in per_scope.most_common()},
        "top_ops": [{"op": n, "ms": ms(v), "shape": ops[n].shape, "opcode": ops[n].opcode,
                     "category": category(ops[n], ops, computations),
                     "scope": f"{scope_of(ops[n].op_name)}/{pass_of(ops[n].op_name)}"}
                    for n, v in per_op.most_common(top)],
        "thread_ms": ms(total),
        "busy_ms": ms(busy_union(counted)),
        "span_ms": ms(span),
        "matmul_gflop": flops / 1e9 / steps,
    }


def trace_events(xplane_path: str) -> list[list[tuple[str, int, int]]]:
    """(name, start ns, duration ns) per line that runs XLA ops: the first GPU's "XLA Ops"
    stream when the trace has a GPU, else the host's XLA execution threads (CPU backend)."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane_path)
    gpus = sorted(p.name for p in data.planes if p.name.startswith("/device:GPU:"))
    lines = []
    for plane in data.planes:
        if plane.name != (gpus[0] if gpus else "/host:CPU"):
            continue
        for line in plane.lines:
            if line.name == "XLA Ops" if gpus else line.name.startswith("tf_XLA"):
                lines.append([(e.name, e.start_ns, e.duration_ns) for e in line.events])
    return lines


def matmul_peak_gflops(n: int | None = None, repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` [n,n]x[n,n] matmuls on the default device: float32
    n=2048 on a CPU, bfloat16 n=8192 on an accelerator (its dense peak)."""
    import jax
    import jax.numpy as jnp

    cpu = jax.default_backend() == "cpu"
    n = n or (2048 if cpu else 8192)
    a = jnp.ones((n, n), jnp.float32 if cpu else jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def _step_module(dump_dir: str) -> str:
    files = sorted(glob.glob(f"{dump_dir}/*jit_step*after_optimizations.txt"),
                   key=os.path.getmtime)
    if not files:
        raise SystemExit(f"no compiled train step was dumped into {dump_dir}")
    with open(files[-1]) as f:
        return f.read()


def run(config: str, overrides: list[str], warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={tmp}/hlo",
             "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=.*jit_step.*"])
        import jax

        from jaxtrain.config import load_config
        from jaxtrain.logs import setup_logging
        from jaxtrain.loop import train
        from jaxtrain.runtime import select_platform

        extra = [f"train_iters={warmup + steps}", "log_interval=1", f"workspace={tmp}",
                 "exp_name=breakdown", "stderr_sink_level=WARNING", "profile=true",
                 f"profile_step_start={warmup}", f"profile_step_end={warmup + steps}",
                 "profile_ranks=[0]"]
        cfg = load_config(config, [*overrides, *extra])
        select_platform(cfg)
        cfg = load_config(config, [*overrides, *extra], world_size=jax.device_count())
        train(cfg, setup_logging(cfg))
        with open(f"{tmp}/breakdown/metrics.jsonl") as f:
            rows = [json.loads(line) for line in f][warmup:]
        hlo = _step_module(f"{tmp}/hlo")
        traces = glob.glob(f"{tmp}/breakdown/profile/**/*.xplane.pb", recursive=True)
        ops, computations = parse_hlo(hlo)
        table = breakdown(trace_events(traces[0]), ops, computations, steps)
    step_ms = sorted(r["step_time_s"] * 1e3 for r in rows)
    table["step_ms"] = round(step_ms[len(step_ms) // 2], 1)
    table["peak_gflops"] = round(matmul_peak_gflops(), 1)
    table["matmul_roofline_ms"] = round(table["matmul_gflop"] / table["peak_gflops"] * 1e3, 1)
    return table


def _print(table: dict):
    print(f"step {table['step_ms']} ms (median of the profiled steps)")
    print(f"  XLA threads busy (any): {table['busy_ms']} ms/step; op time summed over threads: "
          f"{table['thread_ms']} ms/step")
    print(f"  host gap (span - busy): {round(table['span_ms'] - table['busy_ms'], 2)} ms/step")
    if table.get("matmul_roofline_ms") is not None:
        print(f"  matmul roofline: {table['matmul_gflop']:.2f} GFLOP at "
              f"{table['peak_gflops']} GFLOP/s = {table['matmul_roofline_ms']} ms/step")
    print(f"\n{'category':<24}{'ms/step':>10}{'share':>8}")
    for k, v in table["categories"].items():
        print(f"{k:<24}{v['ms']:>10}{v['share']:>8.1%}")
    print(f"\n{'scope/pass':<32}{'ms/step':>10}")
    for k, v in table["scopes"].items():
        print(f"{k:<32}{v:>10}")
    print(f"\n{'op':<28}{'ms/step':>9}  {'category':<22}{'scope/pass':<26}shape")
    for r in table["top_ops"]:
        print(f"{r['op']:<28}{r['ms']:>9}  {r['category']:<22}{r['scope']:<26}{r['shape']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a config file, or '' for overrides only")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="also write the tables here")
    args = ap.parse_args(argv)
    table = run(args.config or None, args.overrides, args.warmup, args.steps)
    _print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
