"""Are the copies of each parameter identical on every device that holds one?

Megatron's ``check_weight_hash_across_dp_replicas_interval``: replicas can drift apart only
through faulty hardware or a broken collective (silent data corruption), and finding it early
saves a run. Every device's shard is hashed on its host; the hashes of all processes are
gathered, and devices holding the same slice of a tensor must agree.
"""
from __future__ import annotations

import zlib

import jax
import numpy as np


def _local_hashes(leaves, devices) -> np.ndarray:
    """[leaves, devices] crc32 of each addressable shard (0 where another process holds it)."""
    column = {d.id: i for i, d in enumerate(devices)}
    table = np.zeros((len(leaves), len(devices)), np.int64)
    for row, leaf in enumerate(leaves):
        for shard in leaf.addressable_shards:
            data = np.ascontiguousarray(np.asarray(shard.data))
            table[row, column[shard.device.id]] = zlib.crc32(data.view(np.uint8).tobytes()) + 1
    return table


def replica_mismatches(tree) -> list[str]:
    """Paths of the leaves of ``tree`` (global jax Arrays) whose replicas differ."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not flat:
        return []
    paths, leaves = zip(*flat)
    devices = sorted({d for leaf in leaves for d in leaf.sharding.device_set},
                     key=lambda d: d.id)
    table = _local_hashes(leaves, devices)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = np.asarray(multihost_utils.process_allgather(table)).max(axis=0)
    bad = []
    for row, (path, leaf) in enumerate(zip(paths, leaves)):
        groups: dict[str, set[int]] = {}
        column = {d.id: i for i, d in enumerate(devices)}
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            groups.setdefault(repr(index), set()).add(int(table[row, column[device.id]]))
        if any(len(hashes) > 1 for hashes in groups.values()):
            bad.append(jax.tree_util.keystr(path))
    return bad
