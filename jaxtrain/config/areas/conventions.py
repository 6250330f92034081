"""Whose rules a subsystem follows where the three systems differ: set by the file's dialect.

Megatron, MaxText and pgs each have their own optimizer and LR-schedule knobs and a few
different habits (which parameters weight decay reaches, where warm-up starts). The dialect of
a config picks the convention through these knobs' per-document defaults, and an explicit knob of
another system switches to that system (config/rules.py ``conventions``). Subsystems read these
knobs, never the dialect.
"""
from jaxtrain.config.knob import HONORED, K

_PGS = ("pgs-train", "pgs-distill")

KNOBS = [
    K("optimizer_family", "str", "megatron", "Whose knobs choose the optimizer: Megatron's "
      "optimizer (MaxText's opt_type maps onto it) or pgs's train.optimizer.", "jaxtrain",
      HONORED, choices=("megatron", "pgs"), doc_defaults={d: "pgs" for d in _PGS}),
    K("lr_schedule_family", "str", "megatron", "Whose LR schedule runs: Megatron's "
      "(lr_decay_style, counted in samples), MaxText's (lr_schedule_type) or pgs's "
      "(train.lr_scheduler), both counted in steps.", "jaxtrain", HONORED,
      choices=("megatron", "maxtext", "pgs"),
      doc_defaults={"maxtext": "maxtext", **{d: "pgs" for d in _PGS}}),
    K("lr_warmup_offset", "int", 0, "Steps the pgs schedule's warm-up is shifted by (pgs "
      "distill counts its warm-up from step 1).", "jaxtrain", HONORED,
      doc_defaults={"pgs-distill": 1}),
    K("decay_all_params", "bool", False, "Apply weight decay to every parameter, biases and norm "
      "scales included (MaxText's AdamW); false skips them (Megatron).", "jaxtrain", HONORED,
      doc_defaults={"maxtext": True}),
]
