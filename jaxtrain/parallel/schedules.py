"""Pipeline schedules as tables, and a simulator that times them.

A schedule is, per pipeline rank, the ordered list of what that rank computes: the forward
``F`` of microbatch m on its model chunk c, the backward ``B`` (the input gradient; the whole
backward when the schedule does not split it) and, for zero-bubble schedules, the weight
gradient ``W`` deferred to fill idle time. Sends and receives follow from the order: an F
needs the previous stage's F of that microbatch, a B the next stage's B, a W its own B.

Chunks map to global stages as Megatron interleaves them (chunk c of rank r is stage
c·p + r); V schedules fold the second chunk back (stage 2p − 1 − r), so the first and last
stages share rank 0.

Generators: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (Megatron's
non-interleaved schedule), ``1f1b-interleaved`` (Megatron's virtual stages, microbatches in
groups of ``group`` per chunk), ``zb-h1`` and ``zb-h2`` (Qi et al. 2023: split backward,
1F1B's memory or about twice it, W filling the bubbles), ``zbv`` (the zero-bubble V
schedule, two chunks per rank) and ``1f1b-v`` (Primus's 1F1B-V: the V placement with whole
backwards). :func:`simulate` times a table from per-stage costs and
reports each rank's idle share of the step (the bubble) and its peak activation memory.

Legend: p ranks (pipeline stages per chunk), m microbatches, v chunks per rank.
"""
from __future__ import annotations

import dataclasses
import heapq

KINDS = ("F", "B", "W")


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str        # F, B or W
    microbatch: int
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    ranks: int
    chunks: int
    microbatches: int
    split_backward: bool          # B is the input gradient only, W the weight gradient
    orders: tuple                 # per rank: tuple[Op, ...]
    v_shape: bool = False

    def stage(self, rank: int, chunk: int) -> int:
        """The global stage that ``chunk`` of ``rank`` holds."""
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def table(self) -> str:
        """The table as text: one row per rank, ``F3.1`` = forward of microbatch 3, chunk 1."""
        rows = []
        for r, order in enumerate(self.orders):
            cells = [f"{op.kind}{op.microbatch}" + (f".{op.chunk}" if self.chunks > 1 else "")
                     for op in order]
            rows.append(f"rank {r}: " + " ".join(cells))
        return "\n".join(rows)


def gpipe(p: int, m: int) -> Schedule:
    orders = tuple(tuple([Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)])
                   for _ in range(p))
    return Schedule("gpipe", p, 1, m, False, orders)


