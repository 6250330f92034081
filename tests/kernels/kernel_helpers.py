"""Shared helpers for the kernel tests."""
import re
import subprocess

import jax

# Interpreted Pallas kernels become large XLA programs; unoptimized CPU codegen roughly
# halves their compile time, which dominates these tests.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_fast(fn, *args):
    """fn jitted and compiled with FAST_COMPILE for arguments shaped like args."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)


def run_fast(fn, *args):
    """compile_fast(fn, *args) called on args."""
    return compile_fast(fn, *args)(*args)


# Per vendor: Triton target, and the shared memory a block may use (H100 / MI300 LDS).
TARGETS = {"cuda": (("cuda", 90, 32), 227 * 1024), "rocm": (("hip", "gfx942", 64), 64 * 1024)}


def spilled(vendor, kernel, tmp_path):
    """True when the compiled kernel keeps values in scratch memory."""
    if vendor == "rocm":
        return int(re.search(r"\.vgpr_spill_count:\s+(\d+)", kernel.asm["amdgcn"]).group(1)) > 0
    import triton
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return "STACK:0 " not in usage
