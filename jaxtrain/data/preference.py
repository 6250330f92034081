"""pgs preference pairs (``dpo.enabled``): rows with a prompt, a chosen and a rejected answer ->
pairs of sample rows (chosen at ``2i``, rejected at ``2i + 1``) for :mod:`jaxtrain.dpo`.

Row forms (fields ``dpo.prompt_field``, ``dpo.chosen_field``, ``dpo.rejected_field``): each
of prompt/chosen/rejected is a list of messages, one message, or a string (a string prompt is
one user turn, a string answer one assistant turn after the prompt). A missing or empty prompt
means chosen and rejected are whole conversations (their shared messages are the prompt);
completions that already start with the prompt are not prefixed with it again (pgs).

Each side is rendered and masked exactly as an SFT conversation (:func:`jaxtrain.data.chat.
encode`; ``data.last_turn_only`` and ``data.train_on_reasoning`` apply; loss weight > 0 marks
a scored token). A chosen side longer than ``seq_length`` (pgs ``data.max_seq_length``) drops
the pair (it is never truncated); a rejected one is cut to ``seq_length`` with
``dpo.truncate_rejected`` (dropped if no scored token survives), else dropped. Rows without
both answers, malformed rows, pairs with no scored token, and identical pairs are skipped and
counted by reason in the log; a source without one usable pair is a ConfigError naming it.

MaxText's ``use_dpo`` (:func:`maxtext_pair`) reads its hf files' text columns instead, as its
input pipeline does: ``train_data_columns`` [prompt, chosen, rejected], or [chosen, rejected]
whose shared leading tokens are the prompt; each column is tokenised on its own (BOS/EOS by
``add_bos``/``add_eos``, cut to ``max_target_length``), the prompt keeps its last
``dpo.max_prompt_length`` tokens and each answer its first ``max_target_length`` minus that;
the answer tokens are scored. No chat template is applied.
"""
from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import chat, rows, sft
from jaxtrain.data.batches import TokenData

log = logging.getLogger("jaxtrain.data.preference")

UNBOUNDED = 10 ** 7   # render both sides whole; lengths are checked here


def _key(m):
    if not isinstance(m, dict):
        return None
    content = m.get("content")
    return m.get("role"), content.strip() if isinstance(content, str) else content


def _starts_with(conv: list, prefix: list) -> bool:
    return len(conv) > len(prefix) and all(_key(m) is not None and _key(m) == _key(p)
                                           for m, p in zip(conv, prefix))


def conversations(row: dict, prompt_field: str, chosen_field: str, rejected_field: str):
    """(chosen conversation, rejected conversation); SkipRow when a side is missing."""
    chosen = chat.as_messages(row.get(chosen_field), "assistant")
    rejected = chat.as_messages(row.get(rejected_field), "assistant")
    if not chosen:
        raise chat.SkipRow(f"no {chosen_field}")
    if not rejected:
        raise chat.SkipRow(f"no {rejected_field}")
    prompt = chat.as_messages(row.get(prompt_field), "user")
    if prompt and _starts_with(chosen, prompt) and _starts_with(rejected, prompt):
        return chosen, rejected
    return prompt + chosen, prompt + rejected


@dataclasses.dataclass(frozen=True)
class PairOptions:
    chat: chat.ChatOptions          # the SFT encoding options (max_seq_length unbounded)
    seq_length: int
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    truncate_rejected: bool = True

    @classmethod
    def from_config(cls, cfg, source: sft.Source) -> "PairOptions":
        opts = dataclasses.replace(sft.chat_options(cfg, source), max_seq_length=UNBOUNDED)
        return cls(opts, int(cfg["seq_length"]), cfg["dpo.prompt_field"],
                   cfg["dpo.chosen_field"], cfg["dpo.rejected_field"],
                   bool(cfg["dpo.truncate_rejected"]))


