"""Real upstream config files load, or are refused by name — never an unknown key or a crash.

``tests/data/upstream_corpus.json`` lists the corpus (``python tools/corpus.py scan UPSTREAM``):
Megatron-LM's example and functional-test command lines (stored as argument lists, so they run
here), and files of Primus, MaxText and palingenesis checkouts (read from ``$JAXTRAIN_UPSTREAM``,
a folder holding ``primus/``, ``maxtext/``, ``palingenesis/``; those tests skip without it).
"""
import collections
import json
import os
import pathlib

import pytest

from tests.conftest import ROOT

from jaxtrain.config import ConfigError, load_config

CORPUS = json.loads((ROOT / "tests" / "data" / "upstream_corpus.json").read_text())
UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
# Entries that load today (the floor a change may not fall below), per dialect.
LOADS = {"megatron-lm": 167, "primus": 282, "maxtext": 129, "pgs": 23}
# config.json of the models pgs's files name (published values), for a local Hugging Face cache.
HF_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "Qwen/Qwen2.5-3B-Instruct": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True),
    "Qwen/Qwen3-0.6B": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True),
}
# The Qwen3.5 and Gemma 4 repositories' config.json are not available offline: transformers'
# own default configuration of each family stands in (the files' loading does not depend on
# the sizes; their model_type, text_config and layer kinds are the family's).
STAND_INS = {
    **{name: "Qwen3_5Config" for name in ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-4B")},
    **{name: "Qwen3_5MoeConfig" for name in ("Qwen/Qwen3.5-35B-A22B",
                                              "Qwen/Qwen3.5-35B-A3B-Instruct")},
    **{name: "Gemma4Config" for name in ("google/gemma-4-12B-it", "google/gemma-4-E2B-it",
                                         "google/gemma-4-E4B-it")},
}


def outcome(entry) -> tuple[str, str]:
    file = str(UPSTREAM / entry["file"]) if entry["file"] else None
    try:
        load_config(file, entry["args"], primus_path=str(UPSTREAM / "primus"))
        return "load", ""
    except ConfigError as e:
        return "refused", " | ".join(e.problems)


def check(dialect):
    counts, bad = collections.Counter(), []
    for entry in (e for e in CORPUS if e["dialect"] == dialect):
        result, message = outcome(entry)
        counts[result] += 1
        if "unknown key" in message:
            bad.append(f"{entry['id']}: {message[:200]}")
    assert not bad, "refused by an unknown key instead of by name:\n" + "\n".join(bad)
    assert counts["load"] >= LOADS[dialect], counts


def test_megatron_lm_command_lines():
    check("megatron-lm")


@pytest.mark.slow
@pytest.mark.skipif(not (UPSTREAM / "primus").is_dir(), reason="JAXTRAIN_UPSTREAM has no Primus")
def test_primus_experiments():
    check("primus")


@pytest.mark.slow
@pytest.mark.skipif(not (UPSTREAM / "maxtext").is_dir(), reason="JAXTRAIN_UPSTREAM has no MaxText")
def test_maxtext_files_and_command_lines():
    check("maxtext")


@pytest.mark.slow
@pytest.mark.skipif(not (UPSTREAM / "palingenesis").is_dir(),
                    reason="JAXTRAIN_UPSTREAM has no palingenesis")
def test_pgs_files(tmp_path, monkeypatch):
    import transformers

    stand_ins = {repo: getattr(transformers, name)().to_dict()
                 for repo, name in STAND_INS.items()}
    for repo, config in {**HF_CONFIGS, **stand_ins}.items():
        snapshot = tmp_path / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / "r"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config, default=str))
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    check("pgs")
