"""Megatron indexed files, GPT sample indexing, splits, blends, caches and preprocessing."""
import struct

import numpy as np
import pytest

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import gpt_dataset as gd
from jaxtrain.data import preprocess
from jaxtrain.data.indexed import IndexedDataset
from tests.data import helpers


def test_golden_idx_written_byte_by_byte(tmp_path):
    docs = [[5, 6, 7], [300, 1], [9]]
    prefix = str(tmp_path / "golden")
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(struct.pack(f"<{len(d)}H", *d))           # uint16 tokens
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))                        # version
        f.write(struct.pack("<B", 8))                        # dtype code 8 = uint16
        f.write(struct.pack("<Q", 3))                        # sequences
        f.write(struct.pack("<Q", 4))                        # document indices (docs + 1)
        f.write(struct.pack("<3i", 3, 2, 1))                 # sizes
        f.write(struct.pack("<3q", 0, 6, 10))                # byte pointers
        f.write(struct.pack("<4q", 0, 1, 2, 3))              # document indices
    for mmap in (True, False):
        ds = IndexedDataset(prefix, mmap=mmap)
        assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 3
        assert [ds[i].tolist() for i in range(3)] == docs
        assert ds.get(0, 1, 2).tolist() == [6, 7]


def test_builder_writes_the_same_bytes(tmp_path):
    helpers.write_indexed(tmp_path / "a", [[5, 6, 7], [300, 1], [9]])
    raw = (tmp_path / "a.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and raw[17] == 8
    assert struct.unpack("<3q", raw[34 + 12:34 + 36]) == (0, 6, 10)


def test_preprocessor_round_trip(tmp_path):
    tok_dir = helpers.hf_tokenizer_dir(tmp_path / "tok")
    rows = [{"text": t, "id": i} for i, t in enumerate(helpers.texts(300))]
    rows.insert(5, {"text": ""})                             # empty documents are skipped
    src = helpers.write_jsonl(tmp_path / "in.jsonl", rows)
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        assert preprocess.main(["--input", str(src), "--tokenizer", tok_dir, "--output-prefix",
                                str(out), "--append-eod", "--workers", str(workers)]) == 0
        ds = IndexedDataset(f"{out}_text_document")
        tok = helpers.word_tokenizer()
        want = [tok.encode(r["text"]).ids + [0] for r in rows if r["text"]]
        assert len(ds) == len(want) == ds.num_documents
        assert all(ds[i].tolist() == w for i, w in enumerate(want))
        assert ds.dtype == np.uint16


def _reference_sample_index(sizes, doc_index, seq_length, num_samples):
    """Megatron's C++ build_sample_idx, transcribed."""
    out = [(0, 0)]
    d, off = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            doc_len = sizes[doc_index[d]] - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                d, off = d + 1, 0
        out.append((d, off))
    return np.array(out)


def test_sample_index_matches_megatron_and_samples_span_documents(tmp_path):
    docs = helpers.random_docs(40, seed=1)
    prefix = helpers.write_indexed(tmp_path / "d", docs)
    ds = gd.GPTDataset(IndexedDataset(prefix), np.arange(40), 7, None, seed=3)
    sizes = [len(d) for d in docs]
    total = sum(sizes)
    n = (total - 1) // 7
    assert np.array_equal(ds.sample_index, _reference_sample_index(sizes, ds.document_index, 7, n))
    stream = np.concatenate([docs[i] for i in ds.document_index])
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds[i].tolist() == stream[j * 7:j * 7 + 8].tolist()
    assert sorted(ds.document_index.tolist()) == list(range(40))  # one epoch, shuffled
    assert ds.document_index.tolist() != list(range(40))
    other = gd.GPTDataset(IndexedDataset(prefix), np.arange(40), 7, None, seed=4)
    assert other.document_index.tolist() != ds.document_index.tolist()


def test_epochs_and_separate_last_epoch(tmp_path):
    docs = helpers.random_docs(20, lo=10, hi=11)             # 200 tokens, 39 samples / epoch
    prefix = helpers.write_indexed(tmp_path / "d", docs)
    ds = gd.GPTDataset(IndexedDataset(prefix), np.arange(20), 5, 45, seed=0)
    assert len(ds.document_index) == 40 and len(ds) >= 45     # two epochs
    first, last = ds.document_index[:20], ds.document_index[20:]
    assert sorted(first) == sorted(last) == list(range(20))  # last epoch shuffled apart
    sans = (200 - 1) // 5
    assert sorted(ds.shuffle_index[:sans].tolist()) == list(range(sans))


def test_index_cache(tmp_path, monkeypatch):
    prefix = helpers.write_indexed(tmp_path / "d", helpers.random_docs(30))
    cache = tmp_path / "cache"
    a = gd.GPTDataset(IndexedDataset(prefix), np.arange(30), 4, 50, 1, str(cache))
    assert len(list(cache.glob("*-GPTDataset-train-*.npy"))) == 3
    monkeypatch.setattr(gd.GPTDataset, "_build", lambda *a: pytest.fail("not cached"))
    b = gd.GPTDataset(IndexedDataset(prefix), np.arange(30), 4, 50, 1, str(cache))
    assert np.array_equal(a.shuffle_index, b.shuffle_index) and a[3].tolist() == b[3].tolist()


def test_split_boundaries_exact(tmp_path):
    assert gd.split_boundaries(gd.parse_split("99,1,0"), 1000) == [0, 990, 1000, 1000]
    assert gd.split_boundaries(gd.parse_split("969, 30, 1"), 1001) == [0, 970, 1000, 1001]
    docs = [np.full(5, i + 1) for i in range(100)]           # document i holds token i + 1
    prefix = helpers.write_indexed(tmp_path / "d", docs)
    out = gd.build_datasets(seq_length=4, seed=0, num_samples=[None] * 3, data_path=prefix,
                            split="90,7,3")
    for name, (lo, hi) in zip(gd.SPLITS, [(0, 90), (90, 97), (97, 100)]):
        seen = {int(t) - 1 for i in range(len(out[name])) for t in out[name][i]}
        assert seen == set(range(lo, hi)), name
    assert gd.build_datasets(seq_length=4, seed=0, num_samples=[None] * 3, data_path=prefix,
                             split="100,0,0")["valid"] is None


def test_blend_weights_within_two_percent(tmp_path):
    a = helpers.write_indexed(tmp_path / "a", helpers.random_docs(200, value=1))
    b = helpers.write_indexed(tmp_path / "b", helpers.random_docs(200, value=2))
    c = helpers.write_indexed(tmp_path / "c", helpers.random_docs(200, value=3))
    out = gd.build_datasets(seq_length=8, seed=0, num_samples=[10_000, None, None],
                            data_path=f"0.2 {a} 0.3 {b} 0.5 {c}", split="100,0,0")
    train = out["train"]
    assert len(train) == 10_000
    counts = np.bincount([int(train[i][0]) for i in range(10_000)], minlength=4)[1:]
    assert np.all(np.abs(counts / 10_000 - [0.2, 0.3, 0.5]) <= 0.02), counts
    # each part was sized with Megatron's 0.5% margin over its share
    assert len(train.datasets[0]) >= int(np.ceil(np.ceil(10_000 * 0.2) * 1.005))
    assert gd.parse_blend([0.5, "p1", "0.5", "p2"]) == (["p1", "p2"], [0.5, 0.5])


def test_per_split_paths(tmp_path):
    a = helpers.write_indexed(tmp_path / "a", helpers.random_docs(50, value=1))
    b = helpers.write_indexed(tmp_path / "b", helpers.random_docs(50, value=2))
    out = gd.build_datasets(seq_length=8, seed=0, num_samples=[None] * 3, train_data_path=[a],
                            valid_data_path=b)
    assert set(out["train"][0].tolist()) == {1} and set(out["valid"][0].tolist()) == {2}
    assert out["test"] is None


def test_bad_indexed_inputs(tmp_path):
    with pytest.raises(ConfigError, match="missing.idx does not exist"):
        IndexedDataset(str(tmp_path / "missing"))
    prefix = helpers.write_indexed(tmp_path / "t", helpers.random_docs(10))
    raw = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(raw[:-9])
    with pytest.raises(ConfigError, match=r"t\.idx: truncated index"):
        IndexedDataset(prefix)
    (tmp_path / "t.idx").write_bytes(raw[:20])
    with pytest.raises(ConfigError, match="truncated index"):
        IndexedDataset(prefix)
    (tmp_path / "t.idx").write_bytes(b"XXXXXXXXX" + raw[9:])
    with pytest.raises(ConfigError, match="bad magic"):
        IndexedDataset(prefix)


def test_preprocessor_bad_inputs(tmp_path, capsys):
    tok_dir = helpers.hf_tokenizer_dir(tmp_path / "tok")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad = helpers.write_jsonl(tmp_path / "bad.jsonl", [{"text": "a cat"}, {"body": "x"}])
    cases = [(["--input", str(empty), "--tokenizer", tok_dir], "empty.jsonl: the file holds "
              "no JSON rows"),
             (["--input", str(bad), "--tokenizer", tok_dir], "bad.jsonl:2: the row has no "
              "'text' field"),
             (["--input", str(bad), "--tokenizer", str(tmp_path / "nope")], "nope' does not "
              "exist")]
    for args, message in cases:
        assert preprocess.main([*args, "--output-prefix", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
