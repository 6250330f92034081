"""Starting a run from Hugging Face weights: the model directory ``model.name_or_path`` names.

The config already took the architecture from that directory's config.json (config/dialects/
hf.py); here its safetensors become the initial parameters of a fresh run (a resumed run reads
its own checkpoint instead). The checkpoint is memory-mapped (:mod:`jaxtrain.models.hf.
safetensors_files`); the family adapter turns its tensors into jaxtrain's tree one leaf at a
time, and each leaf is placed shard by shard: every device receives only the slice its
sharding holds, cast to the parameter's dtype (``weight_dtype``, pgs ``model.torch_dtype``).
Host memory peaks at about one copy of the model, never one per device.
"""
from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np

from jaxtrain.config.dialects import hf as hf_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.models import hf
from jaxtrain.models.hf import safetensors_files
from jaxtrain.models.hf.common import Tensors, read_tensors
from jaxtrain.models.moe import trainable

KEY = hf_config.KEY


def model_dir(cfg) -> pathlib.Path | None:
    """The Hugging Face model directory whose weights start the run, or None."""
    name = cfg.get(KEY)
    return hf_config.locate(str(name)) if name else None


def check_weights(path: pathlib.Path) -> None:
    """ConfigError (naming the key and file) unless ``path`` holds readable weights."""
    try:
        safetensors_files.shapes(path)
    except safetensors_files.CheckpointError as e:
        raise ConfigError(f"{KEY}: {e}") from None


EMBEDDINGS = ("embed_tokens.weight", "wte.weight")


def check_vocab(path: pathlib.Path, model_cfg) -> None:
    """ConfigError when the checkpoint's embedding rows are not the model's vocabulary (a
    tokenizer with more tokens than config.json's vocab_size, or a vocab_size override)."""
    for name, shape in safetensors_files.shapes(path).items():
        if name.endswith(EMBEDDINGS) and shape[0] != model_cfg.vocab_size:
            raise ConfigError(
                f"{KEY} {path}: the checkpoint's embedding has {shape[0]} rows but the model's "
                f"vocabulary is {model_cfg.vocab_size} (the tokenizer's size, vocab_size "
                "or make_vocab_size_divisible_by changes it): use the model's own tokenizer and "
                "leave vocab_size to config.json")


def params_tree(path: pathlib.Path, model_cfg) -> dict:
    """The parameter tree (lazy host arrays) of the checkpoint in ``path`` for ``model_cfg``."""
    config = hf_config.read(path)
    try:
        t = Tensors(read_tensors(path))
        tree = hf.adapter(config.get("model_type")).params(t, model_cfg, config)
        t.done()
    except (ValueError, safetensors_files.CheckpointError) as e:
        raise ConfigError(f"{KEY} {path}: {e}") from None
    return tree


def _check_shapes(tree: dict, abstract: dict, path: pathlib.Path) -> None:
    got = jax.tree_util.tree_flatten_with_path(tree)[0]
    want = jax.tree_util.tree_flatten_with_path(abstract)[0]
    if [p for p, _ in got] != [p for p, _ in want]:
        raise ConfigError(f"{KEY} {path}: the checkpoint's parameters are not this model's "
                          "(an architecture knob given in the file or on the command line "
                          "changes the model: leave the architecture to config.json)")
    for (p, a), (_, s) in zip(got, want):
        if tuple(a.shape) != tuple(s.shape):
            raise ConfigError(
                f"{KEY} {path}: {jax.tree_util.keystr(p)} is {tuple(a.shape)} in the checkpoint "
                f"but {tuple(s.shape)} in the model (vocab_size, a tokenizer with more tokens "
                "than config.json's vocab_size, or an architecture knob in the file changes "
                "it: leave the architecture to config.json)")


def place(tree: dict, abstract: dict, shardings: dict) -> dict:
    """Host arrays -> global arrays, each device reading only its own slice."""
    def put(a, s, sharding):
        return jax.make_array_from_callback(
            s.shape, sharding, lambda index: np.asarray(a[index], s.dtype))
    return jax.tree.map(put, tree, abstract, shardings)


def load_params(path: pathlib.Path, model_cfg, abstract: dict, shardings: dict) -> dict:
    """The sharded parameters of the Hugging Face checkpoint in ``path``."""
    tree = params_tree(path, model_cfg)
    _check_shapes(tree, abstract, path)
    return place(tree, abstract, shardings)


def start_from_hf(state, path: pathlib.Path, model_cfg, optimizer, abstract, shardings,
                  on_device):
    """``state`` with the checkpoint's parameters and an optimizer state made for them.

    ``abstract``/``shardings`` are the train state's; ``on_device`` its shardings with every
    part in device memory (the optimizer runs there; host-offloaded parts move after). The
    initial parameters and optimizer state ``state`` holds are freed first, so the device
    never holds two copies of the model."""
    tree = params_tree(path, model_cfg)      # read and checked before anything is freed
    _check_shapes(tree, abstract.params, path)
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        leaf.delete()
    params = place(tree, abstract.params, on_device.params)
    opt_state = jax.jit(lambda p: optimizer.init(trainable(p)),
                        out_shardings=on_device.opt_state)(params)
    state = dataclasses.replace(state, params=params, opt_state=opt_state)
    return jax.device_put(state, shardings) if on_device != shardings else state
