"""Parallel layouts on 8 CPU devices: same losses as one device, shardings as the knobs say.

The layouts run in subprocesses (``layout_worker.py``: the device count is fixed when JAX
starts). Default run: one device and DP x TP x FSDP (with SP) are trained and five layouts'
shardings checked. ``-m slow`` trains FSDP, gradient accumulation and every other layout,
checks the rest's shardings and gather counts, and the MoE expert-parallel layouts.
"""
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.parallel.layout_worker import LAYOUTS

TRAINED = ["one", "fsdp", "tp_fsdp"]  # tp_fsdp: data x tensor, SP on
ACCUMULATED = ["one_ga4", "zero1_ga4"]   # 4 microbatches: reduced once per step
REDUCTIONS = ["zero1_ga4", "zero2_ga4", "fsdp_ga4"]
GATHERS = ["torch_fsdp2", "fsdp_keep", "tp_recompute", "tp_distribute"]
REPLICAS = ["tp"]
MOE = [n for n in LAYOUTS if n.startswith("moe")]   # compared among themselves
CP = [n for n in LAYOUTS if n.startswith("cp")]   # trained in a slow test
GDN = [n for n in LAYOUTS if n.startswith(("gdn", "kda", "hybrid", "small_gemma4"))]  # own tests
BUILT = [n for n in LAYOUTS
         if n not in TRAINED + GATHERS + REPLICAS + MOE + CP + GDN + ACCUMULATED + REDUCTIONS]
# The default run trains one device and DP x TP x FSDP and checks these layouts' shardings;
# the rest (FSDP trained, gradient accumulation, the gather counts, more sharding checks) run
# with -m slow in a second worker.
SPECS = ["dp", "zero1", "pgs_fsdp", "tp_sp", "offload"]
MORE_SPECS = [n for n in BUILT if n not in SPECS]
MORE = ["fsdp"] + ACCUMULATED + REDUCTIONS + GATHERS + MORE_SPECS
# Compile quickly: these programs are tiny and run a few steps (both sides of each comparison).
FAST_COMPILE = "--xla_backend_optimization_level=0"
WQ = "['layers']['attn']['wq']"  # [D, L, N, H]: embed, layers, q_heads, kv


def _worker(tmp_path, *args):
    out = subprocess.run([sys.executable, str(ROOT / "tests/parallel/layout_worker.py"),
                          str(tmp_path), *args], capture_output=True, text=True, cwd=ROOT,
                         timeout=1200, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                            "PYTHONPATH": str(ROOT), "XLA_FLAGS": FAST_COMPILE})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("layouts"), "train:one,tp_fsdp",
                   f"specs:{','.join(SPECS)}", f"replicas:{','.join(REPLICAS)}")


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("more"), f"train:{','.join(['fsdp'] + ACCUMULATED)}",
                   f"reductions:{','.join(REDUCTIONS)}", f"specs:{','.join(MORE_SPECS)}",
                   f"gathers:{','.join(GATHERS)}")


@pytest.fixture
def got(request):
    """name -> that layout's results, from the default worker or (slow tests) the second."""
    def get(name):
        return request.getfixturevalue("more" if name in MORE else "layouts")[name]
    return get


def _names(*names):
    """Parameters for the names, the second worker's marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in MORE else n for n in names]


@pytest.mark.slow
def test_accumulated_gradients_reduced_once_give_the_same_losses(more):
    assert len(more["zero1_ga4"]["losses"]) == 5
    assert more["zero1_ga4"]["losses"] == pytest.approx(more["one_ga4"]["losses"], rel=2e-6)


@pytest.mark.slow
def test_gradients_are_reduced_once_per_step_not_per_microbatch(more):
    """Data parallel with replicated parameters (ZeRO-1, ZeRO-2): no reduction inside the
    microbatch loop. FSDP reduce-scatters each microbatch's gradients (they live sharded,
    the GSPMD loop): it still reduces inside it."""
    for name in ("zero1_ga4", "zero2_ga4"):
        found = more[name]["reductions"]
        assert found["loop_found"] and found["in_loop"] == 0 < found["total"], (name, found)
    found = more["fsdp_ga4"]["reductions"]
    assert found["loop_found"] and found["in_loop"] > 0, found


def _run(got, name) -> dict:
    """Run ``name`` of ``got``: the ``got`` fixture (a function) or a fixture's dict."""
    return got(name) if callable(got) else got[name]


