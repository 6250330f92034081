"""Context-parallel attention against one device (the cases: context_cases.py), in a process of
its own with 8 CPU devices (the suite's processes keep one)."""
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_context_parallel_attention_cases():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "python_files=context_cases.py", "-o", "addopts=",
                          str(HERE / "context_cases.py")],
                         capture_output=True, text=True, env=env, cwd=HERE.parents[1],
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "16 passed" in run.stdout, run.stdout[-2000:]
