"""Megatron's GPT datasets over indexed files: samples, splits, blends and index caches.

A :class:`GPTDataset` serves samples of ``seq_length + 1`` tokens cut from the documents of
one split of an :class:`~jaxtrain.data.indexed.IndexedDataset`, built as Megatron builds them:

- **document index**: the split's document ids repeated for as many epochs as the requested
  sample count needs, shuffled with ``numpy.random.RandomState(seed)``; when the last epoch
  would be used for less than 80% of its samples it is shuffled separately (so the first
  epochs are not mixed with a sliver of the last one);
- **sample index**: ``(position in the document index, token offset)`` where each sample
  starts; sample ``i`` starts at token ``i * seq_length`` of the epochs' concatenated token
  stream and spans documents freely (neighbouring samples share one token);
- **shuffle index**: a permutation of the samples (first epochs and the separate last epoch
  shuffled apart), drawn from the same random state.

With ``data_cache_path`` the three arrays are saved as ``.npy`` files named by a hash of
everything that determines them, and loaded (memory-mapped) by later runs.

:class:`BlendedDataset` interleaves datasets by normalised weights with Megatron's greedy
rule (each next sample goes to the dataset furthest behind its share), and
:func:`build_datasets` turns ``data_path``/``split``/``*_data_path`` into train/valid/test
datasets as ``BlendedMegatronDatasetBuilder`` does, with its 0.5% over-sampling margin per
blended dataset.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
import re
import threading

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")
ADD_EXTRA_TOKEN = 1
LAST_EPOCH_THRESHOLD = 0.80
BLEND_SURPLUS = 0.005


class GPTDataset:
    """``len(ds)`` samples; ``ds[i]`` is an int32 array of ``seq_length + 1`` tokens."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int,
                 num_samples: int | None, seed: int, cache_dir: str | None = None,
                 split: str = "train"):
        self.indexed, self.seq_length = indexed, seq_length
        self.documents = np.asarray(documents, dtype=np.int64)
        if len(self.documents) == 0:
            raise ConfigError(f"indexed dataset {indexed.prefix!r}: the {split} split holds no "
                              "documents")
        description = {"class": "GPTDataset", "prefix": os.path.abspath(indexed.prefix),
                       "split": split, "documents": [int(self.documents[0]),
                                                     int(self.documents[-1]),
                                                     len(self.documents)],
                       "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
                       "add_extra_token": ADD_EXTRA_TOKEN}
        arrays = _cached(cache_dir, description, ("document_index", "sample_index",
                                                  "shuffle_index"),
                         lambda: self._build(num_samples, seed))
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _build(self, num_samples, seed):
        sizes = np.asarray(self.indexed.sizes)
        tokens_per_epoch = int(np.sum(sizes[self.documents], dtype=np.int64))
        T = self.seq_length
        if tokens_per_epoch < T + ADD_EXTRA_TOKEN:
            raise ConfigError(f"indexed dataset {self.indexed.prefix!r}: {tokens_per_epoch} "
                              f"tokens, fewer than one sample of seq_length {T} + 1")
        epochs = 1
        if num_samples is not None:
            epochs = max(1, math.ceil((num_samples * T + ADD_EXTRA_TOKEN) / tokens_per_epoch))
        separate_last = False
        sans_last = None
        if epochs > 1:
            sans_last = ((epochs - 1) * tokens_per_epoch - ADD_EXTRA_TOKEN) // T
            from_last = num_samples - sans_last
            per_epoch = (tokens_per_epoch - ADD_EXTRA_TOKEN) // T
            separate_last = from_last < int(LAST_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(seed)
        if separate_last:
            document_index = np.concatenate([_document_index(self.documents, epochs - 1, rng),
                                             _document_index(self.documents, 1, rng)])
        else:
            document_index = _document_index(self.documents, epochs, rng)
        sample_index = build_sample_index(sizes, document_index, T, epochs * tokens_per_epoch)
        total = sample_index.shape[0] - 1
        shuffle_index = _shuffle_index(sans_last if separate_last else total, total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(self.shuffle_index[idx])
        d0, o0 = (int(x) for x in self.sample_index[i])
        d1, o1 = (int(x) for x in self.sample_index[i + 1])
        docs = self.document_index
        if d0 == d1:
            out = self.indexed.get(int(docs[d0]), o0, o1 - o0 + 1)
        else:
            parts = [self.indexed.get(int(docs[d0]), o0)]
            parts += [self.indexed.get(int(docs[d])) for d in range(d0 + 1, d1)]
            parts.append(self.indexed.get(int(docs[d1]), 0, o1 + 1))
            out = np.concatenate(parts)
        return out.astype(np.int32)


def _document_index(documents, epochs, rng) -> np.ndarray:
    index = np.tile(documents, epochs).astype(np.int32)
    rng.shuffle(index)
    return index


def _shuffle_index(num_samples, total, rng) -> np.ndarray:
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_sample_index(sizes, document_index, seq_length: int, total_tokens: int) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset) of each sample's first token.

    Equal to Megatron's ``build_sample_idx`` (drop the last partial sample, one extra token
    per sample): sample ``i`` starts at token ``i * seq_length`` of the stream.
    """
    num_samples = (total_tokens - ADD_EXTRA_TOKEN) // seq_length
    ends = np.cumsum(np.asarray(sizes)[document_index], dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(ends, starts, side="right")
    before = np.where(where > 0, ends[np.maximum(where - 1, 0)], 0)
    dtype = np.int32 if len(document_index) < 2**31 and seq_length < 2**31 else np.int64
    return np.stack([where, starts - before], axis=1).astype(dtype)


def _cached(cache_dir, description, names, build):
    """Load the arrays ``names`` from ``cache_dir`` if a build with ``description`` saved
    them; otherwise build, save (when a cache directory is given) and return them."""
    if not cache_dir:
        return build()
    text = json.dumps(description, sort_keys=True)
    digest = hashlib.md5(text.encode()).hexdigest()
    base = os.path.join(cache_dir, f"{digest}-{description['class']}-{description['split']}")
    paths = [f"{base}-{n}.npy" for n in names]
    if all(os.path.isfile(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"data_cache_path {cache_dir!r}: cannot create it: {e}") from e
    arrays = build()
    for p, a in zip(paths, arrays):
        tmp = p + f".tmp{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            np.save(f, a)
        os.replace(tmp, p)
    with open(base + "-description.json", "w") as f:
        f.write(text)
    return arrays


class BlendedDataset:
    """Samples of several datasets interleaved by weight (Megatron's ``BlendedDataset``)."""

    def __init__(self, datasets, weights, size: int, cache_dir: str | None = None,
                 split: str = "train"):
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        description = {"class": "BlendedDataset", "split": split, "size": self.size,
                       "weights": self.weights,
                       "datasets": [getattr(d, "indexed", None) and d.indexed.prefix
                                    for d in self.datasets]}
        self.dataset_index, self.dataset_sample_index = _cached(
            cache_dir, description, ("dataset_index", "dataset_sample_index"),
            lambda: blending_indices(self.weights, self.size))
        for d, ds in enumerate(self.datasets):
            need = int(np.sum(self.dataset_index == d))
            if need > len(ds):
                raise ConfigError(f"blend: dataset {d} has {len(ds)} samples; the blend needs "
                                  f"{need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def blending_indices(weights, size: int):
    """Megatron's ``build_blending_indices``: sample ``i`` goes to the dataset whose count lags
    its share ``weight * max(i, 1)`` the most (first one on ties)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        x = max(i, 1.0)
        best, best_err = 0, w[0] * x - counts[0]
        for d in range(1, len(w)):
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def normalize(weights) -> list[float]:
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ConfigError(f"blend weights must be non-negative with a positive sum: {weights}")
    return [float(w) / total for w in weights]


def parse_blend(value, what: str = "data_path") -> tuple[list[str], list[float] | None]:
    """``"w1 p1 w2 p2"`` / ``[w1, p1, w2, p2]`` / ``[p1, p2]`` -> (prefixes, weights or None)."""
    if value is None:
        return [], None
    items = value.split() if isinstance(value, str) else [str(v) for v in value]
    items = [t for item in items for t in str(item).split()]
    if not items:
        return [], None
    if len(items) == 1:
        return items, None

    def is_number(t):
        try:
            float(t)
            return True
        except ValueError:
            return False

    if is_number(items[0]):
        if len(items) % 2:
            raise ConfigError(f"{what}: expected weight/prefix pairs, got {len(items)} items")
        weights, prefixes = items[0::2], items[1::2]
        bad = [w for w in weights if not is_number(w)]
        if bad:
            raise ConfigError(f"{what}: {bad[0]!r} is not a weight (write 'w1 prefix1 w2 ...')")
        return prefixes, [float(w) for w in weights]
    return items, None


def parse_split(split: str | None) -> list[float]:
    """``"99,1,0"`` (also ``/`` separated) -> normalised three proportions."""
    if not split:
        split = "969,30,1"
    parts = [float(x) for x in re.findall(r"[0-9.]+", str(split))]
    if not parts or len(parts) > 3:
        raise ConfigError(f"split {split!r}: give up to three comma-separated proportions")
    parts += [0.0] * (3 - len(parts))
    return normalize(parts)


def split_boundaries(split: list[float], num_documents: int) -> list[int]:
    """Document boundaries [0, a, b, num_documents] of the train/valid/test splits, rounded as
    Megatron rounds them (the last boundary corrected to the document count)."""
    idx = [0]
    for p in split:
        idx.append(idx[-1] + int(round(p * float(num_documents))))
    diff = idx[-1] - num_documents
    return [idx[0]] + [i - diff for i in idx[1:]]


def _open_all(prefixes, mmap: bool, pool) -> dict:
    """prefix -> IndexedDataset, each distinct prefix opened once."""
    unique = list(dict.fromkeys(prefixes))
    return dict(zip(unique, pool.map(lambda p: IndexedDataset(p, mmap=mmap), unique)))


def _blend_size(target: int | None, weight: float) -> int | None:
    if target is None:
        return None
    return int(math.ceil(math.ceil(target * weight) * (1 + BLEND_SURPLUS)))


def _blend(datasets, weights, target, cache_dir, split):
    if len(datasets) == 1:
        return datasets[0]
    size = target if target is not None else sum(len(d) for d in datasets)
    return BlendedDataset(datasets, weights, size, cache_dir, split)


def build_datasets(*, seq_length: int, seed: int, num_samples: list[int | None],
                   data_path=None, split: str | None = None, train_data_path=None,
                   valid_data_path=None, test_data_path=None, cache_dir: str | None = None,
                   mmap: bool = True, splits: tuple[str, ...] = SPLITS, threads: int = 1) -> dict:
    """{"train"|"valid"|"test": dataset or None} as Megatron's builder makes them.

    ``num_samples`` gives each split's target sample count (None: one epoch). Only the
    ``splits`` named are built; the others are None. ``threads`` (Megatron's
    ``num_dataset_builder_threads``) open the prefixes and build their index arrays in
    parallel; the result does not depend on it.
    """
    with concurrent.futures.ThreadPoolExecutor(max(1, int(threads))) as pool:
        return _build(pool, seq_length, seed, num_samples, data_path, split,
                      (train_data_path, valid_data_path, test_data_path), cache_dir, mmap,
                      splits)


def _build(pool, seq_length, seed, num_samples, data_path, split, per_split, cache_dir, mmap,
           splits) -> dict:
    out = {}
    # per split: (indexed, documents, sample target, split, blend weight) of each part,
    # built as GPTDatasets in the pool, then blended
    jobs: dict[str, list] = {}
    if any(p for p in per_split):
        blends = {}
        for s, value in zip(SPLITS, per_split):
            prefixes, weights = parse_blend(value, f"{s}_data_path")
            if prefixes and s in splits:
                blends[s] = (prefixes, normalize(weights or [1.0] * len(prefixes)))
        opened = _open_all([p for ps, _ in blends.values() for p in ps], mmap, pool)
        for s, target in zip(SPLITS, num_samples):
            if s not in blends:
                continue
            prefixes, weights = blends[s]
            jobs[s] = [(opened[p], np.arange(opened[p].num_documents),
                        _blend_size(target, w) if len(prefixes) > 1 else target, s, w)
                       for p, w in zip(prefixes, weights)]
    else:
        prefixes, weights = parse_blend(data_path)
        if not prefixes:
            raise ConfigError("no dataset prefixes: set data_path or train_data_path")
        weights = normalize(weights or [1.0] * len(prefixes))
        fractions = parse_split(split)
        opened = _open_all(prefixes, mmap, pool)
        bounds = [split_boundaries(fractions, opened[p].num_documents) for p in prefixes]
        for k, (s, target) in enumerate(zip(SPLITS, num_samples)):
            if fractions[k] == 0 or s not in splits:
                continue
            # a prefix with no documents in this split is left out (as in Megatron)
            jobs[s] = [(opened[p], np.arange(b[k], b[k + 1]),
                        _blend_size(target, w) if len(prefixes) > 1 else target, s, w)
                       for p, b, w in zip(prefixes, bounds, weights) if b[k + 1] > b[k]]
    flat = [job for s in SPLITS for job in jobs.get(s, [])]
    built = iter(list(pool.map(
        lambda job: GPTDataset(job[0], job[1], seq_length, job[2], seed, cache_dir, job[3]),
        flat)))
    for s, target in zip(SPLITS, num_samples):
        parts = [(next(built), job[4]) for job in jobs.get(s, [])]
        if not parts:
            out[s] = None
            continue
        datasets, kept = [d for d, _ in parts], [w for _, w in parts]
        out[s] = _blend(datasets, normalize(kept), target, cache_dir, s)
    return out
