"""Megatron's verify_integrity: a SHA-256 manifest of a checkpoint's files, written once the
checkpoint is complete and checked before it is read.

The manifest (``integrity.json`` in the step directory) maps each file's path relative to the
step directory to its digest; Orbax checkpoints are directory trees, so every file below the
step directory counts. A resume with verify_integrity stops, naming the files, when one is
missing, unreadable or changed, or when the checkpoint has no manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

from jaxtrain.config.errors import ConfigError

MANIFEST = "integrity.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 22


def _digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write(step_dir) -> pathlib.Path:
    """Hash every file below the complete checkpoint ``step_dir`` into its manifest (written
    to a temporary name first, so a manifest present is a whole one)."""
    step_dir = pathlib.Path(step_dir)
    files = {p.relative_to(step_dir).as_posix(): _digest(p) for p in _files(step_dir)}
    path, tmp = step_dir / MANIFEST, step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1))
    os.replace(tmp, path)
    return path


def verify(step_dir) -> int:
    """The number of files checked; a ConfigError naming what differs from the manifest."""
    step_dir = pathlib.Path(step_dir)
    path = step_dir / MANIFEST
    if not path.is_file():
        raise ConfigError(f"verify_integrity: checkpoint {step_dir} has no {MANIFEST}; it was "
                          f"saved without verify_integrity. Resume without verify_integrity, "
                          f"or from a checkpoint saved with it")
    try:
        manifest = json.loads(path.read_text())
        algorithm, files = manifest.get("algorithm", ALGORITHM), dict(manifest["files"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"verify_integrity: {path} is not a readable manifest ({e})") from None
    if algorithm != ALGORITHM:
        raise ConfigError(f"verify_integrity: {path} uses hash {algorithm!r}; jaxtrain checks "
                          f"{ALGORITHM!r} manifests")
    bad = []
    for name, expected in files.items():
        try:
            got = _digest(step_dir / name)
        except OSError as e:
            bad.append(f"{name}: missing or unreadable ({e.strerror or e})")
            continue
        if got != expected:
            bad.append(f"{name}: changed since it was saved (sha256 {got[:12]}..., manifest "
                       f"{expected[:12]}...)")
    if bad:
        raise ConfigError(f"verify_integrity: checkpoint {step_dir} fails its integrity check "
                          f"({len(bad)} of {len(files)} files): " + "; ".join(bad[:5])
                          + ("; ..." if len(bad) > 5 else ""))
    return len(files)
