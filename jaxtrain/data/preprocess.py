"""Tokenise a JSON-lines corpus into Megatron indexed files (``.bin``/``.idx``).

    python -m jaxtrain.data.preprocess --input FILE.jsonl --tokenizer PATH --output-prefix P
        [--tokenizer-type HuggingFaceTokenizer|GPT2BPETokenizer|NullTokenizer|TikTokenizer|
                          SentencePieceTokenizer|Llama2Tokenizer|BertWordPieceCase|...]
        [--vocab-file F --merge-file F] [--vocab-size N] [--vocab-extra-ids N]
        [--json-key text] [--append-eod]
        [--tiktoken-pattern v1|v2 --tiktoken-num-special-tokens N
         --tiktoken-special-tokens T ...] [--workers N]

Each line is a JSON object; its ``--json-key`` field is one document. As Megatron's
``tools/preprocess_data.py`` does, the output is ``P_<json-key>_document.bin/.idx`` (pass
that prefix as ``data_path``), one sequence per document, EOD appended with ``--append-eod``,
empty documents skipped, tokens stored as uint16 when the vocabulary has under 65 500 ids
(else int32). Megatron reads the files as they are, and jaxtrain reads Megatron's.
A problem with the input prints one line naming the file and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

from jaxtrain.config.errors import ConfigError
from jaxtrain.data.indexed import IndexedDatasetBuilder, optimal_dtype
from jaxtrain.data.tokenizers import BUILT, load_tokenizer

_TOKENIZER = None
_ARGS = None


def _tokenizer(args):
    return load_tokenizer(args.tokenizer_type, args.tokenizer, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, vocab_size=args.vocab_size,
                          trust_remote_code=args.trust_remote_code,
                          tiktoken_pattern=args.tiktoken_pattern,
                          tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                          tiktoken_special_tokens=args.tiktoken_special_tokens,
                          vocab_extra_ids=args.vocab_extra_ids)


def _init(args):
    global _TOKENIZER, _ARGS
    _ARGS, _TOKENIZER = args, _tokenizer(args)


def _encode(item):
    lineno, line = item
    text = _text(_ARGS.input, lineno, line, _ARGS.json_key)
    if text is None:
        return lineno, None
    ids = _TOKENIZER.encode(text) if text else []
    if ids and _ARGS.append_eod:
        ids.append(_TOKENIZER.eod)
    return lineno, ids


def _text(path, lineno, line, key):
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not a JSON object: {e}") from e
    if not isinstance(row, dict) or key not in row:
        raise ConfigError(f"{path}:{lineno}: the row has no {key!r} field")
    if not isinstance(row[key], str):
        raise ConfigError(f"{path}:{lineno}: field {key!r} is not a string")
    return row[key]


def _lines(path):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            yield i, line


def preprocess(args) -> dict:
    """Write the indexed files; returns counts (documents, tokens, seconds, output prefix)."""
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input}: no such file")
    tok = _tokenizer(args)
    if args.append_eod and tok.eod is None:
        raise ConfigError(f"--append-eod: the tokenizer {args.tokenizer} has no end-of-document "
                          "token")
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(prefix, dtype=optimal_dtype(tok.vocab_size))
    docs = tokens = rows = 0
    try:
        if args.workers > 1:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(args.workers, initializer=_init, initargs=(args,)) as pool:
                results = pool.imap(_encode, _lines(args.input), chunksize=64)
                for _, ids in results:
                    rows += ids is not None
                    if ids:
                        builder.add_document(ids)
                        docs, tokens = docs + 1, tokens + len(ids)
        else:
            _init(args)
            for item in _lines(args.input):
                _, ids = _encode(item)
                rows += ids is not None
                if ids:
                    builder.add_document(ids)
                    docs, tokens = docs + 1, tokens + len(ids)
    finally:
        builder.finalize()
    if rows == 0:
        raise ConfigError(f"--input {args.input}: the file holds no JSON rows")
    return {"prefix": prefix, "documents": docs, "tokens": tokens,
            "seconds": time.perf_counter() - start}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxtrain.data.preprocess",
                                description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default=None,
                   help="tokenizer directory or tokenizer.json (HuggingFaceTokenizer)")
    p.add_argument("--tokenizer-type", default=None, choices=BUILT)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--vocab-extra-ids", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None)
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    p.add_argument("--tiktoken-special-tokens", nargs="+", default=None)
    p.add_argument("--json-key", default="text")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        out = preprocess(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out['prefix']}.bin/.idx: {out['documents']} documents, {out['tokens']} "
          f"tokens in {out['seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
