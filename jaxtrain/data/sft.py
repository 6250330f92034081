"""pgs SFT data: chat rows -> masked token sequences -> mixed, packed or padded samples.

The training set of a pgs file is its chat data (``data.dataset``, or ``data.sources``; with
``preprocess.enabled`` the rows ``python -m jaxtrain.prepare`` selected from ``data.dataset``,
in ``preprocess.output_dir``, its held-out rows the validation set when ``data.eval_dataset`` is
empty, and a curriculum's rows trained in their order):

1. **Rows** of each source are read from local files (:mod:`jaxtrain.data.rows`).
2. **Encoding**: a source of mode ``sft`` (the default) renders each conversation with the
   model's chat template and weights its tokens (:mod:`jaxtrain.data.chat`: assistant tokens
   only, reasoning / observation / last-turn / turn-scaling knobs). Mode ``pretrain`` (and
   ``data.pretrain_replay_dataset``) tokenises ``text_field`` with the tokenizer's special
   tokens, loss on every token. Rows pgs skips (no messages, no assistant turn that fits,
   nothing trained) are counted and logged by reason; a source that yields nothing is an error.
3. **Mixing** (several sources, ``data.mix_epoch``): ``total`` makes an epoch as many examples
   as the sources hold together, each source contributing its weight's share (a source without
   a weight: its share of the rows); a source above its row count repeats (in fresh shuffles),
   one below contributes a random subset. ``first_exhausted`` draws a source by weight for
   every example until one runs out (pgs's MixedDataset). Replay
   (``data.pretrain_replay_dataset``) is a second such draw: each example is a replay document
   with probability ``data.pretrain_replay_weight``, until either side runs out. The mix is
   drawn once, from ``data.seed``; epochs reshuffle it.
4. **Samples** of ``seq_length`` (pgs ``data.max_seq_length``) tokens: with ``packing``, whole
   conversations are packed into samples, first-fit decreasing within buffers of 256 (pgs
   sorts buffers of 256 by length too; a conversation never straddles two samples, as pgs's
   documentation promises), each its own attention segment with
   positions restarting at 0 and no target across a boundary; without, one conversation per
   sample, padded. ``data.length_group_buffer`` then orders unpacked samples so each
   microbatch step holds conversations of similar length (:class:`~jaxtrain.data.batches.
   LengthGroups`).

Encoding renders and tokenizes every row once, at start-up, in ``num_workers`` processes for
sources of 2,048 rows or more (rows keep their order and their file/row in error messages).

A sample row holds ``tokens``/``segment_ids`` and ``weights`` (the loss weight of each token as
a target), ``seq_length + 1`` long like every jaxtrain sample; the last column is padding.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import chat, prepared, pretokenized, rows
from jaxtrain.data.batches import TokenData
from jaxtrain.data.text_files import Rows

log = logging.getLogger("jaxtrain.data.sft")

MODES = ("sft", "pretrain")
SOURCE_KEYS = ("dataset", "split", "weight", "mode", "messages_field", "text_field",
               "last_turn_only", "chat_template_kwargs", "name")
EVAL_SOURCE_KEYS = SOURCE_KEYS + ("samples", "regression_floor")
CHAT_FIELDS = ("messages", "conversations", "conversation", "chat", "dialogue", "turns")
PARALLEL_MIN_ROWS = 2048   # fewer rows than this are encoded in-process (spawning costs more)
ENCODE_CHUNK = 256         # rows per task of the encoding processes
PACK_BUFFER = 256   # pgs sorts this many conversations by length before packing them


@dataclasses.dataclass(frozen=True)
class Source:
    """One dataset of the mix (or of the validation sources) and how its rows are read."""

    name: str
    dataset: str
    split: str
    weight: float | None = None
    mode: str = "sft"
    messages_field: str = "messages"
    text_field: str = "text"
    last_turn_only: bool = False
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    samples: int | None = None             # validation: the fixed subset's size
    regression_floor: float | None = None  # validation: warn when the loss rises above it
    any_split: bool = False                # a folder naming no split is read whole
    paths: tuple = ()                      # the files themselves, when already resolved
    prompt_completion: tuple | None = None  # MaxText: (prompt, completion) columns
    completion_only: bool = True           # MaxText sft_train_on_completion_only

    def files(self, what: str) -> list[str]:
        if self.paths:
            return list(self.paths)
        split_key = {"data.dataset": "data.dataset_split", "data.eval_dataset": "data.eval_split"
                     }.get(what, f"the split of {what}")
        return rows.files(self.dataset, self.split, what, split_key,
                          any_split=self.any_split or self.split == "train")


def _source(entry: Any, i: int, cfg, key: str, allowed, default_split: str) -> Source:
    what = f"{key}[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{what}: each entry is a mapping with at least a dataset, not "
                          f"{entry!r}")
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ConfigError(f"{what}: unknown field(s) {unknown}; an entry takes "
                          f"{', '.join(allowed)}")
    if not entry.get("dataset"):
        raise ConfigError(f"{what}: no dataset (a local .jsonl/.json/.parquet file or folder)")
    mode = entry.get("mode", "sft")
    if mode not in MODES:
        raise ConfigError(f"{what}: mode {mode!r}: use sft (chat, assistant tokens) or pretrain "
                          "(raw text, every token)")
    weight = entry.get("weight")
    if weight is not None and (not isinstance(weight, (int, float)) or weight < 0):
        raise ConfigError(f"{what}: weight {weight!r} must be a number >= 0")
    kwargs = entry.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{what}: chat_template_kwargs must be a mapping")
    samples = entry.get("samples")
    if samples is not None and (not isinstance(samples, int) or samples < 1):
        raise ConfigError(f"{what}: samples {samples!r} must be a positive integer")
    return Source(
        name=str(entry.get("name") or f"{key.split('.')[-1]}[{i}]:{entry['dataset']}"),
        dataset=str(entry["dataset"]), split=str(entry.get("split") or default_split),
        weight=None if weight is None else float(weight), mode=mode,
        messages_field=entry.get("messages_field") or cfg["data.messages_field"],
        text_field=entry.get("text_field") or "text",
        last_turn_only=bool(entry.get("last_turn_only", cfg["data.last_turn_only"])),
        chat_template_kwargs=dict(kwargs), samples=samples,
        regression_floor=entry.get("regression_floor"))


def _maxtext_source(cfg, name: str, paths: list[str], columns_key: str) -> Source:
    """MaxText ``use_sft``: its hf files, a ``messages`` column or ``prompt``/``completion``
    columns (each a string or a list of messages), ``sft_train_on_completion_only``."""
    columns = cfg[columns_key]
    columns = [columns] if isinstance(columns, str) else list(columns)
    if len(columns) not in (1, 2):
        raise ConfigError(f"{columns_key} {columns}: use_sft reads one messages column, or a "
                          "prompt and a completion column")
    return Source(name=name, dataset=name, split="", paths=tuple(paths),
                  messages_field=columns[0] if len(columns) == 1 else "messages",
                  prompt_completion=tuple(columns) if len(columns) == 2 else None,
                  completion_only=bool(cfg["sft_train_on_completion_only"]))


def maxtext_sft(cfg) -> bool:
    """MaxText's ``use_sft`` on its hf files (no pgs dataset named)."""
    if not cfg["use_sft"] or cfg["data.sources"] or cfg.is_set("data.dataset"):
        return False
    if cfg["dataset_type"] != "hf":
        raise ConfigError(f"use_sft with dataset_type {cfg['dataset_type']}: jaxtrain reads "
                          "MaxText's SFT data from dataset_type hf files (hf_path / "
                          "hf_train_files, .jsonl/.json/.parquet)")
    return True