def encode_pair(row: dict, hf_tok, opts: PairOptions):
    """(chosen, rejected) Encoded; SkipRow (with the reason) for a pair that is not used."""
    try:
        convs = conversations(row, opts.prompt_field, opts.chosen_field, opts.rejected_field)
    except chat.BadRow as e:
        raise chat.SkipRow(f"malformed row ({e})") from None
    field = opts.chat.messages_field
    extra = {k: row[k] for k in (opts.chat.tools_field, "chat_template_kwargs") if k in row}
    sides = []
    for conv, name in zip(convs, ("chosen", "rejected")):
        try:
            sides.append(chat.encode({**extra, field: conv}, hf_tok, opts.chat))
        except chat.SkipRow as e:
            raise chat.SkipRow(f"{name}: {e.reason}") from None
        except chat.BadRow as e:
            raise chat.SkipRow(f"malformed {name} ({e})") from None
    chosen, rejected = sides
    T = opts.seq_length
    if len(chosen.ids) > T:
        raise chat.SkipRow("chosen longer than max_seq_length")
    if len(rejected.ids) > T:
        if not opts.truncate_rejected:
            raise chat.SkipRow("rejected longer than max_seq_length")
        rejected = chat.Encoded(rejected.ids[:T], rejected.weights[:T])
        if not np.any(rejected.weights > 0):
            raise chat.SkipRow("rejected answer does not fit max_seq_length")
    if len(chosen.ids) == len(rejected.ids) and np.array_equal(chosen.ids, rejected.ids):
        raise chat.SkipRow("chosen and rejected identical")
    return chosen, rejected


def maxtext(cfg) -> bool:
    """MaxText's use_dpo on its hf files (no pgs data.dataset named)."""
    return bool(cfg.get("use_dpo")) and not cfg.is_set("data.dataset")


def _columns(cfg, key: str) -> tuple[str, ...]:
    columns = cfg[key]
    columns = (columns,) if isinstance(columns, str) else tuple(columns)
    if len(columns) not in (2, 3):
        raise ConfigError(f"{key} {list(columns)}: use_dpo reads [prompt, chosen, rejected] or "
                          "[chosen, rejected] columns")
    return columns


def _framed(hf_tok, text, cfg) -> list[int]:
    if not isinstance(text, str):
        raise chat.SkipRow("malformed row (a column is not text)")
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    if cfg["add_bos"] and hf_tok.bos_token_id is not None:
        ids = [hf_tok.bos_token_id] + ids
    T = cfg["seq_length"]
    if cfg["add_eos"] and hf_tok.eos_token_id is not None:
        return ids[:T - 1] + [hf_tok.eos_token_id]
    return ids[:T]


def maxtext_pair(row: dict, hf_tok, cfg, columns: tuple[str, ...]):
    """(chosen, rejected) Encoded from MaxText's text columns (see the module doc)."""
    missing = [c for c in columns if c not in row]
    if missing:
        raise chat.SkipRow(f"no {missing[0]}")
    ids = [_framed(hf_tok, row[c], cfg) for c in columns]
    if len(ids) == 2:
        shared = 0
        for a, b in zip(*ids):
            if a != b:
                break
            shared += 1
        ids = [ids[0][:shared], ids[0][shared:], ids[1][shared:]]
    prompt_budget = cfg["dpo.max_prompt_length"]
    prompt = ids[0][-prompt_budget:]
    answers = [a[:cfg["seq_length"] - prompt_budget] for a in ids[1:]]
    if not answers[0]:
        raise chat.SkipRow("no chosen answer tokens")
    if not answers[1]:
        raise chat.SkipRow("no rejected answer tokens")
    if answers[0] == answers[1]:
        raise chat.SkipRow("chosen and rejected identical")
    return tuple(chat.Encoded(np.asarray(prompt + a, np.int32),
                              np.asarray([0.0] * len(prompt) + [1.0] * len(a), np.float32))
                 for a in answers)


def source(cfg, what: str = "data.dataset") -> sft.Source:
    if maxtext(cfg):
        files = rows.hf_files(cfg) if what == "data.dataset" else rows.hf_eval_files(cfg)
        if what == "data.dataset" and not files:
            raise ConfigError("use_dpo needs hf_path (a local folder or file) or hf_train_files")
        name = "hf_train_files" if what == "data.dataset" else "hf_eval_files"
        return sft.Source(name=name, dataset=name, split="", paths=tuple(files or ()))
    key, split = ((cfg["data.dataset"], cfg["data.dataset_split"]) if what == "data.dataset"
                  else (cfg["data.eval_dataset"], cfg["data.eval_split"]))
    if not key:
        raise ConfigError(f"dpo.enabled needs {what}: a local .jsonl/.json/.parquet file or "
                          "folder of preference pairs")
    return sft.Source(name=what, dataset=str(key), split=str(split), messages_field="messages",
                      last_turn_only=bool(cfg["data.last_turn_only"]))


