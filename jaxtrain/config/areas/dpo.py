"""pgs preference optimisation (DPO and variants) as a training mode."""
from jaxtrain.config.knob import HONORED, K

_PGS = "pgs-train"
_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm")

KNOBS = [
    # Mode and objective
    K("dpo.enabled", "bool", False, "Switch training data to chosen/rejected preference pairs "
      "rather than SFT chats.", _PGS, HONORED,
      "jaxtrain.data.preference pairs (rows 2i/2i+1) and jaxtrain.dpo's loss in the train step; "
      "train.per_device_batch_size counts pairs (micro-batches hold twice as many rows); "
      "validation scores data.eval_dataset's chosen answers by cross-entropy (no eval rewards)"),
    K("dpo.loss_type", "str", "sigmoid", "Preference objective: DPO=sigmoid, SLiC-HF=hinge, "
      "rDPO=robust, length-normalised DPO=sigmoid_norm, or ipo.", _PGS, HONORED,
      "jaxtrain.dpo.pair_losses, pgs dpo.py's formulas (tests/train/test_dpo.py)",
      choices=_LOSS_TYPES),
    K("dpo.beta", "float", 0.1, "Scales the implicit reward beta*(log pi - log pi_ref); acts as "
      "an inverse temperature.", _PGS, HONORED),
    K("dpo.label_smoothing", "float", 0.0, "robust loss only: assumed rate of flipped preference "
      "labels, below 0.5.", _PGS, HONORED),
    K("dpo.ld_alpha", "float", 1.0, "LD-DPO: down-weights log-probs beyond the length both "
      "answers share; 1.0 disables it.", _PGS, HONORED),
    K("dpo.sft_weight", "float", 0.0, "RPO: add this times the chosen answer's mean NLL to the "
      "loss.", _PGS, HONORED),
    K("dpo.reference_model", "str", "", "Frozen policy the DPO loss compares against; left empty, "
      "model.name_or_path is loaded.",
      _PGS, HONORED, "a Hugging Face directory or hub-cache name, loaded as frozen['ref'] "
      "(must match the policy's architecture)"),

    # Pair fields
    K("dpo.prompt_field", "str", "prompt", "Row field holding the prompt; missing or empty means "
      "chosen/rejected are whole conversations.", _PGS, HONORED),
    K("dpo.chosen_field", "str", "chosen", "Row field holding the preferred completion "
      "(messages or a string).", _PGS, HONORED),
    K("dpo.rejected_field", "str", "rejected", "Row field holding the dispreferred completion "
      "(messages or a string).", _PGS, HONORED),

    # Handling
    K("dpo.truncate_rejected", "bool", True, "Cut over-long rejected answers to the sequence "
      "length instead of dropping the pair.", _PGS, HONORED),
    K("dpo.disable_dropout", "bool", True, "Disable policy dropout so its log-probs, like the "
      "reference's, don't vary between passes.", _PGS, HONORED,
      "the policy forward runs deterministic (jaxtrain.dpo.micro_loss)"),
]
