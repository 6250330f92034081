"""pgs DPO (dpo.enabled): preference pairs, the loss of every dpo.loss_type (with LD-DPO and RPO)
against NumPy formulas on log-probs transformers computes, and a short run that learns."""
import json
import logging
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from sft_helpers import WORDS, pair_task, write_chat_model, write_jsonl

from jaxtrain import dpo
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import preference, sft
from jaxtrain.data.batches import PairOrder, make_batch
from jaxtrain.data.sources import training_data
from jaxtrain.models import forward, from_hf


def _pairs(n=32, seed=0):
    """Preference rows over pair_task: chosen the right word, rejected a fixed wrong answer."""
    out = []
    for i, row in enumerate(pair_task(n, seed)):
        right = row["messages"][-1]["content"]
        wrong = "rust rust"   # one dispreferred answer, never a right one
        out.append({"prompt": row["messages"][:-1], "chosen": right, "rejected": wrong})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_models")
    rows = pair_task(64) + [{"messages": [{"role": "assistant", "content": w * 3}]}
                            for w in WORDS]
    return (write_chat_model(root / "policy", rows=rows, seed=0),
            write_chat_model(root / "ref", rows=rows, seed=1))


def _config(tmp_path, model_dir, data: str = "", *extra, dpo_: str = "", steps: int = 4,
            batch: int = 2):
    path = tmp_path / "pgs.yml"
    path.write_text(f"model: {{name_or_path: {model_dir}, torch_dtype: float32}}\n"
                    f"data: {{max_seq_length: 64{', ' + data if data else ''}}}\n"
                    f"dpo: {{enabled: true{', ' + dpo_ if dpo_ else ''}}}\n"
                    f"train: {{max_steps: {steps}, per_device_batch_size: {batch}, "
                    "gradient_accumulation_steps: 1, output_dir: " + str(tmp_path / "out")
                    + ", warmup_ratio: 0}\n"
                    "logging: {use_wandb: false, use_trackio: false}\n")
    return load_config(path, list(extra), world_size=1, enforce_status=False)


# ---------------------------------------------------------------- NumPy reference (pgs formulas)


def _hf_logps(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(ids[None, :-1])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:, None])).numpy()[:, 0]


def _logsig(x):
    return -np.logaddexp(0.0, -x)


def _numpy_loss(pol, ref, masks, kind, beta, eps, ld_alpha, sft_weight):
    """pgs dpo.py on per-token log-probs: rows 2i chosen, 2i+1 rejected."""
    a = []
    for i in range(0, len(masks), 2):
        shared = min(masks[i].sum(), masks[i + 1].sum())
        for m in masks[i:i + 2]:
            pos = np.cumsum(m)
            a.append(np.where(pos <= shared, m, ld_alpha * m))
    s = np.array([(p * w).sum() for p, w in zip(pol, a)])
    r = np.array([(p * w).sum() for p, w in zip(ref, a)])
    L = np.maximum([w.sum() for w in a], 1.0)
    d = (s[0::2] - r[0::2]) - (s[1::2] - r[1::2])
    davg = (s[0::2] - r[0::2]) / L[0::2] - (s[1::2] - r[1::2]) / L[1::2]
    per = {"sigmoid": -_logsig(beta * d), "hinge": np.maximum(0, 1 - beta * d),
           "robust": (-(1 - eps) * _logsig(beta * d) + eps * _logsig(-beta * d)) / (1 - 2 * eps),
           "cdpo": -(1 - eps) * _logsig(beta * d) - eps * _logsig(-beta * d),   # MaxText/Tunix
           "ipo": (davg - 1 / (2 * beta)) ** 2, "sigmoid_norm": -_logsig(beta * davg)}[kind]
    nll = -sum((p * m).sum() for p, m in zip(pol[0::2], masks[0::2])) / sum(
        m.sum() for m in masks[0::2])
    rewards = beta * (s - r)
    return per.mean() + sft_weight * nll, rewards


@pytest.fixture(scope="module")
def encoded(models, tmp_path_factory):
    """Two pairs of unequal answer lengths, encoded by the preference pipeline."""
    policy, _ = models
    tmp = tmp_path_factory.mktemp("enc")
    cfg = _config(tmp, policy, "dataset: x.jsonl")
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    opts = preference.PairOptions.from_config(cfg, preference.source(cfg))
    rows = [{"prompt": "what follows red?", "chosen": "blue green", "rejected": "gold"},
            {"prompt": [{"role": "user", "content": "what follows teal?"}],
             "chosen": [{"role": "assistant", "content": "plum"}],
             "rejected": "sand jade rose mint"}]
    pairs = [preference.encode_pair(r, tok, opts) for r in rows]
    arrays = sft.assemble([e for p in pairs for e in p], 64, False)
    batch = make_batch({k: v for k, v in arrays.items() if k != "lengths"},
                       sft.to_token_data(arrays, 10, "t", cfg, None), 4)
    return pairs, {k: v[0] for k, v in batch.items()}


