"""pgs preference optimisation (DPO and variants) as a training mode."""
from jaxtrain.config.knob import K

_PGS = "pgs-train"
_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm")

KNOBS = [
    # Mode and objective
    K("dpo.enabled", "bool", False, "Train on preference pairs (chosen vs rejected) instead of "
      "SFT conversations.", _PGS),
    K("dpo.loss_type", "str", "sigmoid", "Preference loss: sigmoid (DPO), hinge (SLiC-HF), ipo, "
      "robust (rDPO) or sigmoid_norm (length-normalised).", _PGS, choices=_LOSS_TYPES),
    K("dpo.beta", "float", 0.1, "Inverse temperature beta of the implicit reward "
      "beta*(log pi - log pi_ref).", _PGS),
    K("dpo.label_smoothing", "float", 0.0, "robust loss only: assumed rate of flipped preference "
      "labels, below 0.5.", _PGS),
    K("dpo.ld_alpha", "float", 1.0, "LD-DPO weight of log-probs past the pair's shared length; "
      "1.0 is off.", _PGS),
    K("dpo.sft_weight", "float", 0.0, "RPO: add this times the chosen answer's mean NLL to the "
      "loss.", _PGS),
    K("dpo.reference_model", "str", "", "Frozen reference policy; empty uses model.name_or_path.",
      _PGS),

    # Pair fields
    K("dpo.prompt_field", "str", "prompt", "Row field holding the prompt; missing or empty means "
      "chosen/rejected are whole conversations.", _PGS),
    K("dpo.chosen_field", "str", "chosen", "Row field holding the preferred completion "
      "(messages or a string).", _PGS),
    K("dpo.rejected_field", "str", "rejected", "Row field holding the dispreferred completion "
      "(messages or a string).", _PGS),

    # Handling
    K("dpo.truncate_rejected", "bool", True, "Cut over-long rejected answers to the sequence "
      "length instead of dropping the pair.", _PGS),
    K("dpo.disable_dropout", "bool", True, "Turn dropout off in the policy so its log-probs are "
      "deterministic like the reference's.", _PGS),
]
