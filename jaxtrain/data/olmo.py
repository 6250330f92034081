"""MaxText's ``dataset_type: olmo_grain``: AI2's OLMo token files through an index.

``olmo_index_path`` is the JSON index MaxText's ``build_olmo_npy_index.py`` writes:
``format_version`` "1", ``sequence_length``, ``dtype`` (e.g. uint32) and ``files`` (each
with ``path``, ``n_tokens``, ``n_instances``, ``instance_offset``). The files are flat token
streams (AI2's ``.npy`` files are raw arrays without a header; a real ``.npy`` header is
also read). Instance ``i`` is the ``i``-th non-overlapping window of ``sequence_length``
tokens of the files taken in index order (a file's trailing tokens are dropped); instances
cross document boundaries with no masking, as OLMo-core trains them. The sequence length
must equal ``seq_length``. ``olmo_path_remap_from``/``olmo_path_remap_to`` replace a prefix
of the index's paths (e.g. a ``gs://`` bucket by its local mount).

A sample holds the window's ``L`` tokens and predicts ``L - 1`` of them: the last position
has no next token inside the instance and is left out of the loss, as MaxText does. With
``olmo_apply_ngram_filter`` an instance in which a pattern of 1 to 13 tokens repeats 32 times
or more in a row is kept out of the loss entirely (OLMo-core's repetition filter).

The files are memory-mapped and read lazily. Validation reads the same instances in another
seeded order (MaxText's olmo_grain has no separate validation data).
"""
from __future__ import annotations

import json
import os
import threading

import numpy as np

from jaxtrain.config.errors import ConfigError

INDEX_VERSION = "1"
EVAL_SEED_MASK = 0x1F1F1F1F
MAX_PERIOD, MIN_PERIOD, MAX_REPEATS = 13, 1, 32
_NPY_MAGIC = b"\x93NUMPY"


