"""pgs preference optimisation (DPO and variants) as a training mode."""
from jaxtrain.config.knob import K

_PGS = "pgs-train"
_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm")

KNOBS = [
    # Mode and objective
    K("dpo.enabled", "bool", False, "Switch training data to chosen/rejected preference pairs "
      "rather than SFT chats.", _PGS, issue=21),
    K("dpo.loss_type", "str", "sigmoid", "Preference objective: DPO=sigmoid, SLiC-HF=hinge, "
      "rDPO=robust, length-normalised DPO=sigmoid_norm, or ipo.", _PGS, choices=_LOSS_TYPES,
      issue=21),
    K("dpo.beta", "float", 0.1, "Scales the implicit reward beta*(log pi - log pi_ref); acts as "
      "an inverse temperature.", _PGS, issue=21),
    K("dpo.label_smoothing", "float", 0.0, "robust loss only: assumed rate of flipped preference "
      "labels, below 0.5.", _PGS, issue=21),
    K("dpo.ld_alpha", "float", 1.0, "LD-DPO: down-weights log-probs beyond the length both "
      "answers share; 1.0 disables it.", _PGS, issue=21),
    K("dpo.sft_weight", "float", 0.0, "RPO: add this times the chosen answer's mean NLL to the "
      "loss.", _PGS, issue=21),
    K("dpo.reference_model", "str", "", "Frozen policy the DPO loss compares against; left empty, "
      "model.name_or_path is loaded.",
      _PGS, issue=21),

    # Pair fields
    K("dpo.prompt_field", "str", "prompt", "Row field holding the prompt; missing or empty means "
      "chosen/rejected are whole conversations.", _PGS, issue=21),
    K("dpo.chosen_field", "str", "chosen", "Row field holding the preferred completion "
      "(messages or a string).", _PGS, issue=21),
    K("dpo.rejected_field", "str", "rejected", "Row field holding the dispreferred completion "
      "(messages or a string).", _PGS, issue=21),

    # Handling
    K("dpo.truncate_rejected", "bool", True, "Cut over-long rejected answers to the sequence "
      "length instead of dropping the pair.", _PGS, issue=21),
    K("dpo.disable_dropout", "bool", True, "Disable policy dropout so its log-probs, like the "
      "reference's, don't vary between passes.", _PGS, issue=21),
]
