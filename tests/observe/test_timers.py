"""Phase timers (level, cross-process combination, L1 barrier) and the straggler report."""
import logging

import numpy as np
import pytest

from jaxtrain.observe import Stragglers, Timers
from jaxtrain.observe import timers as timers_mod


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.5
        return self.now


def _two_processes(value):
    return np.asarray([value, 3 * value])  # process 1 is three times slower


def _timed(c, allgather=_two_processes):
    barriers = []
    timers = Timers.from_config(c)
    timers.clock, timers.sync, timers.allgather = _Clock(), barriers.append, allgather
    timers.add("step", 2.0, level=0)
    with timers("batch", level=1):
        pass
    with timers("device_put", level=2):
        pass
    return timers.collect(), barriers


def test_timing_log_level(cfg):
    assert set(_timed(cfg())[0]) == {"time/step_min", "time/step_max"}
    assert set(_timed(cfg("timing_log_level=1"))[0]) == {
        "time/step_min", "time/step_max", "time/batch_min", "time/batch_max"}
    assert len(_timed(cfg("timing_log_level=2"))[0]) == 6


@pytest.mark.parametrize("option, expected", [
    ("max", {"time/step": 6.0, "time/batch": 1.5}),
    ("minmax", {"time/step_min": 2.0, "time/step_max": 6.0, "time/batch_min": 0.5,
                "time/batch_max": 1.5}),
    ("all", {"time/step/p0": 2.0, "time/step/p1": 6.0, "time/batch/p0": 0.5,
             "time/batch/p1": 1.5})])
def test_timing_log_option(cfg, option, expected):
    got, _ = _timed(cfg("timing_log_level=1", f"timing_log_option={option}"))
    assert got == expected


def test_barrier_before_level_one_timers(cfg):
    assert _timed(cfg("timing_log_level=2"))[1] == ["timer-batch"]
    assert _timed(cfg("timing_log_level=2", "barrier_with_L1_time=false"))[1] == []
    assert _timed(cfg())[1] == []  # no level-1 timer runs at level 0


def test_one_process_gathers_its_own_value(cfg):
    got, _ = _timed(cfg("timing_log_option=all"), allgather=timers_mod.gather)
    assert got == {"time/step/p0": 2.0}
    timers_mod.barrier("noop")  # one process: returns at once


def test_straggler_report(cfg, caplog):
    assert Stragglers.from_config(cfg()).report(1, 1.0) is None
    report = Stragglers.from_config(cfg("log_straggler=true", "straggler_minmax_count=2"))
    report.allgather = lambda t: np.asarray([t, 2.0, 0.5, 1.5])
    with caplog.at_level(logging.INFO, "jaxtrain.observe"):
        line = report.report(7, 1.0)
    assert line == ("step 7 stragglers: slowest process 1 2.000s, process 3 1.500s; "
                    "fastest process 2 0.500s, process 0 1.000s")
    assert line in caplog.text
    single = Stragglers.from_config(cfg("log_straggler=true", "straggler_minmax_count=3"))
    assert single.report(1, 0.25) == ("step 1 stragglers: slowest process 0 0.250s; "
                                      "fastest process 0 0.250s")
