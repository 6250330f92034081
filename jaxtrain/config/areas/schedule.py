"""Learning-rate schedules: peak and floor LR, warmup, decay styles, WSD, and scheduler state on resume."""
from jaxtrain.config.knob import Alias, HONORED, K, REJECTED

_MEGATRON = "megatron"
_MAXTEXT = "maxtext"
_PGS = "pgs-train"
_BOTH_PGS = ("pgs-train", "pgs-distill")

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_PGS_SCHEDULERS = ("power_decay", "wsd", "cosine", "linear", "constant")
_MAXTEXT_SCHEDULES = ("cosine", "wsd")
_MAXTEXT_WSD_STYLES = ("linear", "cosine")


def _unset_if_negative(value):
    """MaxText writes -1 for "the run length"; a negative number becomes None (unset)."""
    try:
        if not isinstance(value, bool) and float(value) < 0:
            return None
    except (TypeError, ValueError):
        pass
    return value


KNOBS = [
    # --- peak and floor LR ---
    K("lr", "float", 2e-5, "Peak learning rate, reached at the end of warmup.", _MEGATRON,
      aliases=(Alias("train.learning_rate", _BOTH_PGS), Alias("learning_rate", _MAXTEXT)),
      doc_defaults={"pgs-train": 2e-5, "pgs-distill": 1e-6, "maxtext": 3e-5}, status=HONORED),
    K("min_lr", "float", 0.0, "Floor the decayed LR never goes below, and the LR past the decay "
      "horizon.", _MEGATRON,
      aliases=(Alias("train.min_learning_rate", _PGS),),
      doc_defaults={"pgs-train": 2e-6, "maxtext": 3e-6}, status=HONORED),
    K("decoupled_lr", "float", None, "Separate peak LR for the input embedding and output layer; "
      "null uses lr.", _MEGATRON, status=HONORED),
    K("decoupled_min_lr", "float", None, "Floor LR for the input embedding and output layer when "
      "decoupled_lr is set; null uses min_lr.", _MEGATRON, status=HONORED),

    # --- warmup ---
    K("lr_warmup_iters", "int", 40, "Steps of linear warmup from lr_warmup_init to lr.",
      _MEGATRON, aliases=(Alias("train.warmup_steps", "pgs-distill"),),
      doc_defaults={"pgs-train": 0, "pgs-distill": 20, "maxtext": 0}, status=HONORED),
    K("lr_warmup_samples", "int", 0, "Warmup length in samples, for sample-based runs.",
      _MEGATRON, status=HONORED),
    K("lr_warmup_fraction", "float", None, "Warmup length as a fraction of the decay horizon; "
      "excludes lr_warmup_iters/samples.", _MEGATRON,
      aliases=(Alias("train.warmup_ratio", _PGS),
               Alias("warmup_steps_fraction", _MAXTEXT,
                     note="MaxText warms up over int(fraction x learning_rate_schedule_steps) "
                          "steps")),
      doc_defaults={"pgs-train": 0.05, "maxtext": 0.1}, status=HONORED),
    K("lr_warmup_init", "float", 0.0, "LR at step 0, where linear warmup starts.", _MEGATRON, status=HONORED),
    K("warmup", "int", None, "Old Megatron warmup argument.", _MEGATRON, REJECTED,
      "removed from Megatron, which stops on any value; use lr_warmup_iters, lr_warmup_samples "
      "or lr_warmup_fraction"),

    # --- decay ---
    K("lr_decay_style", "str", "cosine", "Shape of the LR after warmup: constant, linear, cosine, "
      "inverse-square-root, or WSD (stable then decay).", _MEGATRON,
      choices=_DECAY_STYLES, value_aliases={"wsd": "WSD"}, status=HONORED),
    K("lr_decay_iters", "int", None, "Steps over which the LR decays to min_lr; null uses "
      "train_iters.", _MEGATRON, status=HONORED,
      aliases=(Alias("learning_rate_schedule_steps", _MAXTEXT, to_canonical=_unset_if_negative,
                     note="-1 means the run length (steps); in MaxText's schedule the LR is 0 "
                          "from this step to the end of the run"),)),
    K("lr_decay_samples", "int", None, "Samples over which the LR decays, for sample-based runs; "
      "null uses train_samples.", _MEGATRON, status=HONORED),
    K("lr_wsd_decay_style", "str", "exponential", "Shape of WSD's final decay phase.", _MEGATRON, choices=_WSD_DECAY_STYLES, status=HONORED),
    K("lr_wsd_decay_iters", "int", None, "Length in steps of WSD's final decay phase.", _MEGATRON, status=HONORED),
    K("lr_wsd_decay_samples", "int", None, "Length in samples of WSD's final decay phase.",
      _MEGATRON, status=HONORED),
    K("train.lr_scheduler", "str", "cosine", "pgs LR shape after linear warmup: power_decay "
      "(1-p)^4, wsd (80% flat then power decay), cosine, linear, constant.",
      (_PGS, "pgs-distill"), choices=_PGS_SCHEDULERS, status=HONORED),

    # --- MaxText's schedule (MaxText files, unless lr_decay_style is set) ---
    K("lr_schedule_type", "str", "cosine", "MaxText LR shape: cosine (linear warmup from 0, "
      "cosine to the final fraction) or wsd (warmup, flat, then decay); LR 0 past the schedule.",
      _MAXTEXT, choices=_MAXTEXT_SCHEDULES, value_aliases={"COSINE": "cosine", "WSD": "wsd"},
      status=HONORED),
    K("learning_rate_final_fraction", "float", 0.1, "MaxText: LR at the end of the decay as a "
      "fraction of the peak (an explicit min_lr gives the floor instead).", _MAXTEXT,
      aliases=(Alias("cosine_learning_rate_final_fraction", _MAXTEXT,
                     note="older MaxText spelling"),), status=HONORED),
    K("wsd_decay_steps_fraction", "float", 0.1, "MaxText wsd: share of the schedule steps spent "
      "in the final decay.", _MAXTEXT, status=HONORED),
    K("wsd_decay_style", "str", "linear", "MaxText wsd: shape of the final decay (linear or "
      "cosine).", _MAXTEXT, choices=_MAXTEXT_WSD_STYLES, status=HONORED),

    # --- scheduler state on resume ---
    K("override_opt_param_scheduler", "bool", True, "On resume, take the schedule settings from "
      "this config and ignore those saved in the checkpoint.", _MEGATRON, status=HONORED),
    K("use_checkpoint_opt_param_scheduler", "bool", False, "On resume, take the schedule "
      "settings from the checkpoint and ignore this config's.", _MEGATRON, status=HONORED),

    # --- other model families ---
    K("head_lr_mult", "float", 1.0, "Megatron vision fine-tuning: LR multiplier for the "
      "classification/segmentation head.", _MEGATRON, REJECTED,
      "vision fine-tuning head (Megatron's GPT path never reads it); for a separate embedding/"
      "output-layer LR use decoupled_lr"),
]
