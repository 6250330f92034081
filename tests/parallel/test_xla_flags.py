"""Communication knobs -> XLA flags and jax.config options; every flag exists in our jaxlib."""
import logging
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from jaxtrain.config import ConfigError, load_config, registry
from jaxtrain.config.knob import INERT, MAPPED
from jaxtrain.parallel import xla_flags as xf
from jaxtrain.parallel.xla_flags import (AG_THRESHOLD, AR_THRESHOLD, CPU_COLLECTIVE_TIMEOUT,
                                         DETERMINISTIC, FLAG_NAMES, LHS, MULTI_STREAM_EINSUM,
                                         PIPELINED_AG, PIPELINED_AR, PIPELINED_RS, RS_THRESHOLD,
                                         WINDOWED_EINSUM)

# Every knob that can emit something, switched on (FSDP wins the AG/RS thresholds).
ALL_ON = {"overlap_grad_reduce": True, "overlap_param_gather": True,
          "overlap_param_gather_with_optimizer_step": True, "ddp_bucket_size": 1_000_000,
          "use_megatron_fsdp": True, "tp_comm_overlap": True, "deterministic_mode": True}

MAPPED_KNOBS = ("overlap_grad_reduce", "overlap_param_gather",
                "overlap_param_gather_with_optimizer_step", "ddp_num_buckets", "ddp_bucket_size",
                "suggested_communication_unit_size", "tp_comm_overlap", "tp_comm_overlap_ag",
                "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_wgrad",
                "tp_comm_bulk_dgrad", "deterministic_mode", "shardy",
                "distributed_timeout_minutes")
INERT_KNOBS = ("align_grad_reduce", "align_param_gather", "ddp_pad_buckets_for_high_nccl_busbw",
               "ddp_average_in_collective", "gradient_reduce_div_fusion")


def flags(platform="gpu", /, **cfg):
    """{flag name: value} emitted for ``cfg`` (other knobs at their defaults)."""
    out = {}
    for flag in xf.xla_flags(cfg, platform):
        name, value = flag[2:].split("=", 1)
        assert flag.startswith("--") and name not in out, flag
        out[name] = value
    return out


def _run_jax(code, xla_flags_text):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags_text,
           "PYTHONPATH": str(ROOT)}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_every_emitted_flag_exists_in_the_installed_jaxlib():
    emitted = xf.xla_flags(ALL_ON, "gpu") + xf.xla_flags(ALL_ON, "cpu")
    assert {f[2:].split("=")[0] for f in emitted} == set(FLAG_NAMES)
    # the device count proves XLA read this XLA_FLAGS; an unknown flag would abort it
    text = " ".join(["--xla_force_host_platform_device_count=3"] + emitted)
    result = _run_jax("import jax; print(len(jax.devices()), jax.jit(lambda a: a * 2)(21))", text)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3", "42"]


def test_cpu_jaxlib_parses_gpu_flags_and_rejects_unknown_ones():
    result = _run_jax("import jax; jax.devices()", "--xla_gpu_no_such_flag_for_jaxtrain=true")
    assert result.returncode != 0
    assert "Unknown flag" in result.stderr and "xla_gpu_no_such_flag_for_jaxtrain" in result.stderr


def test_defaults_leave_xla_alone():
    assert flags("gpu") == {}
    assert flags("cpu") == {CPU_COLLECTIVE_TIMEOUT: "3600"}
    assert xf.runtime_options({}) == {"jax_use_shardy_partitioner": False}


def test_cpu_gets_no_gpu_flags():
    assert flags("cpu", **ALL_ON) == {CPU_COLLECTIVE_TIMEOUT: "3600"}
    assert flags("cuda", **ALL_ON) == flags("rocm", **ALL_ON) == flags("gpu", **ALL_ON)
    assert CPU_COLLECTIVE_TIMEOUT not in flags("gpu", **ALL_ON)


@pytest.mark.parametrize("knob, expected", [
    ("overlap_grad_reduce", {LHS: "true", PIPELINED_AR: "true", PIPELINED_RS: "true"}),
    ("overlap_param_gather", {LHS: "true", PIPELINED_AG: "true"}),
    ("overlap_param_gather_with_optimizer_step", {LHS: "true"}),
    ("deterministic_mode", {DETERMINISTIC: "true"}),
    ("tp_comm_overlap", {WINDOWED_EINSUM: "0", MULTI_STREAM_EINSUM: "true", LHS: "true"}),
])
def test_switches(knob, expected):
    assert flags(**{knob: True}) == expected
    assert flags(**{knob: False}) == {}


