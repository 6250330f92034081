"""pgs ``data.pretokenize``: the assembled SFT samples cached on disk, rebuilt when stale.

The cache in ``data.pretokenize_path`` is ``samples.npz`` (the sample arrays) and
``pretokenized_meta.json`` (the fingerprint, the sample count, what was assembled). The
fingerprint covers what the samples depend on: the tokenizer's files (vocabulary, chat
template), the data files (path, size, modification time) and the knobs that shape the samples
(sequence length, packing, sources, mixing, masking, seeds: :func:`jaxtrain.data.sft.
fingerprint_fields`). A cache with another fingerprint is rebuilt, with a log line saying why.
Both files are written under temporary names and renamed, the metadata last, so a killed run
never leaves a cache that looks complete.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib

import numpy as np

log = logging.getLogger("jaxtrain.data.pretokenized")

SAMPLES = "samples.npz"
META = "pretokenized_meta.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def _file_sig(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def fingerprint(fields: dict, tokenizer_dir: str | None, data_files: list[str]) -> str:
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, name)):
            h.update(name.encode())
            h.update(pathlib.Path(tokenizer_dir, name).read_bytes())
    for f in sorted(data_files):
        for p in ([os.path.join(dp, n) for dp, _, ns in os.walk(f) for n in sorted(ns)]
                  if os.path.isdir(f) else [f]):
            h.update(json.dumps(_file_sig(p)).encode())
    return h.hexdigest()


def load(directory: str, key: str) -> dict | None:
    """The cached arrays when the cache in ``directory`` has fingerprint ``key``."""
    meta_path = pathlib.Path(directory, META)
    if not meta_path.is_file():
        log.info("data.pretokenize: no cache in %s yet; building it", directory)
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError:
        meta = {}
    if meta.get("fingerprint") != key:
        log.info("data.pretokenize: the cache in %s was built from other data, tokenizer or "
                 "settings; rebuilding it", directory)
        return None
    with np.load(pathlib.Path(directory, SAMPLES)) as f:
        arrays = {k: f[k] for k in f.files}
    log.info("data.pretokenize: %d samples from the cache in %s", len(arrays["tokens"]),
             directory)
    return arrays


def save(directory: str, key: str, arrays: dict, summary: str) -> None:
    """Write the cache (the arrays, then the metadata that marks it complete)."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (SAMPLES + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, d / SAMPLES)
    meta = {"fingerprint": key, "samples": int(len(arrays["tokens"])), "summary": summary}
    (d / (META + ".tmp")).write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(d / (META + ".tmp"), d / META)
