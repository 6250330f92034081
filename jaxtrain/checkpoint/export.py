"""Hugging Face model directories written during and after training (pgs's output layout).

- ``train.save_final``: the final model in ``<save>/final``;
- ``save_hf`` (on in pgs files): every saved checkpoint also as ``<save>/step-<N>/model``,
  kept and removed with its Orbax checkpoint (``<save>/step_<N>``, what a resume reads), and,
  with validation, the best model so far (lowest ``val_composite``, else ``val_loss``) in
  ``<save>/best`` with ``best_meta.json``.

Each directory is what ``transformers`` loads: config.json and model.safetensors
(:func:`jaxtrain.models.hf.to_hf`; the special token ids from the starting model's
config.json), the tokenizer's files and generation_config.json copied from the tokenizer's
(or the model's) directory. It is written under a temporary name and
renamed when complete, so no half-written model is ever left under the final name.
"""
from __future__ import annotations

import json
import logging
import pathlib
import re
import shutil

import jax
from jax.experimental import multihost_utils

from jaxtrain.config.errors import ConfigError
from jaxtrain.models import hf

HF_STEP = re.compile(r"^step-(\d+)$")
BEST_DIR = "best"
# Files beside the weights that make the directory a complete model for transformers.
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
              "merges.txt", "added_tokens.json", "generation_config.json")


def check_exportable(model_cfg) -> None:
    """ConfigError, before any training, when ``model_cfg`` has no Hugging Face equivalent."""
    try:
        hf.check_exportable(model_cfg, hf.hf_family(model_cfg))
    except ValueError as e:
        raise ConfigError(f"train.save_final / save_hf export Hugging Face format: {e}; set "
                          "train.save_final and save_hf to false") from None


def host_params(params):
    """The whole parameter tree as host arrays on every process (all processes must call it:
    in a multi-process job each one holds only its shards)."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    return multihost_utils.process_allgather(params, tiled=True)


def write_model(params, model_cfg, path: pathlib.Path, side_dirs=()) -> pathlib.Path:
    """``params`` as a Hugging Face model directory ``path`` (replacing one there), with the
    tokenizer and generation files found in ``side_dirs`` (first found wins). Every process
    calls it; the first one writes."""
    params = host_params(params)
    path = pathlib.Path(path)
    if jax.process_index() != 0:
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.to_hf(params, model_cfg, tmp)
    _carry_token_ids(tmp / "config.json", side_dirs)
    for name in SIDE_FILES:
        for d in side_dirs:
            if d is not None and (pathlib.Path(d) / name).is_file():
                shutil.copy2(pathlib.Path(d) / name, tmp / name)
                break
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def _carry_token_ids(config: pathlib.Path, side_dirs) -> None:
    """The special token ids (bos, eos, pad) of the first ``side_dirs`` model whose
    config.json names any, written into the exported config.json: a fine-tuned model stops
    and pads as the one it started from."""
    for d in side_dirs:
        source = pathlib.Path(d) / "config.json" if d is not None else None
        if source is None or not source.is_file():
            continue
        ids = {k: v for k, v in json.loads(source.read_text()).items() if k in TOKEN_IDS}
        if ids:
            config.write_text(json.dumps({**json.loads(config.read_text()), **ids}, indent=2)
                              + "\n")
            return


def export_final(params, model_cfg, final_dir: pathlib.Path, log: logging.Logger,
                 side_dirs=(), what: str = "") -> pathlib.Path:
    """``params`` of ``model_cfg`` written in Hugging Face format to ``final_dir``; ``what``
    names the weights in the log (e.g. the EMA's) when they are not the trained ones."""
    path = write_model(params, model_cfg, final_dir, side_dirs)
    log.info("final model%s exported in Hugging Face format to %s",
             f" ({what})" if what else "", path)
    return path


def step_dir(save_dir: pathlib.Path, step: int) -> pathlib.Path:
    return pathlib.Path(save_dir) / f"step-{step}" / "model"


def purge_steps(save_dir: pathlib.Path, keep: set[int]) -> None:
    """Remove the ``step-<N>`` model directories whose Orbax checkpoint is gone (the first
    process does it)."""
    if jax.process_index() != 0:
        return
    for d in pathlib.Path(save_dir).glob("step-*"):
        m = HF_STEP.match(d.name)
        if m and int(m.group(1)) not in keep:
            shutil.rmtree(d, ignore_errors=True)


def write_best(params, model_cfg, save_dir: pathlib.Path, step: int, metric: str, value: float,
               side_dirs=()) -> pathlib.Path:
    path = write_model(params, model_cfg, pathlib.Path(save_dir) / BEST_DIR, side_dirs)
    if jax.process_index() != 0:
        return path
    (path / "best_meta.json").write_text(json.dumps(
        {"step": int(step), "metric": metric, "value": float(value)}, indent=1) + "\n")
    return path
