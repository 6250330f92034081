"""Choosing the training data from the config.

- Megatron ``mock_data`` and MaxText ``dataset_type: synthetic``: seeded uniform random tokens
  over ``vocab_size`` (nothing to learn: for throughput and plumbing);
- Megatron indexed files: ``data_path`` (a blend "w1 prefix1 w2 prefix2", cut by ``split``),
  or ``train_data_path``/``valid_data_path``/``test_data_path``, or a file holding the blend
  (``data_args_path``) or per-split blends (``per_split_data_args_path``): GPT samples built
  as Megatron builds them (:mod:`jaxtrain.data.gpt_dataset`);
- MaxText ``dataset_type: hf`` with ``hf_path`` (a local directory or file) and/or
  ``hf_train_files`` (globs of .jsonl/.json/.parquet), and pgs ``data.dataset`` as a local
  file: plain-text documents tokenised with the configured tokenizer, packed first-fit into
  ``seq_length + 1`` tokens when ``packing`` is on (else one padded document per row);
- ``dataset_type: corpus``: jaxtrain's generated text corpus with its own BPE tokenizer.

The vocabulary given to the model is the tokenizer's (or ``vocab_size`` without one); the
model pads it by ``make_vocab_size_divisible_by``.
"""
from __future__ import annotations

import json
import os

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import corpus, gpt_dataset, text_files
from jaxtrain.data.batches import TokenData, windows
from jaxtrain.data.tokenizers import build_tokenizer

MOCK_TOKENS = 1 << 20


def _loader(cfg, eod) -> dict:
    """TokenData's document-mask and loader fields from the config."""
    return dict(eod=eod, reset_position_ids=cfg["reset_position_ids"],
                reset_attention_mask=cfg["reset_attention_mask"],
                eod_mask_loss=cfg["eod_mask_loss"], dataloader_type=cfg["dataloader_type"],
                num_workers=cfg["num_workers"])


def _random_tokens(cfg, name: str) -> TokenData:
    vocab = cfg["vocab_size"]
    if not vocab:
        raise ConfigError(f"{name} needs vocab_size (the range of the random token ids)")
    rng = np.random.default_rng(cfg["seed"])
    stream = rng.integers(0, vocab, size=MOCK_TOKENS, dtype=np.int32)
    return TokenData(windows(stream, cfg["seq_length"]), vocab, name,
                     dataloader_type=cfg["dataloader_type"], num_workers=cfg["num_workers"])


def _corpus(cfg) -> TokenData:
    tok = corpus.tokenizer()
    eod = tok.token_to_id(corpus.EOD)
    ids = [i for doc in corpus.documents() for i in tok.encode(doc).ids + [eod]]
    vocab = tok.get_vocab_size()
    if cfg["vocab_size"] and cfg["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size {cfg['vocab_size']} is smaller than the corpus "
                          f"tokenizer's {vocab}; leave vocab_size unset")
    return TokenData(windows(np.asarray(ids, np.int32), cfg["seq_length"]), vocab, "corpus",
                     **_loader(cfg, eod))


def _vocab(cfg, tok, name) -> int:
    if tok is not None:
        return tok.vocab_size
    if not cfg["vocab_size"]:
        raise ConfigError(f"{name}: set tokenizer_type/tokenizer_model (or vocab_size) so the "
                          "model knows the vocabulary")
    return cfg["vocab_size"]


