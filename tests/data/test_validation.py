"""Validation and test data and the evaluator: splits, eval_iters, full validation, loss by hand,
perplexity, several sets, bad paths, resumable positions, skip_train, manual GC."""
import json
import math

import jax
import numpy as np
import pytest

from jaxtrain import evaluation, models
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data.batches import TokenData
from jaxtrain.data.sources import heldout_test_data, training_data, validation_data
from jaxtrain.evaluation import EvalSet, Evaluator, perplexity
from jaxtrain.train_config import TrainConfig
from tests.data import helpers

T, GBS = 8, 4
BASE = [f"seq_length={T}", "max_position_embeddings=16", "micro_batch_size=2",
        f"global_batch_size={GBS}", "train_iters=20", "eval_interval=5", "lr_warmup_iters=0",
        "num_layers=1", "hidden_size=16", "num_attention_heads=2", "bf16=false",
        "hidden_dropout=0.2", "attention_dropout=0.2", "tokenizer_type=NullTokenizer",
        "vocab_size=128", "dataloader_type=single"]


def config(*extra):
    return load_config(None, [*BASE, *extra], world_size=1, enforce_status=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """d: 100 documents of 5 tokens, document i all token i + 1; a / b: tokens 1 / 2 only."""
    root = tmp_path_factory.mktemp("valid")
    return {"d": helpers.write_indexed(root / "d", [np.full(5, i + 1) for i in range(100)]),
            "a": helpers.write_indexed(root / "a", helpers.random_docs(60, value=1, seed=1)),
            "b": helpers.write_indexed(root / "b", helpers.random_docs(60, value=2, seed=2)),
            "r": helpers.write_indexed(root / "r", helpers.random_docs(120, vocab=100, seed=3)),
            "root": root}


@pytest.fixture(scope="module")
def model():
    cfg = config("vocab_size=128")
    mcfg = models.ModelConfig.from_config({**cfg, "vocab_size": 129})
    rng = np.random.default_rng(3)     # random weights without compiling models.init
    params = jax.tree.map(lambda a: jax.numpy.asarray(rng.normal(0, 0.3, a.shape), a.dtype),
                          models.abstract(mcfg))
    return mcfg, params


def tokens_of(samples):
    return {int(t) for i in range(len(samples)) for t in samples[i]}


def hand_loss(params, mcfg, rows):
    """Token-mean cross entropy of [N, T + 1] samples, straight from models.forward."""
    rows = np.asarray(rows)
    logits = models.forward(params, rows[:, :-1], mcfg)
    logp = jax.nn.log_softmax(logits.astype(np.float32), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), rows[:, 1:, None], axis=-1)[..., 0]
    return float(nll.mean())


def test_valid_and_test_splits_are_exact(files):
    cfg = config(f"data_path={files['d']}", "split=90,6,4", "eval_iters=2")
    train, (valid,), test = training_data(cfg), validation_data(cfg), heldout_test_data(cfg)
    assert tokens_of(train.samples) == set(range(1, 91))
    assert tokens_of(valid.samples) == set(range(91, 97))     # documents 90..95 only
    assert tokens_of(test.samples) == set(range(97, 101))
    # Megatron's targets: (20 // 5 + 1) runs x 2 batches x 4; test: 2 batches x 4
    assert len(valid.samples) >= 40 and len(test.samples) >= 8
    full = validation_data(config(f"data_path={files['d']}", "split=90,6,4",
                                  "full_validation=true"))[0]
    assert len(full.samples) == (6 * 5 - 1) // T                # one epoch of the split
    assert validation_data(config(f"data_path={files['d']}", "split=100,0,0")) is None


def test_per_split_paths_and_args_file(files, tmp_path):
    paths = [f"train_data_path={files['r']}", f"valid_data_path={files['a']}",
             f"test_data_path={files['b']}", "eval_iters=1"]
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": files["r"], "valid": files["b"], "test": files["a"]}))
    for extra, valid_token, test_token in [(paths, 1, 2),
                                           ([f"per_split_data_args_path={spec}",
                                             "eval_iters=1"], 2, 1)]:
        cfg = config(*extra)
        (valid,) = validation_data(cfg)
        assert tokens_of(valid.samples) == {valid_token}
        assert tokens_of(heldout_test_data(cfg).samples) == {test_token}
        assert len(tokens_of(training_data(cfg).samples)) > 2      # the random-token file


