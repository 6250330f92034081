"""What a restore accepts: the model, the LR schedule, the leaves present, and no PyTorch files.

- The model: the ModelConfig fields the parameters depend on (:data:`ARCH_FIELDS`) must match
  the checkpoint's, or the restore stops naming each differing field (:func:`check_model`).
- The LR and weight-decay schedule on a resume: Megatron's ``OptimizerParamScheduler`` checks
  the same quantities (:data:`SCHEDULE_KEYS`); ``override_opt_param_scheduler`` keeps this
  config's, ``use_checkpoint_opt_param_scheduler`` takes the checkpoint's (:func:`check_schedule`,
  the policy from :func:`jaxtrain.checkpoint.config.schedule_policy`).
- The leaves: names this run asks for that the checkpoint lacks (Megatron's "unexpected") and
  names the checkpoint holds that this run does not ask for ("missing") are handled as
  ``dist_ckpt_strictness`` says (:func:`differences`, :func:`apply_strictness`). Shapes and
  dtypes are Orbax's to check when it reads into the template's abstract arrays.
- PyTorch / Megatron checkpoints (a ``torch`` ckpt_format; ``iter_*`` directories, ``*.pt``
  files and the like in a directory to load) are refused with the conversion path
  (:data:`TORCH_CONVERSION`, :func:`check_not_torch`).
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib

from jaxtrain.checkpoint.layout import jsonable
from jaxtrain.config.errors import ConfigError

# ModelConfig fields a checkpoint's parameters depend on: a difference makes it unloadable
# into this model (or loadable into a different function), and the error names the field.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "ffn_hidden_size", "vocab_size", "position_embedding_type",
               "normalization", "activation", "gated_linear_unit", "add_bias_linear",
               "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights")

# Config knobs that shape the LR and weight-decay schedules (Megatron's OptimizerParamScheduler
# checks the same quantities on resume: peak/floor LR, warmup, decay horizon and style, WD).
SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_warmup_samples",
                 "lr_warmup_fraction", "lr_decay_style", "lr_decay_iters", "lr_decay_samples",
                 "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
                 "train.lr_scheduler", "decoupled_lr", "decoupled_min_lr", "weight_decay",
                 "start_weight_decay", "end_weight_decay", "weight_decay_incr_style")

TORCH_CONVERSION = ("convert it to Hugging Face format first (Megatron-Bridge, or Megatron's "
                    "tools/checkpoint/convert.py with an HF saver), then import it with "
                    "jaxtrain.models.from_hf")

STRICTNESS_RAISES_UNEXPECTED = ("assume_ok_unexpected", "raise_unexpected", "raise_all")


def schedule_settings(cfg) -> dict:
    """The schedule knobs of a config (or a checkpoint's stored config) with the decay horizon
    explicit: a run that sets neither lr_decay_iters nor lr_decay_samples decays over its
    train_samples (or train_iters), recorded as lr_decay_samples (lr_decay_iters)."""
    out = {k: jsonable(cfg.get(k)) for k in SCHEDULE_KEYS}
    if out["lr_decay_iters"] is None and out["lr_decay_samples"] is None:
        if cfg.get("train_samples"):
            out["lr_decay_samples"] = cfg.get("train_samples")
        elif cfg.get("train_iters"):
            out["lr_decay_iters"] = cfg.get("train_iters")
    return out


def find_torch_checkpoint(path: pathlib.Path) -> str | None:
    """What marks ``path`` as a Megatron/PyTorch checkpoint, if anything does."""
    if (path / "latest_checkpointed_iteration.txt").exists():
        return "latest_checkpointed_iteration.txt"
    for pattern in ("iter_*", "*.pt", "*.distcp", "*.pth"):
        found = next(iter(path.glob(pattern)), None)
        if found is not None:
            return found.name
    return None


def check_not_torch(path: pathlib.Path, what: str) -> None:
    """ConfigError when the directory ``path`` (named by the knob ``what``) holds a PyTorch
    checkpoint."""
    torch = find_torch_checkpoint(path)
    if torch:
        raise ConfigError(f"{what} {path} holds a PyTorch/Megatron checkpoint "
                          f"({torch}); jaxtrain reads Orbax checkpoints only: "
                          f"{TORCH_CONVERSION}")


def check_model(meta: dict, model_cfg, where) -> None:
    """ConfigError naming the :data:`ARCH_FIELDS` in which the checkpoint's model (its meta)
    differs from ``model_cfg``."""
    saved = meta.get("model") or {}
    if model_cfg is None:
        return
    here = dataclasses.asdict(model_cfg)
    diff = [f"{k} = {saved[k]!r} there, {here[k]!r} here" for k in ARCH_FIELDS
            if k in saved and jsonable(here[k]) != saved[k]]
    if diff:
        raise ConfigError(f"checkpoint {where} was saved from a different model: "
                          + "; ".join(diff) + ". Set the model knobs to the checkpoint's "
                          "values, or load a matching checkpoint")


def check_schedule(meta: dict, policy: str, config: dict, where) -> None:
    """override_opt_param_scheduler / use_checkpoint_opt_param_scheduler on a resume:
    ``policy`` 'config' accepts any stored schedule, 'check' and 'checkpoint' stop at one that
    differs from ``config``'s (the latter is adopted when the config is resolved)."""
    saved = meta.get("schedule") or (schedule_settings(meta["config"])
                                     if meta.get("config") else None)
    if policy == "config" or not saved or not config:
        return
    here = schedule_settings(config)
    diff = [f"{k} = {saved[k]!r} there, {here[k]!r} here" for k in SCHEDULE_KEYS
            if k in saved and saved[k] != here[k]]
    if not diff:
        return
    if policy == "check":
        raise ConfigError(f"checkpoint {where} was trained with a different LR schedule: "
                          + "; ".join(diff) + ". Set override_opt_param_scheduler to true "
                          "to continue with this config's schedule, or "
                          "use_checkpoint_opt_param_scheduler to take the checkpoint's")
    raise ConfigError(f"use_checkpoint_opt_param_scheduler: the schedule of checkpoint "
                      f"{where} differs from this config's ({'; '.join(diff)}). It is "
                      "adopted when the config is resolved: python -m jaxtrain.train does "
                      "that; elsewhere resolve the config again with the overrides of "
                      "jaxtrain.checkpoint_args.checkpoint_overrides(cfg)")


def differences(requested: dict[str, set], stored: dict[str, set]) -> tuple[dict, dict]:
    """Per item, the leaf names this run asks for that the checkpoint lacks (Megatron's
    "unexpected") and the names the checkpoint holds that this run does not ask for
    ("missing"), each sorted; items without any are left out."""
    absent = {i: sorted(requested[i] - stored[i]) for i in requested
              if requested[i] - stored[i]}
    extra = {i: sorted(stored[i] - requested[i]) for i in requested
             if stored[i] - requested[i]}
    return absent, extra


def reported(absent: dict, extra: dict, mode: str) -> dict:
    """What dist_ckpt_strictness's return_* modes report of :func:`differences`."""
    return {"unexpected": absent if mode.startswith("return_") else {},
            "missing": extra if mode == "return_all" else {}}


def _show(found: dict) -> str:
    return "; ".join(f"{item}: {', '.join(names[:8])}"
                     + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
                     for item, names in found.items())


def apply_strictness(where, absent: dict, extra: dict, mode: str, log: logging.Logger) -> None:
    """dist_ckpt_strictness ``mode`` on :func:`differences`: a ConfigError for unexpected
    leaves under assume_ok_unexpected, raise_unexpected and raise_all and for missing ones
    under raise_all; a warning under log_unexpected (unexpected) and log_all (both); the
    other modes pass."""
    fail = []
    if absent and mode in STRICTNESS_RAISES_UNEXPECTED:
        fail.append(f"in this run but not in the checkpoint: {_show(absent)}")
    if extra and mode == "raise_all":
        fail.append(f"in the checkpoint but not in this run: {_show(extra)}")
    if fail:
        raise ConfigError(f"checkpoint {where} does not match this run's state "
                          f"(dist_ckpt_strictness {mode}): " + "; ".join(fail) + ". If "
                          "the optimizer differs, set no_load_optim; to start what the "
                          "checkpoint lacks from its initial values, set "
                          "dist_ckpt_strictness to log_unexpected")
    if absent and mode in ("log_unexpected", "log_all"):
        log.warning("checkpoint %s lacks leaves this run has; they keep their initial "
                    "values: %s", where, _show(absent))
    if extra and mode == "log_all":
        log.warning("checkpoint %s holds leaves this run does not use; they are not "
                    "loaded: %s", where, _show(extra))
