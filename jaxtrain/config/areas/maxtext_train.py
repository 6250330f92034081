"""MaxText training keys: optimizer extras, batch ramp-up, loss terms, data pipelines, SFT/DPO
switches, checkpoint storage and evaluation.

Canonical keys are MaxText's own (configs/base.yml); defaults are its base.yml values. MaxText
keys that name an existing jaxtrain setting are aliases on that knob instead (grad_dtype,
save_checkpoint_on_completion, enable_autocheckpoint, num_vocab_tiling, ...).
"""
from jaxtrain.config.knob import HONORED, INERT, REJECTED, K

_MT = "maxtext"
_ORBAX_IO = ("tunes how Orbax writes the checkpoint files; jaxtrain keeps Orbax's own I/O "
             "settings and the stored values are the same")
_TOOL_ONLY = "read only by MaxText's {tool}, not by training"
_TFDS = ("read only by MaxText's tfds and c4_mlperf pipelines (dataset_type tfds), which jaxtrain "
         "refuses because they need TensorFlow; other dataset types never read it")
_MUON = ("belongs to opt_type muon (optax's contrib Muon), which jaxtrain refuses; for Muon use "
         "Megatron's optimizer: muon with muon_momentum in a Megatron-style file")
_MULTI_TIER = ("Orbax's multi-tier checkpointing (local RAM-disk copies backed up to Cloud "
               "Storage across TPU slices) is not offered; for frequent local saves use "
               "non_persistent_save_interval with non_persistent_ckpt_type local")
_DIFFUSION = ("block diffusion training is outside jaxtrain, which trains causal next-token "
              "language models")

