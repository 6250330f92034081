"""Megatron's indexed datasets (``MMapIndexedDataset``): a ``.bin`` of tokens and an ``.idx``.

A dataset is a *prefix* ``P``: ``P.bin`` holds every sequence's tokens back to back, with no
header or padding, in the dtype the index names; ``P.idx`` describes them. All integers are
little-endian. The ``.idx`` layout, in order:

=========================  =======================  ==============================================
field                      bytes                    value
=========================  =======================  ==============================================
magic                      9                        ``b"MMIDIDX\\x00\\x00"``
version                    8 (uint64)               ``1``
dtype code                 1 (uint8)                token dtype of the ``.bin``: 1 uint8, 2 int8,
                                                    3 int16, 4 int32, 5 int64, 6 float64,
                                                    7 float32, 8 uint16
sequence count ``S``       8 (uint64)               number of sequences
document count ``D``       8 (uint64)               length of the document-index array
                                                    (number of documents + 1)
sizes                      4·S (int32)              tokens in each sequence
pointers                   8·S (int64)              byte offset of each sequence in the ``.bin``
document indices           8·D (int64)              ``0`` then, for each document, the index one
                                                    past its last sequence
sequence modes (optional)  1·S (int8)               only in multimodal datasets; not used here
=========================  =======================  ==============================================

A document is a run of sequences (for GPT data, one sequence per document, so the document
indices are ``0, 1, ..., S``). Megatron picks ``uint16`` for vocabularies under 65 500 and
``int32`` otherwise; :class:`IndexedDatasetBuilder` does the same, so files written here are
read by Megatron and the other way round.

Reading uses ``numpy.memmap`` for the index arrays and, with ``mmap_bin_files`` (the default),
for the tokens; without it the ``.bin`` is read into host memory once.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from jaxtrain.config.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def optimal_dtype(vocab_size: int | None):
    """Megatron's token dtype for a vocabulary: uint16 below 65 500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Random access to the sequences of one ``.bin``/``.idx`` pair.

    ``ds[i]`` is sequence ``i`` as a numpy array; ``ds.get(i, offset, length)`` a slice of it
    without reading the rest. ``sizes``, ``pointers`` and ``document_indices`` are the index
    arrays (memory-mapped).
    """

    def __init__(self, prefix: str, mmap: bool = True):
        self.prefix = str(prefix)
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise ConfigError(f"indexed dataset {self.prefix!r}: {path} does not exist "
                                  "(data_path names prefixes, without .bin/.idx)")
        size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise ConfigError(f"{ipath}: truncated index: {size} bytes, fewer than the "
                              f"{HEADER_BYTES}-byte header")
        if head[:len(MAGIC)] != MAGIC:
            raise ConfigError(f"{ipath}: not a Megatron MMapIndexedDataset index (bad magic "
                              f"{head[:len(MAGIC)]!r})")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise ConfigError(f"{ipath}: index version {version}; only version 1 is known")
        if code not in DTYPES:
            raise ConfigError(f"{ipath}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        need = HEADER_BYTES + seqs * 4 + seqs * 8 + docs * 8
        if size < need:
            raise ConfigError(f"{ipath}: truncated index: {size} bytes, but its header "
                              f"({seqs} sequences, {docs} document entries) needs {need}")
        index = np.memmap(ipath, mode="r", dtype=np.uint8)
        off = HEADER_BYTES
        self.sizes = index[off:off + 4 * seqs].view(np.int32)
        off += 4 * seqs
        self.pointers = index[off:off + 8 * seqs].view(np.int64)
        off += 8 * seqs
        self.document_indices = index[off:off + 8 * docs].view(np.int64)
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize \
            if seqs else 0
        bsize = os.path.getsize(bpath)
        if bsize < expected:
            raise ConfigError(f"{bpath}: truncated data: {bsize} bytes, but {ipath} points to "
                              f"{expected}")
        if mmap:
            self._bin = np.memmap(bpath, mode="r", dtype=self.dtype) if bsize else \
                np.zeros(0, self.dtype)
        else:
            self._bin = np.fromfile(bpath, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sizes[i]) - offset if length is None else length
        return self._bin[start:start + n]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    @property
    def num_tokens(self) -> int:
        return int(np.sum(self.sizes, dtype=np.int64))


class IndexedDatasetBuilder:
    """Writes a ``.bin``/``.idx`` pair: ``add_document(tokens)`` per document, then
    ``finalize()``. ``merge(prefix)`` appends another dataset's files (parallel preprocessing)."""

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"no Megatron dtype code for {self.dtype}")
        self._bin = open(bin_path(self.prefix), "wb")
        self.sizes: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """One sequence (not yet closing its document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sizes.append(arr.size)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sizes))

    def add_document(self, tokens) -> None:
        self.add_item(tokens)
        self.end_document()

    def merge(self, prefix: str) -> None:
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} ({other.dtype}) into {self.dtype}")
        base = len(self.sizes)
        self.sizes.extend(int(s) for s in other.sizes)
        self.document_indices.extend(base + int(d) for d in other.document_indices[1:])
        with open(bin_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        self._bin.close()
        write_index(idx_path(self.prefix), self.dtype, self.sizes, self.document_indices)


def write_index(path: str, dtype, sizes, document_indices) -> None:
    """The ``.idx`` for sequences of ``sizes`` tokens stored back to back in ``dtype``."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))
