"""pgs SFT data pipeline: sources and mixing, replay, packing, length groups, the pretokenized
cache, eval sources and their composite, Hugging Face weights in, and Hugging Face models out."""
import dataclasses
import json
import logging

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from sft_helpers import WORDS, pair_task, write_chat_model, write_jsonl

from jaxtrain import loop
from jaxtrain.checkpoint import hf_init
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import chat, sft
from jaxtrain.data.batches import LengthGroups, make_batch
from jaxtrain.data.sources import training_data, validation_data
from jaxtrain.evaluation import composite
from jaxtrain.models import from_hf
from jaxtrain.models.hf import safetensors_files


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("m") / "model")


def _config(tmp_path, model_dir, data: str = "", *extra, train: str = "max_steps: 4"):
    path = tmp_path / "pgs.yml"
    path.write_text(f"model: {{name_or_path: {model_dir}, torch_dtype: float32}}\n"
                    f"data: {{max_seq_length: 64{', ' + data if data else ''}}}\n"
                    f"train: {{{train}, per_device_batch_size: 2, "
                    "gradient_accumulation_steps: 1, output_dir: " + str(tmp_path / "out")
                    + ", warmup_ratio: 0}\n"
                    "logging: {use_wandb: false, use_trackio: false}\n")
    return load_config(path, list(extra), world_size=1, enforce_status=False)


def _words(rows, field="messages"):
    return {r[field][1]["content"].split()[-1].rstrip("?") for r in rows}


# ---------------------------------------------------------------- mixing


def _examples(n, tag):
    return [chat.Encoded(np.full(3, tag, np.int32), np.ones(3, np.float32)) for _ in range(n)]


def test_mix_total_gives_each_source_its_weight_share():
    rng = np.random.default_rng(0)
    a, b = _examples(30, 1), _examples(10, 2)
    out = sft.mix([a, b], [0.5, 0.5], "total", rng)
    tags = [int(e.ids[0]) for e in out]
    assert len(out) == 40 and tags.count(1) == 20 and tags.count(2) == 20   # b repeats
    out = sft.mix([a, b], [None, None], "total", rng)          # no weights: shares of the rows
    assert [int(e.ids[0]) for e in out].count(2) == 10
    out = sft.mix([a, b], [0.9, 0.1], "total", rng)            # a subset of a, all of b... 4 of b
    assert [int(e.ids[0]) for e in out].count(2) == 4


def test_mix_first_exhausted_stops_when_a_source_runs_out():
    out = sft.mix([_examples(100, 1), _examples(5, 2)], [0.5, 0.5], "first_exhausted",
                  np.random.default_rng(0))
    tags = [int(e.ids[0]) for e in out]
    assert tags.count(2) == 5 and 0 < tags.count(1) < 100


# ---------------------------------------------------------------- samples


def test_packing_keeps_conversations_whole_with_their_own_positions():
    exs = [chat.Encoded(np.arange(1, n + 1, dtype=np.int32), np.ones(n, np.float32))
           for n in (5, 3, 4, 6)]
    arrays = sft.assemble(exs, 10, packing=True)
    for row, seg in zip(arrays["tokens"], arrays["segment_ids"]):
        for s in set(seg[seg > 0].tolist()):   # each segment is one whole conversation
            assert row[seg == s].tolist() == list(range(1, (seg == s).sum() + 1))
    assert arrays["segment_ids"][:, -1].tolist() == [0] * len(arrays["tokens"])
    rows = {k: v for k, v in arrays.items() if k != "lengths"}
    data = sft.to_token_data(arrays, 16, "t", {"data.length_group_buffer": 0, "packing": True,
                                               "data.seed": 0}, eod=None)
    batch = make_batch(rows, data, len(arrays["tokens"]))
    seg, mask, pos = batch["segment_ids"][0], batch["loss_mask"][0], batch["positions"][0]
    cross = np.zeros_like(mask, bool)
    cross[:, :-1] = seg[:, 1:] != seg[:, :-1]                   # target in the next segment
    assert not mask[cross].any() and (pos[seg > 0] < 6).all()
    assert mask.sum() == sum(len(e.ids) - 1 for e in exs)      # every in-document target


