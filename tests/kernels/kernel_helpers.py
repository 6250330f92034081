"""Shared helpers for the kernel tests."""
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
