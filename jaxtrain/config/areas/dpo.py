"""Preference optimisation (DPO and variants) as a training mode: pgs's ``dpo`` section and
MaxText's ``use_dpo`` with its ``dpo`` block, onto one implementation (jaxtrain.dpo)."""
from jaxtrain.config.knob import HONORED, INERT, Alias, K

_PGS = "pgs-train"
_MT = "maxtext"
_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "cdpo")

KNOBS = [
    # Mode and objective
    K("dpo.enabled", "bool", False, "Switch training data to chosen/rejected preference pairs "
      "rather than SFT chats.", _PGS, HONORED,
      "jaxtrain.data.preference pairs (rows 2i/2i+1) and jaxtrain.dpo's loss in the train step; "
      "train.per_device_batch_size counts pairs (micro-batches hold twice as many rows); "
      "validation reports pgs's preference metrics on data.eval_dataset (jaxtrain.dpo_eval)"),
    K("dpo.loss_type", "str", "sigmoid", "Preference objective: DPO=sigmoid, SLiC-HF=hinge, "
      "rDPO=robust, length-normalised DPO=sigmoid_norm, or ipo.", _PGS, HONORED,
      "jaxtrain.dpo.pair_losses, pgs dpo.py's formulas (tests/train/test_dpo.py); jaxtrain adds "
      "cdpo, the label-smoothed sigmoid MaxText's use_dpo trains with", choices=_LOSS_TYPES),
    K("dpo.beta", "float", 0.1, "Scales the implicit reward beta*(log pi - log pi_ref); acts as "
      "an inverse temperature.", _PGS, HONORED,
      aliases=(Alias("dpo.dpo_beta", _MT, only_in=(_MT,)),)),
    K("dpo.label_smoothing", "float", 0.0, "robust loss only: assumed rate of flipped preference "
      "labels, below 0.5.", _PGS, HONORED, "robust: pgs's unbiased rDPO; cdpo (MaxText's "
      "dpo_label_smoothing, 0..1): -(1-e) log sig(b d) - e log sig(-b d)",
      aliases=(Alias("dpo.dpo_label_smoothing", _MT, only_in=(_MT,)),)),
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

    K("dpo.precompute_reference", "bool", False, "Score every training and eval pair with "
      "the reference once before training, cache the scores in the run directory, and train "
      "without the reference in memory.", "jaxtrain", HONORED,
      "jaxtrain.dpo_reference: per-row reference scores ride in the batches (ref_scores); the "
      "cache is reused when its fingerprint (reference, pairs, ld_alpha, model) matches"),

    # MaxText (use_dpo and its dpo block)
    K("use_dpo", "bool", False, "Direct preference optimisation on chosen/rejected pairs "
      "(train_data_columns names the two columns).", _MT, HONORED,
      "sets dpo.enabled with dpo.loss_type cdpo; pairs from dataset_type hf files, "
      "train_data_columns [prompt, chosen, rejected] or [chosen, rejected] with their shared "
      "token prefix as the prompt, each column tokenised with add_bos/add_eos "
      "(jaxtrain.data.preference.maxtext_pair); the reference is the starting weights, kept "
      "in checkpoints (dpo_reference)"),
    K("dpo.algo", "str", "dpo", "MaxText: the preference algorithm, dpo or reference-free "
      "orpo.", _MT, HONORED, "dpo runs; orpo is refused with a clear error (not built)",
      choices=("dpo", "orpo")),
    K("dpo.max_prompt_length", "int", None, "MaxText: prompt tokens kept (its end); the "
      "answers keep max_target_length minus this. Unset: half of max_target_length.", _MT,
      HONORED, "jaxtrain.data.preference.maxtext_pair"),
    K("dpo.orpo_lambda", "float", 0.1, "MaxText ORPO: weight of the odds-ratio term.", _MT, INERT,
      "read only by ORPO (dpo.algo orpo), which jaxtrain refuses"),
]
