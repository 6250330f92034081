"""Checkpoints: where and how often to save, what to resume from, and checkpoint formats."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_PGS = ("pgs-train", "pgs-distill")

# Formats Megatron accepts (Primus's pinned copy still has zarr; HEAD adds torch_dcp and
# fsdp_dtensor). torch_dist and zarr map to jaxtrain's Orbax format; the torch formats stop the
# run with the conversion path.
_CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")
_CONVERT_FORMATS = ("torch", "torch_dist", "zarr")
_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
               "raise_all", "return_unexpected", "return_all", "ignore_all")
_WRITES_ORBAX = "jaxtrain writes only Orbax checkpoints"
TORCH_FORMATS = ("torch", "torch_dcp", "fsdp_dtensor")
TORCH_FORMATS_REASON = ("to start from a Megatron checkpoint, convert it to Hugging Face format "
                        "(Megatron-Bridge, or tools/checkpoint/convert.py with an HF saver) and "
                        "import it with jaxtrain.models.from_hf")


def _skip_if_off(value):
    """MaxText save_checkpoint_on_completion is the inverse of disable_last_saving."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    return (not value) if isinstance(value, (bool, int)) else value


def _none_if_empty(value):
    """MaxText writes an empty path for "none"."""
    return None if value in ("", "None", "none") else value


def _keep_all_if_unset(value):
    """MaxText's max_num_checkpoints_to_keep: None (or a negative count) keeps every one."""
    if value in ("None", "none", "null"):
        return 0
    try:
        return 0 if float(value) < 0 else value
    except (TypeError, ValueError):
        return value


def _off_if_zero(value):
    """pgs's save_steps: 0 means no periodic checkpoints, which is null here."""
    return None if value in (0, "0") else value


