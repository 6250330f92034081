"""MaxText dataset_type grain: ArrayRecord / Parquet / TFRecord documents, mixtures, packing
types, resume, validation files, bad input, and a short CLI training run."""
import json

import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import grain_files
from jaxtrain.data.batches import global_batches
from jaxtrain.data.sources import training_data, validation_data
from jaxtrain.train_config import TrainConfig
from tests.data import helpers
from tests.data.test_pipeline import config, take

ArrayRecordWriter = pytest.importorskip(
    "array_record.python.array_record_module").ArrayRecordWriter


def write_arrayrecord(path, records):
    w = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(r)
    w.close()
    return path


def examples(texts, field="text"):
    return [grain_files.make_example({field: t, "id": [i]}) for i, t in enumerate(texts)]


def ids(text):
    """Token ids of the word tokenizer (EOD 0, <unk> 1, then the WORDS)."""
    return [helpers.WORDS.index(w) + 2 for w in text.split()]


def grain(tmp_path, *extra):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    return config("dataset_type=grain", f"tokenizer_model={tok}", *extra)


def real_tokens(data):
    a = data.samples.arrays
    return a["tokens"][a["segment_ids"] > 0].tolist()


def test_example_records_read_back_exactly(tmp_path):
    texts = helpers.texts(30)
    write_arrayrecord(tmp_path / "a-00000.array_record", examples(texts[:15]))
    write_arrayrecord(tmp_path / "a-00001.array_record", examples(texts[15:]))
    got = list(grain_files.read_texts(grain_files.find_files(
        str(tmp_path / "a-*.array_record"), "grain_train_files"), "arrayrecord", "text"))
    assert got == texts
    # the message classes are wire-compatible with tf.train.Example: a hand-written record
    # (Example{features{feature{key: "text", value{bytes_list{value: "hi"}}}}}) decodes
    feature = b"\x0a\x04\x0a\x02hi"                   # Feature.bytes_list{value: "hi"}
    entry = b"\x0a\x04text\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    assert grain_files.record_text(b"\x0a" + bytes([len(features)]) + features, "text",
                                   "r") == "hi"
    # plain text and JSON records are documents too
    assert grain_files.record_text(b"the cat", "text", "r") == "the cat"
    assert grain_files.record_text(b'{"body": "a fox"}', "body", "r") == "a fox"