@pytest.mark.parametrize("kind,eps,ld_alpha,sft_weight,chunks", [
    ("sigmoid", 0.0, 1.0, 0.0, 0), ("hinge", 0.0, 1.0, 0.0, 4), ("robust", 0.2, 1.0, 0.0, 0),
    ("ipo", 0.0, 1.0, 0.0, 0), ("sigmoid_norm", 0.0, 1.0, 0.0, 2),
    ("cdpo", 0.3, 1.0, 0.0, 0), ("cdpo", 0.8, 1.0, 0.0, 2),         # MaxText's use_dpo
    ("sigmoid", 0.0, 0.3, 0.0, 4), ("ipo", 0.0, 0.5, 0.0, 0),       # LD-DPO
    ("sigmoid", 0.0, 1.0, 0.7, 0), ("robust", 0.1, 0.5, 0.4, 2)])   # RPO
@pytest.mark.slow
def test_loss_matches_pgs_formulas_on_transformers_logprobs(models, encoded, kind, eps,
                                                            ld_alpha, sft_weight, chunks):
    policy, ref = models
    pairs, micro = encoded
    seqs = [e for p in pairs for e in p]
    pol = [_hf_logps(policy, e.ids) for e in seqs]
    rf = [_hf_logps(ref, e.ids) for e in seqs]
    masks = [(e.weights[1:] > 0).astype(np.float64) for e in seqs]
    beta = 0.5
    want, rewards = _numpy_loss(pol, rf, masks, kind, beta, eps, ld_alpha, sft_weight)
    cfg = dpo.DPOConfig(kind, beta, eps, ld_alpha, sft_weight)
    model_cfg, p_params = from_hf(policy)
    _, r_params = from_hf(ref)
    micro = {k: jnp.asarray(v) for k, v in micro.items()}
    loss, _, metrics = dpo.micro_loss(p_params, r_params, micro, model_cfg, cfg,
                                      num_chunks=chunks)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(metrics["rewards/chosen"]), rewards[0::2].mean(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(metrics["rewards/margins"]),
                               (rewards[0::2] - rewards[1::2]).mean(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_policy_equal_to_reference_gives_log2(models, encoded):
    policy, _ = models
    _, micro = encoded
    model_cfg, params = from_hf(policy)
    micro = {k: jnp.asarray(v) for k, v in micro.items()}
    loss, _, m = dpo.micro_loss(params, params, micro, model_cfg, dpo.DPOConfig())
    assert abs(float(loss) - np.log(2)) < 1e-6 and abs(float(m["rewards/margins"])) < 1e-7


@pytest.mark.parametrize("kind,ld_alpha", [("sigmoid", 1.0), ("ipo", 0.5)])
def test_validation_metrics_match_pgs_formulas(models, tmp_path, kind, ld_alpha):
    """DPO validation on data.eval_dataset: pgs's eval metrics from the scores of every eval
    pair (transformers' log-probs, NumPy formulas); the reference runs only at the first run."""
    from jaxtrain.dpo_eval import PreferenceEvaluator

    policy, ref = models
    rows = [{"prompt": "what follows red?", "chosen": "blue green", "rejected": "gold"},
            {"prompt": "what follows teal?", "chosen": "plum", "rejected": "sand jade rose"},
            {"prompt": "what follows gold?", "chosen": "mint", "rejected": "rust"}]
    data = write_jsonl(tmp_path / "p.jsonl", _pairs(4))
    ev_file = write_jsonl(tmp_path / "eval.jsonl", rows)
    cfg = _config(tmp_path, policy, f"dataset: {data}, eval_dataset: {ev_file}, eval_every: 2",
                  dpo_=f"loss_type: {kind}, ld_alpha: {ld_alpha}, beta: 0.5")
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    opts = preference.PairOptions.from_config(cfg, preference.source(cfg))
    seqs = [e for r in rows for e in preference.encode_pair(r, tok, opts)]
    masks = [(e.weights[1:] > 0).astype(np.float64) for e in seqs]
    want, rewards = _numpy_loss([_hf_logps(policy, e.ids) for e in seqs],
                                [_hf_logps(ref, e.ids) for e in seqs], masks, kind, 0.5, 0.0,
                                ld_alpha, 0.0)
    model_cfg, p_params = from_hf(policy)
    _, r_params = from_hf(ref)
    ev = PreferenceEvaluator.from_config(cfg, model_cfg)
    assert ev.due(2) and not ev.due(1)
    ev.attach_reference(r_params)
    got = ev.run(p_params, 2)
    assert got["val_pairs"] == 3   # two batches of two pairs, the second half filler
    np.testing.assert_allclose(got["val_loss"], want, rtol=1e-5, atol=1e-6)
    rc, rr = rewards[0::2], rewards[1::2]
    for key, value in [("chosen", rc.mean()), ("rejected", rr.mean()),
                       ("margins", (rc - rr).mean()), ("accuracies", (rc > rr).mean())]:
        np.testing.assert_allclose(got[f"val/rewards/{key}"], value, rtol=1e-5, atol=1e-6)
    ev.attach_reference(None)      # the reference's scores are kept from the first run
    again = ev.run(p_params, 4)
    assert again["val_loss"] == got["val_loss"]
    same = PreferenceEvaluator.from_config(cfg, model_cfg)
    same.attach_reference(p_params)   # policy = reference: log 2 and no margin
    at_start = same.run(p_params, 0)
    if kind == "sigmoid":
        assert abs(at_start["val_loss"] - np.log(2)) < 1e-6
    assert abs(at_start["val/rewards/margins"]) < 1e-7 and at_start["val/rewards/accuracies"] == 0


# ---------------------------------------------------------------- data


def test_pairs_rows_and_skips_are_counted(models, tmp_path, caplog):
    policy, _ = models
    good = _pairs(6)
    long = " ".join(WORDS * 6)
    bad = [{"prompt": "what follows red?", "chosen": "blue"},                 # no rejected
           {"prompt": "what follows red?", "chosen": "", "rejected": "x"},    # empty chosen
           {"prompt": "what follows red?", "chosen": long, "rejected": "gold"},   # too long
           {"prompt": "what follows red?", "chosen": "blue", "rejected": "blue"},  # identical
           {"prompt": "q", "chosen": 5, "rejected": "x"},                      # malformed
           {"prompt": "what follows red?", "chosen": "blue", "rejected": long}]    # cut
    implicit = {"chosen": [{"role": "user", "content": "what follows red?"},
                           {"role": "assistant", "content": "blue"}],
                "rejected": [{"role": "user", "content": "what follows red?"},
                             {"role": "assistant", "content": "gold"}]}
    data = write_jsonl(tmp_path / "p.jsonl", good + bad + [implicit])
    with caplog.at_level(logging.INFO, logger="jaxtrain.data.preference"):
        td = training_data(_config(tmp_path, policy, f"dataset: {data}"))
    assert td.pairs and td.num_samples == 2 * 8   # 6 good + the cut rejected + implicit
    log = caplog.text
    for reason in ("1 no rejected", "1 no chosen", "1 chosen longer than max_seq_length",
                   "1 chosen and rejected identical", "1 malformed"):
        assert reason in log, log
    w = td.samples[0]["weights"]
    assert w.sum() > 0
    with pytest.raises(ConfigError, match="p.jsonl.*no usable preference pair"):
        write_jsonl(tmp_path / "p.jsonl", bad[:2])
        training_data(_config(tmp_path, policy, f"dataset: {data}"))
    # not truncating: the long rejected row is dropped instead
    write_jsonl(tmp_path / "p.jsonl", good + bad[-1:])
    td = training_data(_config(tmp_path, policy, f"dataset: {data}", "dpo.truncate_rejected=false"))
    assert td.num_samples == 12


def test_pair_order_keeps_pairs_together():
    order = PairOrder(np.arange(20), seed=3)
    for start in (0, 20, 40):
        got = [order.index(j) for j in range(start, start + 20)]
        assert sorted(got) == list(range(20))
        assert all(got[k] % 2 == 0 and got[k + 1] == got[k] + 1 for k in range(0, 20, 2))
    assert [order.index(j) for j in range(20)] != [order.index(j) for j in range(20, 40)]


@pytest.mark.parametrize("setting", ["data.sources=[{dataset: a.jsonl}]", "data.pretokenize=true",
                                     "plugins.dft=true", "parallel.context_parallel=true",
                                     "memory.gradient_release=true", "memory.seco=true",
                                     "preprocess.enabled=true",
                                     "data.pretrain_replay_dataset=r.jsonl",
                                     "data.eval_sources=[{dataset: a.jsonl}]"])
def test_bad_combinations_exit_2(models, tmp_path, setting):
    from jaxtrain import train

    policy, _ = models
    data = write_jsonl(tmp_path / "p.jsonl", _pairs(4))
    cfg = tmp_path / "pgs.yml"
    _config(tmp_path, policy, f"dataset: {data}")
    assert train.main([str(cfg), setting, "--dry-run"]) == 2


# ---------------------------------------------------------------- learning


DPO_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "pgs" / "dpo_qwen35_08b.yaml"


@pytest.mark.slow
def test_pgs_dpo_file_runs_unchanged_and_its_output_loads_in_transformers(models, tmp_path):
    """palingenesis configs/dpo_qwen35_08b.yaml as published, run in a folder holding what it
    names: the SFT model at ./checkpoints/qwen35-08b-sft/final and pgs-format pairs (reasoning,
    per-row chat_template_kwargs) at ./data/dpo/{train,eval}.jsonl."""
    import shutil

    from jaxtrain import train

    policy, _ = models
    shutil.copytree(policy, tmp_path / "checkpoints" / "qwen35-08b-sft" / "final")
    rows = [{"prompt": [r["prompt"][-1]],
             "chosen": [{"role": "assistant", "content": r["chosen"], "reasoning": "recall"}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}],
             "chat_template_kwargs": {"enable_thinking": i % 2 == 0}}
            for i, r in enumerate(_conditional_pairs(64))]
    write_jsonl(tmp_path / "data" / "dpo" / "train.jsonl", rows)
    write_jsonl(tmp_path / "data" / "dpo" / "eval.jsonl", rows[:8])
    shutil.copy(DPO_FILE, tmp_path / "dpo.yaml")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert train.main(["dpo.yaml"]) == 0
    finally:
        os.chdir(cwd)
    out = tmp_path / "checkpoints" / "qwen35-08b-dpo"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "rewards/accuracies" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]   # 64 pairs / (2 pairs x 8 accumulation)
    assert abs(steps[0]["dpo/loss"] - np.log(2)) < 1e-3          # bf16 compute (train.bf16)
    val = [r for r in metrics if "val/rewards/accuracies" in r]
    assert val and val[-1]["val_pairs"] == 8
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = torch.tensor([tok.apply_chat_template(pair_task(1)[0]["messages"], tokenize=True,
                                                return_dict=True)["input_ids"]])
    with torch.no_grad():
        theirs = model(ids).logits.numpy()
    model_cfg, params = from_hf(out / "final")
    np.testing.assert_allclose(np.asarray(forward(params, ids.numpy().astype(np.int32),
                                                  model_cfg)), theirs, atol=1e-4, rtol=1e-4)
    moved = max(float((a - b).abs().max().detach()) for a, b in zip(model.parameters(),
                                                           start.parameters()))
    assert moved > 0   # trained (lr 5e-7) from the SFT weights