def train_sources(cfg) -> list[Source]:
    """``data.sources``, or ``data.dataset`` alone, or MaxText's ``use_sft`` hf files."""
    if cfg["preprocess.enabled"]:
        return [prepared_source(cfg)]
    entries = cfg["data.sources"] or []
    if entries:
        return [_source(e, i, cfg, "data.sources", SOURCE_KEYS, cfg["data.dataset_split"])
                for i, e in enumerate(entries)]
    if maxtext_sft(cfg):
        files = rows.hf_files(cfg)
        if not files:
            raise ConfigError("use_sft needs hf_path (a local folder or file) or hf_train_files")
        return [_maxtext_source(cfg, cfg["hf_path"] or "hf_train_files", files,
                                "train_data_columns")]
    return [Source(name=str(cfg["data.dataset"]), dataset=str(cfg["data.dataset"]),
                   split=cfg["data.dataset_split"], messages_field=cfg["data.messages_field"],
                   last_turn_only=cfg["data.last_turn_only"],
                   any_split=not cfg.is_set("data.dataset_split"))]


def prepared_source(cfg) -> Source:
    """``preprocess.enabled``: the rows ``python -m jaxtrain.prepare`` selected, from
    ``preprocess.output_dir`` (read like ``data.dataset``)."""
    folder = str(cfg["preprocess.output_dir"])
    path = prepared.find(folder)
    if path is None:
        raise ConfigError(f"preprocess.enabled: nothing has been prepared in {folder!r} yet (no "
                          f"{prepared.PREPARED}.parquet or .jsonl there); run python -m "
                          "jaxtrain.prepare with this config first, or set preprocess.enabled "
                          "false to train on data.dataset")
    return Source(name=f"prepared {path}", dataset=path, split="train",
                  messages_field=cfg["data.messages_field"],
                  last_turn_only=cfg["data.last_turn_only"], any_split=True)