def test_grain_files_pack_like_hf_files(tmp_path):
    texts = helpers.texts(40)
    write_arrayrecord(tmp_path / "d.array_record", examples(texts, field="body"))
    helpers.write_jsonl(tmp_path / "d.jsonl", [{"body": t} for t in texts])
    common = ("train_data_columns=[body]", "packing=true", "use_truncation=false")
    ar = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/*.array_record", *common))
    hf = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/*.array_record", *common,
                             "dataset_type=hf", f"hf_train_files={tmp_path}/d.jsonl"))
    assert ar.name == "dataset_type grain" and hf.name == "dataset_type hf"
    assert np.array_equal(ar.samples.arrays["tokens"], hf.samples.arrays["tokens"])
    assert np.array_equal(ar.samples.arrays["segment_ids"], hf.samples.arrays["segment_ids"])
    # every token and an EOD after each document, nothing else
    assert sorted(real_tokens(ar)) == sorted(sum((ids(t) + [0] for t in texts), []))
    assert ar.eod == 0 and ar.num_workers == 1            # grain_worker_count's default
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"body": texts, "n": list(range(40))}), str(tmp_path / "d.parquet"))
    par = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/*.parquet",
                              "grain_file_type=parquet", "grain_worker_count=3", *common))
    assert np.array_equal(par.samples.arrays["tokens"], ar.samples.arrays["tokens"])
    assert par.num_workers == 3
    (tmp_path / "d.tfrecord").write_bytes(grain_files.tfrecord_bytes(examples(texts, "body")))
    tfr = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/*.tfrecord",
                              "grain_file_type=tfrecord", *common))
    assert np.array_equal(tfr.samples.arrays["tokens"], ar.samples.arrays["tokens"])


def test_packing_types(tmp_path):
    texts = helpers.texts(60, seed=3)
    write_arrayrecord(tmp_path / "d.array_record", examples(texts))
    want = sorted(sum((ids(t) + [0] for t in texts), []))
    rows = {}
    for kind in ("first_fit", "best_fit", "concat_then_split"):
        data = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/d.array_record",
                                   f"grain_packing_type={kind}", "use_truncation=false"))
        assert sorted(real_tokens(data)) == want, kind          # no token lost
        rows[kind] = data.samples.arrays
    cts = rows["concat_then_split"]
    stream = sum((ids(t) + [0] for t in texts), [])
    flat = cts["tokens"].ravel()[:len(stream)].tolist()
    assert flat == stream                                       # documents end to end
    assert (cts["segment_ids"][:-1] > 0).all()                  # only the last row pads
    assert not np.array_equal(rows["first_fit"]["tokens"], rows["best_fit"]["tokens"])
    padded = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/d.array_record",
                                 "packing=false"))
    assert len(padded.samples) == 60


def test_max_segments_per_seq_caps_first_fit_only(tmp_path):
    """MaxText hands max_segments_per_seq to grain's first_fit packer only; its best_fit and
    concat_then_split packers take no cap."""
    write_arrayrecord(tmp_path / "d.array_record", examples(helpers.texts(60, seed=3)))
    most = {}
    for kind in ("first_fit", "best_fit", "concat_then_split"):
        for cap in (-1, 2):
            data = training_data(grain(tmp_path, f"grain_train_files={tmp_path}/d.array_record",
                                       f"grain_packing_type={kind}", "use_truncation=false",
                                       "seq_length=32", "max_position_embeddings=64",
                                       f"max_segments_per_seq={cap}"))
            most[kind, cap] = int(data.samples.arrays["segment_ids"].max())
    assert most["first_fit", 2] == 2 and most["first_fit", -1] > 2
    assert most["best_fit", 2] == most["best_fit", -1] > 2
    assert most["concat_then_split", 2] == most["concat_then_split", -1] > 2


def test_mixture_weights_hold(tmp_path):
    write_arrayrecord(tmp_path / "cats.array_record", examples(["the cat"] * 200))
    write_arrayrecord(tmp_path / "dogs.array_record", examples(["a dog"] * 100))
    spec = f"{tmp_path}/cats.array_record,0.25;{tmp_path}/dogs.array_record,0.75"
    data = training_data(grain(tmp_path, f"grain_train_files={spec}"))
    toks = real_tokens(data)
    cats, dogs = toks.count(ids("cat")[0]), toks.count(ids("dog")[0])
    assert cats + dogs == 300 and abs(dogs / 300 - 0.75) < 0.02
    mixture = tmp_path / "mix.json"
    mixture.write_text(json.dumps({"c": {"path": str(tmp_path / "cats.array_record"),
                                         "weight": 1}, "d": {"path": str(tmp_path / "d*"),
                                                             "weight": 3}}))
    named = training_data(grain(tmp_path, f"grain_train_mixture_config_path={mixture}"))
    assert np.array_equal(named.samples.arrays["tokens"], data.samples.arrays["tokens"])


def test_resume_and_validation_files(tmp_path):
    write_arrayrecord(tmp_path / "train.array_record", examples(helpers.texts(80)))
    write_arrayrecord(tmp_path / "valid.array_record", examples(["owl saw it"] * 20))
    cfg = grain(tmp_path, f"grain_train_files={tmp_path}/train.array_record",
                f"grain_eval_files={tmp_path}/valid.array_record", "grain_worker_count_eval=0")
    whole = take(training_data(cfg), cfg, 6)
    again = take(training_data(cfg), cfg, 3, consumed=3 * 4)
    for a, b in zip(whole[3:], again):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    tc = TrainConfig.from_config(cfg)          # two processes' rows make the whole batch
    data = training_data(cfg)
    halves = [next(global_batches(data, tc, seed=cfg["seed"], rows=r)) for r in ((0, 1), (1, 2))]
    for k in whole[0]:
        assert np.array_equal(np.concatenate([h[k] for h in halves], axis=1), whole[0][k])
    (valid,) = validation_data(cfg)
    assert valid.name == "grain_eval_files" and valid.num_workers == 0
    assert set(real_tokens(valid)) == set(ids("owl saw it") + [0])
    assert validation_data(grain(tmp_path, f"grain_train_files={tmp_path}/t*")) is None


def test_bad_grain_input(tmp_path):
    write_arrayrecord(tmp_path / "nofield.array_record", examples(["the cat"], field="body"))
    write_arrayrecord(tmp_path / "ids.array_record",
                      [grain_files.make_example({"text": [3, 4]})])
    write_arrayrecord(tmp_path / "corrupt.array_record", [b"\xff\xfe\x00garbage"])
    (tmp_path / "junk.array_record").write_bytes(b"not an array record file" * 10)
    (tmp_path / "cut.tfrecord").write_bytes(grain_files.tfrecord_bytes([b"the cat"])[:-6])
    cases = [
        (f"grain_train_files={tmp_path}/none-*.array_record", "none-.*: no file matches"),
        (f"grain_train_files={tmp_path}/nofield.array_record",
         "nofield.array_record: record 0: the tf.train.Example has no 'text' feature"),
        (f"grain_train_files={tmp_path}/ids.array_record", "holds token ids"),
        (f"grain_train_files={tmp_path}/corrupt.array_record",
         "corrupt.array_record: record 0: a corrupt or unknown record"),
        (f"grain_train_files={tmp_path}/junk.array_record",
         "junk.array_record: not a readable ArrayRecord file"),
        ("grain_train_files=gs://bucket/c4-*.array_record", "reads local files only"),
        (f"grain_train_files={tmp_path}/ids.array_record;x", "is not 'glob,weight'"),
        ("grain_train_files=", "dataset_type grain needs grain_train_files"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            training_data(grain(tmp_path, extra))
    with pytest.raises(ConfigError, match="cut.tfrecord: record 0: truncated"):
        training_data(grain(tmp_path, f"grain_train_files={tmp_path}/cut.tfrecord",
                            "grain_file_type=tfrecord"))


def test_tfds_and_c4_mlperf_are_refused():
    for kind in ("tfds", "c4_mlperf"):
        with pytest.raises(ConfigError, match=f"dataset_type = '{kind}' is not supported.*"
                                              "TensorFlow.*dataset_type: grain"):
            load_config(None, [f"dataset_type={kind}"], world_size=1)


@pytest.mark.slow
def test_grain_cli_training_run(tmp_path, write, cli):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    write_arrayrecord(tmp_path / "train.array_record", examples(helpers.texts(60)))
    write_arrayrecord(tmp_path / "valid.array_record", examples(helpers.texts(20, seed=1)))
    common = f"""
        tokenizer_path: {tok}
        seq_length: 8
        max_position_embeddings: 8
        num_layers: 1
        hidden_size: 16
        num_attention_heads: 2
        micro_batch_size: 2
        global_batch_size: 4
        train_iters: 2
        lr_warmup_iters: 0
        bf16: false
        eval_interval: 2
        eval_iters: 1
        hardware: cpu
        workspace: {tmp_path}
        exp_name: run
    """
    path = write("run.yml", f"""
        dataset_type: grain
        grain_train_files: {tmp_path}/train.array_record
        grain_eval_files: {tmp_path}/valid.array_record
    """ + common)
    code, _, err = cli(path)
    assert code == 0, err
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert train[-1]["step"] == 2 and np.isfinite(train[-1]["loss"])
    assert any(np.isfinite(r.get("val_loss", np.nan)) for r in rows)   # grain_eval_files
    bad = write("bad.yml", f"""
        dataset_type: grain
        grain_train_files: {tmp_path}/missing-*.array_record
    """ + common)
    code, _, err = cli(bad)
    assert code == 2 and "missing-*.array_record': no file matches" in err
    assert "Traceback" not in err
