"""Fixed-length samples from a token stream, served as global batches [M, B, T].

A sample is ``seq_length + 1`` consecutive tokens (inputs and next-token targets), as in
Megatron's GPT datasets. Sample order is a seeded grain shuffle, reshuffled every epoch;
batch ``i`` is the same on every run with the same seed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import grain
import numpy as np

from jaxtrain.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A training set: the sample windows and the vocabulary they index."""

    samples: np.ndarray  # [N, T + 1] int32
    vocab_size: int
    name: str

    @property
    def num_samples(self) -> int:
        return self.samples.shape[0]


def windows(stream: np.ndarray, seq_length: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_length + 1`` tokens (neighbours share one token)."""
    n = (len(stream) - 1) // seq_length
    if n < 1:
        raise ConfigError(f"the data holds {len(stream)} tokens, fewer than one sample of "
                          f"seq_length {seq_length} + 1")
    idx = np.arange(n)[:, None] * seq_length + np.arange(seq_length + 1)[None, :]
    return stream[idx].astype(np.int32)


def global_batches(data: TokenData, tcfg, seed: int,
                   batch_size: Callable[[int], int] | None = None) -> Iterator[dict]:
    """Batches of ``tokens``/``targets``/``loss_mask`` [M, B, T], B = micro batch x DP.

    ``batch_size(consumed_samples)`` gives each step's global batch when it changes during the
    run (``rampup_batch_size``); by default every step takes ``global_batch_size`` samples.
    """
    ds = grain.MapDataset.source(data.samples).shuffle(seed=seed).repeat(None)
    per_micro = tcfg.micro_batch_size * tcfg.data_parallel_size
    consumed = 0
    while True:
        size = batch_size(consumed) if batch_size else tcfg.global_batch_size
        rows = np.stack([ds[i] for i in range(consumed, consumed + size)])
        consumed += size
        rows = rows.reshape(size // per_micro, per_micro, -1)
        yield {"tokens": rows[..., :-1], "targets": rows[..., 1:],
               "loss_mask": np.ones_like(rows[..., 1:], dtype=np.float32)}
