"""Pipeline schedules simulated: bubble fraction and peak activation memory per schedule.

    python benchmarks/pp_schedules.py [--ranks 4] [--microbatches 8] [--chunks 2]
        [--costs 1,2,1] [--table SCHEDULE]

From per-stage costs F, B (input gradient) and W (weight gradient) in any unit, times each of
jaxtrain.parallel.schedules' tables (GPipe, 1F1B, interleaved 1F1B with --chunks virtual
stages, ZB-H1, ZB-H2, the zero-bubble V) and prints the share of the step each rank idles
(mean and worst), the step length, and the most microbatch-activations a rank holds at once
(one unit per microbatch and chunk; a split backward keeps half a unit until its W). The
published bubble of each is printed beside it. ``--table NAME`` prints that schedule's table.
Schedules without a split backward run B and W together (cost B + W).

Beside the simulation, the columns ``ticks`` and ``slots`` come from the program the executor
compiles (jaxtrain.parallel.pipeline.lower, one layer per stage): its tick count, and the
stage inputs its buffers hold per rank at most (what the compiled step allocates; one slot is
one microbatch's [b, T, D] input of a chunk). ``tick-step`` is that program's length with each
tick as long as its slowest op, and ``lockstep`` its length when the ranks run in lockstep
(context parallelism inside the stages: every op kind of a tick runs on every rank, so a tick
lasts the sum of its kinds' costs); ``cp-cost`` is their ratio.
"""
from __future__ import annotations

import argparse
import sys


def published(name: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """The bubble fraction the literature gives (synchronous step, equal stages)."""
    work = m * (f + b + w)
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "1f1b-interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        idle = (p - 1) * (f + b - w)
        return idle / (work + idle)
    if name == "zb-h2":   # the synchronous lower bound: the last stage's first input
        return (p - 1) * f / (work + (p - 1) * f)
    return None


def tick_costs(prog, f: float, b: float, w: float) -> tuple[float, float]:
    """(the program's length with each tick as long as its slowest op, its length in lockstep:
    each tick as long as the sum of the op kinds some rank runs in it)."""
    cost = {"F": f, "BW": b + w, "Bx": b, "W": w}
    kinds = [k for k, _ in prog.branches]
    plain = locked = 0.0
    for row in prog.rows[:, :, 0]:
        used = {kinds[i] for i in row if i}
        plain += max((cost[k] for k in used), default=0.0)
        locked += sum(cost[k] for k in used)
    return plain, locked


def main(argv=None) -> int:
    from jaxtrain.models import ModelConfig
    from jaxtrain.parallel import pipeline
    from jaxtrain.parallel import schedules as S

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2, help="virtual stages per rank (interleaved)")
    ap.add_argument("--costs", default="1,2,1", help="F,B,W per stage")
    ap.add_argument("--table", help="print this schedule's table")
    args = ap.parse_args(argv)
    f, b, w = (float(x) for x in args.costs.split(","))
    p, m, v = args.ranks, args.microbatches, args.chunks
    print(f"{p} ranks, {m} microbatches, costs F={f} B={b} W={w}")
    print(f"{'schedule':<18}{'bubble':>8}{'worst':>8}{'published':>11}{'step':>8}{'memory':>8}"
          f"{'ticks':>7}{'slots':>7}{'tick-step':>11}{'lockstep':>10}{'cp-cost':>9}")
    for name in S.SCHEDULES:
        try:
            sched = S.build(name, p, m, v, costs=(f, b, w))
        except ValueError as e:
            print(f"{name:<18}  {e}")
            continue
        t = S.simulate(sched, f, b, w)
        ref = published(name, p, m, v, f, b, w)
        stages = p * sched.chunks
        cfg = ModelConfig(num_layers=stages, hidden_size=8, num_attention_heads=1,
                          ffn_hidden_size=8, vocab_size=8)
        prog = pipeline.lower(sched, cfg, tuple((s, s + 1) for s in range(stages)))
        plain, locked = tick_costs(prog, f, b, w)
        print(f"{name:<18}{t.bubble_fraction:>8.3f}{max(t.bubble):>8.3f}"
              f"{'' if ref is None else f'{ref:.3f}':>11}{t.makespan:>8.1f}"
              f"{max(t.peak_memory):>8.1f}{prog.ticks:>7}{prog.x_slots:>7}"
              f"{plain:>11.1f}{locked:>10.1f}{locked / plain:>9.2f}")
        if name == args.table:
            print(sched.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
