"""Fixed-length samples served as global batches [M, B, T], with document-aware masks.

A sample is ``seq_length + 1`` consecutive tokens (inputs and next-token targets), as in
Megatron's GPT datasets. ``TokenData.samples`` is any random-access source (``len`` and
``[i]``): an in-memory array, a memory-mapped :class:`~jaxtrain.data.gpt_dataset.GPTDataset`
or blend, or packed documents. A sample is an int array of ``T + 1`` tokens, or a dict with
``tokens`` and ``segment_ids`` (packed documents: 0 marks padding), and optionally ``keep``
(0 keeps the whole sample out of the loss) and ``positions`` (given positions: the segments
are attention blocks of one running sequence, as in MaxText's packed synthetic rows, so every
non-padding target counts, also across a segment boundary).

Order: ``dataloader_type: single`` serves the samples in the source's own order (Megatron's
GPT datasets are already shuffled by their shuffle index). ``cyclic`` (the default) over
Megatron's GPT datasets is Megatron's cyclic sampler (``MegatronPretrainingRandomSampler``
with ``data_sharding`` false; :class:`MegatronCyclicOrder`): epoch ``e`` is
``torch.randperm(⌊N / mbs⌋·mbs)`` drawn from a generator seeded with ``e`` (computed here with
numpy, :func:`torch_randperm`), cut to the ``N - N mod (mbs·dp)`` samples an epoch serves, and
data-parallel rank ``r`` takes every dp-th sample of each microbatch step from the ``r``-th on.
Over other sources, and whenever the data carries an order seed of its own (pgs
``data.seed``, MaxText ``data_shuffle_seed``), ``cyclic`` is a seeded grain shuffle,
reshuffled every epoch. Batch ``i`` is the same on every run with the same settings, and the
iterator's whole state is the number of samples consumed.

The grain order does not depend on the parallel layout: global batch ``i`` holds the same
samples whatever the data-parallel size, so losses match across layouts. Megatron's cyclic
order gives every microbatch step the same samples whatever the data-parallel size too, but
its epochs end where a whole step of ``mbs·dp`` samples no longer fits (as Megatron's do). A
process reads only the rows of each global batch its devices hold (``rows``); the rows of all
processes together are the whole batch. (Megatron's ``data_sharding`` buckets, one per
data-parallel rank, would tie the samples to the data-parallel size; jaxtrain keeps the one
order of ``data_sharding`` false for either value: docs/fidelity.md.)

Document awareness (Megatron's ``get_ltor_masks_and_position_ids``, with ``eod`` the
end-of-document id): ``reset_position_ids`` restarts ``positions`` after each EOD input
token; ``reset_attention_mask`` gives each document its own ``segment_ids`` (the EOD belongs
to the document it ends), so attention stays inside a document; ``eod_mask_loss`` zeroes the
loss where the input token is EOD. Megatron's GPT datasets also take the target out of the
loss where it is the tokenizer's pad id, and read pad ids as token 0 (``pad``; none when the
tokenizer has no pad id of its own, see :func:`jaxtrain.data.gpt_dataset.dataset_pad_id`).
Packed samples always carry segment ids and per-document
positions, and mask targets that cross a document boundary or fall on padding.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Iterator

import grain
import numpy as np

from jaxtrain.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A training set: the samples, the vocabulary they index, and how batches are built."""

    samples: Any  # [N, T + 1] int array, or any random-access source of samples
    vocab_size: int
    name: str
    eod: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    dataloader_type: str = "cyclic"
    num_workers: int = 0
    seed: int | None = None  # the order's seed when not the run's (pgs data.seed)
    pad: int | None = None   # Megatron's GPT-dataset pad id (gpt_dataset.dataset_pad_id)
    megatron_order: bool = False  # cyclic: Megatron's sampler order (MegatronCyclicOrder)
    group_lengths: Any = None     # [N] sample lengths: order by length groups (LengthGroups)
    group_buffer: int = 0         # pgs data.length_group_buffer
    trim: bool = False            # cut each batch to the length bucket of its longest row
    pairs: bool = False           # preference pairs: rows 2i, 2i+1 stay together (PairOrder)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def __post_init__(self):
        if (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss) \
                and self.eod is None:
            raise ConfigError(f"{self.name}: reset_position_ids, reset_attention_mask and "
                              "eod_mask_loss need an end-of-document token, and the tokenizer "
                              "has none")
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"dataloader_type {self.dataloader_type}: only single and cyclic "
                              "are built (external needs a user iterator)")


