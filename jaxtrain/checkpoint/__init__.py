"""Checkpoints with Orbax: save, retention, resume, finetune and reshard on load.

A checkpoint is one Orbax step directory ``<root>/step_<N>`` holding the items

    params       the parameter tree (tensorstore/OCDBT)
    opt_state    the optimizer state (left out with no_save_optim)
    rng          the train state's key as raw key data (left out with no_save_rng)
    train        {step, opt_step}: iterations run and updates applied
    loss_scale   fp16 loss-scale state, when the run has one
    spike_stats  pgs gradient-spike statistics, when the run has them
    fp8          the quantization state (``TrainState.quant_state``: FP8 delayed scaling's amax
                 histories and scales), when the run has one
    meta         JSON: consumed samples (the data iterator's whole state), param_scan_axis,
                 the ModelConfig, the LR-schedule knobs and the resolved config

Orbax writes a step into a temporary directory and renames it when complete, so a save that
did not finish (a killed process) is never listed and never picked as the latest; stale
temporary directories are removed when a manager opens the directory again.

Arrays restore into the shardings of the template state the caller builds on the current mesh,
so a checkpoint saved on one device layout loads on another. Layer-stacked leaves (every leaf
under a ``layers`` key, in params and in the optimizer state mirroring them) move their layer
axis when the checkpoint's ``param_scan_axis`` differs from the model's. Leaves the run has and
the checkpoint lacks, or the reverse, are handled as ``dist_ckpt_strictness`` says.

Non-persistent checkpoints (``non_persistent_save_interval``) are extra saves kept only for
crash recovery, newest one only: ``global`` ones in ``non_persistent_global_ckpt_dir`` (default
``<save>/non_persistent``), ``local`` ones per host (see :mod:`jaxtrain.checkpoint.local`). A
resume takes one when it is at least as new as the newest persistent checkpoint.

    ckpt = Checkpointer.from_config(cfg, run_dir, model_cfg)
    restored = ckpt.restore(state)            # (state, consumed) or None
    ckpt.maybe_save(step, state, consumed)    # every save_interval steps (force=True: now)
    ckpt.close()                              # waits for an async save to finish

The modules, one concern each:

    config    CheckpointConfig (the checkpoint knobs, read once) and schedule_policy
    layout    the format on disk: step directories, items, leaf names, the layer-axis move
    manager   Checkpointer: the Orbax managers, saving, retention, async, non-persistent saves
    restore   which checkpoint to start from (non-persistent ones included), and restoring it
    compat    what a restore accepts: model fields, LR schedule, dist_ckpt_strictness, no
              PyTorch checkpoints
    export    train.save_final: the final model in Hugging Face format
    local     local (per-host) non-persistent checkpoints

:mod:`jaxtrain.checkpoint_args` (use_checkpoint_args and friends) stays beside the package: it
runs while the config resolves, before any model exists, and is loaded only by the CLI.
"""
from jaxtrain.checkpoint.compat import (ARCH_FIELDS, SCHEDULE_KEYS, TORCH_CONVERSION,
                                        check_not_torch, find_torch_checkpoint,
                                        schedule_settings)
from jaxtrain.checkpoint.config import CheckpointConfig, schedule_policy
from jaxtrain.checkpoint.layout import (FINAL_DIR, FLAT_ITEMS, FORMAT_VERSION, ITEMS,
                                        NON_PERSISTENT_DIR, STATE_ITEMS, STEP_PREFIX, LocalRoot)
from jaxtrain.checkpoint.manager import Checkpointer

__all__ = ["ARCH_FIELDS", "FINAL_DIR", "FLAT_ITEMS", "FORMAT_VERSION", "ITEMS",
           "NON_PERSISTENT_DIR", "SCHEDULE_KEYS", "STATE_ITEMS", "STEP_PREFIX", "TORCH_CONVERSION",
           "CheckpointConfig", "Checkpointer", "LocalRoot", "check_not_torch",
           "find_torch_checkpoint", "schedule_policy", "schedule_settings"]