def holdout_source(cfg) -> Source | None:
    """``preprocess.enabled`` without ``data.eval_dataset``: the held-out rows the preparation
    wrote (``preprocess.eval_holdout``), or None."""
    if not cfg["preprocess.enabled"] or cfg["data.eval_dataset"] or cfg["data.eval_sources"]:
        return None
    path = prepared.find(str(cfg["preprocess.output_dir"]), prepared.HOLDOUT)
    if path is None:
        return None
    return Source(name="eval", dataset=path, split="train",
                  messages_field=cfg["data.messages_field"],
                  last_turn_only=cfg["data.last_turn_only"], samples=cfg["data.eval_samples"],
                  any_split=True)


def eval_sources(cfg) -> list[Source]:
    """``data.eval_sources`` (each scored on its own), or ``data.eval_dataset``, or none."""
    entries = cfg["data.eval_sources"] or []
    if entries:
        out = [_source(e, i, cfg, "data.eval_sources", EVAL_SOURCE_KEYS, cfg["data.eval_split"])
               for i, e in enumerate(entries)]
        names = [s.name for s in out]
        if len(set(names)) != len(names):
            raise ConfigError(f"data.eval_sources: names must differ ({names})")
        return out
    if maxtext_sft(cfg):
        files = rows.hf_eval_files(cfg)
        return [_maxtext_source(cfg, "eval", files, "eval_data_columns")] if files else []
    if cfg["data.eval_dataset"]:
        return [Source(name="eval", dataset=str(cfg["data.eval_dataset"]),
                       split=cfg["data.eval_split"], messages_field=cfg["data.messages_field"],
                       last_turn_only=cfg["data.last_turn_only"],
                       samples=cfg["data.eval_samples"])]
    held = holdout_source(cfg)
    if held is not None:
        return [held]
    return []


def chat_options(cfg, source: Source) -> chat.ChatOptions:
    return chat.ChatOptions(
        max_seq_length=cfg["seq_length"], messages_field=source.messages_field,
        tools_field=cfg["data.tools_field"], include_observations=cfg["data.include_observations"],
        train_on_reasoning=cfg["data.train_on_reasoning"], last_turn_only=source.last_turn_only,
        turn_scaling=cfg["data.turn_scaling"], chat_template_kwargs=source.chat_template_kwargs)