def test_length_groups_put_similar_lengths_in_each_step():
    lengths = np.array([1, 9, 2, 8, 3, 7, 4, 6] * 4)
    order = LengthGroups(list(range(len(lengths))), lengths, buffer=16, group=4, seed=1)
    first = [order[j] for j in range(32)]
    assert sorted(first) == list(range(32))
    for b in range(0, 32, 16):           # a buffer's steps: disjoint runs of its sorted lengths
        groups = sorted((lengths[first[g:g + 4]] for g in range(b, b + 16, 4)), key=min)
        assert all((g[1:] >= g[:-1]).all() for g in groups)
        assert all(g.max() <= h.min() for g, h in zip(groups, groups[1:]))
    assert [order[32 + j] for j in range(32)] != first          # each epoch reshuffled


# ---------------------------------------------------------------- training data from config


def test_chat_rows_become_masked_samples(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}, packing: true")
    td = training_data(cfg)
    arrays = td.samples.arrays
    assert td.name == "chat data" and arrays["weights"].sum() > 0
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    trained = tok.decode(arrays["tokens"][arrays["weights"] > 0])
    assert all(w in WORDS for w in trained.replace("<|im_end|>", " ").split())


def test_bad_rows_name_the_file_and_row(tmp_path, model_dir, caplog):
    rows = pair_task(3) + [{"text": "no chat here"}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="jaxtrain.data.sft"):
        training_data(_config(tmp_path, model_dir, f"dataset: {data}"))
    assert "skipped 1 row(s): 1 no messages" in caplog.text
    bad = write_jsonl(tmp_path / "bad.jsonl", pair_task(1) + [{"messages": [{"content": "x"}]}])
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: "):
        training_data(_config(tmp_path, model_dir, f"dataset: {bad}"))
    none = write_jsonl(tmp_path / "none.jsonl", [{"messages": []}, {"chat": []}])
    with pytest.raises(ConfigError, match=r"no usable example \(2 no messages\)"):
        training_data(_config(tmp_path, model_dir, f"dataset: {none}"))


def test_sources_modes_and_replay(tmp_path, model_dir):
    a = write_jsonl(tmp_path / "a.jsonl", pair_task(16))
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": f"plain {w} text"} for w in WORDS])
    sources = (f"sources: [{{dataset: {a}, weight: 0.75}}, "
               f"{{dataset: {text}, mode: pretrain, weight: 0.25}}]")
    arrays = training_data(_config(tmp_path, model_dir, sources)).samples.arrays
    lengths = (arrays["segment_ids"] > 0).sum(1)
    pretrain_rows = (arrays["weights"][:, 1:] > 0).sum(1) == lengths - 1
    assert len(arrays["tokens"]) == 32 and pretrain_rows.sum() == 8   # all-token loss rows
    cfg = _config(tmp_path, model_dir, f"dataset: {a}, pretrain_replay_dataset: {text}, "
                  "pretrain_replay_weight: 0.5")
    arrays = training_data(cfg).samples.arrays
    replay = ((arrays["weights"][:, 1:] > 0).sum(1) == (arrays["segment_ids"] > 0).sum(1) - 1
              ).sum()
    assert 0 < replay <= 16
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: unknown field\(s\) \['wieght'\]"):
        training_data(_config(tmp_path, model_dir, f"sources: [{{dataset: {a}, wieght: 1}}]"))


def test_pretokenize_cache_reused_and_rebuilt_when_stale(tmp_path, model_dir, caplog):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cache = tmp_path / "cache"
    opts = f"dataset: {data}, pretokenize: true, pretokenize_path: {cache}"
    with caplog.at_level(logging.INFO, logger="jaxtrain.data.pretokenized"):
        first = training_data(_config(tmp_path, model_dir, opts)).samples.arrays
        assert (cache / "pretokenized_meta.json").exists() and "no cache" in caplog.text
        caplog.clear()
        again = training_data(_config(tmp_path, model_dir, opts))
        assert "from the cache" in caplog.text and again.name.endswith("(pretokenized)")
        np.testing.assert_array_equal(again.samples.arrays["weights"], first["weights"])
        caplog.clear()
        training_data(_config(tmp_path, model_dir, opts + ", turn_scaling: last_heavy"))
        assert "rebuilding" in caplog.text
        caplog.clear()
        write_jsonl(data, pair_task(9))                              # the data changed
        assert len(training_data(_config(tmp_path, model_dir, opts)).samples.arrays[
            "tokens"]) == 9 and "rebuilding" in caplog.text