def one_f_one_b(p: int, m: int) -> Schedule:
    """Megatron's 1F1B: rank r runs min(p − r − 1, m) forwards, then alternates F and B, then
    drains the remaining backwards."""
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Op("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order += [Op("F", f), Op("B", b)]
            f, b = f + 1, b + 1
        order += [Op("B", i) for i in range(b, m)]
        orders.append(tuple(order))
    return Schedule("1f1b", p, 1, m, False, tuple(orders))


def interleaved(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Megatron's interleaved 1F1B: the k-th forward of a rank is microbatch
    (k // (g·v))·g + k % g on chunk (k // g) % v (backwards take the chunks in reverse); rank
    r warms up with (p − r − 1)·2 + (v − 1)·g forwards. ``group`` g (Megatron's
    microbatch_group_size_per_vp_stage) defaults to p and must divide m."""
    g = group or p
    if m % g:
        raise ValueError(f"interleaved schedule: {m} microbatches are not a multiple of the "
                         f"group size {g} (microbatch_group_size_per_vp_stage)")
    total = m * v

    def ident(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // g) % v
        return (k // (g * v)) * g + k % g, (v - 1 - chunk) if backward else chunk

    orders = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * g, total)
        order = [Op("F", *ident(k, False)) for k in range(warm)]
        f, b = warm, 0
        while f < total:
            order += [Op("F", *ident(f, False)), Op("B", *ident(b, True))]
            f, b = f + 1, b + 1
        order += [Op("B", *ident(k, True)) for k in range(b, total)]
        orders.append(tuple(order))
    return Schedule("1f1b-interleaved", p, v, m, False, tuple(orders))


def zero_bubble(p: int, m: int, kind: str = "zb-h1", costs=(1.0, 1.0, 1.0),
                max_mem=None) -> Schedule:
    """ZB-H1 / ZB-H2 built by list scheduling with split backward: each rank, when free, runs
    its oldest pending W if 2p are pending, else a ready B, else a forward if fewer than its
    limit are in flight (F done, B not), else a pending W, else waits. The limit is p − r for
    H1 (1F1B's memory) and 2(p − r) − 1 for H2. ``costs`` = (F, B, W) time
    units (one for every stage). ``max_mem`` (per rank, Primus's pp_max_mem): at most that
    many microbatches' activations held (F done, W not), a forward waiting for a W."""
    limit = {"zb-h1": lambda r: p - r, "zb-h2": lambda r: 2 * (p - r) - 1}[kind]
    return _list_schedule(kind, p, m, limit, costs, v_shape=False, max_mem=max_mem)


def zbv(p: int, m: int, costs=(1.0, 1.0, 1.0), limit: int | None = None) -> Schedule:
    """The zero-bubble V schedule (two chunks per rank, stage r and 2p − 1 − r), by the same
    list scheduling with ``limit`` chunk forwards in flight per rank at most (default 2p − 1;
    p is about half of 1F1B's activation memory)."""
    n = 2 * p - 1 if limit is None else limit
    return _list_schedule("zbv", p, m, lambda r: n, costs, v_shape=True)


def one_f_one_b_v(p: int, m: int, costs=(1.0, 1.0, 1.0)) -> Schedule:
    """Primus's 1F1B-V: the V placement (stages r and 2p − 1 − r on rank r) with the backward
    whole (input and weight gradients together, no W ops), by list scheduling with at most
    2p − 1 chunk forwards in flight per rank (1F1B's activation memory). A free rank runs the
    ready op that starts first in 1F1B over 2p stages of one device each (the order each
    stage would keep with a device to itself)."""
    f, b, w = costs
    ideal = one_f_one_b(2 * p, m)
    start = {(op.kind, op.microbatch, st): t for st, (order, times) in enumerate(
        zip(ideal.orders, timeline(ideal, {"F": f, "B": b + w, "W": 0.0})))
        for op, t in zip(order, times)}
    return _list_schedule("1f1b-v", p, m, lambda r: 2 * p - 1, costs, v_shape=True,
                          split=False, order_key=lambda kind, mb, stage: start[kind, mb, stage])


def _list_schedule(name, p, m, limit, costs, v_shape, split=True, order_key=None,
                   max_mem=None) -> Schedule:
    """List scheduling (see :func:`zero_bubble`); ``split`` False: whole backwards, no W;
    ``order_key(kind, microbatch, stage)``: ready F/B ops run in its order instead of B first,
    the later chunk first; ``max_mem[r]``: the most microbatches rank r holds (F done, W
    not)."""
    v = 2 if v_shape else 1
    sched = Schedule(name, p, v, m, split, (), v_shape)
    n_stages = p * v
    cost = dict(zip(KINDS, costs))
    if not split:   # B is the whole backward
        cost["B"] += cost["W"]
    done: dict[tuple, float] = {}        # (kind, microbatch, stage) -> finish time
    free = [0.0] * p
    next_f = [[0] * v for _ in range(p)]   # next microbatch to forward per (rank, chunk)
    pending_b = [[] for _ in range(p)]     # (microbatch, chunk) whose F ran, B not yet
    pending_w = [[] for _ in range(p)]
    orders = [[] for _ in range(p)]
    events = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    remaining = (3 if split else 2) * m * n_stages

    def ready_at(kind, mb, stage):
        """When an op's inputs exist (None: not yet known)."""
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", mb, stage - 1))
        if kind == "B":
            own = done.get(("F", mb, stage))
            if own is None:
                return None
            nxt = own if stage == n_stages - 1 else done.get(("B", mb, stage + 1))
            return None if nxt is None else max(own, nxt)
        return done.get(("B", mb, stage))

    stalled = 0
    while remaining:
        now, r = heapq.heappop(events)
        if now < free[r]:
            continue
        stalled += 1
        if stalled > 1000 * p:
            raise ValueError(f"{name}: no rank can go on ({m} microbatches, {p} ranks)")
        candidates = []
        if len(pending_w[r]) >= 2 * p:   # held weight gradients bound the memory too
            mb, c = pending_w[r][0]
            candidates.append((-1, 0, mb, "W", c))
        def rank(kind, mb, c, default):
            return default if order_key is None else order_key(kind, mb, sched.stage(r, c))

        for mb, c in pending_b[r]:
            t = ready_at("B", mb, sched.stage(r, c))
            if t is not None and t <= now:
                candidates.append((rank("B", mb, c, 0), -c, mb, "B", c))
        for c in range(v):   # the limit holds back new microbatches (first chunk) only
            mb = next_f[r][c]
            t = ready_at("F", mb, sched.stage(r, c)) if mb < m else None
            held = len(pending_b[r]) + len(pending_w[r])
            if t is not None and t <= now and (c > 0 or len(pending_b[r]) < limit(r)) and (
                    max_mem is None or held < max_mem[r]):
                candidates.append((rank("F", mb, c, 1), -c, mb, "F", c))
        if not candidates and pending_w[r]:
            mb, c = pending_w[r][0]
            candidates.append((2, 0, mb, "W", c))
        if not candidates:
            later = [t for t in (ready_at(k, mb, sched.stage(r, c))
                                 for k, mb, c in _waiting(pending_b[r], next_f[r], m, v))
                     if t is not None and t > now]
            if later:
                heapq.heappush(events, (min(later), r))
            else:   # woken when another rank finishes something
                heapq.heappush(events, (min((f for f in free if f > now), default=now + 1), r))
            continue
        _, _, mb, kind, c = min(candidates)
        stage = sched.stage(r, c)
        end = now + cost[kind]
        done[(kind, mb, stage)] = end
        orders[r].append(Op(kind, mb, c))
        if kind == "F":
            next_f[r][c] += 1
            pending_b[r].append((mb, c))
        elif kind == "B":
            pending_b[r].remove((mb, c))
            if split:
                pending_w[r].append((mb, c))
        else:
            pending_w[r].pop(0)
        free[r] = end
        remaining, stalled = remaining - 1, 0
        heapq.heappush(events, (end, r))
    return dataclasses.replace(sched, orders=tuple(tuple(o) for o in orders))


def _waiting(pending_b, next_f, m, v):
    yield from (("B", mb, c) for mb, c in pending_b)
    yield from (("F", next_f[c], c) for c in range(v) if next_f[c] < m)


SCHEDULES = ("gpipe", "1f1b", "1f1b-interleaved", "zb-h1", "zb-h2", "zbv", "1f1b-v")


def build(name: str, p: int, m: int, v: int = 1, costs=(1.0, 2.0, 0.0),
          group: int | None = None) -> Schedule:
    """Schedule ``name`` (one of SCHEDULES) for p ranks and m microbatches; ``v`` chunks per
    rank for the interleaved schedule; ``costs`` (F, B, W) guide the zero-bubble ones."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "1f1b-interleaved":
        return interleaved(p, m, v, group)
    if name in ("zb-h1", "zb-h2"):
        return zero_bubble(p, m, name, costs)
    if name == "zbv":
        return zbv(p, m, costs)
    if name == "1f1b-v":
        return one_f_one_b_v(p, m, costs)
    raise ValueError(f"unknown pipeline schedule {name!r}; one of {SCHEDULES}")


@dataclasses.dataclass(frozen=True)
class Timing:
    makespan: float
    bubble: tuple          # per rank: idle share of the makespan
    peak_memory: tuple     # per rank: most microbatch-chunks' activations held at once

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def simulate(s: Schedule, f: float = 1.0, b: float = 2.0, w: float = 0.0,
             w_memory: float = 0.5) -> Timing:
    """Run the table with forward cost ``f``, backward ``b`` and weight-gradient ``w`` per
    stage (without a split backward, B costs b + w). Each op starts when its rank is free and
    its inputs exist (transfers take no time). Memory: a forward holds one unit until its
    backward; with a split backward, ``w_memory`` of it stays until the W."""
    cost = {"F": f, "B": b if s.split_backward else b + w, "W": w}
    starts = timeline(s, cost)
    ends = [[t + cost[op.kind] for op, t in zip(order, st)]
            for order, st in zip(s.orders, starts)]
    end = max(e[-1] for e in ends if e)
    busy = [sum(cost[op.kind] for op in order) for order in s.orders]
    peak = []
    for order in s.orders:
        mem = top = 0.0
        for op in order:
            mem += {"F": 1.0, "B": -(1.0 - w_memory) if s.split_backward else -1.0,
                    "W": -w_memory}[op.kind]
            top = max(top, mem)
        peak.append(top)
    return Timing(end, tuple((end - x) / end for x in busy), tuple(peak))


def deps(s: Schedule, rank: int, op: Op) -> list[tuple]:
    """The (kind, microbatch, stage) results ``op`` of ``rank`` waits for."""
    n_stages = s.ranks * s.chunks
    stage = s.stage(rank, op.chunk)
    if op.kind == "F":
        return [("F", op.microbatch, stage - 1)] if stage else []
    if op.kind == "B":
        nxt = [("B", op.microbatch, stage + 1)] if stage < n_stages - 1 else []
        return [("F", op.microbatch, stage)] + nxt
    return [("B", op.microbatch, stage)]


def timeline(s: Schedule, cost: dict) -> list[list[float]]:
    """Each op's start time, per rank in table order: it starts when its rank is free and its
    inputs exist; ``cost`` maps F/B/W to durations. A cycle of waits raises ValueError."""
    done: dict[tuple, float] = {}
    pos, t_rank = [0] * s.ranks, [0.0] * s.ranks
    starts = [[] for _ in range(s.ranks)]
    left = sum(len(o) for o in s.orders)
    while left:
        progressed = False
        for r, order in enumerate(s.orders):
            while pos[r] < len(order):
                op = order[pos[r]]
                need = deps(s, r, op)
                if any(d not in done for d in need):
                    break
                start = max([t_rank[r]] + [done[d] for d in need])
                starts[r].append(start)
                t_rank[r] = start + cost[op.kind]
                done[(op.kind, op.microbatch, s.stage(r, op.chunk))] = t_rank[r]
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            stuck = {r: s.orders[r][pos[r]] for r in range(s.ranks) if pos[r] < len(s.orders[r])}
            raise ValueError(f"schedule {s.name} deadlocks: ranks wait on {stuck}")
    return starts
