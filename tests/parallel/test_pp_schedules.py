"""jaxtrain.parallel.schedules: every schedule's table is complete and runs, and the
simulator's bubble fractions are the published ones (synchronous step, equal stages)."""
import collections

import pytest

from jaxtrain.parallel import schedules as S

SIZES = [(2, 4), (4, 8), (4, 12), (8, 16)]


def _check_complete(sched):
    """Each (kind, microbatch, stage) exactly once; F, B and (split) W on every stage."""
    seen = collections.Counter((op.kind, op.microbatch, sched.stage(r, op.chunk))
                               for r, order in enumerate(sched.orders) for op in order)
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "B")
    stages = sched.ranks * sched.chunks
    assert set(seen.values()) == {1}
    assert set(seen) == {(k, mb, s) for k in kinds for mb in range(sched.microbatches)
                         for s in range(stages)}


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (3.0, 5.0)])
def test_gpipe_and_1f1b_bubble_and_memory(p, m, f, b):
    for name, memory in (("gpipe", m), ("1f1b", p)):
        sched = S.build(name, p, m)
        _check_complete(sched)
        t = S.simulate(sched, f, b)
        assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert t.peak_memory[0] == memory


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_divides_the_bubble_by_v(p, m, v):
    sched = S.build("1f1b-interleaved", p, m, v)
    _check_complete(sched)
    t = S.simulate(sched, 1.0, 2.0)
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    one = S.simulate(S.build("1f1b", p, m), 1.0, 2.0).bubble_fraction
    assert t.bubble_fraction < one


def test_interleaved_group_size_must_divide_the_microbatches():
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        S.build("1f1b-interleaved", 4, 6, 2)
    _check_complete(S.build("1f1b-interleaved", 4, 6, 2, group=2))


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0)])
def test_zero_bubble_h1_and_h2(p, m, costs):
    f, b, w = costs
    work = m * (f + b + w)
    h1 = S.build("zb-h1", p, m, costs=costs)
    _check_complete(h1)
    t1 = S.simulate(h1, f, b, w)
    idle = (p - 1) * (f + b - w)   # Qi et al.: 1F1B's bubble less one W per stage
    assert t1.bubble_fraction == pytest.approx(idle / (work + idle), abs=1e-12)
    assert max(t1.peak_memory) <= 2 * p   # 1F1B's p plus held weight gradients
    h2 = S.build("zb-h2", p, m, costs=costs)
    _check_complete(h2)
    t2 = S.simulate(h2, f, b, w)
    assert t2.bubble_fraction <= t1.bubble_fraction
    if m >= 2 * p:   # the synchronous floor: the last stage waits for its first input
        floor = (p - 1) * f / (work + (p - 1) * f)
        assert t2.bubble_fraction == pytest.approx(floor, abs=1e-12)


def test_zero_bubble_h2_nears_zero_with_enough_microbatches():
    t = S.simulate(S.build("zb-h2", 4, 64, costs=(1, 2, 1)), 1, 2, 1)
    assert t.bubble_fraction < 0.015
    assert S.simulate(S.build("1f1b", 4, 64), 1, 2, 1).bubble_fraction > 2 * t.bubble_fraction


@pytest.mark.parametrize("p,m", SIZES + [(3, 3), (4, 4)])
def test_zero_bubble_v(p, m):
    sched = S.build("zbv", p, m, costs=(1, 2, 1))
    _check_complete(sched)
    assert sched.stage(0, 0) == 0 and sched.stage(0, 1) == 2 * p - 1
    t = S.simulate(sched, 0.5, 1.0, 0.5)   # 2p stages: half the work each
    h1 = S.simulate(S.build("zb-h1", p, m, costs=(1, 2, 1)), 1, 2, 1)
    assert t.bubble_fraction < h1.bubble_fraction


def test_a_table_that_waits_on_itself_is_refused():
    bad = S.Schedule("bad", 2, 1, 1, False, ((S.Op("B", 0), S.Op("F", 0)),
                                            (S.Op("F", 0), S.Op("B", 0))))
    with pytest.raises(ValueError, match="deadlocks"):
        S.simulate(bad)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        S.build("2f2b", 2, 2)


def test_table_text():
    assert S.build("1f1b", 2, 2).table() == "rank 0: F0 F1 B0 B1\nrank 1: F0 B0 F1 B1"
    assert S.build("1f1b-interleaved", 2, 2, 2).table().startswith("rank 0: F0.0 F1.0 F0.1")


def test_lockstep_cost_of_context_parallel_stages():
    """benchmarks/pp_schedules.py's tick costs of the compiled program: in lockstep (context
    parallelism inside the stages) GPipe's ticks hold one op kind each, so nothing changes;
    1F1B's steady state runs F and B in one tick, which then costs their sum."""
    import sys

    from jaxtrain.models import ModelConfig
    from jaxtrain.parallel import pipeline
    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pp_schedules import tick_costs

    cfg = ModelConfig(num_layers=4, hidden_size=8, num_attention_heads=1, ffn_hidden_size=8,
                      vocab_size=8)
    costs = {}
    for name in ("gpipe", "1f1b"):
        prog = pipeline.lower(S.build(name, 4, 8, 1), cfg, tuple((s, s + 1) for s in range(4)))
        costs[name] = tick_costs(prog, 1.0, 2.0, 0.0)
    assert costs["gpipe"][0] == costs["gpipe"][1] == (8 + 3) * 3.0
    plain, locked = costs["1f1b"]
    assert locked > plain and locked <= plain * 1.5
