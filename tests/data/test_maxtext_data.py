"""MaxText data keys: tokenizer_type spellings, add_bos/add_eos, use_truncation, token-id
columns (tokenize_*_data), eval columns and hf validation splits, data_shuffle_seed and
enable_data_shuffling, and a MaxText data file that loads unchanged."""
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import grain_files
from jaxtrain.data.batches import global_batches
from jaxtrain.data.sources import training_data, validation_data
from jaxtrain.data.tokenizers import build_tokenizer, llama3_special_tokens
from jaxtrain.train_config import TrainConfig
from tests.data import helpers
from tests.data.test_pipeline import BASE, config, take

BOS, EOS = 1, 0      # the test tokenizer's <unk> serves as its BOS; EOD is id 0


def ids(text):
    return [helpers.WORDS.index(w) + 2 for w in text.split()]


def hf_dir(tmp_path, bos=True):
    """The word tokenizer as an AutoTokenizer folder, with a BOS token (<unk>, id 1)."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / ("tok_bos" if bos else "tok")
    fast = PreTrainedTokenizerFast(tokenizer_object=helpers.word_tokenizer(), eos_token=helpers.EOD,
                                   unk_token="<unk>", **({"bos_token": "<unk>"} if bos else {}))
    fast.save_pretrained(str(path))
    return str(path)


def docs_of(data):
    """The documents of packed/padded rows: the tokens of each segment."""
    a = data.samples.arrays
    out = []
    for toks, segs in zip(a["tokens"], a["segment_ids"]):
        for s in range(1, int(segs.max()) + 1):
            out.append(toks[segs == s].tolist())
    return out


def hf(tmp_path, rows, *extra, field="text"):
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{field: r} for r in rows])
    return config("dataset_type=hf", f"hf_train_files={src}", f"tokenizer_model={hf_dir(tmp_path)}",
                  "enable_data_shuffling=false", *extra)


def test_add_bos_and_add_eos_frame_each_document(tmp_path):
    texts = ["the cat", "a dog ran", "fox"]
    framed = docs_of(training_data(hf(tmp_path, texts)))                    # both default true
    assert sorted(framed) == sorted([BOS] + ids(t) + [EOS] for t in texts)
    no_bos = docs_of(training_data(hf(tmp_path, texts, "add_bos=false")))
    assert sorted(no_bos) == sorted(ids(t) + [EOS] for t in texts)
    bare = training_data(hf(tmp_path, texts, "add_bos=false", "add_eos=false"))
    assert sorted(docs_of(bare)) == sorted(ids(t) for t in texts)          # nothing between
    assert BOS not in bare.samples.arrays["tokens"][bare.samples.arrays["segment_ids"] > 0]
    # a tokenizer without a BOS token gets none; padding rows frame documents too
    src = helpers.write_jsonl(tmp_path / "e.jsonl", [{"text": t} for t in texts])
    plain = training_data(config("dataset_type=hf", f"hf_train_files={src}", "packing=false",
                                 f"tokenizer_model={hf_dir(tmp_path, bos=False)}"))
    assert sorted(docs_of(plain)) == sorted(ids(t) + [EOS] for t in texts)


def test_use_truncation_cuts_or_chunks_long_documents(tmp_path, write):
    long = " ".join(helpers.WORDS)                   # 14 words; a sample holds 9 tokens
    hf_cut = docs_of(training_data(hf(tmp_path, [long])))
    assert hf_cut == [[BOS] + ids(long)[:7] + [EOS]]          # hf keeps BOS and EOS
    chunks = docs_of(training_data(hf(tmp_path, [long], "use_truncation=false")))
    assert sum(chunks, []) == [BOS] + ids(long) + [EOS] and [len(c) for c in chunks] == [9, 7]
    ar = tmp_path / "d.array_record"
    from tests.data.test_grain import write_arrayrecord
    write_arrayrecord(ar, [grain_files.make_example({"text": long})])
    grain = ["dataset_type=grain", f"grain_train_files={ar}", f"tokenizer_model={hf_dir(tmp_path)}"]
    assert docs_of(training_data(config(*grain))) == [([BOS] + ids(long))[:9]]   # EOS cut off
    whole = docs_of(training_data(config(*grain, "use_truncation=false")))
    assert sum(whole, []) == [BOS] + ids(long) + [EOS]


def test_token_id_columns(tmp_path):
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"ids": d} for d in docs])
    common = ["dataset_type=hf", f"hf_train_files={src}", "train_data_columns=ids",
              "vocab_size=50", "enable_data_shuffling=false"]
    data = training_data(config(*common, "tokenize_train_data=false"))
    assert sorted(docs_of(data)) == sorted(docs) and data.vocab_size == 50   # no BOS/EOS added
    with pytest.raises(ConfigError, match="set tokenize_train_data: false"):
        training_data(config(*common, f"tokenizer_model={hf_dir(tmp_path)}"))
    text = helpers.write_jsonl(tmp_path / "t.jsonl", [{"ids": "the cat"}])
    with pytest.raises(ConfigError, match="holds text, and tokenize_train_data is false"):
        training_data(config("dataset_type=hf", f"hf_train_files={text}", "vocab_size=50",
                             "train_data_columns=[ids]", "tokenize_train_data=false"))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"ids": docs}), str(tmp_path / "d.parquet"))
    from tests.data.test_grain import write_arrayrecord
    write_arrayrecord(tmp_path / "d.array_record",
                      [grain_files.make_example({"ids": d}) for d in docs])
    for ftype, glob in (("parquet", "d.parquet"), ("arrayrecord", "d.array_record")):
        grain = ["dataset_type=grain", f"grain_train_files={tmp_path / glob}", "vocab_size=50",
                 f"grain_file_type={ftype}", "train_data_columns=[ids]"]
        got = training_data(config(*grain, "tokenize_train_data=false"))
        assert sorted(docs_of(got)) == sorted(docs), ftype
        with pytest.raises(ConfigError, match="set tokenize_train_data: false"):
            training_data(config(*grain, f"tokenizer_model={hf_dir(tmp_path)}"))


def test_hf_splits_and_eval_columns(tmp_path):
    ds = tmp_path / "ds"
    ds.mkdir()
    helpers.write_jsonl(ds / "train-00000.jsonl", [{"text": "the cat", "ids": [3]}] * 4)
    helpers.write_jsonl(ds / "validation.jsonl", [{"text": "a fox", "ids": [4, 5]}] * 2)
    common = ["dataset_type=hf", f"hf_path={ds}", "hf_data_dir=",
              f"tokenizer_model={hf_dir(tmp_path)}", "add_bos=false"]
    train = training_data(config(*common))                        # train_split "train" only
    assert sorted(set(sum(docs_of(train), []))) == sorted(ids("the cat") + [EOS])
    assert validation_data(config(*common)) is None              # no hf_eval_split/files
    [valid] = validation_data(config(*common, "hf_eval_split=validation"))
    assert docs_of(valid) == [ids("a fox") + [EOS]] * 2
    [valid] = validation_data(config(*common, f"hf_eval_files={ds / 'validation.jsonl'}",
                                     "eval_data_columns=[ids]", "tokenize_eval_data=false"))
    assert docs_of(valid) == [[4, 5]] * 2
    swapped = training_data(config(*common, "train_split=validation"))
    assert sorted(set(sum(docs_of(swapped), []))) == sorted(ids("a fox") + [EOS])
    with pytest.raises(ConfigError, match="no file of split 'test'.*set hf_eval_split"):
        validation_data(config(*common, "hf_eval_split=test"))


def test_data_shuffle_seed_and_enable_data_shuffling(tmp_path):
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in helpers.texts(80)])
    tok = hf_dir(tmp_path)

    def first(*extra):
        cfg = load_config(None, [*BASE, "framework=maxtext", "num_query_groups=2",
                                 "dataset_type=hf",
                                 f"hf_train_files={src}", f"tokenizer_model={tok}", *extra],
                          world_size=1, enforce_status=False)
        data = training_data(cfg)
        batch = next(global_batches(data, TrainConfig.from_config(cfg), seed=cfg["seed"]))
        return data, batch["tokens"]

    data, base = first()
    assert data.seed == 0 and data.dataloader_type == "cyclic"   # MaxText's data_shuffle_seed
    assert np.array_equal(base, first("seed=9")[1])                # the model seed: no
    assert not np.array_equal(base, first("data_shuffle_seed=3")[1])
    ordered, tokens = first("enable_data_shuffling=false")
    assert ordered.dataloader_type == "single"
    assert np.array_equal(tokens.reshape(-1, tokens.shape[-1]),
                          ordered.samples.arrays["tokens"][:4, :-1])
    # other dialects: seed orders, unless data_shuffle_seed is chosen
    mock = ["mock_data=true", "vocab_size=50"]
    assert training_data(config(*mock)).seed is None
    assert training_data(config(*mock, "data_shuffle_seed=4")).seed == 4


def test_maxtext_tokenizer_types(tmp_path):
    from tests.data.test_megatron_tokenizers import sp_model
    from tests.data.test_tiktoken import vocab_files

    def tok(*extra, maxtext=True):
        dialect = ["framework=maxtext", "num_query_groups=2"] if maxtext else []
        return build_tokenizer(load_config(None, [*BASE, *dialect, *extra], world_size=1))

    folder = hf_dir(tmp_path)
    for extra in ([], ["tokenizer_type=huggingface"]):
        for maxtext in (True, False):
            t = tok(f"tokenizer_path={folder}", *extra, maxtext=maxtext)
            assert (t.bos, t.eod, t.encode("the cat")) == (BOS, EOS, ids("the cat"))
    assert tok("tokenizer_path=") is None            # MaxText's empty path: no tokenizer
    path, sp = sp_model(tmp_path)
    for extra in ([], ["tokenizer_type=sentencepiece"]):            # MaxText's default type
        t = tok(f"tokenizer_path={path}", *extra)
        assert (t.vocab_size, t.bos, t.eod, t.encode("the cat")) == (len(sp), 1, 2,
                                                                      sp.encode("the cat"))
    _, text, n = vocab_files(tmp_path)
    t = tok(f"tokenizer_path={text}", "tokenizer_type=tiktoken")
    specials = llama3_special_tokens()
    assert len(specials) == 256 and specials[9] == "<|eot_id|>"
    assert (t.vocab_size, t.bos, t.eod) == (n + 256, n, n + 1)
    assert t.decode(t.encode("the cat sat")) == "the cat sat"
    assert max(t.encode("<|end_of_text|>")) < n      # special text stays ordinary text
    with pytest.raises(ConfigError, match="tokenizer_type"):
        tok("tokenizer_type=wordpiece")


def test_maxtext_data_file_loads_unchanged(tmp_path, write):
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in helpers.texts(20)])
    path = write("maxtext.yml", f"""
        dataset_type: hf
        hf_path: ''
        hf_data_dir: ''
        hf_train_files: {src}
        hf_eval_split: ''
        hf_access_token: ''
        hf_name: ''
        tokenizer_type: huggingface
        tokenizer_path: {hf_dir(tmp_path)}
        add_bos: true
        add_eos: true
        use_truncation: true
        tokenize_train_data: true
        tokenize_eval_data: true
        train_data_columns: ['text']
        eval_data_columns: ['text']
        enable_data_shuffling: true
        data_shuffle_seed: 0
        expansion_factor_real_data: -1
        colocated_python_data_input: false
        max_target_length: 8
    """)
    cfg = load_config(path, world_size=1)
    assert cfg["seq_length"] == 8 and cfg["tokenizer_type"] == "huggingface"
    data = training_data(cfg)
    assert data.samples.arrays["tokens"].shape[1] == 9
    assert (data.samples.arrays["tokens"][:, 0] == BOS).all()     # every row starts a document
    warned = load_config(path, ["hf_access_token=hf_x"], world_size=1)
    assert any("hf_access_token" in w for w in warned.warnings)
    assert load_config(path, ["eval_per_device_batch_size=4"],
                       world_size=1)["eval_per_device_batch_size"] == 4


def test_num_epoch_ends_the_run_when_the_data_runs_out(tmp_path):
    """MaxText's num_epoch caps the steps at num_epoch passes over hf/grain data: by default
    (1) in MaxText configs, when set elsewhere; synthetic data and Megatron configs run on."""
    from jaxtrain.loop import total_steps

    def steps(*extra):
        cfg = hf(tmp_path, helpers.texts(60), "train_iters=1000", *extra)
        data = training_data(cfg)
        return total_steps(TrainConfig.from_config(cfg), data.num_samples), data.num_samples

    plain, n = steps()                               # a Megatron-style config: no cap
    assert plain == 1000 and n // 4 < 1000           # GBS 4
    assert steps("num_epoch=2")[0] == 2 * n // 4
    assert steps("framework=maxtext", "num_query_groups=2")[0] == n // 4
    with pytest.raises(ConfigError, match="num_epoch .* must be at least 1"):
        steps("num_epoch=0")


@pytest.mark.parametrize("fit", ["first", "best"])
def test_max_docs_packs_as_grain_max_sequences_per_bin(fit):
    """pack's document cap against grain's own first/best-fit packers with
    max_sequences_per_bin (enough bins that grain never flushes, bins in order)."""
    import grain
    from grain.experimental import BestFitPackIterDataset, FirstFitPackIterDataset

    from jaxtrain.data import text_files

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, rng.integers(1, 7)).tolist() for _ in range(60)]
    packer = FirstFitPackIterDataset if fit == "first" else BestFitPackIterDataset
    for cap in (2, 3, None):
        ours = text_files.pack(docs, 16, fit, cap)
        rows = list(packer(grain.MapDataset.source(
            [{"inputs": np.asarray(d, np.int32)} for d in docs]).to_iter_dataset(),
            length_struct={"inputs": 16}, num_packing_bins=len(docs), shuffle_bins=False,
            max_sequences_per_bin=cap))
        assert np.array_equal(ours["tokens"], np.stack([r["inputs"] for r in rows])), cap
        assert np.array_equal(ours["segment_ids"],
                              np.stack([r["inputs_segment_ids"] for r in rows])), cap
        most = ours["segment_ids"].max()
        assert (most == cap) if cap else (most > 3)                   # the cap binds
    assert text_files.pack(docs, 16, fit, -1)["segment_ids"].max() > 3     # <= 0: no cap


def test_max_segments_per_seq_caps_hf_packing(tmp_path):
    texts = helpers.texts(60, seed=1)
    longer = ("seq_length=32", "max_position_embeddings=64")
    free = training_data(hf(tmp_path, texts, *longer))
    capped = training_data(hf(tmp_path, texts, *longer, "max_segments_per_seq=2"))
    assert free.samples.arrays["segment_ids"].max() > 2
    assert capped.samples.arrays["segment_ids"].max() == 2
    assert sorted(docs_of(capped)) == sorted(docs_of(free))        # the same documents
    assert len(capped.samples) > len(free.samples)


def test_synthetic_rows_carry_maxtext_packed_segments():
    """MaxText's synthetic data with packing: each row holds 2..max_segments_per_seq
    attention segments, positions do not restart, every target counts."""
    base = ("dataset_type=synthetic", "vocab_size=64", "seq_length=32",
            "max_position_embeddings=64", "packing=true")
    cfg = config(*base, "max_segments_per_seq=5")
    data = training_data(cfg)
    seg = data.samples.arrays["segment_ids"][:, :-1]
    counts = seg.max(axis=1)
    assert set(counts.tolist()) == {2, 3, 4, 5}
    assert (seg[:, 0] == 1).all() and set(np.diff(seg, axis=1).ravel().tolist()) == {0, 1}
    plain = [training_data(config(*base[:-1], "packing=false", "max_segments_per_seq=5")),
             training_data(config(*base))]                             # -1: no segments
    for other in plain:
        assert np.array_equal(other.samples, data.samples.arrays["tokens"])   # same tokens
    batch = take(data, cfg, 2)[1]
    T = 32
    assert batch["segment_ids"].shape == (2, 2, T)           # M x (micro batch x DP)
    rows = batch["segment_ids"].reshape(-1, T)
    assert ((rows.max(axis=1) >= 2) & (rows.max(axis=1) <= 5)).all()
    assert (batch["positions"] == np.arange(T)).all()
    assert (batch["loss_mask"] == 1).all()
    for other, c in zip(plain, (config(*base[:-1], "packing=false", "max_segments_per_seq=5"),
                                config(*base))):
        b = take(other, c, 1)[0]
        assert "segment_ids" not in b and (b["loss_mask"] == 1).all()   # one sequence a row
    assert validation_data(cfg)[0].samples.arrays["segment_ids"].max() == 5
    mock = training_data(config("mock_data=true", "vocab_size=64", "max_segments_per_seq=5"))
    assert isinstance(mock.samples, np.ndarray)                        # Megatron's: unchanged
