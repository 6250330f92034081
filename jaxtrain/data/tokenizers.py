"""Tokenizers from local files: Hugging Face, GPT-2 BPE (vocab + merges), tiktoken and null.

``build_tokenizer(cfg)`` reads ``tokenizer_type`` (Megatron) and ``tokenizer_model`` (MaxText
``tokenizer_path``); every tokenizer offers ``encode(text) -> list[int]``, ``decode(ids)``,
``vocab_size`` (what the model's embedding must cover before its
``make_vocab_size_divisible_by`` padding) and ``eod`` (the end-of-document id).
Nothing is downloaded: a path that does not exist is a ConfigError.

- ``HuggingFaceTokenizer``: ``transformers.AutoTokenizer.from_pretrained(path,
  trust_remote_code=...)``; a bare ``tokenizer.json`` file is loaded with the ``tokenizers``
  library. ``vocab_size`` is ``len(tokenizer)`` (added tokens included), ``eod`` the EOS id,
  as in Megatron's ``_HuggingFaceTokenizer``.
- ``GPT2BPETokenizer``: byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file``
  (merges.txt); ``eod`` is ``<|endoftext|>``.
- ``NullTokenizer``: text is whitespace-separated integer ids; ``vocab_size`` ids plus the
  EOD id ``vocab_size`` (Megatron's convention).
- ``TikTokenizer``: Megatron's ``CustomTikTokenizer`` built with the ``tiktoken`` package:
  ``tokenizer_model`` is a vocabulary file (see :func:`read_tiktoken_ranks`), the
  pre-tokenisation regex is ``tiktoken_pattern`` v1 or v2, and ids ``0 ..
  tiktoken_num_special_tokens - 1`` are special tokens (``tiktoken_special_tokens``, default
  ``<unk> <s> </s>``, then ``<SPECIAL_i>`` fillers), the file's ranks following them. The
  vocabulary holds ``vocab_size`` ids (Megatron's 2**17 when unset): the file's first
  ``vocab_size - tiktoken_num_special_tokens`` ranks are kept; ``eod`` is ``</s>``.
- ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``,
  ``BertWordPieceLowerCase``, ``BertWordPieceCase``: Megatron's own classes, with its special
  ids and ``vocab_extra_ids`` (:mod:`jaxtrain.data.megatron_tokenizers`). A
  ``Llama2Tokenizer`` whose ``tokenizer_model`` is a directory or a tokenizer.json is loaded
  as Primus loads it, like ``HuggingFaceTokenizer``.
- Primus's ``Llama3Tokenizer``, ``Llama4Tokenizer``, ``MixtralTokenizer``,
  ``DeepSeekV2/V3/V4Tokenizer``, ``Lfm2Tokenizer``, ``KimiK2Tokenizer``: Primus builds each
  as Megatron's ``HuggingFaceTokenizer`` over ``tokenizer_model``, and so does jaxtrain (the
  code shipped with a tokenizer runs only with ``trust_remote_code``).
- MaxText's ``tokenizer_type`` values over ``tokenizer_path``: ``huggingface`` (as
  ``HuggingFaceTokenizer``), ``sentencepiece`` (the model's own pieces and BOS/EOS ids, as
  ``GPTSentencePieceTokenizer``) and ``tiktoken`` (:class:`MaxTextTikToken`: a ``.tiktoken``
  rank file followed by Llama 3's 256 special tokens). MaxText's hf pipeline always loads
  an AutoTokenizer; :func:`build_tokenizer` does so there when the path is a folder or a
  tokenizer.json, and infers the kind from the path when the type is left at its default.

Every tokenizer has ``bos`` and ``pad`` (None when it has none; ``pad`` is the id Megatron's
tokenizer of that type reports); the MaxText pipelines add it and the
EOD per document by ``add_bos``/``add_eos`` (:mod:`jaxtrain.data.sources`).
"""
from __future__ import annotations

import base64
import binascii
import json
import os

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import megatron_tokenizers as mt

EOD_TEXT = "<|endoftext|>"
# Primus's tokenizer types: each is Hugging Face's AutoTokenizer over tokenizer_model.
PRIMUS_HF = ("Llama3Tokenizer", "Llama4Tokenizer", "MixtralTokenizer", "DeepSeekV2Tokenizer",
             "DeepSeekV3Tokenizer", "DeepSeekV4Tokenizer", "Lfm2Tokenizer", "KimiK2Tokenizer")
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
WORDPIECE = ("BertWordPieceLowerCase", "BertWordPieceCase")
EXTRA_IDS = ("SentencePieceTokenizer",) + WORDPIECE     # the types that read vocab_extra_ids
MAXTEXT_TYPES = ("sentencepiece", "tiktoken", "huggingface")    # MaxText's own spellings
BUILT = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "TikTokenizer",
         *SENTENCEPIECE, *WORDPIECE, *PRIMUS_HF, *MAXTEXT_TYPES)