KNOBS = [
    # --- optimizer ---
    K("skip_step_on_spikes", "bool", False, "Skip the update (weights and moments unchanged) when "
      "the loss or gradient norm exceeds its rolling mean + scaling_factor x std.", _MT,
      issue=None, reason="MaxText's rolling-window spike test is not built; pgs's "
      "train.spike_detection (a z-score of the gradient norm) is a different rule"),
    K("skip_step_interval", "int", 128, "Spike skipping: number of recent steps whose loss and "
      "gradient norm give the rolling mean and std.", _MT, issue=None),
    K("skip_step_scaling_factor", "float", 6.0, "Spike skipping: standard deviations above the "
      "rolling mean that count as a spike.", _MT, issue=None),
    K("trainable_parameters_mask", "list[str]", [], "Regex patterns of the parameters to train; "
      "all others are frozen. Empty trains everything.", _MT, issue=None,
      reason="freezing parameters by name is not built in jaxtrain"),
    K("adamw_mask", "list[str]", [], "Regex patterns of the parameters AdamW does not decay "
      "(e.g. bias, norms); empty decays every parameter.", _MT, issue=None,
      reason="jaxtrain's weight decay always skips biases and norm scales and decays the other "
      "parameters; a name-pattern mask is not built"),
    K("muon_beta", "float", 0.95, "MaxText Muon: decay of the gradient moving average.", _MT,
      REJECTED, _MUON),
    K("muon_consistent_rms", "float", None, "MaxText Muon: null scales updates by matrix width; "
      "a number rescales them to that RMS (0.2 suggested).", _MT, REJECTED, _MUON),

    # --- batch ramp-up ---
    K("enable_rampup_batch_size", "bool", False, "Grow the batch during the first samples, from "
      "per_device_batch_size_start in steps of the increment, to per_device_batch_size.", _MT,
      issue=None, reason="the MaxText spelling is not converted yet; Megatron's "
      "rampup_batch_size builds the same ramp in global-batch units"),
    K("per_device_batch_size_start", "float", 4.0, "Batch ramp-up: per-device batch at the "
      "start.", _MT, issue=None),
    K("per_device_batch_size_increment", "float", 2.0, "Batch ramp-up: per-device batch added at "
      "each stage.", _MT, issue=None),
    K("global_rampup_samples", "int", 500, "Batch ramp-up: training samples over which the batch "
      "reaches its full size.", _MT, issue=None),

    # --- loss ---
    K("z_loss_multiplier", "float", 0.0, "Weight of the output z-loss (squared log-sum-exp of the "
      "logits) added to the cross-entropy; 0 adds none.", _MT, issue=None,
      reason="jaxtrain has a router z-loss (moe_z_loss_coeff) but no output-logit z-loss"),
    K("vocab_tiling_ag_once", "bool", False, "With num_vocab_tiling > 1: gather the output-layer "
      "weight once before the tiled loss and reuse it in the backward pass.", _MT, INERT,
      "where XLA gathers the output weight inside jaxtrain's chunked loss is a memory/time "
      "trade-off; the loss and gradients are the same"),
    K("training_objective", "str", "causal_lm", "What the model learns to predict: causal_lm "
      "(next token) or block_diffusion (denoise masked blocks).", _MT, REJECTED, _DIFFUSION,
      choices=("causal_lm", "block_diffusion")),
    K("block_diffusion_mask_id", "int", -1, "Block diffusion: token id of the mask token.", _MT,
      REJECTED, _DIFFUSION),
    K("block_diffusion_min_noise", "float", 0.001, "Block diffusion: least corruption "
      "probability drawn for a block.", _MT, REJECTED, _DIFFUSION),
    K("block_diffusion_logit_alignment", "str", "same_position", "Block diffusion: whether "
      "logits predict the token at their own position or the next one.", _MT, REJECTED,
      _DIFFUSION, choices=("same_position", "shifted")),
    K("block_diffusion_canvas_policy", "str", "all_masked", "Block diffusion: blocks may be fully "
      "masked, or start with a clean anchor token.", _MT, REJECTED, _DIFFUSION,
      choices=("all_masked", "seed_and_mask")),

    # --- post-training switches ---
    K("use_tunix_gradient_accumulation", "bool", False, "SFT: accumulate gradients with "
      "Tunix's trainer instead of MaxText's own loop.", _MT, INERT,
      "jaxtrain accumulates micro-batches inside its one jitted step (lax.scan) whatever the "
      "objective; there is no second trainer to pick"),
    K("use_sft", "bool", False, "Supervised fine-tuning on prompt/completion data instead of "
      "pretraining on plain text.", _MT, HONORED,
      "dataset_type hf files with a messages column, or prompt and completion columns "
      "(train_data_columns / eval_data_columns), rendered with the tokenizer's chat template "
      "and masked by jaxtrain's chat masker (jaxtrain/data/sft.py), packed whole with packing"),
    K("sft_train_on_completion_only", "bool", False, "SFT: take the loss on completion tokens "
      "only; false also on the prompt.", _MT, HONORED,
      "completion tokens are the assistant turns as the chat masker finds them (answer and "
      "end-of-turn token)"),
    K("use_chat_template", "bool", False, "Format conversations with the tokenizer's chat "
      "template before tokenising.", _MT, issue=None),
    K("chat_template_path", "str", "", "JSON file holding a chat template to use instead of the "
      "tokenizer's.", _MT, HONORED, "read when chat (SFT) data is rendered: a JSON object's "
      "chat_template, a JSON string, or the file's text; chat_template wins over it"),
    K("default_prompt", "str", "", "hf pipeline: prompt filled into rows that lack a prompt "
      "column.", _MT, issue=None),

    # --- data ---
    K("reuse_example_batch", "int", 0, "Benchmark aid: keep feeding the first batch (already on "
      "the devices) instead of reading new data.", _MT, HONORED),
    K("max_corpus_chars", "int", 10_000_000, "Most characters of text read when training a "
      "SentencePiece tokenizer.", _MT, INERT,
      _TOOL_ONLY.format(tool="tokenizer-training script")),
    K("generate_padding_batch_train", "bool", False, "When the training data runs out on some "
      "hosts, feed padding batches so every host keeps stepping.", _MT, issue=None),
    K("generate_padding_batch_eval", "bool", False, "generate_padding_batch_train for the "
      "validation data.", _MT, issue=None),
    K("max_segments_per_seq", "int", -1, "Cap on documents per packed row (hf and grain "
      "first_fit packing); synthetic data with packing splits each row into 2..cap segments. "
      "<= 0: no cap.", _MT, HONORED),
    K("dataset_path", "str", "", "tfds: directory (or bucket) holding the TFDS datasets (also "
      "the data of MaxText's offline distillation).", _MT, INERT, _TFDS + "; MaxText's offline "
      "distillation reads it too, planned with the distill_* keys"),
    K("dataset_name", "str", "c4/en:3.1.0", "tfds: training dataset name and version.", _MT,
      INERT, _TFDS),
    K("eval_dataset_name", "str", "c4/en:3.1.0", "tfds: validation dataset name and version.",
      _MT, INERT, _TFDS),
    K("eval_split", "str", "validation", "tfds: split read for validation.", _MT, INERT, _TFDS),

    # --- checkpoints ---
    K("save_checkpoint_on_start", "bool", True, "Write a checkpoint of the initial state at step "
      "0.", _MT, INERT, "jaxtrain writes no step-0 checkpoint; resuming from one equals a fresh "
      "start with the same seeds, so training is unchanged"),
    K("enable_continuous_checkpointing", "bool", False, "Start a new save as soon as the "
      "previous one finished instead of every checkpoint_period steps.", _MT, issue=None),
    K("checkpoint_todelete_subdir", "str", None, "Move checkpoints that retention drops into "
      "this subdirectory instead of deleting them.", _MT, issue=None),
    K("checkpoint_todelete_full_path", "str", None, "Move checkpoints that retention drops to "
      "this path instead of deleting them.", _MT, issue=None),
    K("force_unroll", "bool", False, "Unroll the scanned layers when writing a parameter-only "
      "checkpoint.", _MT, INERT,
      _TOOL_ONLY.format(tool="generate_param_only_checkpoint script")),
    K("checkpoint_storage_target_data_file_size_bytes", "int", 2147483648, "Orbax: split large "
      "arrays into files of about this size.", _MT, INERT, _ORBAX_IO),
    K("checkpoint_storage_concurrent_gb", "int", 96, "Orbax: gigabytes of array data in flight "
      "at once while saving or restoring.", _MT, INERT, _ORBAX_IO),
    K("enable_orbax_v1", "bool", False, "Save and restore through Orbax's v1 API.", _MT, INERT,
      "selects MaxText's code path into Orbax; jaxtrain drives Orbax itself and the stored "
      "values are the same"),
    K("checkpoint_conversion_fn", "str", "none", "Function that turns a loaded foreign "
      "checkpoint dict into MaxText's layout.", _MT, issue=None),
    K("source_checkpoint_layout", "str", "orbax", "Format of the checkpoint to load: orbax, or "
      "Hugging Face safetensors (converted while loading).", _MT, issue=None,
      choices=("orbax", "safetensors", "safetensors_dynamic")),
    K("colocated_python_checkpointing", "bool", False, "Pathways: write checkpoints from the TPU "
      "hosts' colocated Python instead of the controller.", _MT, INERT,
      "a Pathways deployment detail; each jaxtrain process writes its own shards"),
    K("hf_lora_adapter_path", "str", "", "Hugging Face repo or directory of a LoRA adapter to "
      "convert (or merge) into a MaxText checkpoint.", _MT, INERT,
      _TOOL_ONLY.format(tool="to_maxtext checkpoint conversion")),
    K("enable_multi_tier_checkpointing", "bool", False, "Orbax multi-tier checkpointing: "
      "frequent local saves, periodically backed up to persistent storage.", _MT, REJECTED,
      _MULTI_TIER),
    K("multi_tier_checkpointing_backup_interval_minutes", "int", None, "Multi-tier "
      "checkpointing: minutes between backups of local saves to persistent storage.", _MT,
      REJECTED, _MULTI_TIER),
    K("multi_tier_checkpointing_backup_interval_steps", "int", None, "Multi-tier "
      "checkpointing: steps between backups of local saves to persistent storage.", _MT,
      REJECTED, _MULTI_TIER),
    K("mtc_data_parallelism", "int", 0, "Multi-tier checkpointing: identical replicas in the "
      "job; 0 means the number of slices.", _MT, REJECTED, _MULTI_TIER),
    K("local_checkpoint_directory", "str", "", "Local directory of emergency or multi-tier "
      "checkpoints.", _MT, REJECTED, "read only by emergency and multi-tier checkpointing, "
      "which jaxtrain refuses; use non_persistent_local_ckpt_dir with "
      "non_persistent_ckpt_type local"),
    K("local_checkpoint_period", "int", 0, "Steps between local emergency or multi-tier "
      "checkpoints.", _MT, REJECTED, "read only by emergency and multi-tier checkpointing, "
      "which jaxtrain refuses; use non_persistent_save_interval"),

    # --- evaluation and stopping ---
    K("eval_start_step", "int", 0, "Run periodic evaluation only from this step on, counting "
      "eval_interval from it.", _MT, issue=None),
    K("target_eval_loss", "float", 0.0, "Stop training once the evaluation loss reaches this "
      "value; 0 never stops early.", _MT, HONORED),
    K("abort_on_nan_loss", "bool", True, "Stop training when the loss is NaN.", _MT, issue=None,
      reason="jaxtrain stops on a NaN or infinite loss or gradient norm through "
      "check_for_nan_in_loss_and_grad; a separate switch for NaN losses is not built"),
    K("abort_on_inf_loss", "bool", True, "Stop training when the loss is infinite.", _MT,
      issue=None, reason="jaxtrain stops on a NaN or infinite loss or gradient norm through "
      "check_for_nan_in_loss_and_grad; a separate switch for infinite losses is not built"),
    K("record_internal_nn_metrics", "int", 0, "Log statistics of internal activations (e.g. "
      "per-layer norms) with the step metrics.", _MT, issue=None),
]