def hf_tokenizer(tok, what: str, cfg):
    """The ``transformers`` tokenizer behind jaxtrain's tokenizer (chat templates need it),
    with ``chat_template`` (Megatron-LM, MaxText) or MaxText's ``chat_template_path`` in place
    of its own template when set."""
    inner = getattr(tok, "hf", None)
    if inner is None:
        raise ConfigError(f"{what}: chat data is rendered with the model's chat template, which "
                          "needs a Hugging Face tokenizer (tokenizer_type HuggingFaceTokenizer, "
                          "or a model directory in model.name_or_path that holds one)")
    template = cfg["chat_template"] or _template_file(cfg["chat_template_path"])
    if template:
        inner.chat_template = template
    return inner


def _template_file(path: str) -> str | None:
    """MaxText chat_template_path: a JSON object's chat_template, a JSON string, or the text."""
    if not path:
        return None
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise ConfigError(f"chat_template_path {path!r}: {e}") from None
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
        return data["chat_template"]
    if isinstance(data, str):
        return data
    raise ConfigError(f"chat_template_path {path!r}: a JSON file must hold a string or an object "
                      "with a chat_template string")


def _text_example(row: dict, field: str, hf_tok, max_len: int) -> chat.Encoded:
    text = row.get(field)
    if not isinstance(text, str) or not text:
        raise chat.SkipRow(f"no {field} text")
    ids = hf_tok(text, add_special_tokens=True, truncation=True, max_length=max_len)["input_ids"]
    ids = np.asarray(ids, np.int32)
    return chat.Encoded(ids, np.ones(len(ids), np.float32))


def _encode_one(row: dict, hf_tok, opts: chat.ChatOptions, source: Source):
    """One row -> Encoded, or ("skip", reason), or ("bad", message)."""
    try:
        if source.mode == "pretrain":
            return _text_example(row, source.text_field, hf_tok, opts.max_seq_length)
        if source.prompt_completion is not None:
            prompt, completion = source.prompt_completion
            row = {"messages": chat.as_messages(row.get(prompt), "user")
                   + chat.as_messages(row.get(completion), "assistant")}
        got = chat.encode(row, hf_tok, opts)
        if not source.completion_only:   # MaxText: the prompt carries loss too
            got = chat.Encoded(got.ids, np.ones(len(got.ids), np.float32))
        return got
    except chat.SkipRow as e:
        return ("skip", e.reason)
    except chat.BadRow as e:
        return ("bad", str(e))


def _encode_chunk(args):
    rows_, hf_tok, opts, source = args
    return [_encode_one(r, hf_tok, opts, source) for r in rows_]


def _encoded(read, hf_tok, opts, source: Source, workers: int, limit: int | None):
    """(where, result) per row, in order: in this process, or over ``workers`` processes when
    the source is large (each row is rendered and tokenized independently)."""
    if workers <= 1 or limit is not None:
        for where, row in read:
            yield where, _encode_one(row, hf_tok, opts, source)
        return
    import concurrent.futures
    import multiprocessing

    read = list(read)
    if len(read) < PARALLEL_MIN_ROWS:
        for where, row in read:
            yield where, _encode_one(row, hf_tok, opts, source)
        return
    chunks = [read[i:i + ENCODE_CHUNK] for i in range(0, len(read), ENCODE_CHUNK)]
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = pool.map(_encode_chunk, [([r for _, r in c], hf_tok, opts, source)
                                        for c in chunks])
        for chunk, results in zip(chunks, jobs):
            yield from zip((w for w, _ in chunk), results)


def encode_rows(read: list, hf_tok, cfg, source: Source):
    """(where, Encoded or the reason the encoder skips the row) for each (where, row) of
    ``read``, in order, encoded as training encodes ``source``; a malformed row is a
    ConfigError naming it."""
    opts = chat_options(cfg, source)
    for where, got in _encoded(read, hf_tok, opts, source, cfg["num_workers"] or 0, None):
        if isinstance(got, chat.Encoded):
            yield where, got
        elif got[0] == "skip":
            yield where, got[1]
        else:
            raise ConfigError(f"{where}: {got[1]}")


