"""Optimizer state in host memory: paged_adamw8bit, optimizer_memory_host_offload (MaxText) and
optimizer_cpu_offload (Megatron, with optimizer_offload_fraction and pin_cpu_params).

The state's shardings get a host memory kind (:func:`with_opt_state_memory_kind`); the train
step reads such state with ``jax.device_put`` to device memory and writes the new state back
with these shardings (MaxText's scheme).
"""
from __future__ import annotations

import jax

from jaxtrain.optim.config import OptimConfig

HOST_MEMORY = "pinned_host"
UNPINNED_HOST_MEMORY = "unpinned_host"


def opt_state_memory_kind(opt_cfg: OptimConfig, device=None) -> str | None:
    """Memory kind for the optimizer state's shardings: ``'pinned_host'`` when the config asks
    for host-resident state (paged_adamw8bit, optimizer_memory_host_offload,
    optimizer_cpu_offload) and ``device`` (default: the first device) offers pinned host memory
    (``'unpinned_host'`` with Megatron's ``pin_cpu_params: false``); ``None`` means device
    memory.

    The train step reads such state with ``jax.device_put`` to device memory and writes the new
    state back with these shardings (MaxText's scheme). Paging on demand (bitsandbytes' CUDA
    unified memory) has no XLA equivalent, so paged_adamw8bit is *mapped* to this."""
    if not opt_cfg.host_offload:
        return None
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memory kinds keeps state on device
        return None
    wanted = HOST_MEMORY if opt_cfg.pin_host_memory else UNPINNED_HOST_MEMORY
    return wanted if wanted in kinds else None


def with_opt_state_memory_kind(shardings, opt_cfg: OptimConfig, device=None, abstract=None):
    """``shardings`` (a tree of Shardings for the optimizer state) placed per
    :func:`opt_state_memory_kind`. With ``optimizer_offload_fraction`` < 1 (and ``abstract``,
    the state's shapes), only the first leaves holding that share of the state's bytes go to
    the host, in tree order (Megatron offloads that share of the parameters' state)."""
    kind = opt_state_memory_kind(opt_cfg, device)
    if kind is None:
        return shardings
    if abstract is None or opt_cfg.offload_fraction >= 1.0:
        return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)]
    budget, placed, flat = opt_cfg.offload_fraction * sum(sizes), 0, []
    leaves, treedef = jax.tree.flatten(shardings)
    for s, size in zip(leaves, sizes):
        host = placed + size <= budget
        placed += size if host else 0
        flat.append(s.with_memory_kind(kind) if host else s)
    return jax.tree.unflatten(treedef, flat)