def _conditional_pairs(n=64):
    """Each question's right answer chosen, the next question's right answer rejected: every
    word is preferred after one question and dispreferred after another, so only a model that
    reads the question can tell the sides apart."""
    task = pair_task(n)
    right = {r["messages"][1]["content"]: r["messages"][-1]["content"] for r in task}
    order = [f"what follows {w}?" for w in WORDS]
    return [{"prompt": r["messages"][:-1], "chosen": r["messages"][-1]["content"],
             "rejected": right[order[(order.index(r["messages"][1]["content"]) + 1) % 16]]}
            for r in task]


@pytest.mark.slow
def test_dpo_run_learns_the_preference(models, tmp_path):
    """Preference accuracy on the eval pairs rises from chance to > 90% (train and validation
    metrics); with sft_weight the chosen answers' log-probs rise rather than collapse."""
    from jaxtrain import train

    policy, _ = models
    data = write_jsonl(tmp_path / "p.jsonl", _conditional_pairs(64))
    held = write_jsonl(tmp_path / "eval.jsonl", _conditional_pairs(16))
    cfg = tmp_path / "pgs.yml"
    _config(tmp_path, policy, f"dataset: {data}, eval_dataset: {held}, eval_every: 10, "
            "packing: false", steps=80, batch=8, dpo_="beta: 0.5, sft_weight: 0.1")
    text = cfg.read_text().replace("warmup_ratio: 0", "warmup_ratio: 0, learning_rate: 3.0e-3, "
                                   "logging_steps: 1, save_steps: 1000, bf16: false")
    cfg.write_text(text)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert train.main([str(cfg)]) == 0
    finally:
        os.chdir(cwd)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rewards/accuracies" in r]
    val = [r for r in rows if "val/rewards/accuracies" in r]
    first, last = steps[0], steps[-1]
    print("train accuracy", [round(r["rewards/accuracies"], 2) for r in steps[::5]])
    print("val accuracy", [(r["step"], round(r["val/rewards/accuracies"], 2)) for r in val])
    print("logps/chosen", [round(r["logps/chosen"], 2) for r in steps[::5]])
    assert first["step"] == 1 and abs(first["dpo/loss"] - np.log(2)) < 1e-5
    assert abs(first["rewards/margins"]) < 1e-6
    assert val[0]["val/rewards/accuracies"] < 0.7 and val[0]["val_pairs"] == 16
    assert val[-1]["val/rewards/accuracies"] > 0.9
    assert np.mean([r["rewards/accuracies"] for r in steps[-5:]]) > 0.9
    assert last["logps/chosen"] > first["logps/chosen"] + 5   # the chosen side rose