def encode_source(source: Source, hf_tok, cfg, limit: int | None = None,
                  what: str = "data.dataset") -> list[chat.Encoded]:
    """The encoded examples of ``source`` (the first ``limit`` kept ones with a limit); large
    sources are encoded by ``num_workers`` processes."""
    opts = chat_options(cfg, source)
    out, skipped = [], collections.Counter()
    read = rows.read(source.files(what), what)
    for where, got in _encoded(read, hf_tok, opts, source, cfg["num_workers"] or 0, limit):
        if isinstance(got, chat.Encoded):
            out.append(got)
        elif got[0] == "skip":
            skipped[got[1]] += 1
        else:
            raise ConfigError(f"{where}: {got[1]}")
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        log.info("%s: skipped %d row(s): %s", source.name, sum(skipped.values()),
                 ", ".join(f"{n} {reason}" for reason, n in skipped.most_common()))
    if not out:
        why = "; ".join(f"{n} {r}" for r, n in skipped.items()) or "no rows"
        field = "its text field" if source.mode == "pretrain" else "data.messages_field"
        raise ConfigError(f"{what} {source.dataset!r}: no usable example ({why}); check "
                          f"{field}, the split and data.max_seq_length")
    return out


def _draws(n_rows: int, want: int, rng: np.random.Generator) -> np.ndarray:
    """``want`` row indices of a source: whole fresh shuffles while they fit, then a subset."""
    full, rest = divmod(want, n_rows)
    parts = [rng.permutation(n_rows) for _ in range(full)]
    parts.append(rng.permutation(n_rows)[:rest])
    return np.concatenate(parts).astype(np.int64)


def mix(per_source: list[list], weights: list[float | None], mode: str,
        rng: np.random.Generator) -> list:
    """One epoch of examples drawn from the sources (``data.mix_epoch``)."""
    if len(per_source) == 1:
        return list(per_source[0])
    sizes = np.array([len(s) for s in per_source], np.float64)
    shares = np.array([sizes[i] / sizes.sum() if w is None else w
                       for i, w in enumerate(weights)], np.float64)
    if shares.sum() <= 0:
        raise ConfigError("data.sources: the weights sum to 0")
    shares = shares / shares.sum()
    if mode == "total":
        counts = np.floor(shares * sizes.sum()).astype(np.int64)
        counts[np.argmax(shares)] += int(sizes.sum()) - counts.sum()
        picked = [(i, j) for i, c in enumerate(counts) for j in _draws(int(sizes[i]), int(c), rng)]
        order = rng.permutation(len(picked))
        return [per_source[picked[k][0]][picked[k][1]] for k in order]
    return interleave(per_source, shares, rng)


def interleave(per_source: list[list], probs, rng: np.random.Generator) -> list:
    """Draw a source by ``probs`` for each example, in each source's order, until one runs out."""
    at, out = [0] * len(per_source), []
    while True:
        i = int(rng.choice(len(per_source), p=probs))
        if at[i] >= len(per_source[i]):
            return out
        out.append(per_source[i][at[i]])
        at[i] += 1


def _first_fit(buffer: list, length: int) -> list[list]:
    """Whole conversations into blocks of ``length`` tokens, longest first, each into the
    first block with room (first-fit decreasing): blocks fill far better than in arrival
    order, and none is split."""
    blocks, room = [], []
    for ex in sorted(buffer, key=lambda e: -len(e.ids)):
        n = min(len(ex.ids), length)
        for i, free in enumerate(room):
            if n <= free:
                blocks[i].append(ex)
                room[i] -= n
                break
        else:
            blocks.append([ex])
            room.append(length - n)
    return blocks


