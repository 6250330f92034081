"""MaxText dataset_type olmo_grain: OLMo token files through their JSON index."""
import json

import numpy as np
import pytest

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import olmo
from jaxtrain.data.batches import TokenData, make_batch
from jaxtrain.data.sources import training_data, validation_data
from tests.data.test_pipeline import config, take

L = 8


def write_mix(tmp_path, streams, prefix="gs://bucket/olmo/", npy=False):
    """Raw uint32 token files (AI2's headerless .npy) and the index MaxText's tool writes."""
    files, offset = [], 0
    for i, stream in enumerate(streams):
        path = tmp_path / f"part-{i}.npy"
        arr = np.asarray(stream, np.uint32)
        np.save(path, arr) if npy else arr.tofile(path)
        n = len(arr) // L
        files.append({"path": f"{prefix}part-{i}.npy", "label": "x", "n_tokens": len(arr),
                      "n_instances": n, "instance_offset": offset})
        offset += n
    index = {"format_version": "1", "sequence_length": L, "dtype": "uint32",
             "tokenizer": "t", "total_instances": offset,
             "total_tokens": sum(f["n_tokens"] for f in files), "fingerprint": "",
             "files": files}
    (tmp_path / "index.json").write_text(json.dumps(index))
    return str(tmp_path / "index.json")


def olmo_config(tmp_path, *extra):
    return config("dataset_type=olmo_grain", f"olmo_index_path={tmp_path / 'index.json'}",
                  "olmo_path_remap_from=gs://bucket/olmo/", f"olmo_path_remap_to={tmp_path}/",
                  "vocab_size=100", *extra)


def test_instances_are_windows_of_the_files(tmp_path):
    a, b = np.arange(1, 30), np.arange(50, 70)          # 3 and 2 instances; tails dropped
    write_mix(tmp_path, [a, b])
    data = training_data(olmo_config(tmp_path))
    assert len(data.samples) == 5 and data.vocab_size == 100 and data.samples.ngram_filter
    assert not training_data(olmo_config(tmp_path, "olmo_apply_ngram_filter=false")
                             ).samples.ngram_filter
    want = [a[0:8], a[8:16], a[16:24], b[0:8], b[8:16]]
    for i, w in enumerate(want):
        s = data.samples[i]
        assert s["tokens"][:L].tolist() == w.tolist() and s["tokens"][L] == 0
        assert s["segment_ids"].tolist() == [1] * L + [0] and s["keep"] == 1
    batch = make_batch({k: np.stack([data.samples[i][k] for i in (0, 3)])
                        for k in ("tokens", "segment_ids", "keep")}, data, 2)
    assert batch["tokens"][0, 1].tolist() == b[:8].tolist()
    assert batch["targets"][0, 1, :7].tolist() == b[1:8].tolist()
    assert batch["loss_mask"][0, 1].tolist() == [1] * 7 + [0]     # no target for the last
    assert batch["positions"][0, 1].tolist() == list(range(8))
    # a real .npy header is read too
    write_mix(tmp_path, [a, b], npy=True)
    assert training_data(olmo_config(tmp_path)).samples[4]["tokens"][:L].tolist() == \
        b[8:16].tolist()


def test_ngram_filter_masks_repetitive_instances(tmp_path):
    assert olmo.repetitive([5, 6, 7] * 32) and not olmo.repetitive([5, 6, 7] * 31 + [5, 6])
    assert olmo.repetitive(list(range(40)) + [9] * 32) and not olmo.repetitive(range(200))
    pattern = list(range(1, 14))
    assert olmo.repetitive([99] + pattern * 32 + [98])          # period 13, off alignment
    assert not olmo.repetitive(list(range(1, 15)) * 40)         # period 14: too long
    L2 = 64
    stream = np.concatenate([np.tile([3, 4], L2 // 2), np.arange(1, L2 + 1)])
    path = tmp_path / "p.npy"
    stream.astype(np.uint32).tofile(path)
    index = {"dtype": np.dtype("uint32"), "files": [(str(path), len(stream), 2)], "total": 2}
    src = olmo.OlmoInstances(index, L2)
    assert src[0]["keep"] == 0 and src[1]["keep"] == 1
    assert olmo.OlmoInstances(index, L2, ngram_filter=False)[0]["keep"] == 1
    batch = make_batch({k: np.stack([src[0][k], src[1][k]]) for k in ("tokens", "segment_ids",
                                                                      "keep")},
                       TokenData(src, 100, "olmo"), 2)
    assert batch["loss_mask"][0, 0].sum() == 0 and batch["loss_mask"][0, 1].sum() == L2 - 1


def test_resume_and_validation_order(tmp_path):
    write_mix(tmp_path, [np.arange(1, 90) % 97, np.arange(5, 200) % 97])
    cfg = olmo_config(tmp_path)
    whole = take(training_data(cfg), cfg, 5)
    again = take(training_data(cfg), cfg, 2, consumed=3 * 4)
    for a, b in zip(whole[3:], again):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    (valid,) = validation_data(cfg)
    assert valid.name == "olmo_grain validation" and valid.seed == cfg["seed"] ^ 0x1F1F1F1F
    first_valid = take(valid, cfg, 1)[0]["tokens"]
    assert not np.array_equal(first_valid, whole[0]["tokens"])


def test_bad_olmo_configs(tmp_path):
    write_mix(tmp_path, [np.arange(1, 30)])
    index = tmp_path / "index.json"
    cases = [
        (["seq_length=16", "max_position_embeddings=16"], "sequence_length 8 but seq_length is 16"),
        (["olmo_path_remap_to="], "set together"),
        (["olmo_path_remap_from=", "olmo_path_remap_to="], "part-0.npy does not exist"),
        ([f"olmo_index_path={tmp_path / 'nope.json'}"], "nope.json: no such file"),
        (["olmo_index_path="], "needs olmo_index_path"),
        (["reset_attention_mask=true"], "reset_attention_mask: olmo_grain instances"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            training_data(olmo_config(tmp_path, *extra))
    spec = json.loads(index.read_text())
    spec["files"][0]["n_tokens"] = 80
    spec["files"][0]["n_instances"] = 10
    spec["total_instances"] = 10
    index.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="part-0.npy holds fewer than the 80 tokens"):
        training_data(olmo_config(tmp_path))
    spec["format_version"] = "2"
    index.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="format_version '2'"):
        training_data(olmo_config(tmp_path))


@pytest.mark.slow
def test_olmo_training_run(tmp_path):
    from jaxtrain import loop

    rng = np.random.default_rng(0)
    write_mix(tmp_path, [rng.integers(1, 100, 400), np.tile([7, 8], 100)])
    cfg = olmo_config(tmp_path, "train_iters=2", "eval_interval=2", "eval_iters=1",
                      f"workspace={tmp_path}", "exp_name=run", "bf16=false")
    row = loop.train(cfg)
    assert row["step"] == 2 and np.isfinite(row["loss"])
