"""Rows of a local dataset, as pgs names datasets: a .jsonl/.json/.parquet file, a folder of
them (the files of one split), or a Hugging Face ``datasets`` folder written by
``save_to_disk`` (a Dataset: ``state.json`` + Arrow files; a DatasetDict: ``dataset_dict.json``
+ one such folder per split). Nothing is downloaded: a hub name is an error saying so.

Each row comes with where it was read (``file:line`` or ``file: row n``) for error messages.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterator

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import text_files


SPLIT_NAME = r"(?:^|/){}(?:$|[-._ 0-9/])"
SPLIT_WORDS = ("train", "test", "validation", "valid", "dev", "eval")


def _names_split(path: str, folder: str, split: str) -> bool:
    """Whether a file's path under ``folder`` names ``split`` (Hugging Face's convention)."""
    rel = os.path.relpath(path, folder).replace(os.sep, "/")
    return re.search(SPLIT_NAME.format(re.escape(split)), rel) is not None


def eval_files(spec: str, split: str, what: str = "data.eval_dataset",
               split_key: str = "data.eval_split") -> list[str]:
    """The files of ``spec``; for a directory only those named by ``split`` (a directory whose
    files name no split at all holds only the "train" split, as Hugging Face reads it)."""
    files = text_files.expand(spec, what)
    if not os.path.isdir(spec):
        return files
    chosen = [f for f in files if _names_split(f, spec, split)]
    if chosen:
        return chosen
    if split == "train" and not any(_names_split(f, spec, w) for f in files for w in SPLIT_WORDS):
        return files
    raise ConfigError(f"{what} {spec!r}: no file of split {split!r} (a file or folder name "
                      f"starting with {split!r}); set {split_key} to the split to use")


def hf_dir(cfg) -> str:
    """hf_path/hf_data_dir (hf_path itself when the default hf_data_dir "en" is not a folder
    of it; a chosen one must exist)."""
    path, sub = cfg["hf_path"], cfg["hf_data_dir"]
    if sub and os.path.isdir(os.path.join(path, sub)):
        path = os.path.join(path, sub)
    elif sub and cfg.is_set("hf_data_dir"):
        raise ConfigError(f"hf_data_dir {sub!r}: {os.path.join(path, sub)} is not a folder; "
                          "set it to a sub-folder of hf_path, or to '' to read all of it")
    return path


def hf_files(cfg) -> list[str]:
    """hf_train_files, else the files of split train_split under :func:`hf_dir` (all of a
    folder whose files name no split, for the split "train")."""
    if cfg["hf_train_files"]:
        return text_files.expand(cfg["hf_train_files"], "hf_train_files")
    if cfg["hf_path"]:
        return eval_files(hf_dir(cfg), cfg["train_split"], "hf_path", "train_split")
    return []


def hf_eval_files(cfg) -> list[str] | None:
    """hf_eval_files, else the files of split hf_eval_split under :func:`hf_dir`; None
    when neither is set."""
    if cfg["hf_eval_files"]:
        return text_files.expand(cfg["hf_eval_files"], "hf_eval_files")
    if cfg["hf_eval_split"]:
        if not cfg["hf_path"]:
            raise ConfigError("hf_eval_split needs hf_path (the folder holding the split), or "
                              "give hf_eval_files")
        return eval_files(hf_dir(cfg), cfg["hf_eval_split"], "hf_path", "hf_eval_split")
    return None


def _arrow_rows(folder: str, what: str) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    try:
        state = json.loads(open(os.path.join(folder, "state.json")).read())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{what} {folder!r}: not a readable datasets folder (state.json: "
                          f"{e})") from None
    for name in names:
        path = os.path.join(folder, name)
        try:
            with pa.memory_map(path) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ConfigError(f"{what}: {path} is not a readable Arrow file: {e}") from None
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{path}: row {i}", row


def _saved_split(folder: str, split: str, what: str, split_key: str) -> str | None:
    """The Dataset folder of ``split`` when ``folder`` was written by save_to_disk."""
    if os.path.isfile(os.path.join(folder, "state.json")):
        return folder
    index = os.path.join(folder, "dataset_dict.json")
    if not os.path.isfile(index):
        return None
    try:
        splits = json.loads(open(index).read())["splits"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{what} {folder!r}: unreadable dataset_dict.json: {e}") from None
    if split not in splits:
        raise ConfigError(f"{what} {folder!r} has splits {splits}, not {split!r}; set "
                          f"{split_key} to one of them")
    return os.path.join(folder, split)


def files(spec: str, split: str, what: str, split_key: str, any_split: bool = False
          ) -> list[str]:
    """The files (or save_to_disk folders) ``spec`` names for ``split``: a file as it is, a
    folder's files whose names start with the split (all of them when ``any_split`` and no
    file names a split), a datasets folder's split."""
    if os.path.isdir(spec):
        saved = _saved_split(spec, split, what, split_key)
        if saved is not None:
            return [saved]
        if any_split:
            found = text_files.expand(spec, what)
            if not any(_names_split(f, spec, w) for f in found for w in (split, *SPLIT_WORDS)):
                return found
    return eval_files(spec, split, what, split_key)


def read(paths: list[str], what: str) -> Iterator[tuple[str, dict]]:
    """(where, row) over the files; a row that is not a JSON object is an error."""
    for path in paths:
        rows = _arrow_rows(path, what) if os.path.isdir(path) else text_files.file_rows(path)
        for where, row in rows:
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a row must be a JSON object (a mapping of fields), "
                                  f"not {type(row).__name__}")
            yield where, row


def first(paths: list[str], what: str) -> dict | None:
    """The first row of the files, reading no more of them than it takes (a parquet file by
    its first record batch, not whole)."""
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
                    if batch.num_rows:
                        return batch.to_pylist()[0]
                continue
            except Exception:  # noqa: BLE001 - read() reports the unreadable file by name
                pass
        for _, row in read([path], what):
            return row
    return None
