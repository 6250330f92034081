"""benchmarks/quant.py: FP8 GEMM counting, and a CPU smoke run of the whole CLI."""
import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT


def _bench():
    spec = importlib.util.spec_from_file_location("quant_bench", ROOT / "benchmarks" / "quant.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fp8_gemm_count_reads_compiled_hlo():
    hlo = ('%a = f32[8,8]{1,0} custom-call(f8e4m3fn[8,8]{1,0} %x), '
           'custom_call_target="__cublas$lt$matmul$f8"\n'
           '%b = f32[8,8]{1,0} dot(f8e4m3fn[8,8]{1,0} %p, f8e5m2[8,8]{1,0} %q)\n'
           '%c = f32[8,8]{1,0} dot(f32[8,8]{1,0} %p, f32[8,8]{1,0} %q)')
    assert _bench().fp8_gemms(hlo) == 2


@pytest.mark.slow
def test_smoke_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "quant.json"
    assert _bench().main(["--smoke", "--json", str(out)]) == 0
    assert "fp8-delayed" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["none", "fp8-delayed"]
    assert all("step_s" in r for r in rows), rows