def _param(got, name, path=WQ):
    return _run(got, name)["params"][path]


def _opt(got, name, path=WQ):
    """Specs/memory of the optimizer-state leaves that mirror parameter ``path`` (Adam mu, nu)."""
    found = [v for k, v in _run(got, name)["opt_state"].items() if k.endswith(path)]
    assert len(found) == 2, _run(got, name)["opt_state"].keys()
    return found


@pytest.mark.parametrize("name", _names(*TRAINED[1:]))
def test_same_losses_as_one_device(got, name):
    assert len(got(name)["losses"]) == 5
    assert got(name)["losses"] == pytest.approx(got("one")["losses"], rel=2e-6)


@pytest.mark.slow
def test_context_parallel_strategies_same_losses_as_one_device(tmp_path):
    """The ring (cp4), cp_comm_type all_gather and a2a, and the ring with tensor parallelism
    and with FSDP (the attention alone, against one device: test_context_attention.py)."""
    got = _worker(tmp_path, f"train:one,{','.join(CP)}")
    for name in CP:
        assert got[name]["losses"] == pytest.approx(got["one"]["losses"], rel=2e-6), name


@pytest.mark.slow
def test_same_losses_as_one_device_other_layouts(tmp_path):
    others = BUILT + GATHERS + REPLICAS
    got = _worker(tmp_path, f"train:one,{','.join(others)}")
    for name in others:
        assert got[name]["losses"] == pytest.approx(got["one"]["losses"], rel=2e-6), name


def test_mesh_axes(got):
    assert got("zero1")["mesh"] == {"pipeline": 1, "replica": 1, "data": 8, "expert": 1,
                                    "context": 1, "tensor": 1}
    assert got("tp_sp")["mesh"]["tensor"] == 2 and got("tp_sp")["mesh"]["data"] == 4
    # tensor is the fastest axis: a TP pair is two neighbouring devices
    assert got("tp_sp")["devices"][:4] == [0, 1, 2, 3]
    assert list(got("tp")["mesh"])[0] == "pipeline"


@pytest.mark.slow
def test_mesh_axes_of_instances_and_pipeline(got):
    assert got("instances")["mesh"]["replica"] == 2
    assert list(got("tp_pp_dp")["mesh"])[:3] == ["replica", "data", "pipeline"]


def test_plain_data_parallel_replicates_everything(got):
    assert _param(got, "dp")["spec"] == [None] * 4
    assert all(o["spec"] == [None] * 4 for o in _opt(got, "dp"))


@pytest.mark.parametrize("name", _names("zero1", "zero2", "instances"))
def test_distributed_optimizer_shards_only_the_optimizer_state(got, name):
    assert _param(got, name)["spec"] == [None] * 4
    assert all(o["spec"] == ["data", None, None, None] for o in _opt(got, name))
    count = [v for k, v in got(name)["opt_state"].items() if k.endswith(".count")]
    assert count and all(c["spec"] == [] for c in count)


@pytest.mark.parametrize("name", _names("fsdp", "torch_fsdp2", "pgs_fsdp"))
def test_fsdp_shards_parameters_too(got, name):
    assert _param(got, name)["spec"] == ["data", None, None, None]
    assert _param(got, name, "['embedding']")["spec"] == [None, "data"]  # [V, D]: embed
    assert all(o["spec"] == ["data", None, None, None] for o in _opt(got, name))


@pytest.mark.parametrize("name", ["tp", "tp_sp"])
def test_tensor_parallel_splits_heads_mlp_and_vocab(got, name):
    assert _param(got, name)["spec"] == [None, None, "tensor", None]
    assert _param(got, name, "['layers']['attn']['wk']")["spec"] == [None, None, "tensor", None]
    assert _param(got, name, "['layers']['mlp']['wi_0']")["spec"] == [None, None, "tensor"]
    assert _param(got, name, "['layers']['mlp']['wo']")["spec"] == ["tensor", None, None]
    assert _param(got, name, "['embedding']")["spec"] == ["tensor", None]
    assert _param(got, name, "['layers']['attn_norm']['scale']")["spec"] == [None, None]


