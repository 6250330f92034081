"""Valid ranges of numeric knobs and the path knobs that must name existing files.

One table, applied to the knobs when the registry is built (``Knob.low``/``high``,
``Knob.existing_path``): a value out of range, or a path that does not exist, is a
configuration error naming the key, in the dry run.
"""
from __future__ import annotations

POSITIVE, NON_NEGATIVE, FRACTION = (1, None), (0, None), (0.0, 1.0)

# key -> (low, high), inclusive; None: unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "num_layers": POSITIVE, "hidden_size": POSITIVE, "num_attention_heads": POSITIVE,
    "micro_batch_size": POSITIVE, "global_batch_size": POSITIVE, "seq_length": POSITIVE,
    "tensor_model_parallel_size": POSITIVE, "pipeline_model_parallel_size": POSITIVE,
    "context_parallel_size": POSITIVE, "expert_model_parallel_size": POSITIVE,
    "num_distributed_optimizer_instances": POSITIVE, "make_vocab_size_divisible_by": POSITIVE,
    "attention_dropout": FRACTION, "hidden_dropout": FRACTION,
}

# Knobs naming an input that must exist when set (outputs such as save or tensorboard_dir are
# created by the run and are not listed).
EXISTING_PATHS: frozenset[str] = frozenset()


def bounds(key: str) -> dict:
    """The Knob fields this table sets for ``key``."""
    low, high = RANGES.get(key, (None, None))
    return {"low": low, "high": high, "existing_path": key in EXISTING_PATHS}