def test_bucket_size_in_bytes():
    # elements x 4 (fp32 gradients); the all-gather moves weight_dtype parameters
    assert flags(ddp_bucket_size=1000) == {AR_THRESHOLD: "4000", RS_THRESHOLD: "4000",
                                           AG_THRESHOLD: "4000"}
    assert flags(ddp_bucket_size=1000, grad_reduce_in_bf16=True, weight_dtype="bfloat16") == {
        AR_THRESHOLD: "2000", RS_THRESHOLD: "2000", AG_THRESHOLD: "2000"}
    half = flags(ddp_bucket_size=1000, fp16=True)
    assert half[AR_THRESHOLD] == "2000"
    assert flags(ddp_bucket_size=1000, fp16=True,
                 accumulate_allreduce_grads_in_fp32=True)[AR_THRESHOLD] == "4000"


def test_num_buckets_split_the_parameters():
    assert xf.xla_flags({"ddp_num_buckets": 4}, "gpu", num_params=1001) == [
        f"--{AR_THRESHOLD}=1004", f"--{RS_THRESHOLD}=1004", f"--{AG_THRESHOLD}=1004"]
    model = {"vocab_size": 1000, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "ffn_hidden_size": 256}
    import math

    import jax

    from jaxtrain.models.config import ModelConfig
    from jaxtrain.models.params import abstract

    total = sum(math.prod(a.shape) for a in jax.tree.leaves(
        abstract(ModelConfig.from_config(model))))
    one = int(flags(ddp_num_buckets=1, **model)[AR_THRESHOLD])
    assert one == 4 * total
    two_tp = int(flags(ddp_num_buckets=1, tensor_model_parallel_size=2, **model)[AR_THRESHOLD])
    # the vocabulary pads to a multiple of 128 x TP, so TP=2 holds about half
    assert abs(two_tp - one / 2) < 0.01 * one


@pytest.mark.parametrize("cfg, word", [
    ({"ddp_num_buckets": 2, "ddp_bucket_size": 10}, "not both"),
    ({"ddp_num_buckets": 0}, "ddp_num_buckets"),
    ({"ddp_bucket_size": -1}, "ddp_bucket_size"),
    ({"ddp_num_buckets": 2}, "ddp_num_buckets"),  # no vocab_size: no parameter count
    ({"use_megatron_fsdp": True, "suggested_communication_unit_size": 0},
     "suggested_communication_unit_size"),
])
def test_bad_bucket_settings(cfg, word):
    with pytest.raises(ConfigError, match=word):
        xf.xla_flags(cfg, "gpu")


def test_values_are_checked_on_cpu_too():
    with pytest.raises(ConfigError, match="not both"):
        xf.xla_flags({"ddp_num_buckets": 2, "ddp_bucket_size": 10}, "cpu")
    # the parameter count is only needed where the thresholds are emitted
    assert xf.xla_flags({"ddp_num_buckets": 2}, "cpu") == [f"--{CPU_COLLECTIVE_TIMEOUT}=3600"]


def test_fsdp_communication_unit():
    assert flags(suggested_communication_unit_size=1000) == {}  # Megatron-FSDP only
    assert flags(use_megatron_fsdp=True, suggested_communication_unit_size=1000,
                 weight_dtype="bfloat16") == {AG_THRESHOLD: "2000", RS_THRESHOLD: "4000"}
    both = flags(use_megatron_fsdp=True, suggested_communication_unit_size=1000,
                 ddp_bucket_size=10)
    assert both == {AR_THRESHOLD: "40", RS_THRESHOLD: "4000", AG_THRESHOLD: "4000"}
    assert flags(use_megatron_fsdp=True, suggested_communication_unit_size=None) == {}


def test_tp_overlap_directions():
    off = {"tp_comm_overlap_ag": False, "tp_comm_overlap_rs": False}
    collective_matmul = {WINDOWED_EINSUM: "0", MULTI_STREAM_EINSUM: "true", LHS: "true"}
    for direction in ("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad"):
        assert flags(tp_comm_overlap=True, **{**off, direction: True}) == collective_matmul
    # no split direction left: the bulk overlaps still want the scheduler ...
    assert flags(tp_comm_overlap=True, **off) == {LHS: "true"}
    assert flags(tp_comm_overlap=True, tp_comm_bulk_dgrad=False, **off) == {LHS: "true"}
    # ... and with none of them there is nothing to do
    assert flags(tp_comm_overlap=True, tp_comm_bulk_wgrad=False, tp_comm_bulk_dgrad=False,
                 **off) == {}
    # without the main switch the directions do nothing
    assert flags(tp_comm_overlap_rs_dgrad=True) == {}


def test_inert_knobs_change_nothing():
    for key in INERT_KNOBS:
        flipped = not registry().knobs[key].default
        assert flags(**{key: flipped}) == {} and flags("cpu", **{key: flipped}) == flags("cpu")