def test_eval_sources_scored_apart_and_combined(tmp_path, model_dir):
    a = write_jsonl(tmp_path / "a.jsonl", pair_task(4))
    b = write_jsonl(tmp_path / "b.jsonl", pair_task(6, seed=1))
    cfg = _config(tmp_path, model_dir, f"dataset: {a}, eval_sources: [{{name: one, dataset: {a}, "
                  f"weight: 3}}, {{name: two, dataset: {b}, samples: 2}}]")
    sets = validation_data(cfg)
    assert [s.name for s in sets] == ["one", "two"] and sets[1].num_samples == 2
    assert composite({"one": 1.0, "two": 2.0}, {"one": 3.0, "two": 1.0}) == pytest.approx(1.25)


# ---------------------------------------------------------------- Hugging Face in and out


def test_safetensors_files_read_bf16_and_sharded_indexes(tmp_path):
    import ml_dtypes

    a = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(4, np.int32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / safetensors_files.INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    got = safetensors_files.read(tmp_path)
    assert got["a"].dtype == ml_dtypes.bfloat16 and got["a"].tolist() == a.tolist()
    assert got["b"].tolist() == [1, 1, 1, 1]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(safetensors_files.CheckpointError, match="00002-of-00002"):
        safetensors_files.read(tmp_path)


def test_run_starts_from_the_hf_weights(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}")
    run = loop.build(cfg)
    state = hf_init.start_from_hf(run.state, model_dir, run.model_cfg, run.optimizer,
                                  run.abstract, run.shardings, run.shardings)
    _, expected = from_hf(model_dir)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wide = _config(tmp_path, model_dir, f"dataset: {data}", "vocab_size=512")
    with pytest.raises(ConfigError, match="embedding has 300 rows but the model's vocabulary"):
        hf_init.check_vocab(model_dir, loop.build(wide, materialize=False).model_cfg)


@pytest.mark.slow
def test_hf_checkpoints_at_each_save_kept_with_their_orbax_state(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}, eval_dataset: {data}, eval_every: 2",
                  "train.save_steps=1", "train.keep_checkpoints=2",
                  train="max_steps: 4")
    loop.train(cfg)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("step-*")) == ["step-3", "step-4"]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3", "step_4"]
    for d in (out / "step-4" / "model", out / "final", out / "best"):
        assert (d / "tokenizer.json").exists() and (d / "config.json").exists()
    best = json.loads((out / "best" / "best_meta.json").read_text())
    assert best["metric"] == "val_loss" and best["step"] in (2, 4)
    assert not list(out.glob("*.tmp"))


def test_field_and_mix_knobs_from_the_config(tmp_path, model_dir):
    rows = [{"conv": r["messages"], "fns": []} for r in pair_task(6)]
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    cfg = _config(tmp_path, model_dir, f"dataset: {data}", "data.messages_field=conv",
                  "data.tools_field=fns")
    opts = sft.chat_options(cfg, sft.train_sources(cfg)[0])
    assert (opts.messages_field, opts.tools_field) == ("conv", "fns")
    assert len(training_data(cfg).samples.arrays["tokens"]) == 6
    big = write_jsonl(tmp_path / "big.jsonl", pair_task(40))
    small = write_jsonl(tmp_path / "small.jsonl", pair_task(2))
    both = f"sources: [{{dataset: {big}}}, {{dataset: {small}}}]"
    total = training_data(_config(tmp_path, model_dir, both)).samples.arrays["tokens"]
    first = training_data(_config(tmp_path, model_dir, both, "data.mix_epoch=first_exhausted")
                          ).samples.arrays["tokens"]
    assert len(total) == 42 and len(first) < 42


