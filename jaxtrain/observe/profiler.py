"""XLA profiler traces over a window of training steps, and the on-demand profiler server.

The window, in the loop's 1-based step numbers:

- Megatron ``profile``: the steps after ``profile_step_start`` steps have run, through step
  ``profile_step_end`` (Megatron counts finished iterations: 10 and 12 trace steps 11 and 12).
- MaxText ``profiler: xplane`` (its default in MaxText files, or when set): after skipping
  ``skip_first_n_steps_for_profiler`` steps of this run, ``profiler_steps`` steps.

MaxText's ``profiler: nsys`` brackets the same window with ``cudaProfilerStart`` /
``cudaProfilerStop`` of ``libcudart.so`` (for ``nsys profile --capture-range=cudaProfilerApi``)
instead of a jax trace; without that library it warns and profiles nothing, as MaxText does.

Only processes in ``profile_ranks`` trace. Traces are ``jax.profiler`` traces under
``<run dir>/profile/plugins/profile/<time>/``: ``<host>.xplane.pb`` for TensorBoard/XProf, a
gzipped Chrome trace, and with ``profiler_perfetto_trace`` a ``perfetto_trace.json.gz``.
Steps inside the window are wrapped in ``StepTraceAnnotation``; outside it nothing is traced
or annotated. Megatron's torch-profiler switches map to ``jax.profiler.ProfileOptions``:
``torch_profiler_with_stack`` (with ``use_pytorch_profiler``) turns on the Python tracer,
``disable_profiler_activity_cpu`` sets the host tracer level to 0.
"""
from __future__ import annotations

import ctypes
import logging
import pathlib

import jax

log = logging.getLogger("jaxtrain.observe")
TRACE_DIR = "profile"
SERVER_PORT = 9012  # + process index: the jax.profiler server for on-demand captures


def profile_options(python_tracer: bool, host_activity: bool):
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    options.host_tracer_level = 2 if host_activity else 0
    return options


class ProfileWindow:
    """Starts a trace before step ``first`` and stops it after step ``last`` (inclusive)."""

    def __init__(self, first: int | None, last: int | None, trace_dir: pathlib.Path,
                 options=None, perfetto: bool = False, server_port: int | None = None,
                 nsys: bool = False):
        self.first, self.last = first, last
        self.nsys, self._cudart = nsys, None
        self.trace_dir = pathlib.Path(trace_dir)
        self.options = options if options is not None else profile_options(False, True)
        self.perfetto = perfetto
        self.tracing = False
        self._annotation = None
        self.server_port = server_port
        if server_port is not None:
            jax.profiler.start_server(server_port)
            log.info("profiler server on port %d: capture from TensorBoard/XProf", server_port)

    @classmethod
    def from_config(cls, cfg, run_dir, process_index: int = 0, first_step: int = 1
                    ) -> ProfileWindow:
        """The window the config asks for on this process; ``first_step`` is the first step of
        this run (after a resume), from which MaxText counts its skipped steps."""
        trace_dir = pathlib.Path(run_dir) / TRACE_DIR
        port = SERVER_PORT + process_index if cfg["run_workload_inspector_server"] else None
        maxtext_on = cfg["profiler"] in ("xplane", "nsys")
        first = last = None
        if process_index in (cfg["profile_ranks"] or ()) or cfg["upload_all_profiler_results"]:
            if cfg["profile"]:
                first, last = cfg["profile_step_start"] + 1, cfg["profile_step_end"]
            elif maxtext_on:
                first = first_step + cfg["skip_first_n_steps_for_profiler"]
                last = first + cfg["profiler_steps"] - 1
        options = profile_options(
            python_tracer=cfg["use_pytorch_profiler"] and cfg["torch_profiler_with_stack"],
            host_activity=not cfg["disable_profiler_activity_cpu"])
        return cls(first, last, trace_dir, options, cfg["profiler_perfetto_trace"], port,
                   nsys=cfg["profiler"] == "nsys" and not cfg["profile"])

    @property
    def active(self) -> bool:
        """Whether any step will be traced."""
        return self.first is not None and self.last is not None and self.last >= self.first

    def step_begin(self, step: int):
        """Call before dispatching ``step``: starts the trace at the window's first step and
        opens the step's annotation inside the window."""
        if self.active and step == self.first and not self.tracing:
            if self.nsys:
                self._cuda_profiler("cudaProfilerStart")
            else:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                jax.profiler.start_trace(str(self.trace_dir), create_perfetto_trace=self.perfetto,
                                         profiler_options=self.options)
                self.tracing = True
                log.info("profiling steps %d-%d into %s", self.first, self.last, self.trace_dir)
        if self.tracing:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def step_end(self, step: int, block_on=None):
        """Call after dispatching ``step``; at the window's last step, waits for ``block_on``
        (the step's outputs) so the device work is in the trace, then stops the trace."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.tracing and step >= self.last:
            if block_on is not None:
                jax.block_until_ready(block_on)
            self._stop()

    def close(self):
        """Stop a trace the run left open (it ended inside the window) and the server."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.tracing:
            self._stop()
        if self.server_port is not None:
            jax.profiler.stop_server()
            self.server_port = None

    def _stop(self):
        if self.nsys:
            self._cuda_profiler("cudaProfilerStop")
            return
        jax.profiler.stop_trace()
        self.tracing = False
        log.info("profile written under %s", self.trace_dir)

    def _cuda_profiler(self, call: str):
        """profiler: nsys: start or stop the CUDA profiler's capture range."""
        if self._cudart is None and call == "cudaProfilerStart":
            try:
                self._cudart = ctypes.cdll.LoadLibrary("libcudart.so")
            except OSError as e:
                log.warning("profiler nsys: cannot load libcudart.so (%s); nothing is profiled",
                            e)
                return
        if self._cudart is None:
            return
        getattr(self._cudart, call)()
        self.tracing = call == "cudaProfilerStart"
        log.info("profiler nsys: %s at step %s", call,
                 self.first if self.tracing else self.last)