def test_data_by_tensor_with_fsdp(got):
    assert _param(got, "tp_fsdp")["spec"] == ["data", None, "tensor", None]
    assert _param(got, "tp_fsdp", "['embedding']")["spec"] == ["tensor", "data"]


def test_host_offload_of_parameters_and_a_share_of_the_optimizer_state(got):
    assert {v["memory"] for v in got("offload")["params"].values()} == {"pinned_host"}
    kinds = [v["memory"] for v in got("offload")["opt_state"].values()]
    assert "pinned_host" in kinds and "device" in kinds  # optimizer_offload_fraction 0.5
    mu, nu = _opt(got, "offload")
    assert (mu["memory"], nu["memory"]) == ("pinned_host", "device")
    assert {v["memory"] for v in got("dp")["params"].values()} == {"device"}


@pytest.mark.slow
def test_pin_cpu_params_false_uses_unpinned_host_memory(got):
    kinds = {o["memory"] for o in _opt(got, "unpinned")}
    assert kinds == {"unpinned_host"}
    assert {o["memory"] for o in _opt(got, "offload")} >= {"pinned_host"}


@pytest.mark.slow
def test_fsdp_keeps_gathered_weights_without_reshard_after_forward(got):
    """reshard_after_forward false: the forward's gathered weights serve the backward, so the
    step gathers fewer times than when it gathers again for the backward."""
    again, kept = (got(n)["all_gathers"] for n in ("torch_fsdp2", "fsdp_keep"))
    assert 0 < kept < again
    assert _param(got, "fsdp_keep")["spec"] == ["data", None, None, None]


def test_weight_hash_check_finds_a_drifted_replica(got):
    """check_weight_hash_across_dp_replicas_interval's check: identical copies pass; one
    device's corrupted copy of a TP-split weight is found."""
    found = got("tp")["replicas"]
    assert found["before"] == [] and found["after"] == ["['wq']"]


@pytest.mark.slow
def test_distribute_saved_activations_splits_the_saved_layer_inputs(got):
    """Full recompute saves each layer's input; split over the tensor axis it must be gathered
    again where the layer (and its recomputation) starts."""
    assert got("tp_distribute")["all_gathers"] > got("tp_recompute")["all_gathers"]


# ---------------------------------------------------------------- MoE: expert parallelism

EXPERTS = "['moe_layers']['moe']['experts']['wi_0']"   # [E, L, D, F]: exp, layers, embed, mlp
EXPERT_BIAS = "['moe_layers']['moe']['router']['expert_bias']"


