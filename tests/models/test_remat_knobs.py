"""Remat knobs from a config reach the model and name tensors the model really produces."""
import pytest
from jax.ad_checkpoint import print_saved_residuals
from model_helpers import random_params, tiny, tokens

from jaxtrain.config import load_config
from jaxtrain.models import ModelConfig, forward
from jaxtrain.models.remat import custom_names
from jaxtrain.quant.config import QuantConfig

TENSORWISE = QuantConfig("tensorwise", "e4m3", "e4m3", "e5m2")


def saved(cfg, capsys) -> str:
    print_saved_residuals(lambda p: forward(p, tokens(), cfg).sum(), random_params(cfg))
    return capsys.readouterr().out


def model(*overrides) -> ModelConfig:
    base = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=128",
            "seq_length=16", "max_position_embeddings=16"]
    return ModelConfig.from_config({**load_config(None, [*base, *overrides])})


def test_recompute_modules_knob_reaches_the_model(capsys):
    cfg = model("recompute_granularity=selective", "recompute_modules=[mlp, layernorm]")
    assert cfg.recompute_modules == ("mlp", "layernorm")
    assert model("recompute_granularity=selective").recompute_modules == ("core_attn",)


def test_qkv_proj_stands_for_the_three_projections(capsys):
    assert set(custom_names([("qkv_proj", "device")])[0]) == {"query_proj", "key_proj",
                                                              "value_proj"}
    assert custom_names([("qkv_proj", "remat"), ("key_proj", "device")])[0] == ["key_proj"]
    cfg = model("remat_policy=custom", "qkv_proj=device")
    text = saved(cfg.replace(scan_layers=False), capsys)
    for name in ("query_proj", "key_proj", "value_proj"):
        assert f"named '{name}'" in text
    assert "named 'out_proj'" not in text


def test_mlpwi_names_the_plain_mlp_input(capsys):
    cfg = model("remat_policy=custom", "mlpwi=device", "swiglu=false")
    assert not cfg.gated_linear_unit
    assert "named 'mlpwi'" in saved(cfg.replace(scan_layers=False), capsys)


@pytest.mark.parametrize("policy,kept", [("minimal_with_quantization", True),
                                         ("minimal", False)])
def test_quantization_policies_keep_the_quantized_operands(policy, kept, capsys):
    cfg = tiny(remat_policy=policy, scan_layers=False, quant=TENSORWISE)
    assert ("named 'quantization'" in saved(cfg, capsys)) == kept


def test_block_recompute_of_zero_layers_recomputes_none():
    """Megatron's block method checkpoints the first recompute_num_layers layers: 0 is none
    (Primus's Qwen3.5 experiments write it); uniform needs a positive count."""
    full = ["recompute_granularity=full", "recompute_method=block"]
    cfg = model(*full, "recompute_num_layers=0")
    assert (cfg.remat_policy, cfg.recompute_method) == ("none", None)
    assert model(*full, "recompute_num_layers=1").recompute_method == "block"
    with pytest.raises(ValueError, match="positive layer count"):
        model("recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=0")
