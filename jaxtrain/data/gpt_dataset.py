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
datasets as ``BlendedMegatronDatasetBuilder`` does (checked sample by sample against it):

- a split's documents are ``round(cumulative proportion x documents)`` boundaries (the split
  matrix of megatron-core);
- one prefix without a weight is the split's dataset itself;
- a weighted blend with a sample target ``S`` builds ``ceil(ceil(S·w)·1.005)`` samples of each
  part (Megatron's 0.5% surplus) and blends ``Σ ceil(S·w)`` of them by the weights;
- an unweighted blend builds one epoch of each part and blends ``min(S, Σ epochs)`` samples
  weighted by each part's one-epoch length (without a target: every sample of every part
  once, Megatron's exhaustive blend);
- in the per-split form (``train_data_path`` ...) a single prefix is served directly whatever
  its weight.

A part with a sample target larger than its split repeats the split for as many epochs as the
target needs, however short the split (with one epoch, a split shorter than one sample has
none and is an error).
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
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
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
        if tokens_per_epoch == 0 or (num_samples is None
                                     and tokens_per_epoch < T + ADD_EXTRA_TOKEN):
            # (with a sample target, Megatron repeats a short split for as many epochs as the
            # target needs)
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


def dataset_pad_id(tokenizer) -> int | None:
    """The pad id Megatron's GPT datasets mask (``MegatronDataset._pad_token_id``): the
    tokenizer's ``pad``, unless it has none or it is also its EOS or EOD id (Megatron then
    uses -1, which matches no token; ``allow_ambiguous_pad_tokens`` is not offered). None: no
    pad masking."""
    pad = getattr(tokenizer, "pad", None) if tokenizer is not None else None
    if pad is None or int(pad) < 0:
        return None
    if pad in (getattr(tokenizer, "eos", None), getattr(tokenizer, "eod", None)):
        return None
    return int(pad)


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
    """Samples of several datasets interleaved by weight (Megatron's ``BlendedDataset``).

    ``size`` samples drawn by the normalised ``weights`` (:func:`blending_indices`), or, with
    ``size`` None, exactly ``weights[d]`` samples of dataset ``d`` (integer weights: each
    dataset's length; :func:`exhaustive_blending_indices`)."""

    def __init__(self, datasets, weights, size: int | None, cache_dir: str | None = None,
                 split: str = "train"):
        self.datasets = list(datasets)
        if size is None:
            self.weights = [int(w) for w in weights]
            if any(w <= 0 for w in self.weights):
                raise ConfigError(f"blend: every part needs samples, got {self.weights}")
            self.size = sum(self.weights)
            build = lambda: exhaustive_blending_indices(self.weights)  # noqa: E731
        else:
            self.weights = normalize(weights)
            self.size = int(size)
            build = lambda: blending_indices(self.weights, self.size)  # noqa: E731
        description = {"class": "BlendedDataset", "split": split,
                       "size": None if size is None else self.size, "weights": self.weights,
                       "datasets": [_identity(d) for d in self.datasets]}
        self.dataset_index, self.dataset_sample_index = _cached(
            cache_dir, description, ("dataset_index", "dataset_sample_index"), build)
        counts = np.bincount(np.asarray(self.dataset_index, np.int64),
                             minlength=len(self.datasets))
        for d, ds in enumerate(self.datasets):
            if counts[d] > len(ds):
                raise ConfigError(f"blend: dataset {d} has {len(ds)} samples; the blend needs "
                                  f"{counts[d]}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def _identity(ds):
    """What makes a blended part's samples (its cache key in a blend's description)."""
    indexed = getattr(ds, "indexed", None)
    if indexed is None:
        return None
    return [indexed.prefix, int(ds.documents[0]), len(ds.documents), ds.num_samples]


def blending_indices(weights, size: int):
    """Megatron's ``build_blending_indices``: sample ``i`` goes to the dataset whose count lags
    its share ``weight * max(i, 1)`` the most (first one on ties)."""
    w = [float(x) for x in weights]
    if len(w) == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
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


def exhaustive_blending_indices(sizes):
    """Megatron's ``build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples of each
    dataset, in proportion to the sizes: the greedy rule of :func:`blending_indices` over the
    datasets not yet spent."""
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    w = [n / float(total) for n in sizes]
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    dataset_index = np.empty(total, dtype=np.int16)
    sample_index = np.empty(total, dtype=np.int64)
    for i in range(total):
        x = max(float(i), 1.0)
        best, best_err = -1, -math.inf
        for d in unspent:
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


def normalize(weights) -> list[float]:
    """Weights over their sum, computed as Megatron's ``normalize`` does (float64 numpy sum,
    so the blends' greedy ties fall the same way)."""
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    total = np.sum(w)
    if w.size == 0 or not total > 0 or np.any(w < 0):
        raise ConfigError(f"blend weights must be non-negative with a positive sum: "
                          f"{list(weights)}")
    return (w / total).tolist()


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
    """Document boundaries [0, a, b, c] of the train/valid/test splits, as megatron-core's
    split matrix gives them: each boundary is the cumulative proportion times the document
    count, rounded (``round(0.45 * 10)`` is 4)."""
    bounds, edge = [0], 0.0
    for p in split:
        edge = edge + p
        bounds.append(int(round(edge * float(num_documents))))
    return bounds


def _open_all(prefixes, mmap: bool, pool) -> dict:
    """prefix -> IndexedDataset, each distinct prefix opened once."""
    unique = list(dict.fromkeys(prefixes))
    return dict(zip(unique, pool.map(lambda p: IndexedDataset(p, mmap=mmap), unique)))


def _blend_size(target: int, weight: float, surplus: float = 0.0) -> int:
    """Megatron's ``_get_size_per_split_per_dataset``: ceil(ceil(target * weight) * (1 +
    surplus)) (the part is built with the surplus, the blend draws without it)."""
    return int(math.ceil(math.ceil(target * weight) * (1 + surplus)))


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
    # per split: ([(indexed, documents, weight or None)] of each part, direct); ``direct``: a
    # single part served as it is (no blend), else a BlendedDataset over the parts
    jobs: dict[str, tuple[list, bool]] = {}
    if any(p for p in per_split):
        blends = {}
        for s, value in zip(SPLITS, per_split):
            prefixes, weights = parse_blend(value, f"{s}_data_path")
            if prefixes and s in splits:
                blends[s] = (prefixes, normalize(weights) if weights else None)
        opened = _open_all([p for ps, _ in blends.values() for p in ps], mmap, pool)
        for s, (prefixes, weights) in blends.items():
            # one prefix is served directly whatever its weight (Megatron)
            jobs[s] = ([(opened[p], np.arange(opened[p].num_documents),
                         weights[i] if weights else None) for i, p in enumerate(prefixes)],
                       len(prefixes) == 1)
    else:
        prefixes, weights = parse_blend(data_path)
        if not prefixes:
            raise ConfigError("no dataset prefixes: set data_path or train_data_path")
        weights = normalize(weights) if weights else None
        fractions = parse_split(split)
        opened = _open_all(prefixes, mmap, pool)
        bounds = [split_boundaries(fractions, opened[p].num_documents) for p in prefixes]
        for k, s in enumerate(SPLITS):
            if fractions[k] == 0 or s not in splits:
                continue
            # a prefix with no documents in this split is left out (Megatron fails on it)
            jobs[s] = ([(opened[p], np.arange(b[k], b[k + 1]), weights[i] if weights else None)
                        for i, (p, b) in enumerate(zip(prefixes, bounds)) if b[k + 1] > b[k]],
                       len(prefixes) == 1 and weights is None)
    targets = dict(zip(SPLITS, num_samples))
    # each part's sample target: a weighted blend with a split target builds
    # ceil(ceil(target * w) * 1.005) samples of each part, otherwise one epoch of each
    plans = {s: [(ind, docs, w, targets[s] if direct else _part_target(targets[s], w))
                 for ind, docs, w in parts] for s, (parts, direct) in jobs.items()}
    flat = [(s, job) for s in SPLITS for job in plans.get(s, [])]
    built = iter(list(pool.map(
        lambda sj: GPTDataset(sj[1][0], sj[1][1], seq_length, sj[1][3], seed, cache_dir, sj[0]),
        flat)))
    out = {}
    for s in SPLITS:
        parts = [(next(built), job[2]) for job in plans.get(s, [])]
        if not parts:
            out[s] = None
        elif jobs[s][1]:
            out[s] = parts[0][0]
        else:
            out[s] = _blend(parts, targets[s], cache_dir, s)
    return out


def _part_target(target: int | None, weight: float | None) -> int | None:
    if weight is None or target is None:
        return None
    return _blend_size(target, weight, BLEND_SURPLUS)


def _blend(parts, target: int | None, cache_dir, split) -> BlendedDataset:
    """Megatron's top-level blend of (dataset, weight or None) parts: by the weights at
    Σ ceil(target * w) samples; unweighted (or without a target) by each part's one-epoch
    length, min(target, Σ lengths) samples (all of each part without a target)."""
    datasets = [d for d, _ in parts]
    weights = [w for _, w in parts]
    if weights[0] is not None and target is not None:
        size = sum(int(math.ceil(target * w)) for w in weights)
        return BlendedDataset(datasets, weights, size, cache_dir, split)
    lengths = [len(d) for d in datasets]
    size = None if target is None else min(target, sum(lengths))
    return BlendedDataset(datasets, lengths, size, cache_dir, split)