def encode_pairs(src: sft.Source, hf_tok, cfg, what: str, limit: int | None = None) -> list:
    """[(chosen, rejected)] of the source's usable rows (the first ``limit`` with a limit);
    skipped rows are logged by reason; none usable is a ConfigError naming the file."""
    if maxtext(cfg):
        columns = _columns(cfg, "train_data_columns" if what == "data.dataset"
                           else "eval_data_columns")

        def encode(row):
            return maxtext_pair(row, hf_tok, cfg, columns)
    else:
        opts = PairOptions.from_config(cfg, src)

        def encode(row):
            return encode_pair(row, hf_tok, opts)
    out, skipped, files = [], collections.Counter(), src.files(what)
    for _, row in rows.read(files, what):
        try:
            out.append(encode(row))
        except chat.SkipRow as e:
            skipped[e.reason] += 1
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        log.info("%s: %d pair(s), skipped %d row(s): %s", what, len(out), sum(skipped.values()),
                 ", ".join(f"{n} {reason}" for reason, n in skipped.most_common()))
    if not out:
        why = "; ".join(f"{n} {r}" for r, n in skipped.items()) or "no rows"
        raise ConfigError(f"{what} {', '.join(files)}: no usable preference pair ({why}); check "
                          "dpo.prompt_field/chosen_field/rejected_field and data.max_seq_length")
    return out


def _hf_tok(cfg, tok, what):
    hf_tok = sft.hf_tokenizer(tok, what, cfg)
    if maxtext(cfg):   # plain text, no chat template
        return hf_tok
    try:
        chat.check_template(hf_tok, dataclasses.replace(
            sft.chat_options(cfg, source(cfg)), max_seq_length=UNBOUNDED))
    except chat.BadTemplate as e:
        raise ConfigError(f"tokenizer_model {getattr(tok, 'path', '')}: {e}") from None
    return hf_tok


def _token_data(pairs: list, cfg, vocab: int, name: str, eod) -> TokenData:
    arrays = sft.assemble([ex for pair in pairs for ex in pair], cfg["seq_length"], False)
    samples = sft.Rows({k: v for k, v in arrays.items() if k != "lengths"})
    return TokenData(samples, vocab, name, eod=eod, num_workers=0, seed=cfg["data.seed"],
                     pairs=True, trim=True)


def plan(cfg, tok) -> list[str]:
    """The files the pairs come from (checked to exist) and the chat template checked."""
    _hf_tok(cfg, tok, "data.dataset")
    files = source(cfg).files("data.dataset")
    if has_eval(cfg):
        files += source(cfg, "data.eval_dataset").files("data.eval_dataset")
    return files


def has_eval(cfg) -> bool:
    """Whether held-out pairs are named: data.eval_dataset, or MaxText's hf eval files."""
    if maxtext(cfg):
        return bool(rows.hf_eval_files(cfg))
    return bool(cfg["data.eval_dataset"])


def training_data(cfg, tok, vocab: int) -> TokenData:
    hf_tok = _hf_tok(cfg, tok, "data.dataset")
    pairs = encode_pairs(source(cfg), hf_tok, cfg, "data.dataset")
    log.info("preference data: %d pairs, %d rows", len(pairs), 2 * len(pairs))
    return _token_data(pairs, cfg, vocab, "preference pairs", tok.eod)


def validation_sets(cfg, tok, vocab: int) -> list[TokenData]:
    """``data.eval_dataset``'s first ``data.eval_samples`` usable pairs (MaxText: all of its
    hf eval files' pairs), in file order (:mod:`jaxtrain.dpo_eval` scores them)."""
    hf_tok = _hf_tok(cfg, tok, "data.eval_dataset")
    pairs = encode_pairs(source(cfg, "data.eval_dataset"), hf_tok, cfg, "data.eval_dataset",
                         limit=None if maxtext(cfg) else cfg["data.eval_samples"])
    data = _token_data(pairs, cfg, vocab, "eval pairs", tok.eod)
    return [dataclasses.replace(data, dataloader_type="single")]
