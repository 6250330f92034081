"""Tokenizers from local files: Hugging Face, GPT-2 BPE (vocab + merges) and the null tokenizer.

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
"""
from __future__ import annotations

import os

from jaxtrain.config.errors import ConfigError

EOD_TEXT = "<|endoftext|>"
BUILT = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


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


def _need_path(path, what: str) -> str:
    if not path:
        raise ConfigError(f"{what} is not set")
    if not os.path.exists(path):
        raise ConfigError(f"{what} {path!r} does not exist (tokenizers are read from local "
                          "files; nothing is downloaded)")
    return str(path)


def load_tokenizer(tokenizer_type: str | None, model: str | None = None, *,
                   vocab_file: str | None = None, merge_file: str | None = None,
                   vocab_size: int | None = None, trust_remote_code: bool = False):
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
                          trust_remote_code=cfg["trust_remote_code"])