KNOBS = [
    # Where and how often to save
    K("save", "str", None, "Directory checkpoints are written to; null saves none.", "megatron",
      status=HONORED, aliases=(Alias("train.output_dir", _PGS),),
      doc_defaults={"pgs-train": "./checkpoints", "pgs-distill": "./runs/opd"}),
    K("save_interval", "int", 1000, "Iterations between saved checkpoints; null saves only at the "
      "end.", "megatron", status=HONORED,
      aliases=(Alias("train.save_steps", _PGS, to_canonical=_off_if_zero,
                     note="0 means no periodic saves"),
               Alias("checkpoint_period", "maxtext")),
      doc_defaults={"pgs-train": 500, "pgs-distill": None, "maxtext": 10_000}),
    K("save_retain_interval", "int", None, "Keep every checkpoint whose iteration is a multiple "
      "of this; others but the newest are deleted.", "megatron", status=HONORED),
    K("train.keep_checkpoints", "int", 0, "How many newest step checkpoints to keep; older ones "
      "are deleted (0 keeps all; the final export is exempt).", "pgs-distill", status=HONORED,
      aliases=(Alias("max_num_checkpoints_to_keep", "maxtext", to_canonical=_keep_all_if_unset,
                     note="None keeps all (0 here)"),), nullable=True,
      doc_defaults={"pgs-train": 5, "pgs-distill": 3}),
    K("disable_last_saving", "bool", False, "Skip the checkpoint normally written when training "
      "ends.", "megatron", status=HONORED,
      aliases=(Alias("save_checkpoint_on_completion", "maxtext", to_canonical=_skip_if_off,
                     note="the opposite switch: true writes the final checkpoint"),)),
    K("train.save_final", "bool", False, "At the end, export the final model in Hugging Face "
      "format to <output_dir>/final (on by default in pgs files).", "pgs-train", status=HONORED,
      doc_defaults={"pgs-train": True, "pgs-distill": True}),
    K("save_hf", "bool", False, "Also write each saved checkpoint as a Hugging Face model in "
      "<save>/step-<N>/model and the best validated model in <save>/best (on in pgs files).",
      "jaxtrain", status=HONORED, doc_defaults={"pgs-train": True},
      reason="pgs saves every checkpoint as a Hugging Face model directory beside its optimizer "
             "state; jaxtrain resumes from its Orbax checkpoint <save>/step_<N> and writes the "
             "model directory next to it, removed with it"),
    K("enable_checkpointing", "bool", False, "MaxText switch for writing checkpoints and resuming "
      "from the run's own latest one.", "maxtext", status=HONORED,
      doc_defaults={"maxtext": True}),
    K("async_save", "bool", None, "Write checkpoints in the background while training continues; "
      "null means synchronous.", "megatron", status=HONORED,
      aliases=(Alias("async_checkpointing", "maxtext"),), doc_defaults={"maxtext": True}),

    # What a checkpoint holds
    K("no_save_optim", "bool", None, "Leave the optimizer state out of saved checkpoints.",
      "megatron", status=HONORED),
    K("no_save_rng", "bool", None, "Leave the random-number state out of saved checkpoints.",
      "megatron", status=HONORED),

    # What to load and resume from
    K("load", "str", None, "Checkpoint directory to start from; null starts from fresh "
      "initialisation.", "megatron", status=HONORED),
    K("pretrained_checkpoint", "str", None, "Checkpoint to finetune from when `load` holds none "
      "(forces finetune).", "megatron", status=HONORED,
      aliases=(Alias("load_parameters_path", "maxtext", to_canonical=_none_if_empty,
                     note="weights only, from a jaxtrain checkpoint (run or step directory); "
                          "the run's own checkpoints are resumed first, as in MaxText"),)),
    K("ckpt_step", "int", None, "Iteration to load from the load directory instead of its "
      "latest.", "megatron", status=HONORED),
    K("auto_continue_train", "bool", False, "If the save directory already has checkpoints, "
      "training picks up from the most recent one.", "megatron", status=HONORED),
    K("train.resume_from", "str", None, "Checkpoint directory to resume from, or 'auto' for the "
      "newest in output_dir (fresh if none); null/'' = fresh.", ("pgs-train", "pgs-distill"),
      status=HONORED,
      aliases=(Alias("load_full_state_path", "maxtext", to_canonical=_none_if_empty,
                     note="the full train state (weights, optimizer, step) of a jaxtrain "
                          "checkpoint"),)),
    K("exit_on_missing_checkpoint", "bool", True, "Stop when `load` is set but holds no "
      "checkpoint, instead of initialising at random.", "megatron", status=HONORED),
    K("finetune", "bool", True, "Load only the weights: skip optimizer and RNG state and restart "
      "the iteration count at 0.", "megatron", status=HONORED),
    K("no_load_optim", "bool", None, "Do not restore the optimizer state from the checkpoint.",
      "megatron", status=HONORED),
    K("no_load_rng", "bool", None, "Do not restore the random-number state from the checkpoint.",
      "megatron", status=HONORED),
    K("load_main_params_from_ckpt", "bool", False, "When the optimizer state is not loaded, take "
      "the fp32 main weights from the checkpoint instead of rebuilding them from the model "
      "weights.", "megatron", MAPPED,
      "always the case in jaxtrain: the train state keeps one parameter tree, the master "
      "weights (weight_dtype, fp32 by default), and a checkpoint restores exactly those with or "
      "without the optimizer state; there is no lower-precision model copy to rebuild them "
      "from"),
    K("use_checkpoint_args", "bool", False, "Take the model-shape settings stored in the "
      "checkpoint over those in the config.", "megatron", status=HONORED),
    K("use_mp_args_from_checkpoint_args", "bool", False, "Take the tensor/pipeline parallel sizes "
      "stored in the checkpoint.", "megatron", status=HONORED),
    K("use_tokenizer_model_from_checkpoint_args", "bool", True, "With use_checkpoint_args, also "
      "take the tokenizer path stored in the checkpoint.", "megatron", status=HONORED),
    K("dist_ckpt_strictness", "str", "assume_ok_unexpected", "What to do when checkpoint and model "
      "keys differ on load: assume fine, log, raise, return or ignore.", "megatron",
      status=HONORED, choices=_STRICTNESS),
    K("ckpt_fully_parallel_load", "bool", False, "Read each checkpoint shard on one data-parallel "
      "replica and broadcast it to the others.", "megatron", MAPPED,
      "Orbax always loads in parallel: every process reads from storage only the shards its own "
      "devices hold, concurrently through tensorstore, so no replica reads the whole checkpoint; "
      "there is no torch_dist load strategy to wrap, and values are the same either way",
      aliases=(Alias("enable_single_replica_ckpt_restoring", "maxtext"),)),

    # Checkpoint format
    K("ckpt_format", "str", "torch_dist", "Megatron checkpoint format; jaxtrain stores Orbax "
      "whichever is set, and PyTorch checkpoints must be converted first.", "megatron", MAPPED,
      reason="every value means jaxtrain's Orbax checkpoint format (tensorstore arrays, OCDBT), "
      "which it writes and reads; a PyTorch format (torch, torch_dcp, fsdp_dtensor) warns that "
      "the files are Orbax when the run saves or loads, and a PyTorch checkpoint in a directory "
      "the run loads from stops it (the dry run too) with the way to convert it",
      choices=_CKPT_FORMATS),
    K("auto_detect_ckpt_format", "bool", False, "Megatron: detect legacy or distributed format "
      "from the files when loading.", "megatron", INERT,
      "jaxtrain always inspects the files it loads: it reads Orbax and reports any torch "
      "checkpoint with the conversion path, so there is nothing to switch on"),
    K("use_dist_ckpt_deprecated", "bool", False, "Megatron's retired --use-dist-ckpt switch.",
      "megatron", INERT, "deprecated and without effect in Megatron too; the format follows "
      "ckpt_format"),
    K("dist_ckpt_format_deprecated", "str", None, "Megatron's retired --dist-ckpt-format setting.",
      "megatron", INERT, "deprecated and without effect in Megatron too; the format follows "
      "ckpt_format"),
    K("ckpt_convert_format", "str", None, "Megatron: load, re-save in this torch format, then "
      "exit.", "megatron", REJECTED,
      f"{_WRITES_ORBAX}; to move weights to PyTorch, export a Hugging Face checkpoint "
      "(train.save_final) and convert that with Megatron's Hugging Face importers",
      choices=_CONVERT_FORMATS),
    K("ckpt_convert_save", "str", None, "Megatron: output directory of a checkpoint conversion.",
      "megatron", REJECTED,
      f"{_WRITES_ORBAX}; there is no torch-format conversion to write (see ckpt_convert_format)"),
    K("ckpt_convert_update_legacy_dist_opt_format", "bool", False, "Megatron: during conversion, "
      "rewrite a pre-2024 distributed-optimizer checkpoint into the current layout.",
      "megatron", REJECTED,
      "rewrites a legacy Megatron torch optimizer layout, which jaxtrain can neither read nor "
      "write; convert with Megatron itself"),
    K("dist_ckpt_save_pre_mcore_014", "bool", None, "Megatron: save in the layout read by "
      "Megatron-Core before 0.14.", "megatron", REJECTED,
      f"{_WRITES_ORBAX}, never a Megatron-Core torch_dist layout"),

    # Save/load mechanics with no Orbax counterpart
    K("ckpt_fully_parallel_save", "bool", True, "Megatron: spread the writing of replicated "
      "shards over data-parallel ranks.", "megatron", INERT,
      "Orbax already writes each array shard once, from one replica; there is no torch_dist "
      "save strategy to pick and files hold the same values either way",
      aliases=(Alias("fully_parallel_save", "primus",
                     note="the name Primus's SFT preset writes"),)),
    K("ckpt_fully_parallel_save_deprecated", "bool", False, "Megatron's retired "
      "--ckpt-fully-parallel-save switch.", "megatron", INERT,
      "deprecated and without effect in Megatron too"),
    K("ckpt_assume_constant_structure", "bool", False, "Megatron: reuse cached torch save plans "
      "between saves.", "megatron", INERT,
      "caches torch.distributed.checkpoint save plans; Orbax has no plan to cache, and saved "
      "values are the same either way"),
    K("dist_ckpt_optim_fully_reshardable", "bool", None, "Megatron: store optimizer state so it "
      "reshards across TP/PP/EP/DP changes.", "megatron", INERT,
      "Orbax stores every array by its global shape, so optimizer state always restores onto "
      "any mesh"),
    K("use_persistent_ckpt_worker", "bool", False, "Megatron: keep one background process for "
      "async saves instead of one per save.", "megatron", INERT,
      "a PyTorch process-pool detail; Orbax's async save runs in background threads of the "
      "training process"),

    # MaxText storage options
    K("checkpoint_storage_use_ocdbt", "bool", True, "MaxText: store checkpoint arrays in Orbax's "
      "OCDBT key-value layout; false writes a directory per array (restores read either).",
      "maxtext", HONORED),
    K("checkpoint_storage_use_zarr3", "bool", True, "MaxText: encode checkpoint arrays as Zarr "
      "v3 instead of v2.", "maxtext", INERT,
      "jaxtrain keeps Orbax's own array encoding and reads back what it writes; the stored "
      "values are the same either way"),
    K("enable_emergency_checkpoint", "bool", False, "MaxText: Orbax's emergency checkpointing "
      "(frequent local saves plus slower persistent ones).", "maxtext", REJECTED,
      "jaxtrain does not run Orbax's emergency checkpoint manager; for frequent local "
      "crash-recovery saves use non_persistent_save_interval with non_persistent_ckpt_type "
      "local"),

    # Non-persistent (ephemeral) checkpoints
    K("non_persistent_save_interval", "int", None, "Iterations between extra short-lived "
      "checkpoints kept only for crash recovery.", "megatron", status=HONORED),
    K("non_persistent_ckpt_type", "str", None, "Where short-lived checkpoints go: global (shared "
      "storage) or local (per-host disk).", "megatron", status=HONORED,
      choices=("global", "local", "in_memory"),
      rejected_values={"in_memory": "Megatron lists it but never implemented it, and a copy "
                       "held in the training process's memory dies with the crash it is meant "
                       "to survive; use local (per-host disk, e.g. a RAM disk) or global"}),
    K("non_persistent_global_ckpt_dir", "str", None, "Shared directory for global short-lived "
      "checkpoints.", "megatron", status=HONORED),
    K("non_persistent_local_ckpt_dir", "str", None, "Per-host directory for local short-lived "
      "checkpoints.", "megatron", status=HONORED),
    K("non_persistent_local_ckpt_algo", "str", "fully_parallel", "Megatron: nvidia-resiliency-ext "
      "strategy for writing local checkpoints.", "megatron", INERT,
      "selects between nvidia-resiliency-ext's local-save strategies, which jaxtrain never uses; "
      "saved values are the same either way", choices=("fully_parallel", "atomic")),
]
