"""Megatron-LM's step_batch_size_schedule, parsed (no JAX: config loading checks it).

``"THRESHOLD:BATCH ..."`` pairs, spaces or commas between them; thresholds and batches may end
in K, M, B or T (x 10^3 ... 10^12, the integer part of the product taken). Megatron-LM always
passes the sequence length, so thresholds are tokens, turned into samples by ``// seq_length``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """Megatron's step_batch_size_schedule: (samples consumed, global batch) pairs, the first
    at 0 and the thresholds rising; each batch holds from its threshold to the next."""

    entries: tuple[tuple[int, int], ...]

    def batch_at(self, consumed: int) -> int:
        batch = self.entries[0][1]
        for threshold, b in self.entries:
            if consumed < threshold:
                break
            batch = b
        return batch

    @property
    def final(self) -> int:
        return self.entries[-1][1]


_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _amount(text: str) -> int:
    """'2.4B' -> 2400000000 (Megatron's K/M/B/T suffixes; int of the float product)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_step_schedule(value, seq_length: int | None) -> StepSchedule | None:
    """step_batch_size_schedule 'THRESHOLD:BATCH ...' (spaces or commas) -> StepSchedule with
    thresholds in samples (tokens // seq_length when a sequence length is given); None stays
    None. ValueError for a malformed schedule, as Megatron's checks."""
    if not value:
        return None
    entries = []
    for item in str(value).replace(",", " ").split():
        threshold, sep, batch = item.partition(":")
        try:
            t, b = _amount(threshold), _amount(batch)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"step_batch_size_schedule entry {item!r}: expected "
                             "THRESHOLD:BATCH_SIZE (thresholds may end in K, M, B or T)")
        entries.append((t // seq_length if seq_length else t, b))
    entries.sort(key=lambda e: e[0])
    if entries[0][0] != 0:
        raise ValueError(f"step_batch_size_schedule {value!r}: the first threshold must be 0")
    if any(a[0] >= b[0] for a, b in zip(entries, entries[1:])):
        raise ValueError(f"step_batch_size_schedule {value!r}: the thresholds (in samples) "
                         "must rise strictly")
    if any(b <= 0 for _, b in entries):
        raise ValueError(f"step_batch_size_schedule {value!r}: batch sizes must be positive")
    return StepSchedule(tuple(entries))