def assemble(examples: list, length: int, packing: bool) -> dict:
    """Sample arrays [N, length + 1] (tokens, segment_ids, weights) and lengths [N]."""
    if packing:
        blocks = []
        for start in range(0, len(examples), PACK_BUFFER):
            blocks += _first_fit(examples[start:start + PACK_BUFFER], length)
    else:
        blocks = [[ex] for ex in examples]
    n = len(blocks)
    arrays = {"tokens": np.zeros((n, length + 1), np.int32),
              "segment_ids": np.zeros((n, length + 1), np.int32),
              "weights": np.zeros((n, length + 1), np.float32)}
    lengths = np.zeros(n, np.int32)
    for r, block in enumerate(blocks):
        at = 0
        for s, ex in enumerate(block, 1):
            k = min(len(ex.ids), length)
            arrays["tokens"][r, at:at + k] = ex.ids[:k]
            arrays["segment_ids"][r, at:at + k] = s
            arrays["weights"][r, at:at + k] = ex.weights[:k]
            at += k
        lengths[r] = at
    return {**arrays, "lengths": lengths}


def examples(cfg, hf_tok) -> list:
    """One epoch of encoded training examples: the sources mixed, replay drawn in."""
    sources = train_sources(cfg)
    rng = np.random.default_rng(cfg["data.seed"] if cfg["data.seed"] is not None else cfg["seed"])
    per_source = [encode_source(s, hf_tok, cfg, what="data.sources" if len(sources) > 1
                                else "data.dataset") for s in sources]
    out = mix(per_source, [s.weight for s in sources], cfg["data.mix_epoch"], rng)
    if cfg["data.pretrain_replay_dataset"]:
        p = cfg["data.pretrain_replay_weight"]
        replay = Source(name="replay", dataset=cfg["data.pretrain_replay_dataset"], split="train",
                        mode="pretrain")
        docs = encode_source(replay, hf_tok, cfg, what="data.pretrain_replay_dataset")
        docs = [docs[i] for i in rng.permutation(len(docs))]
        out = interleave([out, docs], np.array([1.0 - p, p]), rng)
    return out


def to_token_data(arrays: dict, vocab: int, name: str, cfg, eod: int | None) -> TokenData:
    """TokenData over assembled sample arrays; unpacked samples carry their lengths for
    ``data.length_group_buffer``, and their batches are cut to the length bucket of their
    longest conversation (as pgs pads a batch to its longest sample)."""
    lengths = arrays["lengths"]
    samples = Rows({k: v for k, v in arrays.items() if k != "lengths"})
    group = cfg["data.length_group_buffer"] if not cfg["packing"] else 0
    return TokenData(samples, vocab, name, eod=eod, num_workers=0, seed=cfg["data.seed"],
                     group_lengths=lengths if group else None, group_buffer=group,
                     trim=not cfg["packing"])


def describe(arrays: dict) -> str:
    """A one-line summary of the assembled samples (for the log)."""
    w = arrays["weights"][:, 1:]
    filled = arrays["lengths"].sum() / max(1, arrays["tokens"].shape[0] * (
        arrays["tokens"].shape[1] - 1))
    return (f"{arrays['tokens'].shape[0]} samples, {int((w > 0).sum())} trained tokens, "
            f"{filled:.0%} of the sample slots filled")


def fingerprint_fields(cfg) -> dict:
    """What the assembled samples depend on, beyond the tokenizer (the cache's key)."""
    keys = ("seq_length", "packing", "data.dataset", "data.dataset_split", "data.sources",
            "data.mix_epoch", "data.messages_field", "data.tools_field",
            "data.include_observations", "data.train_on_reasoning", "data.turn_scaling",
            "data.last_turn_only", "data.pretrain_replay_dataset", "data.pretrain_replay_weight",
            "data.seed", "seed")
    return json.loads(json.dumps({k: cfg[k] for k in keys}, default=str))


def wanted(cfg) -> bool:
    """Whether the training data is chat data: ``data.sources``, or a ``data.dataset`` whose
    rows hold chat turns (a file of plain ``text`` rows trains as raw text); prepared rows
    (``preprocess.enabled``) are chat data."""
    if cfg["preprocess.enabled"]:
        return True
    if cfg["data.sources"] or maxtext_sft(cfg):
        return True
    if not cfg.is_set("data.dataset"):
        return False
    row = rows.first(train_sources(cfg)[0].files("data.dataset"), "data.dataset")
    fields = (cfg["data.messages_field"], *CHAT_FIELDS)
    return row is not None and any(f in row for f in fields)


