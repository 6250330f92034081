"""TikTokenizer: Megatron's special-token layout over a tiktoken vocabulary file."""
import base64
import json
from pathlib import Path

import numpy as np
import pytest

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import preprocess
from jaxtrain.data.indexed import IndexedDataset
from jaxtrain.data.sources import training_data
from jaxtrain.data.tokenizers import load_tokenizer
from tests.data import helpers
from tests.data.test_pipeline import config

pytest.importorskip("tiktoken")

MERGES = [b"th", b"the", b"ca", b"cat", b"oW", b" t", b" the"]


def vocab_files(tmp_path):
    """The same ranks (256 bytes, then MERGES) in Megatron's JSON and tiktoken's text form."""
    tokens = [bytes([i]) for i in range(256)] + MERGES
    enc = [base64.b64encode(t).decode() for t in tokens]
    js = tmp_path / "vocab.json"
    js.write_text(json.dumps([{"rank": i, "token_bytes": e, "token_str": ""}
                              for i, e in enumerate(enc)]))
    text = tmp_path / "vocab.tiktoken"
    text.write_text("".join(f"{e} {i}\n" for i, e in enumerate(enc)))
    return str(js), str(text), len(tokens)


def tik(path, pattern="v2", vocab_size=None, n_special=1000, specials=None):
    return load_tokenizer("TikTokenizer", path, vocab_size=vocab_size, tiktoken_pattern=pattern,
                          tiktoken_num_special_tokens=n_special,
                          tiktoken_special_tokens=specials)


def test_ids_follow_megatrons_layout(tmp_path):
    js, text, n = vocab_files(tmp_path)
    tok = tik(js, vocab_size=n + 10, n_special=10)
    assert tok.vocab_size == n + 10
    assert tok.eod == 2                                   # <unk> <s> </s>: </s> is id 2
    assert tok.encode("the") == [256 + 1 + 10]            # rank of b"the" + 10 specials
    assert tok.encode("a") == [ord("a") + 10]
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert tok.encode("the cat") == tik(text, vocab_size=n + 10, n_special=10).encode("the cat")
    # tiktoken_num_special_tokens shifts every ordinary id
    assert tik(js, vocab_size=n + 20, n_special=20).encode("the") == [256 + 1 + 20]
    # vocab_size keeps only the first vocab_size - num_special ranks (Megatron's cut)
    cut = tik(js, vocab_size=256 + 10, n_special=10)
    assert cut.vocab_size == 266 and cut.encode("the") == [ord(c) + 10 for c in "the"]


def test_pattern_and_special_tokens(tmp_path):
    js, _, n = vocab_files(tmp_path)
    v1 = tik(js, "v1", vocab_size=n + 10, n_special=10)
    v2 = tik(js, "v2", vocab_size=n + 10, n_special=10)
    # v1 keeps "HelloWorld" one piece (the "oW" merge applies); v2 splits at the capital
    assert len(v1.encode("HelloWorld")) == 9 and len(v2.encode("HelloWorld")) == 10
    custom = tik(js, vocab_size=n + 10, n_special=10, specials=["<s>", "<pad>", "<unk>", "</s>"])
    assert custom.eod == 3 and custom.special_ids["<pad>"] == 1
    assert custom.special_ids["<SPECIAL_9>"] == 9
    assert custom.decode([3]) == "</s>"
    assert custom.encode("</s>") != [3]                   # text is never read as a special


def test_bad_tiktoken_settings(tmp_path):
    js, text, n = vocab_files(tmp_path)
    small = {"vocab_size": n + 10, "n_special": 10}
    cases = [
        ({**small, "pattern": None}, "needs tiktoken_pattern v1 or v2"),
        ({**small, "specials": ["<s>", "</s>"]}, "must include <unk>"),
        ({**small, "specials": ["<unk>", "<s>", "</s>", "<s>"]}, "lists a token twice"),
        ({"vocab_size": n + 10, "n_special": 2}, "at least the 3 special tokens"),
        ({"vocab_size": n + 100, "n_special": 10}, f"set vocab_size to {n + 10} or less"),
        ({}, f"needs {2 ** 17 - 1000}"),                       # Megatron's 2**17 default
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            tik(js, **kwargs)
    broken = tmp_path / "broken.tiktoken"
    broken.write_text(Path(text).read_text().replace(" 5\n", " 500\n"))
    with pytest.raises(ConfigError, match="broken.tiktoken: the ranks must be 0..n-1"):
        tik(str(broken), vocab_size=300, n_special=10)
    short = tmp_path / "short.json"
    short.write_text(json.dumps(json.loads(Path(js).read_text())[1:]))
    with pytest.raises(ConfigError, match="short.json: entry 0"):
        tik(str(short), vocab_size=300, n_special=10)
    with pytest.raises(ConfigError, match="not a directory"):
        tik(str(tmp_path), vocab_size=300, n_special=10)


def test_tiktoken_knobs_reach_the_data(tmp_path):
    js, _, n = vocab_files(tmp_path)
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in helpers.texts(30)])
    common = ["dataset_type=hf", f"hf_train_files={src}", "tokenizer_type=TikTokenizer",
              f"tokenizer_model={js}", "packing=true", "add_bos=false"]
    data = training_data(config(*common, "tiktoken_pattern=v2", f"vocab_size={n + 16}",
                                "tiktoken_num_special_tokens=16"))
    assert data.vocab_size == n + 16 and data.eod == 2
    toks = data.samples.arrays["tokens"][data.samples.arrays["segment_ids"] > 0]
    assert toks.min() == 2 and toks[toks != 2].min() >= 16   # EOD, then shifted ordinary ids
    other = training_data(config(*common, "tiktoken_pattern=v2", f"vocab_size={n + 16}",
                                 "tiktoken_num_special_tokens=16",
                                 "tiktoken_special_tokens=[<s>,</s>,<unk>]"))
    assert other.eod == 1
    with pytest.raises(ConfigError, match="tiktoken_pattern"):
        training_data(config(*common, f"vocab_size={n + 16}", "tiktoken_num_special_tokens=16"))
    # the preprocessor takes the same settings
    out = tmp_path / "out"
    assert preprocess.main(["--input", str(src), "--tokenizer-type", "TikTokenizer",
                            "--tokenizer", js, "--tiktoken-pattern", "v2",
                            "--tiktoken-num-special-tokens", "16", "--vocab-size", str(n + 16),
                            "--append-eod", "--output-prefix", str(out)]) == 0
    ds = IndexedDataset(f"{out}_text_document")
    first = load_tokenizer("TikTokenizer", js, vocab_size=n + 16, tiktoken_pattern="v2",
                           tiktoken_num_special_tokens=16).encode(helpers.texts(30)[0])
    assert np.array_equal(ds.get(0), first + [2])
