"""Profile windows: which steps are traced, what the trace holds, and the profiler options."""
import gzip
import json
import socket

import jax
import jax.numpy as jnp

from jaxtrain.observe import ProfileWindow, profiler


@jax.jit
def _step(x):
    with jax.named_scope("attention_block"):
        y = jnp.tanh(x @ x)
    with jax.named_scope("mlp_block"):
        return jnp.sin(y) @ x


def _run(window, steps=6):
    x = jnp.ones((16, 16))
    for step in range(1, steps + 1):
        window.step_begin(step)
        out = _step(x)
        window.step_end(step, block_on=out)
    window.close()


def _files(window, suffix):
    return sorted(window.trace_dir.rglob(f"*{suffix}"))


def _trace_events(window):
    (path,) = _files(window, ".trace.json.gz")
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def _spy(monkeypatch):
    calls = []
    real_start, real_annotation = jax.profiler.start_trace, jax.profiler.StepTraceAnnotation
    monkeypatch.setattr(jax.profiler, "start_trace",
                        lambda *a, **k: (calls.append("start"), real_start(*a, **k))[1])
    monkeypatch.setattr(jax.profiler, "StepTraceAnnotation",
                        lambda name, **k: (calls.append(k["step_num"]),
                                           real_annotation(name, **k))[1])
    return calls


def test_megatron_window_traces_steps_3_and_4_only(cfg, tmp_path, monkeypatch):
    window = ProfileWindow.from_config(cfg("profile=true", "profile_step_start=2",
                                           "profile_step_end=4"), tmp_path / "run")
    assert (window.first, window.last) == (3, 4)
    calls = _spy(monkeypatch)
    _run(window)
    assert calls == ["start", 3, 4]  # nothing traced or annotated outside the window
    (xplane,) = _files(window, ".xplane.pb")
    assert str(xplane).startswith(str(tmp_path / "run" / "profile" / "plugins" / "profile"))
    data = xplane.read_bytes()
    assert b"attention_block" in data and b"mlp_block" in data  # the model's named scopes
    steps = [e["args"]["step_num"] for e in _trace_events(window) if e.get("name") == "train"]
    assert sorted(steps) == ["3", "4"]
    assert not _files(window, "perfetto_trace.json.gz")


def test_no_window_by_default_and_other_ranks(cfg, tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    for c, rank in ((cfg(), 0), (cfg("profile=true", "profile_step_start=0"), 1)):
        window = ProfileWindow.from_config(c, tmp_path / "run", process_index=rank)
        assert not window.active
        _run(window, 2)
    assert calls == [] and not (tmp_path / "run" / "profile").exists()
    c = cfg("profile=true", "profile_step_start=0", "profile_step_end=1", "profile_ranks=[1]")
    assert ProfileWindow.from_config(c, tmp_path / "run", process_index=1).active
    every = cfg("profile=true", "profile_step_start=0", "profile_step_end=1",
                "upload_all_profiler_results=true")   # MaxText: every process traces
    assert ProfileWindow.from_config(every, tmp_path / "run", process_index=3).active


def test_maxtext_window(cfg, tmp_path):
    assert not ProfileWindow.from_config(cfg("framework=maxtext"), tmp_path).active  # base.yml
    window = ProfileWindow.from_config(cfg("framework=maxtext", "profiler=xplane"), tmp_path)
    assert (window.first, window.last) == (2, 6)  # skip 1 step, profile 5 (MaxText base.yml)
    window = ProfileWindow.from_config(cfg("framework=maxtext", "profiler=xplane",
                                           "skip_first_n_steps_for_profiler=1",
                                           "profiler_steps=3"), tmp_path, first_step=11)
    assert (window.first, window.last) == (12, 14)  # counted from the resumed run's first step
    assert not ProfileWindow.from_config(cfg("framework=maxtext", "profiler="), tmp_path).active
    assert ProfileWindow.from_config(cfg("profiler=xplane"), tmp_path).active


def test_maxtext_nsys_brackets_the_window_with_the_cuda_profiler(cfg, tmp_path, monkeypatch,
                                                                   caplog):
    """profiler: nsys calls libcudart's cudaProfilerStart before the window's first step and
    cudaProfilerStop after its last (no jax trace); without the library it warns and runs."""
    calls = _spy(monkeypatch)
    events = []

    class Cudart:
        def cudaProfilerStart(self):
            events.append("start")

        def cudaProfilerStop(self):
            events.append("stop")

    monkeypatch.setattr(profiler.ctypes.cdll, "LoadLibrary",
                        lambda name: Cudart() if name == "libcudart.so" else None)
    knobs = ("framework=maxtext", "profiler=nsys", "skip_first_n_steps_for_profiler=1",
             "profiler_steps=2")
    window = ProfileWindow.from_config(cfg(*knobs), tmp_path)
    assert (window.first, window.last) == (2, 3)
    _run(window, 5)
    assert events == ["start", "stop"] and "start" not in calls
    assert not (tmp_path / "profile").exists()

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(profiler.ctypes.cdll, "LoadLibrary", missing)
    with caplog.at_level("WARNING", logger="jaxtrain.observe"):
        _run(ProfileWindow.from_config(cfg(*knobs), tmp_path), 5)
    assert "cannot load libcudart.so" in caplog.text and events == ["start", "stop"]


def _host_names(window):
    return {e.get("name", "") for e in _trace_events(window) if e.get("ph") == "X"}


def test_python_tracer_and_host_activity_options(cfg, tmp_path):
    base = ["profile=true", "profile_step_start=0", "profile_step_end=1"]
    traced = {}
    for name, extra in {"plain": [], "stack": ["use_pytorch_profiler=true"],
                        "no_stack": ["use_pytorch_profiler=true",
                                     "torch_profiler_with_stack=false"],
                        "no_cpu": ["disable_profiler_activity_cpu=true"]}.items():
        window = ProfileWindow.from_config(cfg(*base, *extra), tmp_path / name)
        _run(window, 1)
        traced[name] = _host_names(window)
    python = {n: any(s.startswith("$") for s in names) for n, names in traced.items()}
    assert python == {"plain": False, "stack": True, "no_stack": False, "no_cpu": False}
    assert "train" in traced["plain"] and "train" not in traced["no_cpu"]


def test_perfetto_trace_on_request(cfg, tmp_path):
    window = ProfileWindow.from_config(cfg("profile=true", "profile_step_start=0",
                                           "profile_step_end=1", "profiler_perfetto_trace=true"),
                                       tmp_path)
    _run(window, 2)
    (path,) = _files(window, "perfetto_trace.json.gz")
    assert "traceEvents" in json.loads(gzip.decompress(path.read_bytes()))


def test_a_run_ending_inside_the_window_still_writes_the_trace(cfg, tmp_path):
    window = ProfileWindow.from_config(cfg("profile=true", "profile_step_start=1",
                                           "profile_step_end=10"), tmp_path)
    _run(window, 3)
    assert not window.tracing and _files(window, ".xplane.pb")


def test_workload_inspector_server_accepts_connections(cfg, tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(profiler, "SERVER_PORT", port)
    assert ProfileWindow.from_config(cfg(), tmp_path).server_port is None
    window = ProfileWindow.from_config(cfg("run_workload_inspector_server=true"), tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        window.close()
