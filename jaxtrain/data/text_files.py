"""Plain-text documents from local files (.jsonl, .json, .parquet), and first-fit packing.

``read_documents(paths, field)`` yields each row's text field; ``expand(spec)`` turns a
directory, a file or a glob into the data files it names (sorted). ``pack`` places tokenised
documents into rows of ``length`` tokens first-fit (a document longer than a row is cut into
row-sized pieces), giving each document its own segment id (0 = padding); no token is lost.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np

from jaxtrain.config.errors import ConfigError

EXTENSIONS = (".jsonl", ".json", ".parquet")
OPEN_BINS = 256
CHAT_FIELDS = ("messages", "conversations", "chat", "dialogue", "turns")


def expand(spec: str, what: str) -> list[str]:
    """Data files named by a directory, a file or a glob (comma-separated allowed)."""
    files: list[str] = []
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        if os.path.isdir(part):
            found = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(part) for f in fs
                           if f.endswith(EXTENSIONS))
            if not found:
                raise ConfigError(f"{what} {part!r}: the directory holds no "
                                  f"{'/'.join(EXTENSIONS)} files")
            files += found
        elif any(c in part for c in "*?["):
            found = sorted(glob.glob(part, recursive=True))
            if not found:
                raise ConfigError(f"{what} {part!r}: the pattern matches no file")
            files += found
        elif os.path.isfile(part):
            files.append(part)
        else:
            raise ConfigError(f"{what} {part!r}: no such local file or directory (datasets are "
                              "read from local files; nothing is downloaded)")
    for f in files:
        if not f.endswith(EXTENSIONS):
            raise ConfigError(f"{what}: {f} is not a .jsonl, .json or .parquet file")
    return files


def file_rows(path: str):
    """(where, row) of every row of a .jsonl, .json or .parquet file."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError(f"{path}: reading parquet needs the pyarrow package") from e
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{path}: not a readable parquet file: {e}") from e
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{path}: row {i}", row
        return
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            head = f.read(1)
            f.seek(0)
            if head == "[":
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}: not valid JSON: {e}") from e
                for i, row in enumerate(rows, 1):
                    yield f"{path}: row {i}", row
                return
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{i}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{i}: not a JSON object: {e}") from e


def _token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def read_documents(paths: list[str], field: str, token_ids: bool = False,
                   tokenize_key: str = "tokenize_train_data"):
    """Every row's ``field`` text (or, with ``token_ids``, its list of token ids), in file
    order; a ConfigError names a bad file or row (and ``tokenize_key`` when the field holds
    the other kind)."""
    for path in paths:
        n = 0
        for where, row in file_rows(path):
            if not isinstance(row, dict) or field not in row:
                chat = isinstance(row, dict) and any(k in row for k in CHAT_FIELDS)
                raise ConfigError(f"{where}: the row has no {field!r} text field" + (
                    "; it holds chat turns, and chat (SFT) data is not trained yet: give "
                    "plain-text rows" if chat else
                    " (train_data_columns names the field to read)"))
            value = row[field]
            if token_ids:
                if isinstance(value, str):
                    raise ConfigError(f"{where}: field {field!r} holds text, and {tokenize_key} "
                                      "is false (token ids expected); set it to true")
                if not _token_ids(value):
                    raise ConfigError(f"{where}: field {field!r} is not a list of token ids")
            elif not isinstance(value, str):
                raise ConfigError(f"{where}: field {field!r} is not a string" + (
                    f" (it holds token ids: set {tokenize_key}: false)"
                    if _token_ids(value) else ""))
            n += 1
            yield value
        if n == 0:
            raise ConfigError(f"{path}: the file holds no rows")


def pack(docs, length: int, fit: str = "first", max_docs: int | None = None) -> dict:
    """First-fit packing of token lists into rows of ``length``: {"tokens", "segment_ids"}
    [N, length] int32. Rows stay open for later documents while they have room (the oldest
    of more than 256 open rows is closed first). ``fit="best"`` puts each piece in the open
    row it fills most tightly instead of the first one it fits in. ``max_docs`` > 0 closes a
    row once it holds that many pieces (grain's ``max_sequences_per_bin``; None or <= 0: no
    cap)."""
    rows_tok: list[list[int]] = []
    rows_seg: list[list[int]] = []
    room: list[int] = []     # free slots of the open rows
    which: list[int] = []    # their row numbers
    cap = max_docs if max_docs is not None and max_docs > 0 else None
    for doc in docs:
        doc = list(doc)
        pieces = [doc[i:i + length] for i in range(0, len(doc), length)] or []
        for piece in pieces:
            free = np.asarray(room)
            fits = np.nonzero(free >= len(piece))[0] if len(room) else []
            if len(fits):
                j = int(fits[0] if fit == "first" else fits[np.argmin(free[fits])])
                r = which[j]
                room[j] -= len(piece)
            else:
                r = len(rows_tok)
                rows_tok.append([])
                rows_seg.append([])
                room.append(length - len(piece))
                which.append(r)
                j = len(room) - 1
            seg = (rows_seg[r][-1] + 1) if rows_seg[r] else 1
            rows_tok[r].extend(piece)
            rows_seg[r].extend([seg] * len(piece))
            if room[j] == 0 or (cap is not None and seg >= cap):
                del room[j], which[j]
            elif len(room) > OPEN_BINS:
                del room[0], which[0]
    n = len(rows_tok)
    tokens = np.zeros((n, length), np.int32)
    segs = np.zeros((n, length), np.int32)
    for i, (t, s) in enumerate(zip(rows_tok, rows_seg)):
        tokens[i, :len(t)] = t
        segs[i, :len(s)] = s
    return {"tokens": tokens, "segment_ids": segs}


def concat_split(docs, length: int, bos: int | None = None) -> dict:
    """The documents end to end, cut into rows of ``length`` (the last row padded): a document
    crossing a row end continues in the next row; each piece has its own segment id. With
    ``bos``, every piece starts with it (a continuing piece's first token becomes BOS, as
    grain's REPLACE_FIRST_TOKEN_WITH_BOS does)."""
    docs = [np.asarray(d, np.int32).ravel() for d in docs]
    total = sum(len(d) for d in docs)
    n = -(-total // length)
    tokens = np.zeros(n * length, np.int32)
    owner = np.full(n * length, -1, np.int64)
    if total:
        tokens[:total] = np.concatenate(docs)
        owner[:total] = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    tokens, owner = tokens.reshape(n, length), owner.reshape(n, length)
    starts = np.ones(owner.shape, np.int32)
    starts[:, 1:] = owner[:, 1:] != owner[:, :-1]
    segs = np.where(owner >= 0, np.cumsum(starts, axis=1), 0).astype(np.int32)
    if bos is not None:
        tokens[(starts == 1) & (owner >= 0)] = bos
    return {"tokens": tokens, "segment_ids": segs}


def pad_rows(docs, length: int) -> dict:
    """One document per row, truncated or padded to ``length`` (packing off)."""
    docs = [list(d)[:length] for d in docs]
    tokens = np.zeros((len(docs), length), np.int32)
    segs = np.zeros((len(docs), length), np.int32)
    for i, d in enumerate(docs):
        tokens[i, :len(d)] = d
        segs[i, :len(d)] = 1
    return {"tokens": tokens, "segment_ids": segs}


class Rows:
    """A random-access source over {"tokens", "segment_ids"} arrays (one dict per row)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["tokens"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.arrays.items()}
