"""Choosing the training data from the config: mock tokens, synthetic tokens or the corpus.

Megatron ``mock_data`` and MaxText ``dataset_type: synthetic`` give seeded uniform random
tokens over ``vocab_size`` (nothing to learn: for throughput and plumbing);
``dataset_type: corpus`` is jaxtrain's generated text corpus with its own BPE tokenizer (the
quickstart). Dataset files arrive with the data issue (#6).
"""
from __future__ import annotations

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import corpus
from jaxtrain.data.batches import TokenData, windows

MOCK_TOKENS = 1 << 20


def _random_tokens(cfg, name: str) -> TokenData:
    vocab = cfg["vocab_size"]
    if not vocab:
        raise ConfigError(f"{name} needs vocab_size (the range of the random token ids)")
    rng = np.random.default_rng(cfg["seed"])
    stream = rng.integers(0, vocab, size=MOCK_TOKENS, dtype=np.int32)
    return TokenData(windows(stream, cfg["seq_length"]), vocab, name)


def _corpus(cfg) -> TokenData:
    tok = corpus.tokenizer()
    eod = tok.token_to_id(corpus.EOD)
    ids = [i for doc in corpus.documents() for i in tok.encode(doc).ids + [eod]]
    vocab = tok.get_vocab_size()
    if cfg["vocab_size"] and cfg["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size {cfg['vocab_size']} is smaller than the corpus "
                          f"tokenizer's {vocab}; leave vocab_size unset")
    return TokenData(windows(np.asarray(ids, np.int32), cfg["seq_length"]), vocab, "corpus")


def training_data(cfg) -> TokenData:
    """The training set the config asks for, or a ConfigError saying how to ask for one."""
    if cfg["mock_data"]:
        return _random_tokens(cfg, "mock_data")
    if cfg.is_set("dataset_type") or cfg.dialect == "maxtext":
        if cfg["dataset_type"] == "synthetic":
            return _random_tokens(cfg, "dataset_type synthetic")
        if cfg["dataset_type"] == "corpus":
            return _corpus(cfg)
    raise ConfigError("no training data configured: set mock_data: true, dataset_type: "
                      "synthetic or dataset_type: corpus (dataset files arrive with issue #6)")
