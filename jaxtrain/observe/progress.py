"""Console progress with an ETA, and Megatron's ``progress.txt`` (``log_progress``).

:class:`Progress` serves any long piece of work (training steps, preprocessing, imports). The
rate, and so the ETA, is measured from the first update on, so a first step that compiles does
not skew it. On a terminal the line is redrawn in place; elsewhere a line is written at most
every ``min_interval_s`` seconds (and at the end).
"""
from __future__ import annotations

import datetime
import os
import pathlib
import sys
import time

PROGRESS_FILE = "progress.txt"


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class Rate:
    """Items per second since the first observation, and the time left for ``total``."""

    def __init__(self, total: int | None, clock=time.perf_counter):
        self.total, self.clock = total, clock
        self.t0 = self.n0 = None
        self.start = clock()

    def observe(self, done: int):
        if self.t0 is None:
            self.t0, self.n0 = self.clock(), done

    def per_s(self, done: int) -> float | None:
        if self.t0 is None or done <= self.n0:
            return None
        elapsed = self.clock() - self.t0
        return (done - self.n0) / elapsed if elapsed > 0 else None

    def eta_s(self, done: int) -> float | None:
        rate = self.per_s(done)
        if rate is None or not self.total:
            return None
        return max(0.0, self.total - done) / rate


class Progress:
    """``desc done/total (pct) | rate | elapsed | ETA | extra fields``.

    ``update(done, **fields)`` sets the count (``advance(n)`` adds to it); ``fields`` such as
    ``tok_s=1234.0`` or ``MFU="41.0%"`` are shown after the ETA.
    """

    def __init__(self, total: int | None, desc: str = "", unit: str = "it", stream=None,
                 min_interval_s: float = 1.0, clock=time.perf_counter):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s, self.clock = min_interval_s, clock
        self.rate = Rate(total, clock)
        self.done, self.fields = 0, {}
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = None

    def advance(self, n: int = 1, **fields):
        self.update(self.done + n, **fields)

    def update(self, done: int, **fields):
        self.rate.observe(done)
        self.done = done
        self.fields.update(fields)
        now = self.clock()
        if self._last_draw is None or now - self._last_draw >= self.min_interval_s or (
                self.total and done >= self.total):
            self._draw()
            self._last_draw = now

    def line(self) -> str:
        head = f"{self.desc} " if self.desc else ""
        parts = [head + (f"{self.done}/{self.total}" if self.total else f"{self.done}")
                 + (f" ({100 * self.done / self.total:.0f}%)" if self.total else "")]
        rate = self.rate.per_s(self.done)
        if rate is not None:
            parts.append(f"{rate:.2f} {self.unit}/s" if rate < 10 else f"{rate:.0f} {self.unit}/s")
        parts.append(f"elapsed {format_duration(self.clock() - self.rate.start)}")
        eta = self.rate.eta_s(self.done)
        parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA ?")
        for key, value in self.fields.items():
            if value is not None:
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else
                             f"{key} {value}")
        return " | ".join(parts)

    def _draw(self):
        text = self.line()
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self):
        """Draw the final state (and end the redrawn line on a terminal)."""
        self._draw()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def progress(iterable, total: int | None = None, desc: str = "", **kw):
    """Iterate while showing a :class:`Progress`."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = Progress(total, desc, **kw)
    try:
        for item in iterable:
            yield item
            bar.advance()
    finally:
        bar.close()


class ProgressLog:
    """Megatron's ``log_progress``: lines appended to ``progress.txt`` in the run directory at
    the job's start, at each checkpoint save and at its end, with the consumed tokens, the
    floating-point operations so far and the throughput."""

    def __init__(self, directory: pathlib.Path | None, num_devices: int = 1,
                 clock=time.perf_counter):
        self.path = pathlib.Path(directory) / PROGRESS_FILE if directory is not None else None
        self.num_devices, self.clock = num_devices, clock
        self.start, self.start_flops = clock(), None

    @classmethod
    def from_config(cls, cfg, run_dir, num_devices: int, is_main_process: bool = True
                    ) -> ProgressLog:
        on = cfg["log_progress"] and is_main_process
        return cls(pathlib.Path(run_dir) if on else None, num_devices)

    def _append(self, text: str):
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        job = os.environ.get("SLURM_JOB_ID", "")
        with self.path.open("a") as f:
            f.write(f"{stamp}\tJob ID: {job}\t# devices: {self.num_devices}\t{text}\n")

    def job_start(self, step: int, flops_so_far: float = 0.0):
        self.start, self.start_flops = self.clock(), flops_so_far
        self._append(f"Starting job\tIteration: {step}")

    def checkpoint(self, step: int, tokens_so_far: float, flops_so_far: float):
        """After a checkpoint save at ``step``."""
        self._append(f"Saved checkpoint\t{self._stats(step, tokens_so_far, flops_so_far)}")

    def job_end(self, step: int, tokens_so_far: float, flops_so_far: float):
        self._append(f"Job finished\t{self._stats(step, tokens_so_far, flops_so_far)}")

    def _stats(self, step, tokens, flops) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        job_flops = flops - (self.start_flops or 0.0)
        tflops = job_flops / elapsed / self.num_devices / 1e12
        return (f"Iteration: {step}\tJob throughput: {tflops:.3f} TFLOP/s/device\t"
                f"Floating-point operations: {flops:.2e}\tTokens (in billions): "
                f"{tokens / 1e9:.6f}")