@pytest.mark.slow
def test_eval_iters_batches_and_loss_by_hand(files, model):
    mcfg, params = model
    cfg = config(f"data_path={files['r']}", "split=80,20,0", "eval_iters=2")
    ev = Evaluator.from_config(cfg, mcfg)
    (s,) = ev.sets
    first, second = ev.run(params, 5), ev.run(params, 10)
    rows = np.stack([s.data.samples[i] for i in range(16)])    # single: the source's order
    assert first["val_tokens"] == 2 * GBS * T and ev.state() == {"valid_consumed":
                                                                  {"validation": 16}}
    assert first["val_loss"] == pytest.approx(hand_loss(params, mcfg, rows[:8]), rel=1e-5)
    assert second["val_loss"] == pytest.approx(hand_loss(params, mcfg, rows[8:]), rel=1e-5)
    assert first["val_ppl"] == pytest.approx(math.exp(first["val_loss"]))
    three = Evaluator.from_config(config(f"data_path={files['r']}", "split=80,20,0",
                                         "eval_iters=3"), mcfg)
    out = three.run(params, 5)
    assert out["val_tokens"] == 3 * GBS * T and three.state()["valid_consumed"] == {
        "validation": 12}
    rows3 = np.stack([three.sets[0].data.samples[i] for i in range(12)])  # sized for 3 a run
    assert out["val_loss"] == pytest.approx(hand_loss(params, mcfg, rows3), rel=1e-5)


class Counting:
    def __init__(self, samples):
        self.samples, self.seen = samples, []

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.seen.append(i)
        return self.samples[i]


def test_full_validation_covers_the_split_once(files, model):
    mcfg, params = model
    cfg = config(f"data_path={files['r']}", "split=80,20,0", "full_validation=true",
                 "dataloader_type=cyclic")
    ev = Evaluator.from_config(cfg, mcfg)
    (s,) = ev.sets
    n = s.data.num_samples
    assert n % GBS and s.iters is None                       # a padded last batch
    counting = Counting(s.data.samples)
    ev.sets[0] = EvalSet(s.name, TokenData(counting, s.data.vocab_size, s.name), None)
    out = ev.run(params, 5)
    assert sorted(counting.seen) == list(range(n))
    assert out["val_tokens"] == n * T
    rows = np.stack([s.data.samples[i] for i in range(n)])
    assert out["val_loss"] == pytest.approx(hand_loss(params, mcfg, rows), rel=1e-5)
    assert ev.run(params, 10)["val_loss"] == pytest.approx(out["val_loss"], rel=1e-6)
    ev.restore({"valid_consumed": {s.name: 8}})
    assert ev.state()["valid_consumed"][s.name] == 0          # always the whole split


def test_perplexity_formula():
    assert perplexity(1.0) == pytest.approx(math.e)
    assert perplexity(25.0) == pytest.approx(math.exp(20.0))
    assert perplexity(0.0) == 1.0


def test_multiple_validation_sets_report_each(files, model):
    mcfg, params = model
    common = [f"train_data_path={files['r']}", "multiple_validation_sets=true"]
    cfg = config(*common, f"valid_data_path={files['a']} {files['b']}", "eval_iters=[1,2]")
    ev = Evaluator.from_config(cfg, mcfg)
    assert [(s.name, s.iters) for s in ev.sets] == [("a", 1), ("b", 2)]
    assert tokens_of(ev.sets[0].data.samples) == {1} and tokens_of(ev.sets[1].data.samples) == {2}
    out = ev.run(params, 5)
    assert out["val/a/tokens"] == GBS * T and out["val/b/tokens"] == 2 * GBS * T
    la, lb = out["val/a/loss"], out["val/b/loss"]
    assert la != pytest.approx(lb)
    assert out["val/a/loss"] == pytest.approx(
        hand_loss(params, mcfg, [ev.sets[0].data.samples[i] for i in range(4)]), rel=1e-5)
    assert out["val/b/ppl"] == pytest.approx(perplexity(lb))
    assert out["val_loss"] == pytest.approx((la + 2 * lb) / 3)   # tokens pooled
    split = Evaluator.from_config(config(f"data_path={files['a']} {files['b']}",
                                         "split=80,20,0", "multiple_validation_sets=true",
                                         "eval_iters=1"), mcfg)
    assert [s.name for s in split.sets] == ["a", "b"]
    with pytest.raises(ConfigError, match="eval_iters lists 3 counts for 2"):
        Evaluator.from_config(config(*common, f"valid_data_path={files['a']} {files['b']}",
                                     "eval_iters=[1,1,1]"), mcfg)
    with pytest.raises(ConfigError, match="validation blend has weights"):
        validation_data(config(*common, f"valid_data_path=0.5 {files['a']} 0.5 {files['b']}",
                               "eval_iters=1"))
    with pytest.raises(ConfigError, match="needs multiple_validation_sets"):
        TrainConfig.from_config(config("eval_iters=[1,2]"))