def split_samples(cfg) -> list[int | None]:
    """Megatron's train/valid/test sample targets: train_samples (or train_iters x global
    batch); (train_iters // eval_interval + 1) x eval_iters and eval_iters global batches."""
    gbs = cfg["global_batch_size"]
    train_iters = cfg["train_iters"]
    train = cfg["train_samples"] or (train_iters * gbs if train_iters else None)
    eval_iters = cfg["eval_iters"] if isinstance(cfg["eval_iters"], int) else 0
    if train_iters and cfg["eval_interval"] and eval_iters:
        valid = (train_iters // cfg["eval_interval"] + 1) * eval_iters * gbs
    else:
        valid = None
    return [train, valid, eval_iters * gbs if eval_iters else None]


def _read_json(path, what):
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r}: no such file")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def megatron_datasets(cfg) -> dict:
    """{"train", "valid", "test"} GPT datasets (or None) from the Megatron data knobs."""
    data_path = cfg["data_path"]
    per_split = [cfg["train_data_path"], cfg["valid_data_path"], cfg["test_data_path"]]
    if cfg["data_args_path"]:
        data_path = _read_json(cfg["data_args_path"], "data_args_path")
    if cfg["per_split_data_args_path"]:
        spec = _read_json(cfg["per_split_data_args_path"], "per_split_data_args_path")
        if not isinstance(spec, dict):
            raise ConfigError(f"per_split_data_args_path {cfg['per_split_data_args_path']}: "
                              "expected a JSON object with train/valid/test keys")
        per_split = [spec.get(s) for s in gpt_dataset.SPLITS]
    return gpt_dataset.build_datasets(
        seq_length=cfg["seq_length"], seed=cfg["seed"], num_samples=split_samples(cfg),
        data_path=data_path, split=cfg["split"], train_data_path=per_split[0],
        valid_data_path=per_split[1], test_data_path=per_split[2],
        cache_dir=cfg["data_cache_path"], mmap=cfg["mmap_bin_files"])


def _megatron(cfg) -> TokenData:
    tok = build_tokenizer(cfg)
    vocab = _vocab(cfg, tok, "data_path")
    train = megatron_datasets(cfg)["train"]
    if train is None:
        raise ConfigError("the train split is empty: check split and data_path")
    return TokenData(train, vocab, "indexed", **_loader(cfg, tok.eod if tok else None))


def _text(cfg, files: list[str], name: str) -> TokenData:
    tok = build_tokenizer(cfg)
    if tok is None:
        raise ConfigError(f"{name}: text data needs a tokenizer: set tokenizer_type and "
                          "tokenizer_model (MaxText tokenizer_path)")
    columns = cfg["train_data_columns"]
    field = columns if isinstance(columns, str) else columns[0]
    texts = list(text_files.read_documents(files, field))
    encode_batch = getattr(tok, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [tok.encode(t) for t in texts]
    if cfg["packing"] and tok.eod is not None:
        docs = [list(d) + [tok.eod] for d in docs]
    length = cfg["seq_length"] + 1
    arrays = text_files.pack(docs, length) if cfg["packing"] else \
        text_files.pad_rows(docs, length)
    if len(arrays["tokens"]) == 0:
        raise ConfigError(f"{name}: the documents hold no tokens")
    return TokenData(text_files.Rows(arrays), tok.vocab_size, name,
                     **{**_loader(cfg, tok.eod), "reset_position_ids": False,
                        "reset_attention_mask": False})


def _hf_files(cfg) -> list[str]:
    files = []
    if cfg["hf_train_files"]:
        files = text_files.expand(cfg["hf_train_files"], "hf_train_files")
    elif cfg["hf_path"]:
        path = cfg["hf_path"]
        sub = os.path.join(path, cfg["hf_data_dir"]) if cfg["hf_data_dir"] else None
        if sub and os.path.isdir(sub):
            path = sub
        files = text_files.expand(path, "hf_path")
    return files


def has_megatron_paths(cfg) -> bool:
    return any(cfg[k] for k in ("data_path", "train_data_path", "data_args_path",
                                "per_split_data_args_path"))


def training_data(cfg) -> TokenData:
    """The training set the config asks for, or a ConfigError saying how to ask for one."""
    if cfg["mock_data"]:
        return _random_tokens(cfg, "mock_data")
    if has_megatron_paths(cfg):
        return _megatron(cfg)
    if cfg.is_set("data.dataset"):
        return _text(cfg, text_files.expand(cfg["data.dataset"], "data.dataset"), "data.dataset")
    if cfg.is_set("dataset_type") or cfg.dialect == "maxtext":
        kind = cfg["dataset_type"]
        if kind == "synthetic":
            return _random_tokens(cfg, "dataset_type synthetic")
        if kind == "corpus":
            return _corpus(cfg)
        if kind == "hf":
            return _text(cfg, _hf_files(cfg), "dataset_type hf")
    raise ConfigError("no training data configured: set data_path (Megatron indexed files), "
                      "mock_data: true, dataset_type: hf with hf_path/hf_train_files, "
                      "dataset_type: synthetic or dataset_type: corpus")
