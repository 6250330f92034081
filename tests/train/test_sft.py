"""pgs SFT end to end: a real pgs file trains from a local Hugging Face model on local chat data,
and what it writes is a Hugging Face model that transformers loads with the same logits."""
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from sft_helpers import pair_task, write_chat_model, write_jsonl

from jaxtrain.models import forward, from_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "tests" / "data" / "pgs" / "quickstart.yaml"


def _hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _ours_logits(path, ids):
    cfg, params = from_hf(path)
    return np.asarray(forward(params, np.asarray(ids, np.int32), cfg))


def _in(folder, args):
    """``python -m jaxtrain.train args`` run in ``folder`` (in-process); the exit code."""
    import os

    from jaxtrain import train

    cwd = pathlib.Path.cwd()
    os.chdir(folder)
    try:
        return train.main([str(a) for a in args])
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """pgs's quickstart.yaml, unchanged but for the model and dataset, run in its own folder."""
    root = tmp_path_factory.mktemp("pgs_quickstart")
    model = write_chat_model(root / "model")
    data = write_jsonl(root / "chat.jsonl", pair_task(48))
    config = root / "quickstart.yaml"
    shutil.copy(QUICKSTART, config)
    return root, model, _in(root, [config, f"model.name_or_path={model}", f"data.dataset={data}"])


@pytest.mark.slow
def test_pgs_quickstart_trains_and_final_loads_in_transformers(chat_run):
    root, model, code = chat_run
    assert code == 0
    final = root / "output" / "final"
    names = {p.name for p in final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    tok = transformers.AutoTokenizer.from_pretrained(final)
    convo = pair_task(1)[0]["messages"]
    ids = [tok.apply_chat_template(convo, tokenize=True, return_dict=True)["input_ids"]]
    theirs, ours = _hf_logits(final, ids), _ours_logits(final, ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # the weights moved from the starting model (training happened, from the HF weights)
    assert np.abs(_hf_logits(model, ids) - theirs).max() > 1e-3
    rows = [json.loads(x) for x in (root / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and np.isfinite(rows[0]["loss"])


LEARN = """\
model: {name_or_path: model, torch_dtype: float32}
data: {dataset: chat.jsonl, max_seq_length: 48, packing: false}
train: {output_dir: out, max_steps: 150, per_device_batch_size: 16,
        gradient_accumulation_steps: 1, learning_rate: 3.0e-3, min_learning_rate: 3.0e-4,
        warmup_ratio: 0.05, save_steps: 1000, bf16: false, gradient_checkpointing: none,
        logging_steps: 50}
logging: {use_wandb: false, use_trackio: false}
"""


def _accuracy(path, rows) -> float:
    """Share of conversations whose greedy answer (transformers' generate) is the reference."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    right = 0
    for row in rows:
        prompt = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip()
        right += answer == row["messages"][-1]["content"]
    return right / len(rows)


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    rows = pair_task(64)
    model = write_chat_model(root / "model", rows=rows)
    write_jsonl(root / "chat.jsonl", rows)
    (root / "sft.yml").write_text(LEARN)
    return root, model, rows, _in(root, ["sft.yml"])


@pytest.mark.slow
def test_tiny_model_learns_the_assistant_answers(learned):
    """Greedy generation before/after SFT on the pairing task (16 questions, one answer each)."""
    root, model, rows, code = learned
    assert code == 0
    before, after = _accuracy(model, rows[:16]), _accuracy(root / "out" / "final", rows[:16])
    print(f"greedy accuracy before {before:.0%}, after {after:.0%}")
    assert before <= 0.25 and after >= 0.9


@pytest.mark.slow
def test_final_model_logits_match_transformers(learned):
    root, model, rows, _ = learned
    final = root / "out" / "final"
    tok = transformers.AutoTokenizer.from_pretrained(final)
    ids = [tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
           for r in rows[:2]]
    theirs, ours = _hf_logits(final, ids), _ours_logits(final, ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(_hf_logits(model, ids) - theirs).max() > 1e-2


MAXTEXT_SFT = ROOT / "tests" / "data" / "maxtext" / "sft.yml"


@pytest.mark.slow
def test_maxtext_sft_file_trains_on_local_chat_data(tmp_path):
    """MaxText's post_train/sft.yml, with a local hf_path folder and a local model."""
    model = write_chat_model(tmp_path / "model")
    write_jsonl(tmp_path / "ds" / "train_sft.jsonl", pair_task(16))
    write_jsonl(tmp_path / "ds" / "test_sft.jsonl", pair_task(4, seed=1))
    prompt_completion = [{"prompt": r["messages"][1]["content"],
                          "completion": r["messages"][2]["content"]} for r in pair_task(16)]
    write_jsonl(tmp_path / "pc" / "train_sft.jsonl", prompt_completion)
    shutil.copy(MAXTEXT_SFT, tmp_path / "sft.yml")
    common = ["run_name=t", "base_output_directory=out", f"model.name_or_path={model}",
              "steps=2", "per_device_batch_size=2", "max_target_length=64",
              "enable_checkpointing=false", "eval_interval=2", "eval_steps=1"]
    assert _in(tmp_path, ["sft.yml", "hf_path=ds", *common]) == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "t" / "metrics.jsonl").read_text()
            .splitlines()]
    assert any("val_loss" in r for r in rows)
    from jaxtrain.config import load_config
    from jaxtrain.data.sources import training_data

    def trained(*extra):
        cfg = load_config(tmp_path / "sft.yml", [f"hf_path={tmp_path / 'pc'}", *common,
                                                  "hf_eval_split=", *extra], world_size=1)
        assert cfg["use_sft"] and cfg["lora"]["enabled"] is False   # MaxText's lora: off
        arrays = training_data(cfg).samples.arrays
        return (arrays["weights"][:, 1:] > 0).sum(), (arrays["segment_ids"][:, 1:] > 0).sum()

    completion, _ = trained("train_data_columns=[prompt,completion]")
    everything, real = trained("train_data_columns=[prompt,completion]",
                               "sft_train_on_completion_only=false")
    assert 0 < completion < everything == real      # false: every real token carries loss


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "olmo3"])
def test_pgs_quickstart_on_gemma3_and_olmo3(family, tmp_path):
    """pgs's quickstart on a Gemma 3 and an OLMo 3 chat model: it trains, and the final export
    loads in transformers with jaxtrain's logits and moved away from the start."""
    model = write_chat_model(tmp_path / "model", family=family)
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(48))
    config = tmp_path / "quickstart.yaml"
    shutil.copy(QUICKSTART, config)
    assert _in(tmp_path, [config, f"model.name_or_path={model}", f"data.dataset={data}",
                          "train.max_steps=2"]) == 0
    final = tmp_path / "output" / "final"
    ids = [[3, 5, 7, 11, 13, 17, 19, 23]]
    theirs = _hf_logits(final, ids)
    np.testing.assert_allclose(_ours_logits(final, ids), theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(_hf_logits(model, ids) - theirs).max() > 1e-4
