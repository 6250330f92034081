"""Optimizers: choice, Adam/SGD/Muon hyperparameters, weight decay, clipping, state dtypes and offload."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, Alias, K

_MEGATRON = "megatron"
_MAXTEXT = "maxtext"
_PGS = "pgs-train"
_BOTH_PGS = ("pgs-train", "pgs-distill")

# Megatron (Primus's pinned version) accepts these optimizer names.
_MEGATRON_OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon")
_PGS_OPTIMIZERS = ("adamw", "muon", "lion8bit", "adamw8bit", "paged_adamw8bit")
_WD_INCR_STYLES = ("constant", "linear", "cosine")
_MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
_MUON_MATMUL_PRECS = ("low", "medium", "high")
_MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
_WD_METHODS = ("decoupled", "independent", "l2")
_DTYPE_SPELLINGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                    "float8": "fp8"}
# MaxText's opt_type values, and the Megatron optimizer each one is computed by.
MAXTEXT_OPTIMIZERS = {"adamw": "adam", "adam_pax": "adam", "sgd": "sgd"}
_MAXTEXT_MUON = ("MaxText's muon is optax's contrib Muon (its own scaling, Nesterov and "
                 "weight-decay rules), which jaxtrain does not implement; use opt_type adamw, or "
                 "Megatron's optimizer: muon in a Megatron-style file")


def _mu_dtype(value):
    """MaxText's empty mu_dtype inherits weight_dtype; jaxtrain's master weights are float32."""
    return "fp32" if value in ("", None) else value


KNOBS = [
    # --- optimizer choice ---
    K("optimizer", "str", "adam", "Optimizer: adam (AdamW), sgd, or muon (2-D weights; Adam for "
      "the rest); dist_muon is muon with sharded state.", _MEGATRON,
      choices=_MEGATRON_OPTIMIZERS + ("lion", "soap", "adaptive_muon"), status=HONORED,
      planned_values={"lion": None, "soap": None, "adaptive_muon": None}),
    K("train.optimizer", "str", "adamw", "pgs optimizer: adamw, muon (Adam for non-matrix "
      "params), 8-bit-state lion/adamw, or paged 8-bit adamw.", _PGS,
      choices=_PGS_OPTIMIZERS, status=HONORED),
    K("opt_type", "str", "adamw", "MaxText optimizer: adamw, adam_pax (the same AdamW maths "
      "written as Pax's), sgd (no momentum or decay) or muon.", _MAXTEXT, HONORED,
      choices=("adamw", "adam_pax", "sgd", "muon"), rejected_values={"muon": _MAXTEXT_MUON}),
    K("plugins.schedule_free", "bool", False, "Use schedule-free AdamW (iterate averaging) in "
      "place of the optimizer plus LR decay schedule.", _PGS, status=HONORED),

    # --- Adam / SGD ---
    K("adam_beta1", "float", 0.9, "Adam decay rate of the first-moment (mean) estimate.",
      _MEGATRON, aliases=(Alias("adam_b1", _MAXTEXT),), status=HONORED),
    K("adam_beta2", "float", 0.999, "Adam decay rate of the second-moment (variance) estimate.",
      _MEGATRON, aliases=(Alias("adam_b2", _MAXTEXT),),
      doc_defaults={"pgs-train": 0.95, "maxtext": 0.95}, status=HONORED),
    K("adam_eps", "float", 1e-8, "Adam term added to the root of the second moment for "
      "stability.", (_MEGATRON, _MAXTEXT), status=HONORED),
    K("adam_eps_root", "float", 0.0, "Adam term added to the second moment inside the square "
      "root.", _MAXTEXT, status=HONORED),
    K("sgd_momentum", "float", 0.9, "Velocity coefficient of plain SGD; other optimizers ignore "
      "it.", _MEGATRON, doc_defaults={"maxtext": 0.0}, status=HONORED),

    # --- weight decay and clipping ---
    K("weight_decay", "float", 0.0, "Decoupled weight-decay coefficient for matrices (not biases, "
      "norms); fixed unless start/end_weight_decay are set.", _MEGATRON,
      aliases=(Alias("train.weight_decay", _PGS),
               Alias("adam_weight_decay", _MAXTEXT,
                     note="MaxText decays every parameter (norms and biases too) and SGD "
                          "not at all")),
      doc_defaults={"pgs-train": 0.1, "maxtext": 0.1}, status=HONORED),
    K("start_weight_decay", "float", None, "Weight decay at step 0 when it follows a schedule "
      "(weight_decay_incr_style linear or cosine).", _MEGATRON, status=HONORED),
    K("end_weight_decay", "float", None, "Weight decay at the end of the run when it follows a "
      "schedule.", _MEGATRON, status=HONORED),
    K("weight_decay_incr_style", "str", "constant", "How weight decay moves from start to end "
      "value over the run; constant needs both unset.", _MEGATRON,
      choices=_WD_INCR_STYLES, status=HONORED),
    K("clip_grad", "float", 1.0, "Clip the global L2 norm of the gradients to this value; 0 "
      "turns clipping off.", _MEGATRON,
      aliases=(Alias("train.max_grad_norm", _BOTH_PGS),
               Alias("gradient_clipping_threshold", _MAXTEXT,
                     note="optax's clip_by_global_norm scales by max/norm, jaxtrain by "
                          "max/(norm + 1e-6) as Megatron and torch do")), status=HONORED),

    # --- Muon ---
    K("muon_momentum", "float", 0.95, "Muon momentum coefficient before orthogonalization.",
      _MEGATRON, status=HONORED),
    K("muon_use_nesterov", "bool", False, "Whether Muon's momentum takes the Nesterov look-ahead "
      "form.", _MEGATRON, aliases=(Alias("muon_nesterov", _MEGATRON, note="Megatron HEAD spelling"),),
      doc_defaults={"pgs-train": True}, status=HONORED),
    K("muon_num_ns_steps", "int", 5, "Newton-Schulz iterations used to orthogonalize each Muon "
      "update.", _MEGATRON, status=HONORED),
    K("muon_scale_mode", "str", "spectral", "Shape-dependent factor applied to the orthogonalized "
      "update (spectral, unit_rms_norm, shape_scaling).", _MEGATRON,
      choices=_MUON_SCALE_MODES, status=HONORED),
    K("muon_extra_scale_factor", "float", 1.0, "Extra multiplier on every Muon update.",
      _MEGATRON, status=HONORED),
    K("muon_fp32_matmul_prec", "str", "medium", "Matmul precision of the fp32 Newton-Schulz "
      "iteration (low/medium/high; medium runs in bf16-level precision).", _MEGATRON,
      choices=_MUON_MATMUL_PRECS, status=HONORED),
    K("muon_split_qkv", "bool", True, "Orthogonalize the Q, K and V blocks of a fused QKV weight "
      "separately.", _MEGATRON, status=HONORED),
    K("muon_tp_mode", "str", "blockwise", "How Muon orthogonalizes tensor-parallel-sharded "
      "weights: per shard (blockwise) or whole matrix.", _MEGATRON,
      choices=_MUON_TP_MODES, status=HONORED),
    K("muon_weight_decay", "float", 0.01, "Primus: Muon-only weight decay.", _MEGATRON, INERT,
      "Megatron never reads it (Primus has since dropped the key): Muon matrices decay by "
      "weight_decay"),
    K("muon_weight_decay_method", "str", "decoupled", "Primus: decay variant Muon uses "
      "(decoupled, independent or l2).",
      _MEGATRON, INERT,
      "Megatron never reads it (Primus has since dropped the key): Muon's decay is always "
      "decoupled", choices=_WD_METHODS),

    # --- optimizer state placement (host offload) ---
    K("optimizer_cpu_offload", "bool", False, "Keep optimizer state in host memory and move it "
      "to the device for the update.", _MEGATRON, status=HONORED),
    K("optimizer_offload_fraction", "float", 1.0, "Share of optimizer state (0 to 1) kept in host "
      "memory when optimizer_cpu_offload is on.", _MEGATRON, status=HONORED),
    K("overlap_cpu_optimizer_d2h_h2d", "bool", False, "Overlap host<->device transfers of "
      "offloaded optimizer state with computation.", _MEGATRON, INERT,
      "the host<->device copies of offloaded state are inside the one compiled step, where XLA's "
      "scheduler overlaps them with compute whenever the data dependencies allow; there is no "
      "separate switch"),
    K("pin_cpu_grads", "bool", True, "Put offloaded gradients in pinned (page-locked) host "
      "memory.", _MEGATRON, INERT,
      "gradients never go to the host: the update runs on the device with the offloaded state "
      "brought in, so there is no host gradient buffer to pin"),
    K("pin_cpu_params", "bool", True, "Put offloaded parameters in pinned (page-locked) host "
      "memory.", _MEGATRON, status=HONORED),
    K("use_torch_optimizer_for_cpu_offload", "bool", False, "Megatron: run the offloaded step "
      "with a torch.optim class instead of its hybrid optimizer.", _MEGATRON, INERT,
      "only chooses which PyTorch class computes the same Adam update on the host; jaxtrain "
      "has one optax update wherever the state lives"),
    K("optimizer_memory_host_offload", "bool", False, "Keep the optimizer state in pinned host "
      "memory between steps.", "maxtext", status=MAPPED,
      reason="optimizer state lives in XLA's pinned_host memory kind between steps; the jitted "
      "step copies it to the device for the update and back (paged_adamw8bit does the same)"),

    # --- reduced-precision optimizer state ---
    K("use_precision_aware_optimizer", "bool", False, "Allow the dtypes below to differ from fp32 "
      "for master weights, gradients and Adam moments.", _MEGATRON, status=HONORED),
    K("main_grads_dtype", "str", "fp32", "Dtype of the gradients the optimizer reads.",
      _MEGATRON, choices=("fp32", "bf16"), value_aliases=_DTYPE_SPELLINGS, status=HONORED,
      aliases=(Alias("grad_dtype", _MAXTEXT, note="MaxText casts float32 gradients to it before "
                     "clipping and the update; a dtype other than float32 needs "
                     "use_precision_aware_optimizer here"),)),
    K("main_params_dtype", "str", "fp32", "Dtype of the master copy of the weights; fp16 (with "
      "use_precision_aware_optimizer) keeps a per-tensor-scaled fp16 copy in the optimizer and "
      "holds the model weights in the training dtype.", _MEGATRON, choices=("fp32", "fp16"),
      value_aliases=_DTYPE_SPELLINGS, status=HONORED),
    K("exp_avg_dtype", "str", "fp32", "Dtype of Adam's first moment.", _MEGATRON,
      choices=("fp32", "fp16", "bf16", "fp8"), value_aliases=_DTYPE_SPELLINGS, status=HONORED,
      aliases=(Alias("mu_dtype", _MAXTEXT, to_canonical=_mu_dtype,
                     note="empty inherits the weights' dtype (fp32 unless weight_dtype says "
                          "otherwise); another dtype turns use_precision_aware_optimizer on"),)),
    K("exp_avg_sq_dtype", "str", "fp32", "Dtype of Adam's second moment.", _MEGATRON,
      choices=("fp32", "fp16", "bf16", "fp8"), value_aliases=_DTYPE_SPELLINGS, status=HONORED),
]
