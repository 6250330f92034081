"""Local (per-host) non-persistent checkpoints: Megatron's ``non_persistent_ckpt_type: local``.

Each process writes only the array shards its own devices hold, to a directory on its own
disk, ``<non_persistent_local_ckpt_dir>/process_<i>/step_<N>``:

    arrays.npz    one raw-bytes entry per distinct shard this process holds
    layout.json   per leaf: global shape, dtype, and each shard's index and device ids
    meta.json     the same metadata a global checkpoint carries

A step is written (synchronously, even with async_save) into a temporary directory and
renamed when complete, then older steps are deleted (the newest ``keep`` stay). A local
checkpoint restores only onto the same devices with the same shardings (a restarted job on
the same nodes); anything else raises :class:`Unusable` and the caller falls back to a global
checkpoint. In a job of several processes a step counts only when every process has it.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import uuid

import jax
import numpy as np

STEP_PREFIX = "step"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}_(\d+)$")


class Unusable(Exception):
    """The local checkpoint cannot be restored into this run's layout."""


def process_dir(root) -> pathlib.Path:
    return pathlib.Path(root) / f"process_{jax.process_index()}"


def steps(root) -> list[int]:
    """Complete steps in this process's directory, oldest first."""
    here = process_dir(root)
    if not here.is_dir():
        return []
    found = (_STEP_DIR.match(p.name) for p in here.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found
                  if m and (here / m.group(0) / "meta.json").exists())


def newest_common_step(root) -> int | None:
    """The newest step every process of the job holds (None if there is none)."""
    mine = steps(root)
    newest = mine[-1] if mine else -1
    if jax.process_count() > 1:  # a process that missed the newest save has an older one
        from jax.experimental import multihost_utils

        everyone = np.asarray(multihost_utils.process_allgather(np.int64(newest)))
        if (everyone != newest).any():
            return None
    return newest if newest >= 0 else None


def _index(index, shape) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def save(root, step: int, items: dict[str, dict[str, jax.Array]], meta: dict,
         keep: int = 1) -> pathlib.Path:
    """Write this process's shards of ``items`` (item -> name -> array) as step ``step``."""
    here = process_dir(root)
    here.mkdir(parents=True, exist_ok=True)
    for stale in here.glob(f"{STEP_PREFIX}_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = here / f"{STEP_PREFIX}_{step}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    arrays, layout = {}, {}
    for item, leaves in items.items():
        layout[item] = {}
        for name, x in leaves.items():
            x = x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
            entry = {"shape": list(x.shape), "dtype": str(x.dtype), "shards": []}
            seen = {}
            for shard in x.addressable_shards:
                index = _index(shard.index, x.shape)
                key = json.dumps(index)
                if key not in seen:
                    seen[key] = len(entry["shards"])
                    data = np.asarray(shard.data)  # raw bytes: any dtype, bfloat16 too
                    arrays[f"{item}|{name}|{seen[key]}"] = np.ascontiguousarray(data).view(
                        np.uint8).reshape(-1)
                    entry["shards"].append({"index": index, "devices": [],
                                            "shape": list(data.shape)})
                entry["shards"][seen[key]]["devices"].append(shard.device.id)
            layout[item][name] = entry
    with open(tmp / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)
    (tmp / "layout.json").write_text(json.dumps(layout))
    (tmp / "meta.json").write_text(json.dumps(meta, default=str))  # written last: complete
    final = here / f"{STEP_PREFIX}_{step}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in steps(root)[:-keep] if keep else ():
        shutil.rmtree(here / f"{STEP_PREFIX}_{old}", ignore_errors=True)
    return final


def step_dir(root, step: int) -> pathlib.Path:
    return process_dir(root) / f"{STEP_PREFIX}_{step}"


def read_meta(root, step: int) -> dict:
    return json.loads((step_dir(root, step) / "meta.json").read_text())


def keys(root, step: int) -> dict[str, set[str]]:
    """item -> the leaf names stored for it."""
    layout = json.loads((step_dir(root, step) / "layout.json").read_text())
    return {item: set(leaves) for item, leaves in layout.items()}


def restore(root, step: int, wanted: dict[str, dict[str, jax.ShapeDtypeStruct]]
            ) -> dict[str, dict[str, jax.Array]]:
    """``wanted`` (item -> name -> target with ``.shape``, ``.dtype``, ``.sharding``) from
    this process's shards; raises :class:`Unusable` when a shard this run needs is absent."""
    where = step_dir(root, step)
    layout = json.loads((where / "layout.json").read_text())
    out = {}
    with np.load(where / "arrays.npz") as arrays:
        for item, leaves in wanted.items():
            out[item] = {}
            for name, target in leaves.items():
                entry = layout.get(item, {}).get(name)
                if entry is None:
                    raise Unusable(f"{item} {name} is not in it")
                shape, dtype = tuple(target.shape), np.dtype(target.dtype)
                if tuple(entry["shape"]) != shape or entry["dtype"] != str(dtype):
                    raise Unusable(f"{item} {name} is {entry['dtype']}{entry['shape']} there, "
                                   f"{dtype}{list(shape)} here")
                pieces = []
                for device, index in target.sharding.addressable_devices_indices_map(
                        shape).items():
                    index = _index(index, shape)
                    found = next((k for k, s in enumerate(entry["shards"])
                                  if s["index"] == index and device.id in s["devices"]), None)
                    if found is None:
                        raise Unusable(f"{item} {name}: no shard {index} for device "
                                       f"{device.id} (saved on another layout)")
                    data = arrays[f"{item}|{name}|{found}"].view(dtype).reshape(
                        entry["shards"][found]["shape"])
                    pieces.append(jax.device_put(data, device))
                out[item][name] = jax.make_array_from_single_device_arrays(
                    shape, target.sharding, pieces)
    return out
