"""Knob declarations, one module per area; each module exposes ``KNOBS``."""

AREAS = (
    "base", "model", "tokenizer", "fusion", "mla", "recompute",
    "moe", "turbo", "precision", "quant",
    "parallel", "distributed", "comm", "pipeline",
    "training", "optim", "schedule", "conventions", "memory",
    "sft", "preprocess", "dpo", "distill",
    "data", "checkpoint",
    "logging", "profiling", "rl", "families", "inference", "resilience",
    "megatron_lm", "megatron_lm_train", "megatron_lm_infer", "primus", "primus_models",
    "maxtext_model", "maxtext_train", "maxtext_runtime", "maxtext_serving", "hf",
)
