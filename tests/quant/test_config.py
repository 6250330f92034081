"""Quantization knobs (issue 11): what each dialect's setting becomes, AMD formats, the rules."""
import pytest

from jaxtrain import models
from jaxtrain.config import ConfigError, load_config
from jaxtrain.quant import QuantConfig, from_config

BASE = ["mock_data=true", "vocab_size=64", "seq_length=8", "num_layers=4", "hidden_size=32",
        "num_attention_heads=2", "micro_batch_size=2", "global_batch_size=4",
        "lr_warmup_iters=0", "train_iters=2"]


def resolved(*extra):
    return load_config(None, [*BASE, *extra], world_size=1)


def quant_of(*extra, accelerator="cpu"):
    return from_config(resolved(*extra), accelerator)


def test_megatron_fp8_knobs():
    assert quant_of() is None
    qc = quant_of("fp8=hybrid")
    assert (qc.recipe, qc.x, qc.w, qc.g, qc.history_len, qc.amax_algo) == (
        "delayed", "e4m3", "e4m3", "e5m2", 1024, "max")
    qc = quant_of("fp8=e4m3", "fp8_recipe=tensorwise", "fp8_wgrad=false")
    assert (qc.recipe, qc.g, qc.wgrad) == ("tensorwise", "e4m3", False)
    qc = quant_of("fp8=hybrid", "fp8_margin=2", "fp8_amax_history_len=16",
                  "fp8_amax_compute_algo=most_recent")
    assert (qc.margin, qc.history_len, qc.amax_algo) == (2, 16, "most_recent")
    qc = quant_of("fp8=hybrid", "fp8_recipe=mxfp8", "first_last_layers_bf16=true",
                  "num_layers_at_start_in_bf16=2", "num_layers_at_end_in_bf16=1")
    assert qc.layer_quantized(4) == [False, False, True, False]
    assert quant_of("fp4=e2m1") == QuantConfig("nvfp4", "e2m1", "e2m1", "e2m1", source="fp4")


def test_amd_formats_on_rocm_and_by_choice():
    assert not quant_of("fp8=hybrid", accelerator="cuda").fnuz
    assert quant_of("fp8=hybrid", accelerator="rocm").fnuz
    assert not quant_of("fp8=hybrid", "fp8_format_variant=ocp", accelerator="rocm").fnuz
    assert quant_of("fp8=hybrid", "fp8_format_variant=fnuz", accelerator="cuda").fnuz
    assert quant_of("quantization=nanoo_fp8", accelerator="cuda").fnuz
    assert not quant_of("quantization=fp8", accelerator="cuda").fnuz


@pytest.mark.parametrize("value,want", [
    ("fp8", ("delayed", "e4m3", "e4m3", "e5m2")),
    ("fp8_full", ("qwix", "e4m3", "e4m3", "e5m2")),
    ("int8", ("qwix", "int8", "int8", None)),
    ("int8w", ("qwix", None, "int8", None)),
    ("int4w", ("qwix", None, "int4", None)),
    ("te_fp8_currentscaling", ("tensorwise", "e4m3", "e4m3", "e5m2")),
    ("te_mxfp8", ("mxfp8", "e4m3", "e4m3", "e4m3")),
])
def test_maxtext_quantization_strings(value, want):
    qc = quant_of(f"quantization={value}")
    assert (qc.recipe, qc.x, qc.w, qc.g) == want


def test_pgs_float8_is_rowwise_e4m3():
    qc = quant_of("memory.float8_training=true")
    assert (qc.recipe, qc.x, qc.w, qc.g) == ("qwix", "e4m3", "e4m3", "e4m3")


def test_model_config_carries_it():
    cfg = models.ModelConfig.from_config(resolved("fp8=hybrid", "fp8_recipe=tensorwise"))
    assert cfg.quant.recipe == "tensorwise"
    assert models.ModelConfig.from_config(resolved()).quant is None


@pytest.mark.parametrize("extra,message", [
    (["fp8=hybrid", "fp4=e2m1"], "fp8 and fp4 are exclusive"),
    (["fp8=hybrid", "quantization=int8"], "quantization knobs are exclusive"),
    (["fp8=hybrid", "first_last_layers_bf16=true"], "not allowed with delayed scaling"),
    (["quantization=fp8", "first_last_layers_bf16=true"], "not allowed with delayed scaling"),
    (["fp8=hybrid", "fp8_recipe=tensorwise", "first_last_layers_bf16=true",
      "num_layers_at_end_in_bf16=9"], r"must lie in \[0, num_layers = 4\]"),
    (["fp8=hybrid", "fp8_recipe=custom"], "quantizer factory"),
    (["quantization=intmp"], "quant_cfg_path"),
    (["quantization=te_nvfp4"], "Hadamard"),
])
def test_rules(extra, message):
    with pytest.raises(ConfigError, match=message):
        resolved(*extra)
