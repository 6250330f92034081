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
LOADS = {"megatron-lm": 44, "primus": 185, "maxtext": 67, "pgs": 1}


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
def test_pgs_files():
    check("pgs")