def windows(stream: np.ndarray, seq_length: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_length + 1`` tokens (neighbours share one token)."""
    n = (len(stream) - 1) // seq_length
    if n < 1:
        raise ConfigError(f"the data holds {len(stream)} tokens, fewer than one sample of "
                          f"seq_length {seq_length} + 1")
    idx = np.arange(n)[:, None] * seq_length + np.arange(seq_length + 1)[None, :]
    return stream[idx].astype(np.int32)


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 wherever the segment id changes along the last axis."""
    T = segment_ids.shape[-1]
    idx = np.broadcast_to(np.arange(T), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return (idx - first).astype(np.int32)


def document_masks(tokens: np.ndarray, data: TokenData) -> dict:
    """positions / segment_ids / loss_mask of input ``tokens`` [..., T] from EOD tokens."""
    out = {}
    ones = np.ones(tokens.shape, np.float32)
    if data.eod_mask_loss:
        ones[tokens == data.eod] = 0.0
    out["loss_mask"] = ones
    if data.reset_position_ids or data.reset_attention_mask:
        is_eod = (tokens == data.eod).astype(np.int32)
        # the EOD closes its document: the segment changes after it
        seg = np.cumsum(is_eod, axis=-1) - is_eod + 1
        if data.reset_attention_mask:
            out["segment_ids"] = seg.astype(np.int32)
        if data.reset_position_ids:
            out["positions"] = segment_positions(seg)
    return out


def _mask_pad(batch: dict, pad: int) -> None:
    """Megatron's GPTDataset on the pad id (after the EOD masks and positions are made): no
    loss where the target is a pad, and pad ids read as token 0 in inputs and targets."""
    targets = batch["targets"] = np.array(batch["targets"])
    tokens = batch["tokens"] = np.array(batch["tokens"])
    batch["loss_mask"][targets == pad] = 0.0
    tokens[tokens == pad] = 0
    targets[targets == pad] = 0


def _rows(data: TokenData, ds, idx, pool):
    got = list(pool.map(ds.__getitem__, idx)) if pool else [ds[i] for i in idx]
    if isinstance(got[0], dict):
        return {k: np.stack([g[k] for g in got]) for k in got[0]}
    return np.stack(got)


def make_batch(rows, data: TokenData, per_micro: int) -> dict:
    """[N, T + 1] samples (or packed dicts) -> the step's [M, B, T] arrays."""
    if isinstance(rows, dict):
        toks, seg = rows["tokens"], rows["segment_ids"]
        n = toks.shape[0]
        inputs, targets, s_in, s_tg = toks[:, :-1], toks[:, 1:], seg[:, :-1], seg[:, 1:]
        batch = {"tokens": inputs, "targets": targets,
                 "loss_mask": ((s_in == s_tg) & (s_in > 0)).astype(np.float32),
                 "segment_ids": s_in.astype(np.int32), "positions": segment_positions(s_in)}
        if "positions" in rows:        # one running sequence cut into attention segments
            batch["positions"] = np.asarray(rows["positions"][:, :-1], np.int32)
            batch["loss_mask"] = (s_in > 0).astype(np.float32)
        if data.eod_mask_loss:
            batch["loss_mask"][inputs == data.eod] = 0.0
        if "weights" in rows:          # per-token loss weights of the targets (chat data)
            batch["loss_mask"] *= np.asarray(rows["weights"][:, 1:], np.float32)
        if "keep" in rows:             # a sample kept out of the loss entirely (keep 0)
            batch["loss_mask"] *= np.asarray(rows["keep"], np.float32).reshape(n, 1)
        if "ref_score" in rows:        # DPO: the row's precomputed reference score, [.., 1]
            batch["ref_scores"] = np.asarray(rows["ref_score"], np.float32).reshape(n, 1)
    else:
        n = rows.shape[0]
        batch = {"tokens": rows[:, :-1], "targets": rows[:, 1:], **document_masks(rows[:, :-1],
                                                                                   data)}
        if data.pad is not None:
            _mask_pad(batch, data.pad)
    return {k: np.ascontiguousarray(v).reshape(n // per_micro, per_micro, -1)
            for k, v in batch.items()}


# torch's CPU randperm draws 32-bit numbers below this n, 64-bit ones from it on.
TORCH_RANDPERM_SMALL = (2 ** 32 - 1) // 20


def torch_randperm(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` on the CPU, with
    numpy (int64): torch's generator is an MT19937 seeded with the seed's low 32 bits, as
    ``numpy.random.RandomState`` seeds one, and below :data:`TORCH_RANDPERM_SMALL` torch swaps
    ``i`` with ``i + next32() % (n - i)`` for i = 0 .. n - 2; from it on it builds the
    permutation inside-out: ``r[i] = r[z]; r[z] = i`` with ``z = next64() % (i + 1)``, next64
    being two draws, the first the high word. (A Python loop: about half a microsecond per
    sample, once per epoch.)"""
    rs = np.random.RandomState(int(seed) & 0xFFFFFFFF)
    if n < TORCH_RANDPERM_SMALL:
        if n <= 1:
            return np.arange(n, dtype=np.int64)
        raw = rs.randint(0, 2 ** 32, size=n - 1, dtype=np.uint64)
        swap = (raw % np.arange(n, 1, -1, dtype=np.uint64)).astype(np.int64) + np.arange(n - 1)
        r = list(range(n))
        for i, j in enumerate(swap.tolist()):
            r[i], r[j] = r[j], r[i]
        return np.asarray(r, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for start in range(0, n, 1 << 24):      # draw the random words a block at a time
        count = min(n, start + (1 << 24)) - start
        words = rs.randint(0, 2 ** 32, size=2 * count, dtype=np.uint64)
        wide = (words[0::2] << np.uint64(32)) | words[1::2]
        zs = (wide % np.arange(start + 1, start + count + 1, dtype=np.uint64)).tolist()
        for i, z in zip(range(start, start + count), zs):
            out[i] = out[z]
            out[z] = i
    return out


class MegatronCyclicOrder:
    """Megatron's cyclic sampler order over ``samples`` (``MegatronPretrainingRandomSampler``,
    ``data_sharding`` false): position ``p`` of the sample stream is sample
    ``perm_e[p mod A]`` with ``e = p // A``, ``perm_e`` = :func:`torch_randperm` of
    ``⌊N / mbs⌋·mbs`` seeded with the epoch ``e``, and ``A = N - N mod (mbs·dp)`` the
    samples an epoch serves. Within a microbatch step Megatron gives rank ``r`` the positions
    ``r, r + dp, r + 2·dp, ...``: :meth:`row_position`."""

    def __init__(self, samples, micro_batch_size: int, data_parallel_size: int):
        n = len(samples)
        self.samples, self.mbs, self.dp = samples, int(micro_batch_size), int(data_parallel_size)
        self.active = n - n % (self.mbs * self.dp)
        self.bucket = (n // self.mbs) * self.mbs
        if self.active <= 0:
            raise ConfigError(f"dataloader_type cyclic: {n} samples, fewer than one microbatch "
                              f"step of {self.mbs * self.dp} (micro_batch_size x data-parallel "
                              "size)")
        self._lock = threading.Lock()
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = torch_randperm(self.bucket, epoch)
                self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
                self._perms[epoch] = perm
            return perm

    def index(self, position: int) -> int:
        epoch, k = divmod(int(position), self.active)
        return int(self.permutation(epoch)[k])

    def __getitem__(self, position: int):
        return self.samples[self.index(position)]

    def row_position(self, row: int) -> int:
        """Where row ``row`` of a microbatch step (rank ``row // mbs``, its ``row % mbs``-th
        sample) sits among the step's positions."""
        return (row % self.mbs) * self.dp + row // self.mbs


class LengthGroups:
    """pgs's length-grouped order (``data.length_group_buffer``), endless and random-access.

    Each epoch is a fresh seeded shuffle, cut into buffers of ``buffer`` samples (rounded down
    to whole groups); each buffer is sorted by length and cut into groups of ``group`` samples,
    one microbatch step's rows, and its full groups are shuffled (a partial group, only in the
    last buffer, comes last). A step's rows then differ little in length, which is what lets
    padding shrink. Position ``j`` is sample ``order(j // N)[j % N]``.
    """

    def __init__(self, samples, lengths, buffer: int, group: int, seed: int):
        self.samples, self.lengths = samples, np.asarray(lengths)
        self.buffer, self.group, self.seed = max(buffer - buffer % group, group), group, seed
        self._epoch = (None, None)

    def order(self, epoch: int) -> np.ndarray:
        if self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            perm, out = rng.permutation(len(self.lengths)), []
            for start in range(0, len(perm), self.buffer):
                chunk = perm[start:start + self.buffer]
                chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
                groups = [chunk[i:i + self.group] for i in range(0, len(chunk), self.group)]
                full = [g for g in groups if len(g) == self.group]
                rest = [g for g in groups if len(g) < self.group]
                out += [full[i] for i in rng.permutation(len(full))] + rest
            self._epoch = (epoch, np.concatenate(out))
        return self._epoch[1]

    def __getitem__(self, j: int):
        epoch, k = divmod(j, len(self.lengths))
        return self.samples[int(self.order(epoch)[k])]


class PairOrder:
    """Preference pairs (pgs DPO) in order, endless and random-access: rows ``2i`` (chosen)
    and ``2i + 1`` (rejected) are one pair and stay adjacent. Each epoch is a seeded
    permutation of the pairs (none with ``shuffle`` off): position ``j`` of epoch ``e`` is row
    ``2·perm_e[k // 2] + k % 2``, ``k = j mod N``."""

    def __init__(self, samples, seed: int, shuffle: bool = True):
        n = len(samples)
        if n % 2:
            raise ConfigError(f"preference data: {n} rows, not whole pairs")
        self.samples, self.seed, self.shuffle, self.n = samples, seed, shuffle, n
        self._epoch = (None, None)

    def permutation(self, epoch: int) -> np.ndarray:
        if self._epoch[0] != epoch:
            pairs = self.n // 2
            perm = (np.random.default_rng([self.seed, epoch]).permutation(pairs)
                    if self.shuffle else np.arange(pairs))
            self._epoch = (epoch, perm)
        return self._epoch[1]

    def index(self, j: int) -> int:
        epoch, k = divmod(int(j), self.n)
        return 2 * int(self.permutation(epoch)[k // 2]) + k % 2

    def __getitem__(self, j: int):
        return self.samples[self.index(j)]


def ordered(data: TokenData, seed: int, tcfg=None):
    """The sample order as an endless random-access source (position -> sample): a grain
    MapDataset, or Megatron's cyclic order (``data.megatron_order``, no ``data.seed``; needs
    ``tcfg`` for the microbatch and data-parallel sizes). ``data.seed``, when set, replaces
    ``seed``. Preference pairs (``data.pairs``) keep their two rows together
    (:class:`PairOrder`)."""
    if data.pairs:
        return PairOrder(data.samples, seed if data.seed is None else data.seed,
                         shuffle=data.dataloader_type == "cyclic")
    if (data.dataloader_type == "cyclic" and data.megatron_order and data.seed is None
            and tcfg is not None):
        return MegatronCyclicOrder(data.samples, tcfg.micro_batch_size,
                                   tcfg.data_parallel_size)
    if data.group_lengths is not None and data.dataloader_type == "cyclic" and tcfg is not None:
        return LengthGroups(data.samples, data.group_lengths, data.group_buffer,
                            tcfg.micro_batch_size * tcfg.data_parallel_size,
                            seed if data.seed is None else data.seed)
    ds = grain.MapDataset.source(data.samples)
    if data.dataloader_type == "cyclic":
        ds = ds.shuffle(seed=seed if data.seed is None else data.seed)
    return ds.repeat(None)


MIN_BUCKET = 128   # the shortest trimmed batch length; buckets double up to the sample length


def bucket(longest: int, length: int) -> int:
    """The batch length for rows whose longest holds ``longest`` tokens: the smallest of
    128, 256, 512, ... (and ``length`` itself, the cap) that fits, so a run compiles its step
    for a handful of lengths only."""
    b = MIN_BUCKET
    while b < min(longest, length):
        b *= 2
    return min(b, length)


def longest_row(rows) -> int:
    """Tokens up to the last real one in the longest of these samples (dicts with
    ``segment_ids``, 0 marking padding)."""
    real = np.asarray(rows["segment_ids"]) > 0
    cols = np.flatnonzero(real.reshape(-1, real.shape[-1]).any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 1


def trim(batch: dict, longest: int) -> dict:
    """``batch`` [M,B,T] cut to the length bucket of ``longest`` (the inputs of a sample of
    ``longest`` tokens are its first ``longest - 1``), as pgs pads a batch to its longest
    sample; a longer tail is all padding."""
    T = batch["tokens"].shape[-1]
    b = bucket(longest - 1, T)
    return batch if b == T else {k: np.ascontiguousarray(v[..., :b]) for k, v in batch.items()}


def global_batches(data: TokenData, tcfg, seed: int,
                   batch_size: Callable[[int], int] | None = None,
                   consumed: int = 0, rows: tuple[int, int] | None = None) -> Iterator[dict]:
    """Batches of ``tokens``/``targets``/``loss_mask`` [M, B, T], B = micro batch x DP, plus
    ``positions``/``segment_ids`` when the data asks for them.

    ``batch_size(consumed_samples)`` gives each step's global batch when it changes during the
    run (``rampup_batch_size``); by default every step takes ``global_batch_size`` samples.
    The iterator's whole state is the number of samples consumed: starting at ``consumed``
    resumes exactly where a run that had consumed that many samples stopped. With
    ``num_workers`` > 0, that many threads read samples, and the next batch is read while the
    current one trains.

    ``rows`` = (lo, hi) reads only rows lo..hi-1 of B in every microbatch: a process of a
    multi-host job reads just the samples its devices hold, [M, hi - lo, T]. ``seed`` orders
    the samples unless the data carries its own (``data.seed``).
    """
    ds = ordered(data, seed, tcfg)
    per_micro = tcfg.micro_batch_size * tcfg.data_parallel_size
    lo, hi = rows or (0, per_micro)
    at = ds.row_position if isinstance(ds, MegatronCyclicOrder) else (lambda j: j)

    def indices(start, size):
        return [start + m + at(j) for m in range(0, size, per_micro) for j in range(lo, hi)]

    def sizes(start):
        while True:
            size = batch_size(start) if batch_size else tcfg.global_batch_size
            yield start, size
            start += size

    def read(start, size, pool):
        batch = make_batch(_rows(data, ds, indices(start, size), pool), data, hi - lo)
        if not data.trim:
            return batch
        # every process measures the whole global batch, so all cut to the same length
        whole = [start + m + at(j) for m in range(0, size, per_micro)
                 for j in range(per_micro)]
        return trim(batch, longest_row(_rows(data, ds, whole, pool)))

    if data.num_workers <= 0:
        for start, size in sizes(consumed):
            yield read(start, size, None)
        return
    with concurrent.futures.ThreadPoolExecutor(data.num_workers) as pool, \
            concurrent.futures.ThreadPoolExecutor(1) as ahead:
        plan = sizes(consumed)
        nxt = ahead.submit(read, *next(plan), pool)
        for start, size in plan:
            current, nxt = nxt, ahead.submit(read, start, size, pool)
            yield current.result()
