"""MaxText's use_dpo onto jaxtrain's DPO: its post_train/dpo.yml runs on local hf files, pairs
are cut as its DPODataFormatting cuts them, the reference is the starting weights (kept in
checkpoints, so a resumed run compares with them), and its refusals hold."""
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from sft_helpers import WORDS, pair_task, write_chat_model, write_jsonl

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data import preference

DPO_YML = pathlib.Path(__file__).resolve().parents[1] / "data" / "maxtext" / "dpo.yml"
TINY = ["model_name=default", "override_model_config=true", "base_emb_dim=64",
        "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=128",
        "base_num_decoder_layers=2", "head_dim=16"]


class _Ids:
    """A tokenizer whose text is space-separated token ids (BOS 1, EOS 2)."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(t) for t in text.split()]}


def _cfg(T, prompt, bos=False, eos=False):
    return {"seq_length": T, "dpo.max_prompt_length": prompt, "add_bos": bos, "add_eos": eos}


def _ids(n0, n1):
    return " ".join(str(i) for i in range(n0, n1))


def _sides(pair):
    return [(list(e.ids), [int(w) for w in e.weights]) for e in pair]


def test_pairs_are_cut_as_maxtext_cuts_them():
    """Three columns: the prompt keeps its end, each answer its start (MaxText's own unit-test
    cases); two columns: the shared leading tokens are the prompt; answers are scored."""
    row = {"input": _ids(1, 10), "chosen": _ids(10, 20), "rejected": _ids(20, 30)}
    (c, cw), (r, rw) = _sides(preference.maxtext_pair(row, _Ids(), _cfg(9, 4),
                                                      ("input", "chosen", "rejected")))
    assert c == [6, 7, 8, 9, 10, 11, 12, 13, 14] and cw == [0] * 4 + [1] * 5
    assert r == [6, 7, 8, 9, 20, 21, 22, 23, 24] and rw == [0] * 4 + [1] * 5
    row = {"liked": "1 2 3 10 11", "disliked": "1 2 3 20 21 22"}
    (c, cw), (r, rw) = _sides(preference.maxtext_pair(row, _Ids(), _cfg(21, 10),
                                                      ("liked", "disliked")))
    assert c == [1, 2, 3, 10, 11] and cw == [0, 0, 0, 1, 1]
    assert r == [1, 2, 3, 20, 21, 22] and rw == [0, 0, 0, 1, 1, 1]
    # add_bos / add_eos frame every column before the prefix is found
    (c, cw), _ = _sides(preference.maxtext_pair(row, _Ids(), _cfg(21, 10, True, True),
                                                ("liked", "disliked")))
    assert c == [1, 1, 2, 3, 10, 11, 2] and cw == [0, 0, 0, 0, 1, 1, 1]
    with pytest.raises(preference.chat.SkipRow, match="identical"):
        preference.maxtext_pair({"p": "4", "a": "5 6", "b": "5 6"}, _Ids(), _cfg(9, 4),
                                ("p", "a", "b"))
    with pytest.raises(preference.chat.SkipRow, match="no chosen answer"):   # all shared
        preference.maxtext_pair({"a": "5 6", "b": "5 6"}, _Ids(), _cfg(9, 4), ("a", "b"))
    with pytest.raises(preference.chat.SkipRow, match="no b"):
        preference.maxtext_pair({"a": "5 6"}, _Ids(), _cfg(9, 4), ("a", "b"))


def _hh_pairs():
    """Anthropic/hh-rlhf-style two-column rows over the question -> answer task: the right
    answer chosen, the next question's rejected."""
    right = {r["messages"][1]["content"]: r["messages"][-1]["content"] for r in pair_task(16)}
    order = [f"what follows {w}?" for w in WORDS]

    def hh(q, a):
        return f"\n\nHuman: {q}\n\nAssistant: {a}"

    return [{"chosen": hh(q, right[q]), "rejected": hh(q, right[order[(i + 1) % 16]])}
            for i, q in enumerate(order)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("maxtext_dpo")
    write_chat_model(root / "model", rows=pair_task(64))
    write_jsonl(root / "ds" / "train.jsonl", _hh_pairs() * 2)
    write_jsonl(root / "ds" / "test.jsonl", _hh_pairs()[:6])
    shutil.copy(DPO_YML, root / "dpo.yml")
    return root


def _run(root, *args) -> int:
    from jaxtrain import train

    cwd = os.getcwd()
    os.chdir(root)
    try:
        return train.main([str(a) for a in args])
    finally:
        os.chdir(cwd)


def _common(root):
    return ["run_name=t", "base_output_directory=out", "hf_path=ds", "max_target_length=64",
            f"tokenizer_path={root / 'model'}", "learning_rate=1e-3", "checkpoint_period=2",
            "log_period=1", *TINY]


@pytest.mark.slow
def test_maxtext_dpo_file_trains_and_resumes_against_its_starting_weights(folder):
    """post_train/dpo.yml (hf_path 'Anthropic/hh-rlhf' swapped for a local folder, a tiny
    model): the reference is the starting weights, so step 1 scores log 2; a run resumed at
    step 2 reads them back from the checkpoint, so step 3's margins are not zero (they would be
    with the step-2 weights as reference); validation reads the hf test split."""
    shutil.rmtree(folder / "out", ignore_errors=True)
    assert _run(folder, "dpo.yml", *_common(folder), "steps=2") == 0
    assert (folder / "out" / "t" / "checkpoints" / "step_2" / "dpo_reference").is_dir()
    assert _run(folder, "dpo.yml", *_common(folder), "steps=4") == 0
    rows = [json.loads(x) for x in (folder / "out" / "t" / "metrics.jsonl").read_text()
            .splitlines()]
    steps = {r["step"]: r for r in rows if "rewards/margins" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    assert abs(steps[1]["dpo/loss"] - np.log(2)) < 1e-6 and steps[1]["rewards/margins"] == 0
    assert abs(steps[3]["rewards/margins"]) > 1e-3
    val = [r for r in rows if "val/rewards/accuracies" in r]
    assert val and val[-1]["val_pairs"] == 4   # eval_steps 2 x 2 pairs


@pytest.mark.parametrize("extra,why", [
    (["dpo.algo=orpo"], "ORPO is not built"),
    (["use_sft=true"], "only one of them"),
    (["dpo.max_prompt_length=64"], "less than max_target_length"),
    (["packing=true"], "packing is not supported"),
    (["train_data_columns=[text]"], "prompt, chosen, rejected"),
])
def test_maxtext_refusals(folder, extra, why):
    with pytest.raises(ConfigError, match=why):
        load_config(folder / "dpo.yml", [*_common(folder), *extra], world_size=1)


def test_maxtext_keys_reach_the_loss(folder):
    """use_dpo -> dpo.enabled with the cdpo loss; dpo_beta, dpo_label_smoothing and
    max_prompt_length (default: half of max_target_length) land on jaxtrain's knobs."""
    from jaxtrain import dpo

    cfg = load_config(folder / "dpo.yml", [*_common(folder), "dpo.dpo_beta=0.3",
                                           "dpo.dpo_label_smoothing=0.2"], world_size=1)
    d = dpo.DPOConfig.from_config(cfg)
    assert (d.loss_type, d.beta, d.label_smoothing) == ("cdpo", 0.3, 0.2)
    assert cfg["dpo.max_prompt_length"] == 32 and not cfg["packing"]
    assert dpo.reference_name(cfg) == ""


@pytest.mark.slow
def test_precomputed_scores_of_the_starting_weights_survive_only_in_their_cache(folder):
    """dpo.precompute_reference without a named reference: the starting weights are scored
    before step 1; a resumed run reads the cache; without it, it stops with exit 2 (the weights
    it would need are gone)."""
    shutil.rmtree(folder / "out", ignore_errors=True)
    args = ["dpo.yml", *_common(folder), "dpo.precompute_reference=true"]
    assert _run(folder, *args, "steps=2") == 0
    run = folder / "out" / "t"
    assert not (run / "checkpoints" / "step_2" / "dpo_reference").exists()
    assert _run(folder, *args, "steps=3") == 0
    assert "reference scores read from" in (run / "jaxtrain.log").read_text()
    (run / "dpo_reference_scores.npz").unlink()
    assert _run(folder, *args, "steps=4") == 2
