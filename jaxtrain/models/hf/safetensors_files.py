"""Hugging Face checkpoint files read lazily: tensors memory-mapped, named, typed, shaped.

A checkpoint directory holds ``model.safetensors`` or shards named by
``model.safetensors.index.json``. The ``safetensors`` package cannot hand bfloat16 (or FP8)
tensors to numpy, so the files are read here from their documented layout (an 8-byte
little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then
the raw bytes) as memory-mapped arrays with ``ml_dtypes`` types: nothing is read from disk
until a tensor's values are used, and only the part of it used.
"""
from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

INDEX = "model.safetensors.index.json"
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read (the message names the file)."""


def files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint directory (the index's, else every one)."""
    index = path / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names {len(missing)} file(s) that are not in {path}: "
                                  f"{', '.join(missing[:4])}; download the whole checkpoint")
        return [path / n for n in names]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors weights in {path}: a Hugging Face model "
                              "directory holds config.json and model*.safetensors")
    return found


def header(file: pathlib.Path) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data) of one safetensors file."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file.stat().st_size - 8:   # garbage: its "header" would exceed the file
                raise ValueError(f"a header of {size} bytes in a file of "
                                 f"{file.stat().st_size}")
            entries = json.loads(f.read(size))
            if not isinstance(entries, dict):
                raise ValueError("the header is not a JSON object")
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    entries.pop("__metadata__", None)
    for name, e in entries.items():
        if e.get("dtype") not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name} has dtype {e.get('dtype')}, which "
                                  f"jaxtrain does not read ({', '.join(DTYPES)})")
    return entries, 8 + size


def shapes(path: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over a checkpoint directory, from the headers alone."""
    return {name: tuple(e["shape"]) for file in files(path) for name, e in header(file)[0].items()}


def read(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Tensor name -> memory-mapped array over a checkpoint directory."""
    out = {}
    for file in files(path):
        entries, base = header(file)
        if not entries:
            continue
        data = np.memmap(file, np.uint8, mode="r")
        for name, e in entries.items():
            start, end = e["data_offsets"]
            out[name] = data[base + start: base + end].view(DTYPES[e["dtype"]]).reshape(
                e["shape"])
    return out