BOS_TEXTS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")

# Megatron's two tiktoken pre-tokenisation regexes (PATTERN_TIKTOKEN and PATTERN_TIKTOKEN_V2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_REQUIRED = ("<unk>", "<s>", "</s>")
TIKTOKEN_VOCAB = 2 ** 17   # Megatron's vocabulary size when vocab_size is unset


class NullTokenizer:
    bos = pad = None

    def __init__(self, vocab_size: int):
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class _TokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` (a tokenizer.json, or GPT-2 vocab + merges)."""

    def __init__(self, tok, eod_text: str | None = None):
        self._tok = tok
        eod = tok.token_to_id(eod_text or EOD_TEXT)
        if eod is None:
            for name in ("</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"):
                eod = tok.token_to_id(name)
                if eod is not None:
                    break
        self._eod = eod
        self.bos = next((i for i in map(tok.token_to_id, BOS_TEXTS) if i is not None), None)
        self.pad = None     # a bare tokenizer.json names no pad token

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self):
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


class HFTokenizer:
    """``transformers.AutoTokenizer`` over a local directory."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        import transformers

        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(
                path, trust_remote_code=trust_remote_code, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ConfigError(f"tokenizer_model {path!r}: cannot load it with AutoTokenizer: "
                              f"{type(e).__name__}: {e}") from e
        self.bos = self._tok.bos_token_id
        self.pad = self._tok.pad_token_id
        self.path = path

    @property
    def hf(self):
        """The ``transformers`` tokenizer itself (chat templates, offsets)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self):
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Token bytes -> rank from a tiktoken vocabulary file, in either form:

    - Megatron's JSON: a list of ``{"rank": i, "token_bytes": base64, "token_str": ...}`` in
      rank order, whose first 256 entries are the single bytes 0..255;
    - tiktoken's text form (``*.tiktoken``): one ``base64-token rank`` pair per line.

    The ranks must be 0..n-1 and include every single byte (so any text can be encoded).
    """
    def bad(what):
        return ConfigError(f"tokenizer_model: TikTokenizer vocabulary {path}: {what}")

    ranks: dict[bytes, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                try:
                    entries = json.load(f)
                except json.JSONDecodeError as e:
                    raise bad(f"not valid JSON: {e}") from e
                if not isinstance(entries, list):
                    raise bad("expected a JSON list of {rank, token_bytes, token_str} entries")
                for i, entry in enumerate(entries):
                    if not isinstance(entry, dict) or entry.get("rank") != i \
                            or not isinstance(entry.get("token_bytes"), str):
                        raise bad(f"entry {i} is not {{'rank': {i}, 'token_bytes': ...}}")
                    ranks[base64.b64decode(entry["token_bytes"], validate=True)] = i
                singles = [bytes([i]) for i in range(min(256, len(entries)))]
                if [t for t, r in ranks.items() if r < 256] != singles:
                    raise bad("the first 256 entries must be the single bytes 0..255 in order")
            else:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    parts = line.split()
                    if len(parts) != 2 or not parts[1].isdigit():
                        raise bad(f"line {lineno}: expected 'base64-token rank'")
                    ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
    except binascii.Error as e:
        raise bad(f"a token is not valid base64: {e}") from e
    except UnicodeDecodeError as e:
        raise bad(f"not a text file: {e}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise bad("the ranks must be 0..n-1, each token once")
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:
        raise bad(f"{len(missing)} single bytes have no rank (byte {missing[0]} first); "
                  "every byte 0..255 needs one")
    return ranks


class _TiktokenText:
    """Text <-> ids through a ``tiktoken.Encoding`` in ``self._model`` (special-token text in a
    document is encoded as ordinary text)."""

    def encode(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def encode_batch(self, texts) -> list[list[int]]:
        return self._model.encode_ordinary_batch(list(texts))

    def decode(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])


class TikTokenizer(_TiktokenText):
    """Megatron's ``CustomTikTokenizer``: special tokens first, then the file's ranks."""

    def __init__(self, path: str, pattern: str | None, vocab_size: int | None = None,
                 num_special_tokens: int = 1000, special_tokens: list[str] | None = None):
        try:
            import tiktoken
        except ImportError as e:
            raise ConfigError("tokenizer_type TikTokenizer needs the tiktoken package "
                              "(pip install tiktoken)") from e
        if pattern not in TIKTOKEN_PATTERNS:
            raise ConfigError(f"TikTokenizer needs tiktoken_pattern v1 or v2 (got {pattern!r})")
        self._n = int(vocab_size or TIKTOKEN_VOCAB)
        specials = list(special_tokens) if special_tokens else list(TIKTOKEN_REQUIRED)
        if len(set(specials)) != len(specials):
            raise ConfigError(f"tiktoken_special_tokens lists a token twice: {specials}")
        lacking = [t for t in TIKTOKEN_REQUIRED if t not in specials]
        if lacking:
            raise ConfigError(f"tiktoken_special_tokens must include {', '.join(lacking)} "
                              f"(Megatron's TikTokenizer needs <unk>, <s> and </s>)")
        if not len(specials) <= num_special_tokens < self._n:
            raise ConfigError(f"tiktoken_num_special_tokens {num_special_tokens} must be at "
                              f"least the {len(specials)} special tokens and below the "
                              f"vocabulary size {self._n} (vocab_size)")
        fillers = [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        clash = [t for t in fillers if t in specials]
        if clash:
            raise ConfigError(f"tiktoken_special_tokens: {clash[0]} is the name of a filler "
                              "special token; rename it")
        inner = self._n - num_special_tokens
        ranks = read_tiktoken_ranks(path)
        if len(ranks) < inner:
            raise ConfigError(f"TikTokenizer vocabulary {path}: {len(ranks)} tokens, but "
                              f"vocab_size {self._n} - tiktoken_num_special_tokens "
                              f"{num_special_tokens} needs {inner}; set vocab_size to "
                              f"{len(ranks) + num_special_tokens} or less")
        mergeable = {t: r + num_special_tokens for t, r in ranks.items() if r < inner}
        self.special_ids = {t: i for i, t in enumerate(specials + fillers)}
        self.pad = self.special_ids.get("<pad>")
        self._model = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=mergeable, special_tokens=self.special_ids)

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self.special_ids["</s>"]

    @property
    def bos(self) -> int:
        return self.special_ids["<s>"]


# Llama 3's pre-tokenisation regex (contractions, letters, 1-3 digit groups, punctuation runs).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in id order after the base vocabulary."""
    named = ["<|begin_of_text|>", "<|end_of_text|>"]
    named += [f"<|reserved_special_token_{i}|>" for i in range(4)]
    named += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>",
              "<|eot_id|>"]
    return named + [f"<|reserved_special_token_{i}|>"
                    for i in range(5, LLAMA3_SPECIALS - len(named) + 5)]


class MaxTextTikToken(_TiktokenText):
    """MaxText's ``tokenizer_type: tiktoken``: a tiktoken rank file (``base64 rank`` lines),
    then Llama 3's special tokens numbered after it; BOS ``<|begin_of_text|>``, EOS/EOD
    ``<|end_of_text|>``. Special-token text in a document is encoded as ordinary text."""

    def __init__(self, path: str):
        try:
            import tiktoken
        except ImportError as e:
            raise ConfigError("tokenizer_type tiktoken needs the tiktoken package "
                              "(pip install tiktoken)") from e
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer_path {path!r}: tokenizer_type tiktoken reads a "
                              "tiktoken rank file, not a directory")
        ranks = read_tiktoken_ranks(path)
        self.special_ids = {t: len(ranks) + i for i, t in enumerate(llama3_special_tokens())}
        self._model = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                        mergeable_ranks=ranks, special_tokens=self.special_ids)
        self.bos = self.special_ids["<|begin_of_text|>"]
        self.pad = None

    @property
    def vocab_size(self) -> int:
        return self._model.n_vocab

    @property
    def eod(self) -> int:
        return self.special_ids["<|end_of_text|>"]


class MaxTextSentencePiece(mt.GPTSentencePieceTokenizer):
    """MaxText's ``tokenizer_type: sentencepiece``: the model's pieces, BOS and EOS."""

    kind = "sentencepiece"


def _need_path(path, what: str) -> str:
    if not path:
        raise ConfigError(f"{what} is not set")
    if not os.path.exists(path):
        raise ConfigError(f"{what} {path!r} does not exist (tokenizers are read from local "
                          "files; nothing is downloaded)")
    return str(path)


def load_tokenizer(tokenizer_type: str | None, model: str | None = None, *,
                   vocab_file: str | None = None, merge_file: str | None = None,
                   vocab_size: int | None = None, trust_remote_code: bool = False,
                   tiktoken_pattern: str | None = None, tiktoken_num_special_tokens: int = 1000,
                   tiktoken_special_tokens: list[str] | None = None,
                   vocab_extra_ids: int = 0):
    """The tokenizer of this type from these files (the config-free entry point)."""
    if tokenizer_type is None:
        tokenizer_type = "HuggingFaceTokenizer" if model else (
            "GPT2BPETokenizer" if vocab_file else None)
    if vocab_extra_ids and tokenizer_type not in EXTRA_IDS:
        raise ConfigError(f"vocab_extra_ids {vocab_extra_ids}: only {', '.join(EXTRA_IDS)} add "
                          f"sentinel tokens (tokenizer_type is {tokenizer_type}); set it to 0")
    if vocab_extra_ids < 0:
        raise ConfigError(f"vocab_extra_ids {vocab_extra_ids}: give 0 or more")
    if tokenizer_type == "sentencepiece":
        return MaxTextSentencePiece(_need_path(model, "tokenizer_path"))
    if tokenizer_type == "tiktoken":
        return MaxTextTikToken(_need_path(model, "tokenizer_path"))
    if tokenizer_type == "huggingface":
        tokenizer_type = "HuggingFaceTokenizer"
    if tokenizer_type in WORDPIECE:
        return mt.BertWordPieceTokenizer(_need_path(vocab_file, "vocab_file"),
                                         tokenizer_type == "BertWordPieceLowerCase",
                                         vocab_extra_ids)
    if tokenizer_type == "SentencePieceTokenizer":
        return mt.SentencePieceTokenizer(_need_path(model, "tokenizer_model"), vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return mt.GPTSentencePieceTokenizer(_need_path(model, "tokenizer_model"))
    if tokenizer_type == "Llama2Tokenizer":
        path = _need_path(model, "tokenizer_model")
        if os.path.isfile(path) and not path.endswith(".json"):
            return mt.Llama2Tokenizer(path)
        tokenizer_type = "HuggingFaceTokenizer"        # Primus's Llama2Tokenizer
    if tokenizer_type in PRIMUS_HF:
        tokenizer_type = "HuggingFaceTokenizer"
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ConfigError("NullTokenizer needs vocab_size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = _need_path(vocab_file, "vocab_file")
        merges = _need_path(merge_file, "merge_file")
        try:
            tok = Tokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"GPT2BPETokenizer: cannot read vocab_file {vocab!r} / merge_file "
                              f"{merges!r}: {e}") from e
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return _TokenizersTokenizer(tok)
    if tokenizer_type == "HuggingFaceTokenizer":
        path = _need_path(model, "tokenizer_model")
        if os.path.isfile(path) and path.endswith(".json"):
            from tokenizers import Tokenizer

            try:
                return _TokenizersTokenizer(Tokenizer.from_file(path))
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"tokenizer_model {path!r}: not a tokenizer.json: {e}") from e
        return HFTokenizer(path, trust_remote_code)
    if tokenizer_type == "TikTokenizer":
        path = _need_path(model, "tokenizer_model")
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer_model {path!r}: TikTokenizer reads a vocabulary file, "
                              "not a directory")
        return TikTokenizer(path, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens,
                            tiktoken_special_tokens)
    if tokenizer_type is None:
        raise ConfigError("no tokenizer: set tokenizer_type and tokenizer_model (or "
                          "tokenizer_path)")
    raise ConfigError(f"tokenizer_type {tokenizer_type} is not built yet (built: "
                      f"{', '.join(BUILT)})")


def _maxtext_type(cfg, ttype: str, model: str) -> str:
    """MaxText's type for ``model``: its hf pipeline always reads an AutoTokenizer, and a type
    left at MaxText's default follows the path (a folder or tokenizer.json is Hugging Face's,
    a *.tiktoken file tiktoken's)."""
    hf_files = os.path.isdir(model) or model.endswith(".json")
    hf_data = cfg["dataset_type"] == "hf"
    if hf_files and (hf_data or not cfg.is_set("tokenizer_type")):
        return "huggingface"
    if not cfg.is_set("tokenizer_type") and model.endswith(".tiktoken"):
        return "tiktoken"
    return ttype


def build_tokenizer(cfg):
    """The tokenizer the config names, or None when it names none."""
    ttype, model = cfg["tokenizer_type"], cfg["tokenizer_model"]
    if ttype in MAXTEXT_TYPES:
        if not model:
            return None     # MaxText's default type with no tokenizer_path: no tokenizer
        ttype = _maxtext_type(cfg, ttype, str(model))
    if ttype is None and not model and not cfg["vocab_file"]:
        if cfg["vocab_extra_ids"]:
            raise ConfigError("vocab_extra_ids adds sentinel tokens to a SentencePieceTokenizer "
                              "or BertWordPiece* tokenizer, and no tokenizer is configured")
        return None
    return load_tokenizer(ttype, model, vocab_file=cfg["vocab_file"],
                          merge_file=cfg["merge_file"], vocab_size=cfg["vocab_size"],
                          trust_remote_code=cfg["trust_remote_code"],
                          tiktoken_pattern=cfg["tiktoken_pattern"],
                          tiktoken_num_special_tokens=cfg["tiktoken_num_special_tokens"],
                          tiktoken_special_tokens=cfg["tiktoken_special_tokens"],
                          vocab_extra_ids=cfg["vocab_extra_ids"])
