"""Pallas kernels with plain-jnp references (DESIGN principle 7).

Each kernel package exports the fused op and its reference; GPU runs lower through
Pallas' Triton path (NVIDIA and AMD), CPU runs use Pallas interpret mode.
"""
