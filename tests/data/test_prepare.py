"""pgs-style data preparation (python -m jaxtrain.prepare, preprocess.*): scoring, buckets,
filters, held-out rows, the selection strategies, the files and metadata, and training on
the prepared rows (preprocess.enabled)."""
import contextlib
import copy
import importlib.util
import io
import json
import math
import pathlib
import random

import numpy as np
import pytest

from jaxtrain import prepare
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import prepared, sft
from jaxtrain.data.sources import training_data, validation_data
from jaxtrain.data.tokenizers import build_tokenizer
from tests.conftest import run_module
from tests.train.sft_helpers import WORDS, write_chat_model, write_jsonl

PGS_PREPARE = pathlib.Path("/work/corpus/palingenesis/src/palingenesis/prepare.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("m") / "model")


def _chat_rows(n: int) -> list[dict]:
    """Conversations of varied lengths, each with a ``source`` and its number ``i``."""
    rows = []
    for i in range(n):
        answer = " ".join(WORDS[(i * (k + 3)) % len(WORDS)] for k in range(1 + i % 5))
        rows.append({"i": i, "source": "alpha" if i % 3 else "beta", "messages": [
            {"role": "system", "content": "You answer with one word."},
            {"role": "user", "content": f"what follows {WORDS[i % len(WORDS)]}?"},
            {"role": "assistant", "content": answer}]})
    return rows


def _pgs_file(tmp_path, model_dir, data, preprocess: str = "") -> pathlib.Path:
    path = tmp_path / "pgs.yml"
    path.write_text(f"model: {{name_or_path: {model_dir}, torch_dtype: float32}}\n"
                    f"data: {{max_seq_length: 64, dataset: {data}, packing: false}}\n"
                    f"preprocess: {{output_dir: {tmp_path / 'prepared'}"
                    f"{', ' + preprocess if preprocess else ''}}}\n"
                    "train: {max_steps: 2, per_device_batch_size: 2, gradient_accumulation_steps: "
                    f"1, output_dir: {tmp_path / 'out'}, warmup_ratio: 0}}\n"
                    "logging: {use_wandb: false, use_trackio: false}\nhardware: cpu\n")
    return path


def _run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = prepare.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------- constructed scores


def _scored(ppls, lengths=None, full=None) -> list[dict]:
    return [{"i": i, "_score_response_ppl": p, "_score_ppl": (full or ppls)[i],
             "_score_length": (lengths or [20] * len(ppls))[i],
             "_score_response_nll": round(math.log(p), 4) if math.isfinite(p) else p,
             "_score_response_token_count": 3}
            for i, p in enumerate(ppls)]


def _ids(rows):
    return [r["i"] for r in rows]


PPLS = [12.0, 3.0, 40.0, 7.0, 25.0, 2.0, 90.0, 15.0, 5.0, 60.0,
        9.0, 33.0, 4.0, 18.0, 70.0, 11.0, 2.5, 50.0, 8.0, 21.0]


def test_classify_buckets_by_percentiles_of_the_finite_perplexities():
    rows = _scored(PPLS + [math.inf])
    prepared.classify(rows)
    ordered = sorted(PPLS)                       # 20 finite: thresholds at indices 5 and 15
    easy, hard = ordered[5], ordered[15]
    for r in rows:
        ppl = r["_score_response_ppl"]
        want = "easy" if ppl <= easy else "hard" if ppl >= hard else "medium"
        assert r["_score_difficulty_bucket"] == want
    assert rows[-1]["_score_difficulty_bucket"] == "hard"     # unscoreable: infinite


def test_filters_exact_on_a_constructed_case():
    rows = _scored([1.2, 1.5, 3.0, 480.0, 520.0, 40.0, 40.0, math.inf],
                   lengths=[20, 20, 9, 20, 20, 20, 40000, 0],
                   full=[2.0, 1.4, 3.0, 600.0, 100.0, 40.0, 40.0, math.inf])
    kept, removed = prepared.filter_rows(rows, min_ppl=1.5, max_ppl=500.0, score="response")
    assert _ids(kept) == [1, 3, 5]               # 1.5 is not below min_ppl; 480 not above
    assert removed == {"too_easy": 1, "too_hard": 2, "too_short": 1, "too_long": 1}
    kept, removed = prepared.filter_rows(rows, min_ppl=1.5, max_ppl=500.0, score="full")
    assert _ids(kept) == [0, 4, 5]               # the full perplexities decide
    assert removed == {"too_easy": 1, "too_hard": 2, "too_short": 1, "too_long": 1}
    kept, removed = prepared.filter_rows(rows, min_ppl=1.5, max_ppl=0, score="response")
    assert _ids(kept) == [1, 3, 4, 5]            # max_ppl <= 0: no upper bound
    assert removed["too_hard"] == 0 and removed["too_short"] == 2   # inf: length 0


def _pool():
    rows = _scored(PPLS)
    prepared.classify(rows)
    return rows


def _by_bucket(rows, b):
    return [r["i"] for r in rows if r["_score_difficulty_bucket"] == b]


def test_each_strategy_against_its_definition():
    pool = _pool()
    ppl = {r["i"]: r["_score_response_ppl"] for r in pool}
    median = sorted(PPLS)[len(PPLS) // 2]
    # hard_focus: highest perplexity first
    assert _ids(prepared.select(_pool(), 4, "hard_focus", 0)) == [6, 14, 9, 17]
    # flow: highest exp(-ppl / median) = lowest perplexity; each keeps its weight
    chosen = prepared.select(_pool(), 4, "flow", 0)
    assert _ids(chosen) == [5, 16, 1, 12]
    assert all(r["_score_flow_weight"] == pytest.approx(math.exp(-ppl[r["i"]] / median))
               for r in chosen)
    # medium_focus: closest to the median (ties in pool order)
    got = prepared.select(_pool(), 5, "medium_focus", 0)
    dist = sorted(range(20), key=lambda i: abs(PPLS[i] - median))
    assert _ids(got) == dist[:5] and _ids(got)[0] == PPLS.index(median)
    # balanced: budget // 3 of each bucket in pool order, the rest from medium
    got = prepared.select(_pool(), 7, "balanced", 0)
    easy, medium, hard = (_by_bucket(pool, b) for b in prepared.BUCKETS)
    assert _ids(got) == easy[:2] + medium[:2] + hard[:2] + medium[2:3]
    # optimal, budget 10 (< 2000): int(3.5)=3 easy, 5 medium, int(1.5)=1 hard, 1 very hard
    got = prepared.select(_pool(), 10, "optimal", 0)
    hardest = sorted(hard, key=lambda i: -PPLS[i])
    assert _ids(got) == easy[:3] + medium[:5] + hardest[1:2] + hardest[:1]
    tau = sorted(ppl[i] for i in _ids(got))[5]
    assert all(r["_score_flow_weight"] == round(math.exp(-r["_score_response_ppl"] / tau), 4)
               for r in got)
    # random / curriculum: a seeded uniform sample; curriculum then orders it by perplexity
    assert _ids(prepared.select(_pool(), 6, "random", 3)) == _ids(
        random.Random(3).sample(_pool(), 6))
    cur = prepared.order_curriculum(prepared.select(_pool(), 6, "curriculum", 3))
    sample = _ids(random.Random(3).sample(_pool(), 6))
    assert _ids(cur) == sorted(sample, key=lambda i: PPLS[i])
    assert [r["_score_rank"] for r in cur] == list(range(6))
    # a budget that does not cut keeps the pool as it is
    for strategy in prepared.STRATEGIES:
        assert _ids(prepared.select(_pool(), 20, strategy, 0)) == list(range(20))
        assert _ids(prepared.select(_pool(), 0, strategy, 0)) == list(range(20))
    with pytest.raises(ConfigError, match="preprocess.strategy 'hardest'"):
        prepared.select(_pool(), 3, "hardest", 0)


def test_optimal_backfills_short_buckets_medium_first():
    rows = _scored([10.0] * 4 + [20.0] * 14 + [30.0, 31.0])
    for r in rows:                                   # 4 easy, 14 medium, 2 hard
        r["_score_difficulty_bucket"] = ("easy" if r["i"] < 4 else "medium" if r["i"] < 18
                                         else "hard")
    got = _ids(prepared.select(rows, 19, "optimal", 0))
    # quotas: int(6.65)=6 easy (4 there), int(9.5)=9 medium, int(2.85)=2 hard, 2 very hard:
    # the two hardest; the 4 missing come from the medium rows left
    assert got == [0, 1, 2, 3] + list(range(4, 13)) + [19, 18] + list(range(13, 17))


def test_selection_is_deterministic_for_a_seed():
    for strategy in ("random", "curriculum"):
        a = _ids(prepared.select(_pool(), 8, strategy, 7))
        assert a == _ids(prepared.select(_pool(), 8, strategy, 7))
        assert a != _ids(prepared.select(_pool(), 8, strategy, 8))
    rest, held = prepared.split_holdout(_pool(), 5, 7)
    rest2, held2 = prepared.split_holdout(_pool(), 5, 7)
    assert _ids(held) == _ids(held2) and _ids(rest) == _ids(rest2)
    assert sorted(_ids(held) + _ids(rest)) == list(range(20)) and _ids(held) == sorted(_ids(held))
    assert _ids(prepared.split_holdout(_pool(), 5, 8)[1]) != _ids(held)
    assert prepared.split_holdout(_pool(), 20, 7)[1] == []      # nothing left: none held (pgs)


# ---------------------------------------------------------------- side by side with pgs


def _pgs():
    if not PGS_PREPARE.is_file():
        pytest.skip("no palingenesis checkout")
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("pgs_prepare_reference", PGS_PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # by path: its folder's logging.py stays off sys.path
    return module


def _random_scores(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        if rng.random() < 0.05:
            rows.append({"i": i, **prepared.unscoreable()})
            continue
        ppl = rng.choice([rng.randint(1, 12) * 5.0, round(rng.uniform(1.0, 700.0), 2)])
        row = {"i": i, "_score_response_ppl": ppl,
               "_score_ppl": round(ppl * rng.uniform(0.5, 1.5), 2),
               "_score_length": rng.choice([5, 9, 10, 30, 200, 40000])}
        if rng.random() < 0.3:
            row["_score_ifd"] = rng.choice([0.5, 1.0, 1.5])
        rows.append(row)
    return rows


def test_strategies_and_filters_match_palingenesis_side_by_side():
    pgs = _pgs()
    rng = random.Random(0)
    for trial in range(40):
        rows = _random_scores(rng, rng.randint(5, 120))
        theirs, ours = copy.deepcopy(rows), copy.deepcopy(rows)
        pgs.classify_difficulty(theirs)
        prepared.classify(ours)
        assert theirs == ours
        min_ppl, max_ppl = rng.choice([1.5, 10.0]), rng.choice([500.0, 0.0, 200.0])
        score = rng.choice(["response", "full"])
        theirs = pgs.filter_samples(theirs, min_ppl=min_ppl, max_ppl=max_ppl, score=score)
        ours, _ = prepared.filter_rows(ours, min_ppl, max_ppl, score)
        assert _ids(theirs) == _ids(ours)
        if not ours:
            continue
        holdout, seed = rng.choice([0, 1, 3]), rng.randint(0, 99)
        theirs, _ = pgs.split_eval_holdout(theirs, holdout, seed=seed)
        ours, _ = prepared.split_holdout(ours, holdout, seed)
        assert _ids(theirs) == _ids(ours)
        budget = rng.randint(1, len(ours) + 2)
        for strategy in prepared.STRATEGIES:
            a, b = copy.deepcopy(theirs), copy.deepcopy(ours)
            if strategy == "curriculum" and budget < len(b):
                continue     # pgs's code takes the easiest rows; its documentation a sample
            random.seed(seed)   # pgs's random strategy draws from the global generator
            picked_theirs = pgs.select_by_budget(a, budget, strategy)
            picked_ours = prepared.select(b, budget, strategy, seed)
            if strategy == "curriculum":    # pgs orders (and ranks) after selecting
                picked_theirs = sorted(picked_theirs, key=lambda s: s["_score_response_ppl"])
                for k, s in enumerate(picked_theirs):
                    s["_score_rank"] = k
                picked_ours = prepared.order_curriculum(picked_ours)
            assert picked_theirs == picked_ours, (trial, strategy, budget)


# ---------------------------------------------------------------- files


def test_parquet_round_trip_or_jsonl(tmp_path):
    rows = _chat_rows(4)
    path = prepared.write_rows(rows, str(tmp_path), "parquet")
    assert path.endswith("scored_data.parquet")
    import pyarrow.parquet as pq
    assert pq.read_table(path).to_pylist() == rows
    # a message key only some rows have: Arrow would add nulls -> jsonl, the parquet removed
    uneven = _chat_rows(3)
    uneven[1]["messages"][2]["name"] = "bot"
    path = prepared.write_rows(uneven, str(tmp_path), "parquet")
    assert path.endswith("scored_data.jsonl") and not (tmp_path / "scored_data.parquet").exists()
    assert [json.loads(line) for line in open(path)] == uneven
    # types that cannot be unified (a string content and a list content) -> jsonl
    mixed = _chat_rows(2)
    mixed[0]["messages"][1]["content"] = [{"type": "text", "text": "what follows red?"}]
    assert prepared.write_rows(mixed, str(tmp_path), "parquet").endswith(".jsonl")
    assert prepared.write_rows(rows, str(tmp_path), "parquet").endswith(".parquet")
    assert not (tmp_path / "scored_data.jsonl").exists()      # no stale file left behind
    assert prepared.write_rows(rows, str(tmp_path), "jsonl").endswith(".jsonl")
    assert prepared.find(str(tmp_path)).endswith("scored_data.jsonl")


def test_group_profile():
    rows = _scored([2.0, 4.0, 8.0, 16.0])
    for r, g in zip(rows, ["a", "b", "a", None]):
        r["src"] = g
    prepared.classify(rows)
    got = prepared.profile(rows, "src")
    assert list(got) == ["(missing)", "a", "b"]
    assert got["a"]["count"] == 2 and got["a"]["median_response_nll"] == round(math.log(8), 4)
    assert got["a"]["buckets"] == {"easy": 1, "medium": 1, "hard": 0}
    assert got["b"]["mean_response_tokens"] == 3.0


# ---------------------------------------------------------------- end to end


def _encodings(cfg, raw):
    tok = build_tokenizer(cfg)
    hf_tok = sft.hf_tokenizer(tok, "data.dataset", cfg)
    return [e for _, e in sft.encode_rows([(str(i), r) for i, r in enumerate(raw)], hf_tok, cfg,
                                          prepare.dataset_source(cfg))]


def _torch_scores(model_dir, ids, weights, top_k_pct):
    """(mean NLL, mean NLL of the trained targets, HES) by transformers' own forward."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    trained = torch.tensor(np.asarray(weights[1:]) > 0)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    k = max(1, int(len(entropy) * top_k_pct / 100.0))
    return float(nll.mean()), float(nll[trained].mean()), float(entropy.topk(k).values.sum())


def test_cli_prepares_and_training_reads_exactly_the_selection(tmp_path, model_dir):
    raw = _chat_rows(40)
    raw.append({"i": 40, "source": "beta", "messages": []})       # cannot be scored
    data = write_jsonl(tmp_path / "chat.jsonl", raw)
    config = _pgs_file(tmp_path, model_dir, data, "budget: 12, strategy: curriculum, "
                       "eval_holdout: 5, group_field: source, hes: true, hes_top_k_pct: 10, "
                       "batch_size: 8, max_batch_tokens: 256, max_samples: 0")
    code, out, err = _run(config)
    assert code == 0, err
    folder = tmp_path / "prepared"
    assert "prepared 12 of 41 rows" in out
    assert (folder / "scored_data.parquet").is_file() and (folder / "eval_data.parquet").is_file()
    meta = json.loads((folder / "prepared_meta.json").read_text())
    assert meta["strategy"] == "curriculum" and meta["num_samples"] == 12
    assert meta["counts"]["unscoreable"] == {"no messages": 1}
    assert meta["counts"]["read"] == 41 and meta["counts"]["held_out"] == 5
    assert meta["eval_holdout"] == 5 and meta["format"] == "parquet"
    assert meta["counts"]["passed_filters"] == 40 and meta["counts"]["pool"] == 35
    selected, held = meta["selected_rows"], meta["eval_rows"]
    assert len(selected) == 12 and len(held) == 5 and not set(selected) & set(held)
    groups = meta["groups"]
    assert sum(g["count"] for g in groups["before"].values()) == 35
    assert sum(g["count"] for g in groups["after"].values()) == 12
    assert groups["after"]["beta"]["count"] == sum(raw[i]["source"] == "beta" for i in selected)

    import pyarrow.parquet as pq
    out_rows = pq.read_table(folder / "scored_data.parquet").to_pylist()
    assert [r["i"] for r in out_rows] == selected
    ppls = [r["_score_response_ppl"] for r in out_rows]
    assert ppls == sorted(ppls) and [r["_score_rank"] for r in out_rows] == list(range(12))
    assert all(r["_score_hes"] > 0 and 0 <= r["_score_hes_normalized"] <= 1 for r in out_rows)
    for r in out_rows:
        assert {k: v for k, v in r.items() if not k.startswith("_score_")} == raw[r["i"]]

    # the scores are the model's: the reference forward of transformers on the same tokens
    cfg = load_config(config, [], world_size=1)
    first = out_rows[0]
    enc = _encodings(cfg, [raw[first["i"]]])[0]
    full, response, hes = _torch_scores(model_dir, enc.ids.tolist(), enc.weights, 10)
    assert first["_score_length"] == len(enc.ids)
    assert first["_score_avg_nll"] == pytest.approx(full, abs=0.05)
    assert first["_score_response_nll"] == pytest.approx(response, abs=0.05)
    assert first["_score_response_token_count"] == int((enc.weights[1:] > 0).sum())
    assert first["_score_hes"] == pytest.approx(hes, rel=0.02)
    assert first["_score_response_ppl"] == pytest.approx(
        math.exp(first["_score_response_nll"]), rel=1e-3)

    # training on it: exactly the selected rows, in the file's order (curriculum), and the
    # held-out rows as the validation set
    on = load_config(config, ["preprocess.enabled=true"], world_size=1)
    td = training_data(on)
    want = sft.assemble(_encodings(on, [raw[i] for i in selected]), on["seq_length"], False)
    np.testing.assert_array_equal(td.samples.arrays["tokens"], want["tokens"])
    np.testing.assert_array_equal(td.samples.arrays["weights"], want["weights"])
    assert td.dataloader_type == "single"                          # curriculum order kept
    val = validation_data(on)
    want = sft.assemble(_encodings(on, [raw[i] for i in held]), on["seq_length"], False)
    np.testing.assert_array_equal(val[0].samples.arrays["tokens"], want["tokens"])
    # an eval dataset of the user's wins over the held-out rows
    other = load_config(config, ["preprocess.enabled=true", f"data.eval_dataset={data}"],
                        world_size=1)
    assert validation_data(other)[0].num_samples == 40


@pytest.mark.slow
def test_jsonl_output_random_strategy_and_a_training_run(tmp_path, model_dir, cli):
    raw = _chat_rows(24)
    data = write_jsonl(tmp_path / "chat.jsonl", raw)
    config = _pgs_file(tmp_path, model_dir, data, "budget: 6, format: jsonl, max_samples: 20, "
                       "min_ppl: 1.5, max_ppl: 0, filter_score: full")
    result = run_module("jaxtrain.prepare", config, "--preprocess.strategy", "random")
    assert result.returncode == 0, result.stderr
    assert "prepared 6 of 24 rows" in result.stdout
    folder = tmp_path / "prepared"
    assert (folder / "scored_data.jsonl").is_file()
    assert not list(folder.glob("eval_data.*"))
    meta = json.loads((folder / "prepared_meta.json").read_text())
    assert meta["format"] == "jsonl" and meta["counts"]["sampled"] == 20
    assert meta["max_ppl"] == 0 and meta["filter_score"] == "full" and meta["strategy"] == "random"
    sampled = random.Random(42).sample(range(24), 20)          # pgs: seed 42 by default
    assert set(meta["selected_rows"]) <= set(sampled)
    out_rows = [json.loads(line) for line in open(folder / "scored_data.jsonl")]
    assert [r["i"] for r in out_rows] == meta["selected_rows"]
    # deterministic: the same config selects the same rows
    assert _run(config, "--preprocess.strategy", "random")[0] == 0
    assert json.loads((folder / "prepared_meta.json").read_text())["selected_rows"] == \
        meta["selected_rows"]

    on = load_config(config, ["preprocess.enabled=true"], world_size=1)
    td = training_data(on)
    want = sft.assemble(_encodings(on, [raw[i] for i in meta["selected_rows"]]),
                        on["seq_length"], False)
    np.testing.assert_array_equal(td.samples.arrays["tokens"], want["tokens"])
    assert td.dataloader_type == "cyclic" and validation_data(on) is None
    code, _, err = cli(config, "preprocess.enabled=true", "train.max_steps=2")
    assert code == 0, err
    log = (tmp_path / "out").rglob("jaxtrain.log")
    assert any(f"training on {folder / 'scored_data.jsonl'}" in p.read_text() for p in log)


@pytest.mark.slow
def test_clear_errors(tmp_path, model_dir, cli):
    data = write_jsonl(tmp_path / "chat.jsonl", _chat_rows(6))
    config = _pgs_file(tmp_path, model_dir, data)
    # training on prepared rows before any were prepared
    with pytest.raises(ConfigError, match="nothing has been prepared in .* yet"):
        training_data(load_config(config, ["preprocess.enabled=true"], world_size=1))
    code, _, err = cli(config, "preprocess.enabled=true", "--dry-run")
    assert code == 2 and "nothing has been prepared" in err and "Traceback" not in err
    # with data.sources (pgs's rule)
    with pytest.raises(ConfigError, match="preprocess.enabled trains on the rows prepared"):
        load_config(config, ["preprocess.enabled=true", f"--data.sources=[{{dataset: {data}}}]"],
                    world_size=1)
    code, _, err = _run(config, f"--data.sources=[{{dataset: {data}}}]")
    assert code == 2 and "prepare each one with its own config" in err
    # an unknown strategy
    result = run_module("jaxtrain.prepare", config, "preprocess.strategy=hardest")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "preprocess.strategy" in result.stderr and "hardest" in result.stderr
    # a group field no row has, filters that keep nothing, too many held-out rows
    code, _, err = _run(config, "preprocess.group_field=topic")
    assert code == 2 and "no row of data.dataset has this field" in err
    code, _, err = _run(config, "preprocess.min_ppl=100000")
    assert code == 2 and "passed the filters" in err and "too_easy" in err
    code, _, err = _run(config, "preprocess.eval_holdout=6")
    assert code == 2 and "hold out fewer" in err
    code, out, _ = _run("--help")
    assert code == 0 and "preprocess.enabled" in out


def test_bucketed_batches_respect_both_caps():
    lengths = {i: n for i, n in enumerate([3, 17, 17, 40, 64, 64, 64, 64, 64, 300, 600, 900])}
    batches = prepare.plan_batches(lengths, batch_size=4, max_batch_tokens=256, cap=1000)
    assert sorted(i for _, _, ids in batches for i in ids) == list(range(12))
    for T, B, ids in batches:
        assert len(ids) <= B <= 4 and B & (B - 1) == 0
        assert B * T <= 256 or B == 1
        assert all(lengths[i] <= T for i in ids)
    assert prepare.bucket_length(3, 64) == 16 and prepare.bucket_length(200, 64) == 256
    assert prepare.bucket_length(300, 1000) == 512 and prepare.bucket_length(600, 700) == 768
