"""``dpo.precompute_reference``: the reference policy scores every pair once, before training,
and then leaves memory.

Each row's reference score ``sum_t a[t] log pi_ref(y_t)`` (the training's scored-token weights,
LD-DPO included) depends only on the frozen reference and the row, so it is computed once per
training and validation row, in order, with the DPO validation's score step, and stored as the
row's ``ref_score`` column: batches carry it (``ref_scores``), the train step
(:func:`jaxtrain.dpo.micro_loss`) and the validation read it instead of running the reference.

The scores are cached in the run directory (``dpo_reference_scores.npz``) under a fingerprint
of the reference (its weight files, or "the starting weights"), the rows' tokens and masks,
``ld_alpha`` and the model configuration, so a resumed run reads them back instead of
recomputing. A reference that no directory names is the run's starting weights: once training
has moved them, only the cache can give its scores.
"""
from __future__ import annotations

import hashlib
import os
import pathlib

import jax
import numpy as np

from jaxtrain import dpo
from jaxtrain.config.errors import ConfigError

CACHE = "dpo_reference_scores.npz"


def fingerprint(cfg, sets: list, model_cfg, ld_alpha: float) -> str:
    h = hashlib.sha256()
    if dpo.reference_name(cfg):
        for f in sorted(pathlib.Path(dpo.reference_dir(cfg)).glob("*.safetensors*")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    else:
        h.update(b"the starting weights\n")
    h.update(repr((ld_alpha, model_cfg)).encode())
    for name, data in sets:
        h.update(name.encode())
        for key in ("tokens", "segment_ids", "weights"):
            h.update(np.ascontiguousarray(data.samples.arrays[key]).tobytes())
    return h.hexdigest()


def _read(path: pathlib.Path, fp: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        with np.load(path) as got:
            if str(got["fingerprint"]) != fp:
                return None
            return {k: got[k] for k in got.files if k != "fingerprint"}
    except (OSError, ValueError, KeyError):
        return None


def _write(path: pathlib.Path, fp: str, scores: dict):
    if jax.process_index() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, fingerprint=np.asarray(fp), **scores)
    os.replace(tmp, path)


def attach(cfg, data, evaluator, model_cfg, directory, reference, logger):
    """Give ``data`` (the training pairs) and the validation sets of ``evaluator`` their
    ``ref_score`` column, from the cache in ``directory`` or computed with ``reference()``
    (called only then: a zero-argument function returning the reference parameters, or None
    when they no longer exist)."""
    ld_alpha = evaluator.dpo.ld_alpha
    sets = [("train", data)] + [(f"val:{s.name}", s.data) for s in evaluator.sets]
    fp = fingerprint(cfg, sets, model_cfg, ld_alpha)
    path = pathlib.Path(directory) / CACHE
    scores = _read(path, fp)
    if scores is None:
        params = reference()
        if params is None:
            raise ConfigError(f"dpo.precompute_reference: {path} holds no reference scores for "
                              "these pairs, and the reference (the weights this run started "
                              "from) is gone after training moved them; start the run afresh "
                              "or name the reference with dpo.reference_model")
        scores = {name: evaluator.score_all(d, params) for name, d in sets}
        _write(path, fp, scores)
        logger.info("DPO reference scores of %s rows computed and cached in %s",
                    sum(len(v) for v in scores.values()), path)
    else:
        logger.info("DPO reference scores read from %s", path)
    for name, d in sets:
        d.samples.arrays["ref_score"] = np.asarray(scores[name], np.float32)
