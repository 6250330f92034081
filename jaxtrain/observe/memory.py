"""Device memory: statistics the backend reports, and pprof memory profiles.

``use_rocm_mem_info`` (Primus reads ``rocm-smi``) is served by ``Device.memory_stats()``, which
both the CUDA and ROCm backends of XLA fill in; CPUs report nothing, and then nothing is added.
``record_memory_history`` writes ``jax.profiler.save_device_memory_profile`` (pprof: the live
device buffers and the Python stacks that allocated them; view with ``pprof -http=: FILE``) to
``memory_snapshot_path`` after the first step and when a step runs out of memory.
"""
from __future__ import annotations

import logging
import pathlib

import jax

log = logging.getLogger("jaxtrain.observe")
GIB = 2 ** 30
_STATS = {"bytes_in_use": "mem_bytes_in_use", "peak_bytes_in_use": "mem_peak_bytes_in_use",
          "bytes_limit": "mem_bytes_limit"}
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def device_memory_stats(devices=None) -> dict[str, int]:
    """The largest ``bytes_in_use``, ``peak_bytes_in_use`` and ``bytes_limit`` over the local
    devices, as ``mem_*`` row keys; empty where the backend reports none."""
    out: dict[str, int] = {}
    for device in devices if devices is not None else jax.local_devices():
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
            stats = {}
        for name, key in _STATS.items():
            if stats.get(name) is not None:
                out[key] = max(out.get(key, 0), int(stats[name]))
    return out


class MemoryReport:
    """Device memory in the metrics row: every step with ``use_rocm_mem_info``, else at the
    steps listed in ``use_rocm_mem_info_iters``."""

    def __init__(self, every_step: bool, steps=(), devices=None):
        self.every_step, self.steps, self.devices = every_step, set(steps or ()), devices

    @classmethod
    def from_config(cls, cfg) -> MemoryReport:
        return cls(cfg["use_rocm_mem_info"], cfg["use_rocm_mem_info_iters"])

    def due(self, step: int) -> bool:
        return self.every_step or step in self.steps

    def fields(self, step: int) -> dict[str, int]:
        """``mem_*`` keys for the row of ``step`` when it is due (and the backend reports)."""
        if not self.due(step):
            return {}
        stats = device_memory_stats(self.devices)
        if stats:
            log.info("device memory at step %d: %s", step, ", ".join(
                f"{k[4:]} {v / GIB:.2f} GiB" for k, v in stats.items()))
        return stats


class MemoryProfile:
    """Writes a device memory profile (pprof) once after the first step and on out-of-memory."""

    def __init__(self, path: pathlib.Path | None):
        self.path = path
        self.written = False

    @classmethod
    def from_config(cls, cfg, run_dir, process_index: int = 0) -> MemoryProfile:
        """Off unless ``record_memory_history``; a relative ``memory_snapshot_path`` is in the
        run directory, and processes other than 0 add ``.<process>`` to the name."""
        if not cfg["record_memory_history"]:
            return cls(None)
        path = pathlib.Path(cfg["memory_snapshot_path"])
        if not path.is_absolute():
            path = pathlib.Path(run_dir) / path
        if process_index:
            path = path.with_name(f"{path.name}.{process_index}")
        return cls(path)

    def dump(self) -> pathlib.Path | None:
        """Write the profile of the buffers alive now; returns the file."""
        if self.path is None:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        jax.profiler.save_device_memory_profile(str(self.path))
        self.written = True
        log.info("device memory profile (pprof) written to %s", self.path)
        return self.path

    def step_end(self, step: int):
        """After a step: the first call writes the profile."""
        if self.path is not None and not self.written:
            self.dump()

    def on_error(self, error: BaseException) -> bool:
        """Write the profile if ``error`` is an out-of-memory error; True if written."""
        if self.path is None or not any(m in str(error) for m in OOM_MARKERS):
            return False
        try:
            self.dump()
        except Exception as e:  # noqa: BLE001 - the OOM itself is the error to report
            log.warning("could not write the memory profile after out-of-memory: %s", e)
            return False
        return True