@pytest.mark.parametrize("extra, message", [
    (("plugins.dft=true", "data.turn_scaling=progressive"),
     "data.turn_scaling progressive weights the cross-entropy"),
    (("data.pretokenize=true", "data.msft_tracking=true"), "data.pretokenize fixes the data"),
    (("data.pretokenize=true", "data.seq_len_curriculum=true"),
     "data.pretokenize fixes the sequence length"),
])
def test_pgs_refuses_these_combinations(tmp_path, model_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, model_dir, "", *extra)
    if extra[0] == "plugins.dft=true":      # DEFT is the objective that takes turn weights
        _config(tmp_path, model_dir, "", "plugins.deft=true", "data.turn_scaling=progressive")


@pytest.mark.slow
def test_ga_ramp_grows_accumulation_with_progress(tmp_path, model_dir):
    from jaxtrain.optim.schedules import ga_ramp_sizes

    size = ga_ramp_sizes(1, 4, 4, 2)          # steps 0..3 accumulate 1, 1, 2, 3 micro-batches
    consumed, got = 0, []
    for _ in range(5):
        got.append(size(consumed) // 2)
        consumed += size(consumed)
    assert got == [1, 1, 2, 3, 4]
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(1) * 8)   # equal conversations
    cfg = _config(tmp_path, model_dir, f"dataset: {data}", "train.gradient_accumulation_steps=4",
                  "train.ga_ramp_start=1", "train.save_final=false", "save_hf=false",
                  train="max_steps: 4")
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in rows if "loss" in r]
    per_micro = tokens[0]
    assert tokens == [per_micro * m for m in (1, 1, 2, 3)]
    with pytest.raises(ConfigError, match="set train.max_steps"):
        from jaxtrain.train_config import TrainConfig
        TrainConfig.from_config(_config(tmp_path, model_dir, f"dataset: {data}",
                                        "train.gradient_accumulation_steps=4",
                                        "train.ga_ramp_start=1", train="epochs: 1"))