def repetitive(tokens, max_period: int = MAX_PERIOD, min_period: int = MIN_PERIOD,
               max_repeats: int = MAX_REPEATS) -> bool:
    """Whether some run of ``tokens`` is a pattern of ``min_period..max_period`` tokens
    repeated at least ``max_repeats`` times in a row."""
    a = np.asarray(tokens)
    for p in range(min_period, min(max_period, len(a) // 3) + 1):
        same = np.concatenate([[False], a[p:] == a[:-p], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        runs = edges[1::2] - edges[::2]     # lengths of the runs of a[i] == a[i - p]
        if len(runs) and (int(runs.max()) + p) // p >= max_repeats:
            return True
    return False


def _bad(path, what):
    return ConfigError(f"olmo_index_path {path}: {what}")


def load_index(path: str, seq_length: int, remap: tuple[str, str] | None = None) -> dict:
    """The checked index: {"dtype", "files": [(path, n_instances)], "total"}."""
    if not path:
        raise ConfigError("dataset_type olmo_grain needs olmo_index_path (the JSON index of "
                          "the OLMo token files)")
    if not os.path.isfile(path):
        raise _bad(path, "no such file")
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(path, f"not valid JSON: {e}") from e
    if not isinstance(index, dict):
        raise _bad(path, "expected a JSON object")
    if index.get("format_version") != INDEX_VERSION:
        raise _bad(path, f"format_version {index.get('format_version')!r}; this reader reads "
                   f"version {INDEX_VERSION!r}")
    if index.get("sequence_length") != seq_length:
        raise _bad(path, f"sequence_length {index.get('sequence_length')} but seq_length is "
                   f"{seq_length}: set seq_length (MaxText max_target_length) to the index's, or "
                   "rebuild the index for this length")
    try:
        dtype = np.dtype(index.get("dtype"))
    except TypeError:
        raise _bad(path, f"dtype {index.get('dtype')!r} is not a numpy dtype") from None
    if dtype.kind not in "ui":
        raise _bad(path, f"dtype {dtype} is not an integer type")
    files, offset = [], 0
    for i, entry in enumerate(index.get("files") or []):
        try:
            fpath, n_tokens = str(entry["path"]), int(entry["n_tokens"])
            n_inst, start = int(entry["n_instances"]), int(entry["instance_offset"])
        except (KeyError, TypeError, ValueError):
            raise _bad(path, f"file entry {i} needs path, n_tokens, n_instances and "
                       "instance_offset") from None
        if n_inst != n_tokens // seq_length or start != offset:
            raise _bad(path, f"file entry {i} ({fpath}): its instance count or offset does "
                       "not match the token counts; rebuild the index")
        if remap and fpath.startswith(remap[0]):
            fpath = remap[1] + fpath[len(remap[0]):]
        files.append((fpath, n_tokens, n_inst))
        offset += n_inst
    if not files or offset == 0:
        raise _bad(path, "the index lists no instances")
    if index.get("total_instances", offset) != offset:
        raise _bad(path, f"total_instances {index.get('total_instances')} but the files hold "
                   f"{offset}; rebuild the index")
    return {"dtype": dtype, "files": files, "total": offset}


class OlmoInstances:
    """Random access to the instances: ``tokens`` [L + 1] (a 0 after the window),
    ``segment_ids`` [L + 1] (1 over the window, 0 after it) and ``keep`` (0.0 for an instance
    the n-gram filter drops from the loss)."""

    def __init__(self, index: dict, seq_length: int, ngram_filter: bool = True):
        self.index, self.L, self.ngram_filter = index, seq_length, ngram_filter
        self.files = index["files"]
        self.starts = np.cumsum([0] + [n for _, _, n in self.files])
        self._open: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        for fpath, n_tokens, _ in self.files:
            self._check(fpath, n_tokens)

    def _check(self, fpath, n_tokens):
        if not os.path.isfile(fpath):
            raise ConfigError(f"olmo_grain: token file {fpath} does not exist (set "
                              "olmo_path_remap_from/olmo_path_remap_to when the index names "
                              "another location)")
        if self._array(fpath, probe=True) < n_tokens:
            raise ConfigError(f"olmo_grain: token file {fpath} holds fewer than the "
                              f"{n_tokens} tokens its index entry says; rebuild the index")

    def _array(self, fpath, probe=False):
        with open(fpath, "rb") as f:
            npy = f.read(6) == _NPY_MAGIC
        try:
            arr = np.load(fpath, mmap_mode="r") if npy else np.memmap(
                fpath, dtype=self.index["dtype"], mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"olmo_grain: token file {fpath}: cannot read it: {e}") from e
        if arr.ndim != 1:
            raise ConfigError(f"olmo_grain: token file {fpath} is not a flat token array")
        return len(arr) if probe else arr

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _file(self, f: int) -> np.ndarray:
        arr = self._open.get(f)
        if arr is None:
            with self._lock:
                arr = self._open.get(f)
                if arr is None:
                    arr = self._open[f] = self._array(self.files[f][0])
        return arr

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(i)
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        first = (i - int(self.starts[f])) * self.L
        window = np.asarray(self._file(f)[first:first + self.L], dtype=np.int64)
        tokens = np.zeros(self.L + 1, np.int32)
        tokens[:self.L] = window
        segs = np.zeros(self.L + 1, np.int32)
        segs[:self.L] = 1
        keep = 0.0 if self.ngram_filter and repetitive(window) else 1.0
        return {"tokens": tokens, "segment_ids": segs, "keep": np.float32(keep)}


def remap(cfg) -> tuple[str, str] | None:
    src, dst = cfg["olmo_path_remap_from"], cfg["olmo_path_remap_to"]
    if bool(src) != bool(dst):
        raise ConfigError("olmo_path_remap_from and olmo_path_remap_to are set together (a "
                          "prefix and what replaces it), or neither")
    return (src, dst) if src else None


def instances(cfg) -> OlmoInstances:
    """The OLMo instances the config's index names."""
    for key in ("reset_position_ids", "reset_attention_mask"):
        if cfg[key]:
            raise ConfigError(f"{key}: olmo_grain instances run across documents unmasked, as "
                              "OLMo-core trains them; set it false")
    index = load_index(cfg["olmo_index_path"], cfg["seq_length"], remap(cfg))
    return OlmoInstances(index, cfg["seq_length"], cfg["olmo_apply_ngram_filter"])
