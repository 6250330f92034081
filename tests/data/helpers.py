"""Shared helpers for the data tests: tiny local tokenizers, indexed files, jsonl corpora."""
import json

import numpy as np

from jaxtrain.data.indexed import IndexedDatasetBuilder

WORDS = "the cat dog sat on a mat ran far and fox owl saw it".split()
EOD = "<|endoftext|>"


def word_tokenizer():
    """A word-level tokenizers.Tokenizer: EOD=0, <unk>=1, then WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOD: 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def hf_tokenizer_dir(path):
    """A local AutoTokenizer directory around :func:`word_tokenizer`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), eos_token=EOD,
                                   unk_token="<unk>")
    fast.save_pretrained(str(path))
    return str(path)


def gpt2_files(path):
    """vocab.json + merges.txt of a tiny byte-level BPE trained on WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    vocab, merges = tok.model.save(str(path))
    return vocab, merges


def texts(n, seed=0):
    rng = np.random.RandomState(seed)
    return [" ".join(rng.choice(WORDS, rng.randint(1, 12))) for _ in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_indexed(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(str(prefix), dtype=dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()
    return str(prefix)


def random_docs(n, vocab=50, lo=1, hi=20, seed=0, value=None):
    rng = np.random.RandomState(seed)
    return [np.full(rng.randint(lo, hi), value) if value is not None
            else rng.randint(1, vocab, rng.randint(lo, hi)) for _ in range(n)]