def test_timeout_and_runtime_options():
    assert flags("cpu", distributed_timeout_minutes=5) == {CPU_COLLECTIVE_TIMEOUT: "300"}
    with pytest.raises(ConfigError, match="distributed_timeout_minutes"):
        flags("cpu", distributed_timeout_minutes=0)
    assert xf.runtime_options({"shardy": True}) == {"jax_use_shardy_partitioner": True}
    assert xf.runtime_options({"deterministic_mode": True}) == {
        "jax_use_shardy_partitioner": False, "jax_threefry_partitionable": True}


def test_registry_statuses_name_real_flags():
    for key in MAPPED_KNOBS + INERT_KNOBS:
        knob = registry().knobs[key]
        assert knob.status == (MAPPED if key in MAPPED_KNOBS else INERT), key
        assert knob.issue is None, key
        for name in re.findall(r"--(xla_\w+)", knob.reason):
            assert name in FLAG_NAMES, (key, name)
    for key in MAPPED_KNOBS[:-2]:  # the last two act through jax.config / jax.distributed
        if key != "shardy":
            assert "--xla_" in registry().knobs[key].reason, key


def test_resolved_config_reaches_the_flags():
    cfg = load_config(None, ["overlap_grad_reduce=true", "overlap_param_gather=true",
                             "ddp_bucket_size=1000", "deterministic_mode=true", "shardy=true",
                             "align_grad_reduce=false"])
    got = flags("gpu", **cfg)
    assert got[LHS] == got[PIPELINED_AG] == "true" and got[AR_THRESHOLD] == "4000"
    assert got[DETERMINISTIC] == "true"
    assert xf.runtime_options(cfg)["jax_use_shardy_partitioner"] is True
    assert any("align_grad_reduce" in w for w in cfg.warnings)


def test_platform_kind(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert xf.platform_kind({"hardware": "gpu_multiprocess"}) == "gpu"
    assert xf.platform_kind({"hardware": "cpu"}) == "cpu"
    assert xf.platform_kind(None) == "gpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert xf.platform_kind({"hardware": "gpu"}) == "cpu"
    assert xf.platform_kind({"hardware": "cpu"}, "rocm") == "gpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert xf.platform_kind({}) == "gpu"


def test_merge_keeps_the_users_flags():
    text, added, kept = xf.merge(f"--{LHS}=false  --xla_dump_to=/tmp/d",
                                 [f"--{LHS}=true", f"--{DETERMINISTIC}=true"])
    assert text == f"--{LHS}=false --xla_dump_to=/tmp/d --{DETERMINISTIC}=true"
    assert added == [f"--{DETERMINISTIC}=true"] and kept == [f"--{LHS}=true"]
    assert xf.merge("", []) == ("", [], [])


@pytest.fixture
def fake_jax(monkeypatch):
    """Record jax.config updates instead of changing this test process's JAX."""
    import jax
    from jax._src import xla_bridge

    updates, started = {}, {"value": False}
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: started["value"])
    return updates, started


def test_apply_before_the_backend(monkeypatch, fake_jax):
    updates, _ = fake_jax
    monkeypatch.setenv("XLA_FLAGS", f"--{DETERMINISTIC}=false")
    done = xf.apply({"deterministic_mode": True, "overlap_param_gather": True, "shardy": True},
                    "gpu")
    assert os.environ["XLA_FLAGS"] == (f"--{DETERMINISTIC}=false --{LHS}=true "
                                       f"--{PIPELINED_AG}=true")
    assert done.added == (f"--{LHS}=true", f"--{PIPELINED_AG}=true")
    assert done.overridden == (f"--{DETERMINISTIC}=true",)
    assert updates == {"jax_use_shardy_partitioner": True, "jax_threefry_partitionable": True}


def test_apply_after_the_backend_warns(monkeypatch, fake_jax, caplog):
    updates, started = fake_jax
    started["value"] = True
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(logging.getLogger("jaxtrain"), "propagate", True)  # CLI runs turn it off
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        done = xf.apply({"overlap_grad_reduce": True}, "gpu")
    assert "XLA_FLAGS" not in os.environ and done.added == ()
    assert "cannot take effect" in caplog.text and LHS in caplog.text
    assert updates == {"jax_use_shardy_partitioner": False}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        xf.apply({}, "cpu")  # a repeated in-process CPU run: no noise
        monkeypatch.setenv("XLA_FLAGS", f"--{LHS}=true")
        xf.apply({"overlap_grad_reduce": True, "overlap_param_gather": True}, "gpu")
    assert LHS not in caplog.text and PIPELINED_AG in caplog.text
