"""benchmarks/attention.py: its FLOP count, and a CPU smoke run of the whole CLI."""
import importlib.util
import json
import sys

import pytest
from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("attention_bench",
                                                  ROOT / "benchmarks" / "attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_visible_pairs_counts_the_attended_pairs():
    pairs = _bench().visible_pairs
    assert pairs(8, 8, causal=False, window=None) == 64
    assert pairs(8, 8, causal=True, window=None) == 8 * 9 // 2
    assert pairs(8, 8, causal=True, window=3) == 1 + 2 + 3 * 6
    assert pairs(4, 8, causal=True, window=None) == 5 + 6 + 7 + 8


@pytest.mark.slow
def test_smoke_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert _bench().main(["--smoke", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "f+b TF/s" in table and "cuDNN attention has no sinks" in table
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows if "error" not in r} >= {"flash", "xla"}