def plan(cfg, tok) -> list[str]:
    """The files the chat data reads, checked without reading them, and the chat template
    checked against a probe conversation (the dry run's part)."""
    hf_tok = hf_tokenizer(tok, "data.dataset", cfg)
    files = [f for s in train_sources(cfg) for f in s.files("data.sources" if cfg[
        "data.sources"] else "data.dataset")]
    if cfg["data.pretrain_replay_dataset"]:
        files += Source("replay", cfg["data.pretrain_replay_dataset"], "train").files(
            "data.pretrain_replay_dataset")
    for s in eval_sources(cfg):
        files += s.files("data.eval_sources" if cfg["data.eval_sources"] else "data.eval_dataset")
    try:
        chat.check_template(hf_tok, chat_options(cfg, train_sources(cfg)[0]))
    except chat.BadTemplate as e:
        raise ConfigError(f"tokenizer_model {getattr(tok, 'path', '')}: {e}") from None
    return files


def training_data(cfg, tok, vocab: int) -> TokenData:
    """The chat training set, from the pretokenized cache when ``data.pretokenize`` has one."""
    hf_tok = hf_tokenizer(tok, "data.dataset", cfg)
    key = None
    if cfg["data.pretokenize"]:
        key = pretokenized.fingerprint(fingerprint_fields(cfg), getattr(tok, "path", None),
                                       plan(cfg, tok))
        arrays = pretokenized.load(cfg["data.pretokenize_path"], key)
        if arrays is not None:
            return _prepared_order(cfg, to_token_data(arrays, vocab, "chat data (pretokenized)",
                                                      cfg, tok.eod))
    try:
        chat.check_template(hf_tok, chat_options(cfg, train_sources(cfg)[0]))
    except chat.BadTemplate as e:
        raise ConfigError(f"tokenizer_model {getattr(tok, 'path', '')}: {e}") from None
    arrays = assemble(examples(cfg, hf_tok), cfg["seq_length"], cfg["packing"])
    log.info("chat data: %s", describe(arrays))
    if key is not None:
        import jax

        if jax.process_index() == 0:
            pretokenized.save(cfg["data.pretokenize_path"], key, arrays, describe(arrays))
    return _prepared_order(cfg, to_token_data(arrays, vocab, "chat data", cfg, tok.eod))


def _prepared_order(cfg, data: TokenData) -> TokenData:
    """Prepared rows (``preprocess.enabled``) of a curriculum (the strategy in the
    preparation's metadata, else ``preprocess.strategy``) are served in the file's order, as pgs
    serves them: no shuffle, no length groups."""
    if not cfg["preprocess.enabled"]:
        return data
    meta = prepared.read_meta(str(cfg["preprocess.output_dir"]))
    strategy = meta.get("strategy") or cfg["preprocess.strategy"]
    log.info("preprocess.enabled: training on %s (%s rows, strategy %s, scored with %s)",
             prepared.find(str(cfg["preprocess.output_dir"])), meta.get("num_samples", "?"),
             strategy, meta.get("model", "?"))
    if strategy != "curriculum":
        return data
    return dataclasses.replace(data, dataloader_type="single", group_lengths=None,
                               group_buffer=0)


def validation_sets(cfg, tok, vocab: int) -> list[TokenData]:
    """One validation set per eval source, each its first ``samples`` usable examples,
    unpacked (every conversation scored on its own)."""
    hf_tok = hf_tokenizer(tok, "data.eval_dataset", cfg)
    out = []
    for s in eval_sources(cfg):
        what = "data.eval_sources" if cfg["data.eval_sources"] else "data.eval_dataset"
        limit = s.samples or cfg["data.eval_samples"]
        arrays = assemble(encode_source(s, hf_tok, cfg, limit=limit, what=what),
                          cfg["seq_length"], packing=False)
        data = to_token_data(arrays, vocab, s.name, cfg, tok.eod)
        out.append(dataclasses.replace(data, group_lengths=None, group_buffer=0,
                                       dataloader_type="single"))
    return out

