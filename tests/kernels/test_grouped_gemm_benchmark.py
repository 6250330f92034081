"""benchmarks/moe.py: its routing, and a CPU smoke run of the whole CLI."""
import importlib.util
import json
import sys

import numpy as np
import pytest
from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "benchmarks" / "moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_routing_sends_every_token_to_topk_experts():
    bench = _bench()
    sizes = bench.route(bench.Shape(500, 8, 8, 16, 4))
    assert sizes.shape == (16,) and sizes.dtype == np.int32
    assert sizes.sum() == 500 * 4 and sizes.max() <= 500


@pytest.mark.slow
def test_smoke_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert _bench().main(["--smoke", "--json", str(out)]) == 0
    assert "f+b TF/s" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r for r in rows)
    assert {(r["proj"], r["impl"]) for r in rows} == {
        (p, i) for p in ("gate_up", "down") for i in ("gmm", "ragged_dot")}
    assert all(r["err"] < 1e-2 for r in rows if r["impl"] == "gmm")
