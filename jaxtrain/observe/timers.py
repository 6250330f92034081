"""Host-side phase timers (Megatron's ``timing_log_level`` / ``timing_log_option``) and the
straggler report (``log_straggler``).

A timer has a level: 0 is the whole step, 1 a once-per-step phase (fetching the batch, saving
a checkpoint), 2 a finer one. Timers above ``timing_log_level`` cost nothing. With
``barrier_with_L1_time`` all processes meet at a barrier before a level-1 timer starts, so its
time excludes waiting for slower processes. Across processes each timer is combined as the
``max``, the ``min`` and ``max``, or ``all`` (one value per process).
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time

import jax
import numpy as np

log = logging.getLogger("jaxtrain.observe")


def gather(value: float) -> np.ndarray:
    """One float from every process, in process order."""
    if jax.process_count() == 1:
        return np.asarray([value], np.float64)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray([value], np.float32),
                                                        tiled=True), np.float64)


def barrier(name: str):
    """Wait for every process (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Timers:
    """``with timers("batch", level=1): ...`` accumulates seconds; ``collect()`` returns the
    ``time/<name>`` row fields combined across processes and resets."""

    def __init__(self, level: int = 0, option: str = "minmax", barrier_l1: bool = True,
                 clock=time.perf_counter, sync=barrier, allgather=gather):
        self.level, self.option, self.barrier_l1 = level, option, barrier_l1
        self.clock, self.sync, self.allgather = clock, sync, allgather
        self.elapsed: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg) -> Timers:
        return cls(cfg["timing_log_level"], cfg["timing_log_option"], cfg["barrier_with_L1_time"])

    def enabled(self, level: int) -> bool:
        return level <= self.level

    @contextlib.contextmanager
    def __call__(self, name: str, level: int = 1):
        if not self.enabled(level):
            yield
            return
        if level == 1 and self.barrier_l1:
            self.sync(f"timer-{name}")
        start = self.clock()
        try:
            yield
        finally:
            self.elapsed[name] = self.elapsed.get(name, 0.0) + self.clock() - start

    def add(self, name: str, seconds: float, level: int = 0):
        """Record a time measured elsewhere (e.g. the step time)."""
        if self.enabled(level):
            self.elapsed[name] = self.elapsed.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds accumulated so far, cleared (to be :meth:`merge`-d back later)."""
        taken, self.elapsed = self.elapsed, {}
        return taken

    def merge(self, seconds: dict[str, float]):
        """Add seconds from :meth:`take` back in."""
        _add(self.elapsed, seconds)

    def merge_into(self, seconds: dict[str, float]):
        """Move the seconds accumulated so far into ``seconds`` (a dict from :meth:`take`)."""
        _add(seconds, self.take())

    def collect(self) -> dict[str, float]:
        """Row fields for the timers since the last call. Every process must call it at the
        same steps when there are several (the values are gathered)."""
        out = {}
        for name in sorted(self.elapsed):
            values = self.allgather(self.elapsed[name])
            if self.option == "max":
                out[f"time/{name}"] = float(values.max())
            elif self.option == "minmax":
                out[f"time/{name}_min"] = float(values.min())
                out[f"time/{name}_max"] = float(values.max())
            else:
                out.update({f"time/{name}/p{i}": float(v) for i, v in enumerate(values)})
        self.elapsed = {}
        return out


def _add(into: dict[str, float], seconds: dict[str, float]):
    for name, value in seconds.items():
        into[name] = into.get(name, 0.0) + value


class Stragglers:
    """Names the ``count`` slowest and fastest processes by step time (``log_straggler``)."""

    def __init__(self, enabled: bool, count: int = 1, allgather=gather):
        self.on, self.count, self.allgather = enabled, max(1, count), allgather

    @classmethod
    def from_config(cls, cfg) -> Stragglers:
        return cls(cfg["log_straggler"], cfg["straggler_minmax_count"])

    def report(self, step: int, step_time_s: float) -> str | None:
        """Gather the step time of every process and log the extremes; every process calls it
        at the same steps. Returns the line (None when off)."""
        if not self.on:
            return None
        times = self.allgather(step_time_s)
        order = np.argsort(times)
        k = min(self.count, len(times))
        slow = ", ".join(f"process {i} {times[i]:.3f}s" for i in order[::-1][:k])
        fast = ", ".join(f"process {i} {times[i]:.3f}s" for i in order[:k])
        line = f"step {step} stragglers: slowest {slow}; fastest {fast}"
        log.info("%s", line)
        return line


def median_seconds(fn, args, warmup: int, iters: int) -> float:
    """Median wall time of ``fn(*args)`` to completion over ``iters`` calls, after ``warmup``
    untimed ones (compilation, caches): the benchmarks' measure of a device call."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
