"""benchmarks/step_breakdown.py: HLO parsing, classification, exclusive times, and one real
profile of a tiny config turned into the tables."""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_breakdown as sb  # noqa: E402

HLO = """\
HloModule jit_step

%fused_computation.1 (param_0: f32[8,16], param_1: f32[16,32]) -> f32[8,32] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.3 = f32[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.2 (param_0.1: f32[8,32]) -> f32[32,8] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  ROOT %transpose.1 = f32[32,8]{0,1} transpose(%param_0.1), dimensions={1,0}
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> (f32[32,8], f32[8,32]) {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %ynn_fusion.1 = f32[8,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(step)/while/body/transpose(jvp(decoder_layer))/mlp/dot_general"}
  %copy_fusion = f32[32,8]{1,0} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(step)/jvp(loss)/transpose"}
  %exp.1 = f32[8,32]{1,0} exponential(%ynn_fusion.1), metadata={op_name="jit(step)/optimizer/exp"}
  %all-reduce.1 = f32[8,32]{1,0} all-reduce(%exp.1), replica_groups={}, to_apply=%add
  ROOT %tuple = (f32[32,8]{1,0}, f32[8,32]{1,0}) tuple(%copy_fusion, %all-reduce.1)
}
"""


def test_parse_and_classify():
    ops, computations = sb.parse_hlo(HLO)
    assert {"ynn_fusion.1", "copy_fusion", "exp.1", "dot.3", "all-reduce.1"} <= set(ops)
    cat = {n: sb.category(ops[n], ops, computations)
           for n in ("ynn_fusion.1", "copy_fusion", "exp.1", "all-reduce.1")}
    assert cat == {"ynn_fusion.1": "matmul", "copy_fusion": "cross-entropy",
                   "exp.1": "optimizer update", "all-reduce.1": "collectives"}
    assert sb.category(None, ops, computations) == "runtime"
    assert sb.matmul_flops(ops["ynn_fusion.1"], ops, computations) == 2 * 8 * 32 * 16
    assert sb.matmul_flops(ops["exp.1"], ops, computations) == 0
    name = ops["ynn_fusion.1"].op_name
    assert (sb.scope_of(name), sb.pass_of(name)) == ("mlp", "backward")
    assert sb.scope_of(ops["copy_fusion"].op_name) == "loss"
    assert sb.pass_of("jit(step)/checkpoint/rematted_computation/attention/dot") == "recompute"
    assert sb.scope_of("jit(step)/add") == "other"


GPU_HLO = """\
ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %gemm.1 = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), """ \
    """custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":""" \
    """{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
  %fmha = (bf16[64,16]{1,0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %kernel = bf16[64,16]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_gpu_library_calls_are_classified_and_counted():
    ops, computations = sb.parse_hlo(GPU_HLO)
    got = [sb.category(ops[n], ops, computations) for n in ("gemm.1", "fmha", "kernel")]
    assert got == ["matmul", "fused attention (cuDNN)", "Pallas kernels"]
    assert sb.matmul_flops(ops["gemm.1"], ops, computations) == 2 * 64 * 16 * 32


def test_exclusive_times_subtract_nested_events():
    # a while loop (0..100) holding two ops (10..30, 40..90); another thread with one op
    lines = [[("while.1", 0, 100), ("a", 10, 20), ("b", 40, 50)], [("c", 5, 10)]]
    got = {n: excl for n, _, _, excl in sb.exclusive_times(lines)}
    assert got == {"while.1": 30, "a": 20, "b": 50, "c": 10}
    assert sb.busy_union([(0, 10), (5, 20), (30, 40)]) == 30


def test_breakdown_tables_sum_to_the_thread_time():
    ops, computations = sb.parse_hlo(HLO)
    events = [[("ynn_fusion.1", 0, 4_000_000), ("copy_fusion", 4_000_000, 1_000_000),
               ("ThunkExecutor::Execute (wait for completion)", 0, 9_000_000)],
              [("exp.1", 1_000_000, 2_000_000), ("unknown-runtime", 6_000_000, 1_000_000)]]
    table = sb.breakdown(events, ops, computations, steps=2)
    assert table["categories"]["matmul"] == {"ms": 2.0, "share": 0.5}
    assert table["categories"]["runtime"]["ms"] == 0.5
    assert table["thread_ms"] == 4.0
    assert table["busy_ms"] == 2.5 and table["span_ms"] == 2.5
    assert table["scopes"] == {"mlp/backward": 2.0, "optimizer/update": 1.0, "loss/forward": 0.5}
    assert table["matmul_gflop"] == 2 * 8 * 32 * 16 / 1e9 / 2
    assert [r["op"] for r in table["top_ops"]] == ["ynn_fusion.1", "exp.1", "copy_fusion"]


@pytest.mark.slow
def test_profile_of_a_tiny_run(tmp_path):
    """The whole tool on a tiny config: matmuls, the loss and the optimizer show up."""
    tiny = ["mock_data=true", "vocab_size=512", "seq_length=32", "max_position_embeddings=32",
            "num_layers=2", "hidden_size=64", "num_attention_heads=4", "micro_batch_size=2",
            "global_batch_size=2", "lr_warmup_iters=0", "lr=1e-3"]
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, "benchmarks/step_breakdown.py", "", *tiny,
                           "--warmup", "2", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())
    assert {"matmul", "cross-entropy", "optimizer update"} <= set(table["categories"])
    assert table["scopes"]["optimizer/update"] > 0 and table["matmul_gflop"] > 0
    assert "step " in done.stdout and "category" in done.stdout
