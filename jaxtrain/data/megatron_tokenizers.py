"""Megatron's SentencePiece and BERT WordPiece tokenizers, with Megatron's special ids.

- ``SentencePieceTokenizer``: a SentencePiece model file (``tokenizer_model``). The
  vocabulary is the model's pieces, then the tokens ``<CLS> <SEP> <EOD> <MASK>``, the pad,
  BOS and EOS pieces (``<PAD>``/``<BOS>``/``<EOS>`` when the model has none) and
  ``vocab_extra_ids`` sentinels ``<extra_id_0>..``, each appended only when not already a
  piece. Those special strings written in a text encode to their ids (the leftmost match
  first; on a tie the one added first). ``eod`` is ``<EOD>``.
- ``GPTSentencePieceTokenizer``: the model's pieces alone; ``eod`` is the model's EOS.
- ``Llama2Tokenizer`` (a SentencePiece file): the pieces alone; every text starts with the
  model's BOS; ``eod`` is the EOS. (Primus builds Llama2Tokenizer with Hugging Face's
  AutoTokenizer; :func:`jaxtrain.data.tokenizers.load_tokenizer` does that when
  ``tokenizer_model`` is a directory or a tokenizer.json.)
- ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: BERT's basic tokenizer (lower-cased and
  accent-stripped, or not) and greedy WordPiece over ``vocab_file`` (one token a line, the
  line number its id). ``[BOS]`` and ``[EOS]`` are appended when missing, then the
  ``vocab_extra_ids`` sentinels; ``eod`` is ``[EOS]``. The appended tokens are ids only: text
  that spells them is tokenised like other text, as in Megatron.

Every tokenizer here offers ``encode``, ``encode_batch``, ``decode``, ``vocab_size``,
``eod`` and the ids ``bos``, ``eos``, ``pad`` (None where Megatron has none).
"""
from __future__ import annotations

import os
import re

from jaxtrain.config.errors import ConfigError

BERT_REQUIRED = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
MAX_WORD_CHARS = 200     # BERT's limit: a longer word becomes [UNK]


def _sentencepiece(path: str, kind: str):
    try:
        import sentencepiece
    except ImportError as e:
        raise ConfigError(f"tokenizer_type {kind} needs the sentencepiece package "
                          "(pip install sentencepiece)") from e
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer_model {path!r}: {kind} reads a SentencePiece model file, "
                          "not a directory")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError
        raise ConfigError(f"tokenizer_model {path}: not a SentencePiece model: {e}") from e


def _piece_id(sp, i: int) -> int | None:
    return i if 0 <= i < len(sp) else None


class GPTSentencePieceTokenizer:
    """The SentencePiece model's own ids; EOS ends a document."""

    kind = "GPTSentencePieceTokenizer"

    def __init__(self, path: str):
        self._sp = _sentencepiece(path, self.kind)
        self.bos = _piece_id(self._sp, self._sp.bos_id())
        self.eos = _piece_id(self._sp, self._sp.eos_id())
        self.pad = _piece_id(self._sp, self._sp.pad_id())

    @property
    def vocab_size(self) -> int:
        return len(self._sp)

    @property
    def eod(self):
        return self.eos

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama-2 tokenizer: the model's ids with BOS in front of every text."""

    kind = "Llama2Tokenizer"

    def __init__(self, path: str):
        super().__init__(path)
        if self.bos is None:
            raise ConfigError(f"tokenizer_model {path}: the SentencePiece model has no BOS "
                              "piece, which Llama2Tokenizer puts in front of every text")

    def encode(self, text: str) -> list[int]:
        return [self.bos] + self._sp.encode(text)

    def encode_batch(self, texts) -> list[list[int]]:
        return [[self.bos] + ids for ids in self._sp.encode(list(texts))]


class SentencePieceTokenizer:
    """Megatron's SentencePieceTokenizer: pieces, then its special tokens and sentinels."""

    def __init__(self, path: str, vocab_extra_ids: int = 0):
        sp = self._sp = _sentencepiece(path, "SentencePieceTokenizer")
        self._vocab = {sp.id_to_piece(i): i for i in range(len(sp))}
        self._specials: dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add(token)
        named = []
        for i, fallback in ((sp.pad_id(), "<PAD>"), (sp.bos_id(), "<BOS>"),
                            (sp.eos_id(), "<EOS>")):
            named.append(self._add(sp.id_to_piece(i) if _piece_id(sp, i) is not None
                                   else fallback))
        self.pad, self.bos, self.eos = named
        self.extra_ids = [self._add(f"<extra_id_{i}>") for i in range(vocab_extra_ids)]
        self.cls, self.sep = self._vocab["<CLS>"], self._vocab["<SEP>"]
        self.mask = self._vocab["<MASK>"]
        self._names = {i: t for t, i in self._specials.items()}
        self._split = re.compile("|".join(re.escape(t) for t in self._specials))

    def _add(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        self._specials[token] = self._vocab[token]
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._vocab["<EOD>"]

    def encode(self, text: str) -> list[int]:
        ids, start = [], 0
        for m in self._split.finditer(text):
            ids += self._sp.encode(text[start:m.start()])
            ids.append(self._specials[m.group()])
            start = m.end()
        return ids + self._sp.encode(text[start:])

    def decode(self, ids) -> str:
        out, run = [], []
        for i in (int(x) for x in ids):
            if i in self._names:
                out += [self._sp.decode(run), self._names[i]]
                run = []
            else:
                run.append(i)
        return " ".join(p for p in out + [self._sp.decode(run)] if p)


def read_bert_vocab(path: str) -> dict[str, int]:
    """BERT's vocab.txt: each line (stripped) is a token, its line number the id."""
    if not os.path.isfile(path):
        raise ConfigError(f"vocab_file {path!r} does not exist (tokenizers are read from local "
                          "files; nothing is downloaded)")
    try:
        with open(path, encoding="utf-8") as f:
            return {line.strip(): i for i, line in enumerate(f)}
    except UnicodeDecodeError as e:
        raise ConfigError(f"vocab_file {path}: not a UTF-8 text file: {e}") from e


class BertWordPieceTokenizer:
    """Megatron's BERT WordPiece tokenizer (lower-cased or cased)."""

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0):
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        kind = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        vocab = read_bert_vocab(vocab_file)
        missing = [t for t in BERT_REQUIRED if t not in vocab]
        if missing:
            raise ConfigError(f"vocab_file {vocab_file}: {kind} needs the tokens "
                              f"{', '.join(BERT_REQUIRED)}; {', '.join(missing)} missing")
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]",
                                         max_input_chars_per_word=MAX_WORD_CHARS))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case,
            lowercase=lower_case)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        self._tok = tok
        ids = dict(vocab)

        def add(token):
            if token not in ids:
                ids[token] = len(ids)
            return ids[token]

        self.bos, self.eos = add("[BOS]"), add("[EOS]")
        self.extra_ids = [add(f"<extra_id_{i}>") for i in range(vocab_extra_ids)]
        self._n = len(ids)
        self._added = {i: t for t, i in ids.items() if t not in vocab}
        self.cls, self.sep = vocab["[CLS]"], vocab["[SEP]"]
        self.pad, self.mask = vocab["[PAD]"], vocab["[MASK]"]

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self.eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        parts, run = [], []
        for i in (int(x) for x in ids):
            if i in self._added:
                parts += [self._tok.decode(run), self._added[i]]
                run = []
            else:
                run.append(i)
        return " ".join(p for p in parts + [self._tok.decode(run)] if p)