@pytest.fixture(scope="module")
def moe_layouts(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("moe"), "train:moe,moe_ep2,moe_ep4")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_ep2", "moe_ep4"])
def test_expert_parallel_same_losses_as_ep1(moe_layouts, name):
    """EP 2 (allgather dispatch) and EP 4 (alltoall) on 8 devices (DP 8 either way): the
    losses, and the aux loss (per data-parallel rank, like Megatron's), of EP = 1."""
    got, ref = moe_layouts[name], moe_layouts["moe"]
    assert len(got["losses"]) == 5
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-6)
    assert got["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=2e-6)
    ep = moe_layouts[name]["mesh"]["expert"]
    assert ep == int(name[-1]) and moe_layouts[name]["mesh"]["data"] == 8 // ep
    assert _param(moe_layouts, name, EXPERTS)["spec"] == ["expert", None, None, None]
    assert _param(moe_layouts, "moe", EXPERTS)["spec"] == [None] * 4


@pytest.mark.slow
def test_expert_bias_is_state_outside_the_optimizer(moe_layouts):
    assert EXPERT_BIAS in moe_layouts["moe"]["params"]
    assert not any(k.endswith(EXPERT_BIAS) for k in moe_layouts["moe"]["opt_state"])
    assert len(_opt(moe_layouts, "moe", EXPERTS)) == 2


@pytest.mark.slow
def test_expert_parallel_with_capacity_and_tensor_parallel(tmp_path):
    """Capacity with padded buffers under EP 4 (allgather) and EP 2 (alltoall) against EP 1;
    EP 2 x TP 2 (expert FFNs split over the tensor axis) against TP 2 (both DP 4); EP with
    FSDP against EP 1; an MoE layer and a dense layer (two stacks scanned as one block) with
    full recompute of both under EP 4 against EP 1."""
    got = _worker(tmp_path, "train:moe,moe_capacity,moe_ep4_capacity,moe_ep2_a2a_capacity,"
                            "moe_tp,moe_ep2_tp,moe_ep2_fsdp,moe_mixed,moe_mixed_ep4_recompute")
    for name, ref in (("moe_ep4_capacity", "moe_capacity"),
                      ("moe_ep2_a2a_capacity", "moe_capacity"), ("moe_ep2_tp", "moe_tp"),
                      ("moe_ep2_fsdp", "moe"), ("moe_mixed_ep4_recompute", "moe_mixed")):
        assert got[name]["losses"] == pytest.approx(got[ref]["losses"], rel=2e-6), name
    assert _param(got, "moe_ep2_tp", EXPERTS)["spec"] == ["expert", None, None, "tensor"]
    assert _param(got, "moe_ep2_fsdp", EXPERTS)["spec"] == ["expert", None, "data", None]


@pytest.mark.slow
def test_gated_deltanet_hybrid_splits_its_heads_without_changing_the_losses(tmp_path):
    """A Gated DeltaNet + gated-attention model under TP 2 with SP and FSDP trains with the
    one-device losses; the linear layers' heads are split over the tensor axis."""
    got = _worker(tmp_path, "train:gdn,gdn_tp_sp_fsdp")
    assert got["gdn_tp_sp_fsdp"]["losses"] == pytest.approx(got["gdn"]["losses"], rel=2e-6)
    specs = got["gdn_tp_sp_fsdp"]["params"]
    wq = next(v for k, v in specs.items() if "linear_attn" in k and k.endswith("['wq']"))
    assert "tensor" in json.dumps(wq)


@pytest.mark.slow
def test_kimi_delta_attention_splits_its_heads_without_changing_the_losses(tmp_path):
    """Kimi Delta Attention layers under TP 2 with SP and FSDP train with the one-device
    losses; the per-channel decay bias and the gate projections split with the heads. So does
    Primus's hybrid KDA (two value heads per key head, the gate's bias)."""
    got = _worker(tmp_path, "train:kda,kda_tp_sp_fsdp,kda_primus,kda_primus_tp_sp_fsdp")
    for ref, leaves in (("kda", ("dt_bias", "wf_b", "wg_b")), ("kda_primus", ("wf_b", "bg_b"))):
        name = ref + "_tp_sp_fsdp"
        assert got[name]["losses"] == pytest.approx(got[ref]["losses"], rel=2e-6), name
        specs = got[name]["params"]
        for leaf in leaves:
            spec = next(v for k, v in specs.items()
                        if "linear_attn" in k and k.endswith(f"['{leaf}']"))
            assert "tensor" in json.dumps(spec), (name, leaf)


@pytest.mark.slow
def test_mamba_hybrid_splits_its_heads_without_changing_the_losses(tmp_path):
    """Megatron's hybrid stack (Mamba, attention, MLP, Mamba) under TP 2 with SP and FSDP trains
    with the one-device losses; the Mamba heads and groups are split over the tensor axis."""
    got = _worker(tmp_path, "train:hybrid,hybrid_tp_sp_fsdp")
    assert got["hybrid_tp_sp_fsdp"]["losses"] == pytest.approx(got["hybrid"]["losses"],
                                                                rel=2e-6)
    specs = got["hybrid_tp_sp_fsdp"]["params"]
    for leaf in ("wx", "wB", "wo"):
        spec = next(v for k, v in specs.items() if "mamba" in k and k.endswith(f"['{leaf}']"))
        assert "tensor" in json.dumps(spec), leaf


@pytest.mark.slow
def test_small_gemma4_splits_without_changing_the_losses(tmp_path):
    """Gemma 4 small (per-layer inputs, KV sharing, double-wide MLPs) under TP 2 with SP, FSDP
    and each layer recomputed trains with the one-device losses; the per-layer gates split over
    the tensor axis."""
    got = _worker(tmp_path, "train:small_gemma4,small_gemma4_tp_sp_fsdp")
    assert got["small_gemma4_tp_sp_fsdp"]["losses"] == pytest.approx(
        got["small_gemma4"]["losses"], rel=2e-6)
    specs = got["small_gemma4_tp_sp_fsdp"]["params"]
    gate = next(v for k, v in specs.items() if k.endswith("['ple_gate']"))
    assert "tensor" in json.dumps(gate)
