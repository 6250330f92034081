"""Batches from any source: document masks, packing, resume, loader order, tokenizers, files."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import text_files
from jaxtrain.data.batches import TokenData, global_batches, make_batch
from jaxtrain.data.sources import training_data
from jaxtrain.data.tokenizers import load_tokenizer
from jaxtrain.train_config import TrainConfig
from tests.data import helpers

BASE = ["seq_length=8", "max_position_embeddings=16", "micro_batch_size=2",
        "global_batch_size=4", "train_iters=20", "lr_warmup_iters=0", "num_layers=1",
        "hidden_size=16", "num_attention_heads=2"]


def config(*extra):
    return load_config(None, [*BASE, *extra], world_size=1, enforce_status=False)


def take(data, cfg, n, consumed=0):
    it = global_batches(data, TrainConfig.from_config(cfg), seed=cfg["seed"], consumed=consumed)
    return [next(it) for _ in range(n)]


@pytest.fixture
def indexed(tmp_path):
    docs = helpers.random_docs(200, vocab=60, seed=2)
    return helpers.write_indexed(tmp_path / "d", docs), docs


def test_megatron_data_from_config(indexed):
    prefix, docs = indexed
    data = training_data(config(f"data_path={prefix}", "split=100,0,0",
                                "tokenizer_type=NullTokenizer", "vocab_size=60"))
    assert data.vocab_size == 61 and data.eod == 60   # NullTokenizer: ids + EOD
    assert len(data.samples) >= 20 * 4
    stream = set(np.concatenate(docs).tolist())
    assert set(data.samples[0].tolist()) <= stream and len(data.samples[0]) == 9
    assert isinstance(data.samples.indexed._bin, np.memmap)


def test_cache_mmap_and_blend_file_from_config(indexed, tmp_path):
    prefix, _ = indexed
    cache = tmp_path / "cache"
    args = tmp_path / "blend.txt"
    args.write_text(f"0.5 {prefix} 0.5 {prefix}")
    data = training_data(config(f"data_args_path={args}", "split=100,0,0", "vocab_size=60",
                                f"data_cache_path={cache}", "mmap_bin_files=false"))
    assert len(data.samples.datasets) == 2 and len(data.samples) == 80
    assert list(cache.glob("*-GPTDataset-train-shuffle_index.npy"))
    assert list(cache.glob("*-BlendedDataset-train-dataset_index.npy"))
    ds = data.samples.datasets[0].indexed
    assert not isinstance(ds._bin, np.memmap)


def test_document_masks_follow_megatron(indexed):
    prefix, _ = indexed
    row = np.array([[3, 4, 9, 5, 9, 9, 6, 7, 8]])
    flags = dict(eod=9)
    plain = make_batch(row, TokenData(row, 10, "x", **flags), 1)
    assert set(plain) == {"tokens", "targets", "loss_mask"}
    b = make_batch(row, TokenData(row, 10, "x", reset_position_ids=True,
                                  reset_attention_mask=True, eod_mask_loss=True, **flags), 1)
    assert b["tokens"][0, 0].tolist() == [3, 4, 9, 5, 9, 9, 6, 7]
    assert b["segment_ids"][0, 0].tolist() == [1, 1, 1, 2, 2, 3, 4, 4]
    assert b["positions"][0, 0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert b["loss_mask"][0, 0].tolist() == [1, 1, 0, 1, 0, 0, 1, 1]
    only_pos = make_batch(row, TokenData(row, 10, "x", reset_position_ids=True, **flags), 1)
    assert "segment_ids" not in only_pos and "positions" in only_pos
    # the knobs reach the batches through the config
    data = training_data(config(f"data_path={prefix}", "split=100,0,0", "eod_mask_loss=true",
                                "reset_position_ids=true", "reset_attention_mask=true",
                                "tokenizer_type=NullTokenizer", "vocab_size=60"))
    assert (data.eod, data.reset_position_ids, data.reset_attention_mask,
            data.eod_mask_loss) == (60, True, True, True)
    with pytest.raises(ConfigError, match="end-of-document"):
        TokenData(row, 10, "x", eod_mask_loss=True)


def test_resume_from_consumed_samples(indexed):
    prefix, _ = indexed
    for extra in ([], ["reset_attention_mask=true"]):
        cfg = config(f"data_path={prefix}", "split=100,0,0", "tokenizer_type=NullTokenizer",
                     "vocab_size=60", *extra)
        data = training_data(cfg)
        whole = take(data, cfg, 7)
        again = take(training_data(cfg), cfg, 4, consumed=3 * 4)
        for a, b in zip(whole[3:], again):
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[k], b[k]) for k in a)


def test_dataloader_type_and_workers(indexed):
    prefix, _ = indexed
    common = [f"data_path={prefix}", "split=100,0,0", "tokenizer_type=NullTokenizer",
              "vocab_size=60"]
    cfg = config(*common, "dataloader_type=single", "num_workers=0")
    data = training_data(cfg)
    first = take(data, cfg, 2)
    want = np.stack([data.samples[i] for i in range(4)])[:, :-1]
    assert np.array_equal(first[0]["tokens"].reshape(4, -1), want)   # dataset order
    cyc = config(*common, "dataloader_type=cyclic", "num_workers=0")
    assert not np.array_equal(take(training_data(cyc), cyc, 1)[0]["tokens"], first[0]["tokens"])
    threads = config(*common, "dataloader_type=cyclic", "num_workers=3")
    a, b = take(training_data(cyc), cyc, 5), take(training_data(threads), threads, 5)
    assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))


def test_packing_loses_no_token_and_resets():
    rng = np.random.RandomState(0)
    docs = [list(rng.randint(1, 50, rng.randint(1, 30))) for _ in range(100)]
    packed = text_files.pack(docs, 17)
    toks, segs = packed["tokens"], packed["segment_ids"]
    got = sorted(int(t) for t in toks[segs > 0])
    assert got == sorted(int(t) for d in docs for t in d)            # no token lost
    assert (segs > 0).mean() > 0.9                                   # first-fit packs tightly
    for r in range(len(toks)):                                       # each segment is a piece
        for s in set(segs[r][segs[r] > 0].tolist()):
            piece = toks[r][segs[r] == s].tolist()
            assert any(piece == d[i:i + 17] for d in docs for i in range(0, len(d), 17))
    b = make_batch(packed, TokenData(text_files.Rows(packed), 50, "p"), len(toks))
    seg, pos = b["segment_ids"][0], b["positions"][0]
    starts = np.concatenate([np.ones((len(seg), 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
    assert np.all(pos[starts] == 0)
    assert np.all(pos[:, 1:][~starts[:, 1:]] == pos[:, :-1][~starts[:, 1:]] + 1)
    cross = b["segment_ids"][0][:, :] != packed["segment_ids"][:, 1:]
    assert np.all(b["loss_mask"][0][cross] == 0)                     # no cross-document target


@pytest.mark.slow
def test_packed_attention_equals_documents_alone():
    cfg = models.ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                             num_query_groups=2, ffn_hidden_size=64, vocab_size=64,
                             max_position_embeddings=32)
    import jax
    params = models.init(cfg, jax.random.key(0))
    docs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    packed = text_files.pack(docs, 16)
    assert len(packed["tokens"]) == 1
    b = make_batch(packed, TokenData(text_files.Rows(packed), 64, "p"), 1)
    fwd = jax.jit(lambda p, t, pos, seg: models.forward(p, t, cfg, positions=pos,
                                                         segment_ids=seg))
    out = fwd(params, jnp.asarray(b["tokens"][0]), jnp.asarray(b["positions"][0]),
              jnp.asarray(b["segment_ids"][0]))
    start = 0
    for d in docs:
        n = len(d)
        alone = fwd(params, jnp.asarray([d]), jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
        n = min(len(d), 15 - start)
        np.testing.assert_allclose(np.asarray(out[0, start:start + n]),
                                   np.asarray(alone[0, :n]), atol=2e-5)
        start += len(d)


def test_tokenizers(tmp_path):
    hf = load_tokenizer("HuggingFaceTokenizer", helpers.hf_tokenizer_dir(tmp_path / "hf"))
    assert hf.encode("the cat") == [2, 3] and hf.eod == 0
    assert hf.vocab_size == len(helpers.WORDS) + 2
    js = tmp_path / "tokenizer.json"
    helpers.word_tokenizer().save(str(js))
    assert load_tokenizer("HuggingFaceTokenizer", str(js)).encode("dog sat") == [4, 5]
    vocab, merges = helpers.gpt2_files(tmp_path / "gpt2")
    gpt2 = load_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ids = gpt2.encode("the cat sat")
    assert gpt2.decode(ids) == "the cat sat" and gpt2.eod == 0
    null = load_tokenizer("NullTokenizer", vocab_size=100)
    assert null.encode("4 5 6") == [4, 5, 6] and null.eod == 100 and null.vocab_size == 101
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="merge_file is not set"):
        load_tokenizer("GPT2BPETokenizer", vocab_file=vocab)


def test_tokenizer_vocab_reaches_the_model(tmp_path):
    rows = [{"text": t} for t in helpers.texts(50)]
    src = helpers.write_jsonl(tmp_path / "train.jsonl", rows)
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    cfg = config("dataset_type=hf", f"hf_train_files={src}", f"tokenizer_model={tok}",
                 "tokenizer_type=HuggingFaceTokenizer", "make_vocab_size_divisible_by=5")
    data = training_data(cfg)
    assert data.vocab_size == len(helpers.WORDS) + 2
    mc = models.ModelConfig.from_config({**cfg, "vocab_size": data.vocab_size})
    assert mc.vocab_size == 20                         # 16 padded up to a multiple of 5
    vocab, merges = helpers.gpt2_files(tmp_path / "gpt2")
    cfg = config("dataset_type=hf", f"hf_train_files={src}", "tokenizer_type=GPT2BPETokenizer",
                 f"vocab_file={vocab}", f"merge_file={merges}")
    assert training_data(cfg).vocab_size == load_tokenizer(
        "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges).vocab_size


def test_hf_files_packing_and_parquet(tmp_path):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    texts = helpers.texts(60)
    (tmp_path / "ds").mkdir()
    helpers.write_jsonl(tmp_path / "ds" / "a.jsonl", [{"body": t} for t in texts[:30]])
    helpers.write_jsonl(tmp_path / "ds" / "b.jsonl", [{"body": t} for t in texts[30:]])
    common = ["dataset_type=hf", f"tokenizer_model={tok}", "train_data_columns=[body]",
              "use_truncation=false"]
    packed = training_data(config(*common, f"hf_path={tmp_path / 'ds'}", "packing=true"))
    n_tokens = sum(len(t.split()) + 1 for t in texts)
    arrays = packed.samples.arrays
    assert int((arrays["segment_ids"] > 0).sum()) == n_tokens
    padded = training_data(config(*common, f"hf_train_files={tmp_path / 'ds' / '*.jsonl'}",
                                  "packing=false", "use_truncation=true"))
    assert len(padded.samples) == 60 and len(packed.samples) < 60
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"body": texts}), str(tmp_path / "t.parquet"))
    par = training_data(config(*common, f"hf_train_files={tmp_path / 't.parquet'}",
                               "packing=true"))
    assert np.array_equal(par.samples.arrays["tokens"], arrays["tokens"])


def test_pgs_local_dataset(tmp_path, write):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in helpers.texts(40)])
    path = write("pgs.yml", f"""
        model: {{name_or_path: null}}
        data: {{dataset: {src}, packing: true, max_seq_length: 8}}
        train: {{max_steps: 5}}
    """)
    cfg = load_config(path, [f"tokenizer_model={tok}", "micro_batch_size=2",
                             "train.gradient_accumulation_steps=2", "lr_warmup_iters=0"], world_size=1,
                      enforce_status=False)
    data = training_data(cfg)
    assert data.name == "data.dataset" and data.samples.arrays["tokens"].shape[1] == 9


def test_bad_data_configs(tmp_path):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = helpers.write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"txt": "b"}])
    trunc = helpers.write_indexed(tmp_path / "t", helpers.random_docs(5))
    (tmp_path / "t.idx").write_bytes((tmp_path / "t.idx").read_bytes()[:-4])
    cases = [
        ([f"data_path={tmp_path / 'nope'}", "vocab_size=10"], "nope.idx does not exist"),
        ([f"data_path={trunc}", "vocab_size=10"], "t.idx: truncated index"),
        (["dataset_type=hf", f"hf_train_files={empty}", f"tokenizer_model={tok}"],
         "empty.jsonl: the file holds no rows"),
        (["dataset_type=hf", f"hf_train_files={bad}", f"tokenizer_model={tok}"],
         "bad.jsonl:2: the row has no 'text'"),
        (["dataset_type=hf", f"hf_train_files={bad}", f"tokenizer_model={tmp_path / 'x'}"],
         "does not exist"),
        (["dataset_type=hf", f"hf_path={tmp_path / 'nothing'}", f"tokenizer_model={tok}"],
         "no such local file"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            training_data(config(*extra))


def test_bad_data_exits_2(tmp_path, write, cli):
    path = write("run.yml", f"""
        data_path: {tmp_path / 'missing'}
        vocab_size: 32
        train_iters: 2
        lr_warmup_iters: 0
        seq_length: 8
        global_batch_size: 2
        micro_batch_size: 1
        hardware: cpu
        workspace: {tmp_path}
    """)
    code, _, err = cli(path)
    assert code == 2 and "data_path: " in err and "missing.bin does not exist" in err


@pytest.mark.slow
def test_training_on_indexed_data_runs(indexed, tmp_path):
    from jaxtrain import loop
    prefix, _ = indexed
    cfg = config(f"data_path={prefix}", "split=100,0,0", "tokenizer_type=NullTokenizer",
                 "vocab_size=60", "train_iters=2", "reset_attention_mask=true",
                 "reset_position_ids=true", "eod_mask_loss=true", f"workspace={tmp_path}",
                 "exp_name=run", "bf16=false")
    row = loop.train(cfg)
    assert row["step"] == 2 and np.isfinite(row["loss"])


def test_a_model_files_larger_vocabulary_wins_over_the_tokenizers(tmp_path):
    """MaxText model files and Hugging Face configs size the embedding themselves (Qwen3:
    151,936 rows for 151,669 tokens); a vocab_size smaller than the tokenizer yields to it."""
    src = helpers.write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in helpers.texts(20)])
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    common = ["dataset_type=hf", f"hf_train_files={src}", f"tokenizer_model={tok}",
              "tokenizer_type=HuggingFaceTokenizer"]
    assert training_data(config(*common, "vocab_size=40")).vocab_size == 40
    assert training_data(config(*common, "vocab_size=3")).vocab_size == len(helpers.WORDS) + 2