def _metrics_of(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_precomputed_reference_scores_train_alike_and_are_cached(models, tmp_path):
    """dpo.precompute_reference: the same losses, rewards and validation as the reference kept
    in memory (its scores ride in the batches instead), cached in the run directory (a later
    run reading the cache: tests/train/test_dpo_maxtext.py)."""
    from jaxtrain import train

    policy, ref = models
    data = write_jsonl(tmp_path / "p.jsonl", _conditional_pairs(16))
    held = write_jsonl(tmp_path / "eval.jsonl", _conditional_pairs(16)[:5])
    runs = {}
    for name, extra in (("kept", []), ("pre", ["dpo.precompute_reference=true"])):
        cfg = tmp_path / f"{name}.yml"
        _config(tmp_path, policy, f"dataset: {data}, eval_dataset: {held}, eval_every: 2",
                steps=3, batch=2, dpo_=f"reference_model: {ref}, ld_alpha: 0.5, beta: 0.5")
        (tmp_path / "pgs.yml").rename(cfg)
        text = cfg.read_text().replace(str(tmp_path / "out"), str(tmp_path / name))
        cfg.write_text(text.replace("warmup_ratio: 0", "warmup_ratio: 0, learning_rate: 1.0e-3, "
                                    "logging_steps: 1, save_steps: 1000, bf16: false"))
        assert train.main([str(cfg), *extra]) == 0
        runs[name] = _metrics_of(tmp_path / name)
    assert (tmp_path / "pre" / "dpo_reference_scores.npz").is_file()
    assert not (tmp_path / "kept" / "dpo_reference_scores.npz").exists()
    assert len(runs["kept"]) == len(runs["pre"])
    for a, b in zip(runs["kept"], runs["pre"]):
        for key in ("dpo/loss", "rewards/margins", "rewards/chosen", "val_loss",
                    "val/rewards/margins"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5)
    assert any(abs(r.get("rewards/margins", 0)) > 1e-3 for r in runs["pre"])  # ref != policy
    assert any("val_loss" in r for r in runs["pre"])


def test_field_names_reference_and_knobs_reach_the_run(models, tmp_path):
    """dpo.prompt_field/chosen_field/rejected_field pick the row's fields; dpo.reference_model
    names the frozen reference (empty: model.name_or_path); dpo.ld_alpha and
    dpo.disable_dropout reach the loss config."""
    policy, ref = models
    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in _pairs(4)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = _config(tmp_path, policy, f"dataset: {data}", "dpo.prompt_field=q",
                  "dpo.chosen_field=good", "dpo.rejected_field=bad",
                  f"dpo.reference_model={ref}", "dpo.ld_alpha=0.25",
                  "dpo.disable_dropout=false")
    assert training_data(cfg).num_samples == 8
    assert dpo.reference_dir(cfg) == ref
    d = dpo.DPOConfig.from_config(cfg)
    assert d.ld_alpha == 0.25 and d.disable_dropout is False
    assert dpo.reference_dir(_config(tmp_path, policy, f"dataset: {data}")) == policy
    with pytest.raises(ConfigError, match="no usable preference pair"):   # default fields absent
        training_data(_config(tmp_path, policy, f"dataset: {data}"))