def _save_to_disk(folder, rows):
    """A folder laid out as datasets' Dataset.save_to_disk writes it (Arrow stream + state)."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}))


def test_datasets_saved_to_disk(tmp_path, model_dir):
    _save_to_disk(tmp_path / "ds", pair_task(5))
    assert len(training_data(_config(tmp_path, model_dir, f"dataset: {tmp_path / 'ds'}"))
               .samples.arrays["tokens"]) == 5
    whole = tmp_path / "dict"
    _save_to_disk(whole / "train_sft", pair_task(3))
    _save_to_disk(whole / "test_sft", pair_task(2))
    (whole / "dataset_dict.json").write_text(json.dumps({"splits": ["train_sft", "test_sft"]}))
    cfg = _config(tmp_path, model_dir, f"dataset: {whole}, dataset_split: train_sft, "
                  f"eval_dataset: {whole}, eval_split: test_sft")
    assert training_data(cfg).num_samples == 3 and validation_data(cfg)[0].num_samples == 2
    with pytest.raises(ConfigError, match=r"has splits \['train_sft', 'test_sft'\], not 'dev'"):
        training_data(_config(tmp_path, model_dir, f"dataset: {whole}, dataset_split: dev"))


@pytest.mark.slow
def test_workers_encode_large_sources_in_order(tmp_path, model_dir, monkeypatch):
    rows = pair_task(10) + [{"messages": []}] + pair_task(5, seed=3)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    serial = training_data(_config(tmp_path, model_dir, f"dataset: {data}", "num_workers=0"))
    monkeypatch.setattr(sft, "PARALLEL_MIN_ROWS", 4)
    monkeypatch.setattr(sft, "ENCODE_CHUNK", 3)
    parallel = training_data(_config(tmp_path, model_dir, f"dataset: {data}", "num_workers=2"))
    for key in ("tokens", "weights", "segment_ids"):
        np.testing.assert_array_equal(parallel.samples.arrays[key], serial.samples.arrays[key])
    bad = write_jsonl(tmp_path / "bad.jsonl", pair_task(6) + [{"messages": [{"content": "x"}]}])
    with pytest.raises(ConfigError, match=r"bad.jsonl:7: "):
        training_data(_config(tmp_path, model_dir, f"dataset: {bad}", "num_workers=2"))


@pytest.mark.slow
def test_pre_rl_runs_against_the_frozen_starting_weights(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}", "plugins.pre_rl=true",
                  "plugins.pre_rl_kl_coeff=2.0", "train.save_final=false", "save_hf=false",
                  train="max_steps: 3")
    loop.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    path = tmp_path / "none.yml"
    path.write_text(f"model: {{name_or_path: null}}\ndata: {{dataset: {data}}}\n"
                    "plugins: {pre_rl: true}\n")
    from jaxtrain.train_config import TrainConfig
    with pytest.raises(ConfigError, match="plugins.pre_rl anchors training to the base model"):
        TrainConfig.from_config(load_config(path, [f"tokenizer_model={model_dir}",
                                                   "train.max_steps=2"], world_size=1,
                                            enforce_status=False))


@pytest.mark.slow
def test_iterations_to_skip_drop_a_batch_without_an_update(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))

    def rows(out, *extra):
        cfg = _config(tmp_path, model_dir, f"dataset: {data}", f"train.output_dir={out}",
                      "train.save_final=false", "save_hf=false", "train.warmup_ratio=0.5",
                      *extra, train="max_steps: 3")
        loop.train(cfg)
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(x)]

    plain = rows(tmp_path / "plain")
    skipped = rows(tmp_path / "skip", "iterations_to_skip=[2]")
    assert [r["step"] for r in skipped] == [1, 3]
    assert skipped[1]["lr"] == pytest.approx(plain[1]["lr"])   # the schedule did not move
    assert skipped[1]["loss"] != pytest.approx(plain[1]["loss"])   # batch 2 was dropped


def test_chat_template_knob_replaces_the_tokenizers_own(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(2))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] "
                "+ '<|im_end|>' }}{% endfor %}")
    cfg = _config(tmp_path, model_dir, f"dataset: {data}", f"chat_template={template}")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = training_data(cfg).samples.arrays["tokens"][0]
    assert "assistant: " in tok.decode(tokens) and "assistant\n" not in tok.decode(tokens)
    bad = _config(tmp_path, model_dir, f"dataset: {data}",
                  "chat_template={% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ConfigError, match="the chat template has no assistant marker"):
        training_data(bad)


def test_chat_template_path_reads_a_json_or_text_template(tmp_path, model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(2))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ': ' + m['content'] "
                "+ '<|im_end|>' }}{% endfor %}")
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": template}))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}",
                  f"chat_template_path={tmp_path / 't.json'}")
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(model_dir).decode(
        training_data(cfg).samples.arrays["tokens"][0])
    assert "assistant: " in text
    (tmp_path / "t.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="chat_template_path .* must hold a string or an obj"):
        training_data(_config(tmp_path, model_dir, f"dataset: {data}",
                              f"chat_template_path={tmp_path / 't.json'}"))


def test_freeze_non_attention_is_a_warned_no_op_without_hybrid_layers(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir, "", "train.freeze_non_attention=true")
    assert any("nothing is frozen" in w for w in cfg.warnings)
    plain = _config(tmp_path, model_dir, "")
    assert not any("nothing is frozen" in w for w in plain.warnings)


@pytest.mark.slow
def test_unpacked_batches_are_cut_to_the_length_bucket_of_their_longest_row(tmp_path, model_dir):
    from jaxtrain.data.batches import bucket, global_batches
    from jaxtrain.train_config import TrainConfig

    assert [bucket(n, 1000) for n in (1, 128, 129, 600, 999)] == [128, 128, 256, 1000, 1000]
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(8))
    cfg = _config(tmp_path, model_dir, f"dataset: {data}, max_seq_length: 512, packing: false")
    td = training_data(cfg)
    tcfg = TrainConfig.from_config(cfg)
    batch = next(global_batches(td, tcfg, seed=0))
    assert td.trim and batch["tokens"].shape[-1] == 128          # 43-token chats, not 512
    full = next(global_batches(dataclasses.replace(td, trim=False), tcfg, seed=0))
    assert full["tokens"].shape[-1] == 512
    np.testing.assert_array_equal(full["loss_mask"][..., 128:], 0)   # only padding was cut
    run = loop.build(cfg)
    metrics = [run.step_fn(jax.tree.map(lambda a: a.copy(), run.state),   # donated
                           run.put_batch(b))[1] for b in (batch, full)]
    for key in ("loss", "grad_norm"):      # the same up to float summation order
        assert float(metrics[0][key]) == pytest.approx(float(metrics[1][key]), rel=1e-4)
