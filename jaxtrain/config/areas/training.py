"""Training loop length, batching, evaluation cadence, exits, seeds and step-level health checks."""
from jaxtrain.config.knob import Alias, HONORED, INERT, MAPPED, K, REJECTED


def _unset_if_negative(value):
    """pgs writes -1 for "not set" (its trainer reads any max_steps <= 0 so); 0 or a negative
    number becomes None."""
    try:
        if value is not None and not isinstance(value, bool) and float(value) <= 0:
            return None
    except (TypeError, ValueError):
        pass
    return value


def _off_if_zero(value):
    """pgs writes 0 for "off"; 0 becomes None (no periodic evaluation)."""
    try:
        if value is not None and not isinstance(value, bool) and float(value) == 0:
            return None
    except (TypeError, ValueError):
        pass
    return value


_MEGATRON = "megatron"
_PGS = "pgs-train"
_BOTH_PGS = ("pgs-train", "pgs-distill")

KNOBS = [
    # --- run length ---
    K("train_iters", "int", 1000, "Number of optimizer steps to train for; null means the run is "
      "sized by train_samples (or by epochs in pgs files).", _MEGATRON,
      aliases=(Alias("steps", "maxtext", note="-1 means learning_rate_schedule_steps"),
               Alias("train.max_steps", _PGS, to_canonical=_unset_if_negative,
                     note="-1 (any negative) means unset: the length comes from train.epochs"),
               Alias("train.steps", "pgs-distill")),
      doc_defaults={"maxtext": 150_001, "pgs-train": None, "pgs-distill": 1000}, status=HONORED),
    K("train_samples", "int", None, "Run length in samples instead of steps; needed by "
      "rampup_batch_size and exclusive with train_iters.", _MEGATRON, status=HONORED),
    K("train.epochs", "int", None, "Passes over the training data when no step count is given; "
      "null leaves the length to train_iters/train_samples.", _PGS,
      doc_defaults={"pgs-train": 1}, status=HONORED),
    K("train.exact_steps", "bool", False, "Count the steps of an epoch by one full pass over the "
      "data pipeline before training instead of estimating them.", _PGS, status=INERT,
      reason="jaxtrain reads, encodes, mixes and packs the whole dataset before the first step, "
             "so the step count is always the exact one; there is no estimate to replace"),

    # --- batching ---
    K("micro_batch_size", "int", 2, "Batch each data-parallel replica runs through a single "
      "forward/backward; accumulation stacks several.", _MEGATRON,
      aliases=(Alias("batch_size", _MEGATRON, note="deprecated Megatron spelling"),
               Alias("train.per_device_batch_size", _PGS)),
      doc_defaults={"pgs-train": 1}, status=HONORED),
    K("per_device_batch_size", "float", None, "MaxText batch: sequences per device per "
      "micro-step; global batch = this x devices x gradient_accumulation_steps (may be < 1).",
      "maxtext", doc_defaults={"maxtext": 12.0}, status=HONORED),
    K("global_batch_size", "int", 16, "Sequences per optimizer step over all replicas; "
      "accumulation steps = global / (micro x data-parallel size).", _MEGATRON,
      doc_defaults={"pgs-train": None, "pgs-distill": None}, status=HONORED),
    K("train.gradient_accumulation_steps", "int", None, "Micro-batches summed per optimizer step; "
      "null derives it from global_batch_size.", _PGS,
      aliases=(Alias("gradient_accumulation_steps", "maxtext"),),
      doc_defaults={"pgs-train": 16}, status=HONORED),
    K("train.ga_ramp_start", "int", 0, "Start accumulation at this many micro-batches and grow it "
      "linearly to the full count over the run; 0 keeps it constant.", _PGS, status=HONORED,
      reason="step s accumulates start + (full - start)·s // max_steps micro-batches, as pgs; "
             "each distinct count compiles the step once"),
    K("rampup_batch_size", "list[int]|str", None, "Global-batch warm-up as 'start increment "
      "samples': grow from start by increment, reaching the full size after samples.",
      _MEGATRON, status=HONORED),
    K("decrease_batch_size_if_needed", "bool", False, "Shrink the global batch to a multiple of "
      "micro x data-parallel size instead of failing when it does not divide.", _MEGATRON, status=HONORED),

    # --- evaluation cadence ---
    K("eval_interval", "int", 1000, "Steps between validation runs during training; null turns "
      "periodic validation off.", _MEGATRON, nullable=True,
      aliases=(Alias("data.eval_every", _PGS, to_canonical=_off_if_zero,
                     note="0 means off (null)"),
               Alias("train.eval_every", "pgs-distill", to_canonical=_off_if_zero,
                     note="0 means off (null)")),
      doc_defaults={"pgs-train": 100, "pgs-distill": 50, "maxtext": None}, status=HONORED),
    K("eval_iters", "int|list[int]", 0, "Validation batches per validation run (a list gives one "
      "count per validation set); 0 skips validation.", _MEGATRON, status=HONORED,
      aliases=(Alias("eval_steps", "maxtext",
                     note="-1 evaluates the whole validation split (full_validation)"),),
      doc_defaults={"maxtext": -1}),
    K("num_epoch", "int", None, "MaxText: passes over the hf/grain/olmo_grain training data before "
      "it runs out; the run ends then if its steps would go further (MaxText files: 1; null: "
      "no limit).", "maxtext", status=HONORED, doc_defaults={"maxtext": 1}),
    K("full_validation", "bool", False, "Evaluate the whole validation split each time instead of "
      "eval_iters batches.", _MEGATRON, doc_defaults={"pgs-train": True}, status=HONORED),
    K("multiple_validation_sets", "bool", False, "Treat each validation dataset as its own set "
      "and report a separate loss for each.", _MEGATRON, status=HONORED),
    K("skip_train", "bool", False, "Do no training steps: load, run validation/test and exit.",
      _MEGATRON, status=HONORED),

    # --- exits and host/device pacing ---
    K("exit_signal_handler", "bool", False, "On SIGTERM, save a checkpoint at the next step "
      "boundary and exit cleanly.", _MEGATRON, status=HONORED,
      aliases=(Alias("enable_autocheckpoint", "maxtext", note="MaxText saves at the step where "
                     "the preemption notice (SIGTERM) arrives, then stops"),)),
    K("exit_duration_in_mins", "int", None, "Save and exit once the run has been going this many "
      "minutes of wall time.", _MEGATRON, status=HONORED),
    K("exit_interval", "int", None, "Save and exit at the first step number divisible by this "
      "value.", _MEGATRON, status=HONORED),
    K("train_sync_interval", "int", None, "Every this many steps, wait for the device to finish "
      "so the host cannot dispatch too far ahead.", _MEGATRON, status=INERT, reason="the loop already waits for each step's metrics one step behind, so the host never runs further ahead; a periodic extra wait changes nothing"),

    # --- Python garbage collection ---
    K("manual_gc", "bool", False, "Disable Python's automatic GC and collect at fixed steps, so GC "
      "pauses line up across hosts.", _MEGATRON, status=HONORED),
    K("manual_gc_interval", "int", 1, "With manual_gc, collect every this many steps (0: only "
      "around validation).", _MEGATRON, status=HONORED),
    K("manual_gc_eval", "bool", False, "With manual_gc, also collect before and after each "
      "validation run.", _MEGATRON, status=HONORED),

    # --- numerical health checks ---
    K("check_for_nan_in_loss_and_grad", "bool", True, "Stop the run when the loss or the "
      "gradient norm is NaN or infinite.", _MEGATRON, status=HONORED),
    K("check_for_spiky_loss", "bool", False, "Flag steps whose loss is 10x or more the largest "
      "loss seen in the first 100 steps.", _MEGATRON, status=HONORED),
    K("check_for_large_grads", "bool", False, "Flag steps whose gradient norm is 10x or more the "
      "largest seen in the first 100 steps.", _MEGATRON, status=HONORED),
    K("train.spike_detection", "bool", False, "Skip the update (without advancing the LR "
      "schedule) when the pre-clip grad norm's z-score is too high.", _PGS,
      doc_defaults={"pgs-train": True}, status=HONORED),
    K("train.spike_z_threshold", "float", 5.0, "z-score of the gradient norm above which "
      "train.spike_detection skips a step.", _PGS, status=HONORED),

    # --- seeds and initialization ---
    K("seed", "int", 1234, "Base random seed for parameter init, dropout and data order.",
      _MEGATRON, aliases=(Alias("train.seed", _BOTH_PGS),
                          Alias("init_weights_seed", "maxtext", note="MaxText's seed of the "
                                "initial weights (and the dropout keys drawn from it); its data "
                                "order has data_shuffle_seed")),
      doc_defaults={"pgs-train": 42, "pgs-distill": 0, "maxtext": 0}, status=HONORED),
    K("data_parallel_random_init", "bool", False, "Megatron: seed each data-parallel rank's "
      "init differently.", _MEGATRON, INERT,
      "JAX creates each parameter once as one global array and draws dropout per example over "
      "the global batch, so there are no per-replica copies to seed apart"),
    K("init_method_xavier_uniform", "bool", False, "Initialize weight matrices with Xavier-uniform "
      "instead of the normal(init_method_std) default.", _MEGATRON, status=HONORED),
    K("make_vocab_size_divisible_by", "int", 128, "Pad the embedding and output vocabulary up to "
      "a multiple of this (times the tensor-parallel size).", _MEGATRON, status=HONORED,
      doc_defaults={"maxtext": 1}),   # MaxText sizes the embedding by vocab_size as written

    # --- kernels ---
    K("use_flash_attn", "bool", True, "Use the fused flash-attention kernel instead of plain "
      "softmax attention.", _MEGATRON, MAPPED,
      "false selects the plain-XLA attention; true (the default) leaves the kernel to the "
      "other attention knobs, auto by default: jaxtrain's Pallas flash kernel on a GPU, XLA on "
      "the CPU or with attention dropout"),

    # --- PyTorch/Megatron-only tooling ---
    K("onnx_safe", "bool", None, "Megatron: work around Torch ONNX-exporter limits in legacy "
      "models.", _MEGATRON, INERT,
      "only changes how legacy PyTorch modules are written for ONNX export; jaxtrain exports "
      "no ONNX and the training math is the same"),
    K("test_mode", "bool", False, "Megatron: run its built-in attention self-tests inside the "
      "forward pass.", _MEGATRON, INERT,
      "a Megatron self-check of its own CUDA attention path; jaxtrain's kernels are checked "
      "against jnp references by its test suite and the training math is unchanged"),
    K("adlr_autoresume", "bool", False, "Megatron: poll NVIDIA's ADLR cluster autoresume "
      "service and checkpoint/exit when it asks.", _MEGATRON, REJECTED,
      "needs NVIDIA's internal ADLR userlib; use exit_signal_handler or exit_duration_in_mins "
      "with checkpoint resume (load) instead"),
    K("adlr_autoresume_interval", "int", 1000, "Megatron: steps between ADLR autoresume polls.",
      _MEGATRON, REJECTED,
      "belongs to adlr_autoresume (NVIDIA's internal ADLR userlib); use exit_signal_handler or "
      "exit_duration_in_mins with checkpoint resume instead"),

    # --- other model families ---
    K("bert_binary_head", "bool", True, "Megatron BERT: add the next-sentence binary head.",
      _MEGATRON, REJECTED, "BERT-family head; jaxtrain trains decoder-only language models"),
    K("mask_type", "str", "random", "Megatron ViT inpainting: shape of the masked image region.",
      _MEGATRON, REJECTED, "vision inpainting pretraining; jaxtrain trains decoder-only language "
      "models", choices=("random", "row")),
    K("mask_factor", "float", 1.0, "Megatron ViT inpainting: scale of the masked image area.",
      _MEGATRON, REJECTED, "vision inpainting pretraining; jaxtrain trains decoder-only language "
      "models"),
    K("iter_per_epoch", "int", 1250, "Megatron DINO: steps that make one epoch of its teacher "
      "temperature schedule.", _MEGATRON, REJECTED,
      "DINO self-supervised vision pretraining; jaxtrain trains decoder-only language models"),
]
