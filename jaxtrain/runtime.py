"""Choosing the JAX platform from ``hardware`` before any device is touched."""
from __future__ import annotations

import os

from jaxtrain.config.errors import ConfigError

_PLATFORMS = {"cpu": "cpu", "gpu": "cuda,rocm", "gpu_multiprocess": "cuda,rocm"}


def select_platform(cfg) -> str:
    """Point JAX at the configured hardware and return the backend it found.

    ``JAX_PLATFORMS`` in the environment wins (it is how a launcher pins a platform).
    A GPU asked for but absent is a ConfigError, not a silent fall-back to the CPU.
    """
    import jax

    wanted = os.environ.get("JAX_PLATFORMS") or _PLATFORMS[cfg["hardware"]]
    jax.config.update("jax_platforms", wanted)
    try:
        backend = jax.default_backend()
    except RuntimeError:
        raise ConfigError(f"hardware: {cfg['hardware']} asks for platform(s) {wanted}, but JAX "
                          f"finds none on this machine; set hardware=cpu to run on the CPU, or "
                          f"install the jax GPU plugin (pip install 'jax[cuda12]')") from None
    return backend