def test_bad_validation_paths(files, tmp_path):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "ds").mkdir()
    helpers.write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": "a cat"}])
    text = ["tokenizer_type=HuggingFaceTokenizer", f"tokenizer_model={tok}"]
    cases = [
        ([f"train_data_path={files['r']}", f"valid_data_path={tmp_path / 'nope'}"],
         "nope.idx does not exist"),
        ([*text, f"data.eval_dataset={empty}"], "empty.jsonl: the file holds no rows"),
        ([*text, f"data.eval_dataset={tmp_path / 'gone.jsonl'}"], "gone.jsonl"),
        ([*text, f"data.eval_dataset={tmp_path / 'ds'}"], "no file of split 'test'"),
        ([*text, f"data.eval_dataset={empty}", "data.eval_samples=0"], "data.eval_samples"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            validation_data(config(*extra))


def test_pgs_eval_dataset_split_and_samples(tmp_path, write):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    texts = helpers.texts(12)
    (tmp_path / "ds").mkdir()
    helpers.write_jsonl(tmp_path / "ds" / "train.jsonl", [{"text": t} for t in texts[:6]])
    helpers.write_jsonl(tmp_path / "ds" / "test-00000.jsonl", [{"text": t} for t in texts[6:]])
    common = ["tokenizer_type=HuggingFaceTokenizer", f"tokenizer_model={tok}", "packing=false",
              f"data.eval_dataset={tmp_path / 'ds'}"]
    (valid,) = validation_data(config(*common, "data.eval_samples=4"))
    assert len(valid.samples) == 4
    word = helpers.word_tokenizer()
    first = word.encode(texts[6]).ids[:T + 1]
    assert valid.samples[0]["tokens"][:len(first)].tolist() == first
    (train,) = validation_data(config(*common, "data.eval_split=train"))
    assert len(train.samples) == 6
    assert train.samples[0]["tokens"][:3].tolist() == word.encode(texts[0]).ids[:3]
    path = write("pgs.yml", f"""
        model: {{name_or_path: null}}
        data: {{dataset: {tmp_path / 'ds' / 'train.jsonl'}, eval_dataset: {tmp_path / 'ds'},
                eval_samples: 5, eval_every: 3, max_seq_length: {T}}}
        train: {{max_steps: 6}}
    """)
    cfg = load_config(path, [f"tokenizer_model={tok}", "micro_batch_size=2",
                             "train.gradient_accumulation_steps=2", "lr_warmup_iters=0"],
                      world_size=1, enforce_status=False)
    tcfg = TrainConfig.from_config(cfg)
    assert tcfg.eval_interval == 3 and tcfg.full_validation      # pgs: the whole subset
    (pgs,) = validation_data(cfg)
    assert len(pgs.samples) == 5


def test_restore_gives_the_same_next_batches(files, model):
    mcfg, params = model
    cfg = config(f"data_path={files['r']}", "split=80,20,0", "eval_iters=2",
                 "dataloader_type=cyclic")

    def recording():
        seen = []

        def put(host):
            seen.append(host["tokens"].copy())
            return {k: jax.numpy.asarray(v) for k, v in host.items()}
        return seen, put

    seen_a, put_a = recording()
    a = Evaluator.from_config(cfg, mcfg, put_batch=put_a)
    a.run(params, 5)
    saved = a.state()
    second = a.run(params, 10)
    seen_b, put_b = recording()
    b = Evaluator.from_config(cfg, mcfg, put_batch=put_b)
    b.restore(saved)
    assert b.run(params, 10) == second
    assert all(np.array_equal(x, y) for x, y in zip(seen_a[2:], seen_b, strict=True))
    c = Evaluator.from_config(cfg, mcfg)
    c.skip_to(10)                        # no evaluator state: (10 // 5) runs x 2 x 4 samples
    assert c.state() == {"valid_consumed": {"validation": 16}}


def test_due_follows_eval_interval(files, model):
    mcfg, _ = model
    ev = Evaluator.from_config(config(f"data_path={files['r']}", "split=80,20,0",
                                      "eval_iters=1"), mcfg)
    assert [s for s in range(1, 21) if ev.due(s)] == [5, 10, 15, 20]
    off = Evaluator.from_config(config(f"data_path={files['r']}", "split=80,20,0",
                                       "eval_iters=1", "eval_interval=null"), mcfg)
    assert not any(off.due(s) for s in range(1, 21))
    none = Evaluator.from_config(config(f"data_path={files['r']}", "split=100,0,0",
                                        "eval_iters=1"), mcfg)
    assert not none.enabled and not none.due(5) and none.run(None, 5) == {}


def test_skip_train_evaluates_from_the_start(files, model):
    mcfg, params = model
    cfg = config(f"data_path={files['r']}", "split=70,20,10", "eval_iters=1",
                 "skip_train=true")
    out = Evaluator.from_config(cfg, mcfg).evaluate_only(params, step=0)
    assert out["val_tokens"] == GBS * T and out["test_tokens"] == GBS * T
    ev = Evaluator.from_config(cfg, mcfg)
    ev.restore({"valid_consumed": {"validation": 8}})
    assert ev.state()["valid_consumed"]["validation"] == 0
    with pytest.raises(ConfigError, match="skip_train: nothing to evaluate"):
        Evaluator.from_config(config(f"data_path={files['r']}", "split=70,20,10",
                                     "skip_train=true"), mcfg).evaluate_only(params, step=0)


def test_manual_gc_eval_collects_around_runs(files, model, monkeypatch):
    mcfg, params = model
    calls = []
    monkeypatch.setattr(evaluation.gc, "collect", lambda generation=2: calls.append(generation))
    common = [f"data_path={files['r']}", "split=80,20,0", "eval_iters=1", "manual_gc=true"]
    Evaluator.from_config(config(*common, "manual_gc_eval=true"), mcfg).run(params, 5)
    assert calls == [2, 0]
    Evaluator.from_config(config(*common), mcfg).run(params, 5)
    assert calls == [2, 0]


def test_mock_validation_and_test_draw_other_tokens(model):
    cfg = config("mock_data=true", "vocab_size=128", "eval_iters=1")
    train, (valid,), test = training_data(cfg), validation_data(cfg), heldout_test_data(cfg)
    assert not np.array_equal(train.samples[:4], valid.samples[:4])
    assert not np.array_equal(valid.samples[:4], test.samples[:4])
    ev = Evaluator.from_config(cfg, model[0])
    assert ev.final(model[1], 20)["test_tokens"] == GBS * T


def test_eval_per_device_batch_size_sets_the_validation_batch(files, model):
    """MaxText's eval_per_device_batch_size: validation batches of that many sequences per
    device (one micro-step), whatever the training batch; 0 keeps the training batch."""
    mcfg, params = model
    common = (f"data_path={files['r']}", "split=80,20,0", "eval_iters=2")
    shapes = []

    def put(host):
        shapes.append(host["tokens"].shape)
        return {k: jax.numpy.asarray(v) for k, v in host.items()}

    ev = Evaluator.from_config(config(*common, "eval_per_device_batch_size=3"), mcfg,
                               put_batch=put)
    out = ev.run(params, 5)
    assert shapes == [(1, 3, T)] * 2 and out["val_tokens"] == 2 * 3 * T
    rows = np.stack([ev.sets[0].data.samples[i] for i in range(6)])
    assert out["val_loss"] == pytest.approx(hand_loss(params, mcfg, rows), rel=1e-5)
    shapes.clear()
    Evaluator.from_config(config(*common), mcfg, put_batch=put).run(params, 5)
    assert shapes == [(GBS // 2, 2, T)] * 2
