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
"""
from __future__ import annotations

import base64
import binascii
import json
import os

from jaxtrain.config.errors import ConfigError

EOD_TEXT = "<|endoftext|>"
BUILT = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "TikTokenizer")

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
            raise ConfigError(f"tokenizer {path!r}: cannot load it with AutoTokenizer: "
                              f"{type(e).__name__}: {e}") from e

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
        return ConfigError(f"TikTokenizer vocabulary {path}: {what}")

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


class TikTokenizer:
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
        self._model = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks=mergeable, special_tokens=self.special_ids)

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def eod(self) -> int:
        return self.special_ids["</s>"]

    def encode(self, text: str) -> list[int]:
        return self._model.encode_ordinary(text)

    def encode_batch(self, texts) -> list[list[int]]:
        return self._model.encode_ordinary_batch(list(texts))

    def decode(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])


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
                   tiktoken_special_tokens: list[str] | None = None):
    """The tokenizer of this type from these files (the config-free entry point)."""
    if tokenizer_type is None:
        tokenizer_type = "HuggingFaceTokenizer" if model else (
            "GPT2BPETokenizer" if vocab_file else None)
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
            raise ConfigError(f"GPT2BPETokenizer: cannot read {vocab} / {merges}: {e}") from e
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
                raise ConfigError(f"tokenizer {path!r}: not a tokenizer.json: {e}") from e
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


def build_tokenizer(cfg):
    """The tokenizer the config names, or None when it names none."""
    ttype, model = cfg["tokenizer_type"], cfg["tokenizer_model"]
    if ttype is None and not model and not cfg["vocab_file"]:
        return None
    return load_tokenizer(ttype, model, vocab_file=cfg["vocab_file"],
                          merge_file=cfg["merge_file"], vocab_size=cfg["vocab_size"],
                          trust_remote_code=cfg["trust_remote_code"],
                          tiktoken_pattern=cfg["tiktoken_pattern"],
                          tiktoken_num_special_tokens=cfg["tiktoken_num_special_tokens"],
                          tiktoken_special_tokens=cfg["tiktoken_special_tokens"])
