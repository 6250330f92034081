"""ModelConfig: Megatron-style derivations and ``from_config`` on (partial) flat configs."""
import pytest

from jaxtrain.config import load_config, registry
from jaxtrain.models import ModelConfig
from jaxtrain.models.remat import REMAT_POLICIES, checkpoint_policy


def test_derived_sizes():
    cfg = ModelConfig(hidden_size=1024, num_attention_heads=16)
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.ffn_hidden_size) == (64, 16, 2688)
    assert ModelConfig(hidden_size=1024, gated_linear_unit=False).ffn_hidden_size == 4096
    assert ModelConfig(use_rope_scaling=True).original_max_position_embeddings == 8192
    assert ModelConfig(rope_type="yarn").original_max_position_embeddings == 4096


def test_from_partial_config_uses_the_registry_defaults():
    cfg = ModelConfig.from_config({"vocab_size": 1000})
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (24, 1024, 16)
    assert cfg.vocab_size == 1024                       # padded to make_vocab_size_divisible_by
    assert cfg.num_query_groups == 16 and cfg.kv_channels == 64
    assert (cfg.activation, cfg.gated_linear_unit, cfg.ffn_hidden_size) == ("silu", True, 2688)
    assert cfg.position_embedding_type == "learned_absolute"
    assert cfg.normalization == "LayerNorm" and cfg.dtype == "bfloat16"
    assert cfg.hidden_dropout == cfg.attention_dropout == 0.1
    assert cfg.max_position_embeddings == registry().knobs["seq_length"].default   # unset
    assert cfg.remat_policy == "none"


def test_from_config_reads_every_knob():
    flat = {
        "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
        "group_query_attention": True, "num_query_groups": 2, "kv_channels": 48,
        "ffn_hidden_size": 512, "vocab_size": 500, "make_vocab_size_divisible_by": 64,
        "tensor_model_parallel_size": 2, "max_position_embeddings": 128,
        "position_embedding_type": "rope", "rotary_base": 500000, "rotary_percent": 0.5,
        "rotary_interleaved": True, "rotary_seq_len_interpolation_factor": 2.0,
        "use_rope_scaling": True, "rope_scaling_factor": 16.0,
        "original_max_position_embeddings": 64, "normalization": "RMSNorm",
        "norm_epsilon": 1e-6, "apply_layernorm_1p": True, "qk_layernorm": True,
        "swiglu": False, "squared_relu": True, "add_bias_linear": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.05,
        "untie_embeddings_and_output_weights": False, "fp32_residual_connection": True,
        "apply_residual_connection_post_layernorm": True, "init_method_std": 0.01,
        "init_method_xavier_uniform": True, "apply_query_key_layer_scaling": True,
        "attention_backend": "unfused", "attention_softmax_in_fp32": False,
        "sliding_window_size": 32, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "dtype": "float16", "weight_dtype": "bfloat16", "logits_dot_in_fp32": True,
        "use_iota_embed": True, "scan_layers": False, "param_scan_axis": 0,
        "remat_policy": "save_qkv_proj",
    }
    cfg = ModelConfig.from_config(flat)
    assert cfg.vocab_size == 512                         # multiple of 64 * TP 2
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.rotary_dim) == (2, 48, 24)
    assert (cfg.activation, cfg.gated_linear_unit) == ("squared_relu", False)
    assert cfg.add_qkv_bias and cfg.add_bias_linear
    assert cfg.attention_softmax_in_fp32                 # forced by query-key layer scaling
    assert (cfg.dtype, cfg.weight_dtype) == ("float16", "bfloat16")
    assert (cfg.rotary_base, cfg.rope_scaling_factor) == (500000.0, 16.0)
    for key in ("rotary_interleaved", "use_rope_scaling", "apply_layernorm_1p", "qk_layernorm",
                "fp32_residual_connection", "apply_residual_connection_post_layernorm",
                "init_method_xavier_uniform", "logits_dot_in_fp32", "use_iota_embed"):
        assert getattr(cfg, key) is True, key
    for key in ("max_position_embeddings", "rotary_percent", "rotary_seq_len_interpolation_factor",
                "original_max_position_embeddings", "norm_epsilon", "attention_dropout",
                "init_method_std", "final_logit_softcapping",
                "attn_logit_softcapping", "param_scan_axis", "remat_policy", "scan_layers",
                "untie_embeddings_and_output_weights", "hidden_dropout"):
        assert getattr(cfg, key) == flat[key], key
    assert cfg.sliding_window == flat["sliding_window_size"]


@pytest.mark.parametrize("flags,expected", [
    ({"swiglu": True}, ("silu", True)),
    ({"swiglu": False, "quick_geglu": True}, ("quick_gelu", True)),
    ({"swiglu": False, "openai_gelu": True}, ("gelu_tanh", False)),
    ({"swiglu": False, "squared_relu": True}, ("squared_relu", False)),
    ({"swiglu": False}, ("gelu", False)),
])
def test_activation_flags(flags, expected):
    cfg = ModelConfig.from_config({"vocab_size": 128, **flags})
    assert (cfg.activation, cfg.gated_linear_unit) == expected


def test_dtype_from_megatron_precision_flags():
    """bf16/fp16 choose the compute dtype (config/rules.py precision); the model reads dtype."""
    def dtype(*overrides):
        return ModelConfig.from_config(load_config(None, ["vocab_size=8", *overrides])).dtype

    assert dtype("bf16=false") == "float32"
    assert dtype("fp16=true", "bf16=false") == "float16"
    assert dtype("dtype=float32") == "float32"          # a chosen dtype beats bf16's default


@pytest.mark.parametrize("flat,expected", [
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 2}, ("full", "uniform", 2, None, ())),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
     ("full", "block", 1, None, ())),
    ({"recompute_granularity": "full", "recompute_layer_ids": [0, 3]},
     ("full", None, None, (0, 3), ())),
    ({"recompute_granularity": "selective"}, ("none", None, None, None, ("core_attn",))),
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp", "layernorm"]},
     ("none", None, None, None, ("mlp", "layernorm"))),
    ({"recompute_activations": True}, ("none", None, None, None, ("core_attn",))),
    ({"remat_policy": "minimal_offloaded"}, ("minimal_offloaded", None, None, None, ())),
    ({"remat_policy": "custom", "query_proj": "offload", "mlpwo": "device"},
     ("custom", None, None, None, ())),
])
def test_recompute_knobs(flat, expected):
    cfg = ModelConfig.from_config({"vocab_size": 8, "num_layers": 4, **flat})
    assert (cfg.remat_policy, cfg.recompute_method, cfg.recompute_num_layers,
            cfg.recompute_layer_ids, cfg.recompute_modules) == expected
    if cfg.remat_policy == "custom":   # the other tensors keep the registry's modes
        modes = dict(cfg.remat_tensors)
        assert (modes["query_proj"], modes["mlpwo"], modes["key_proj"]) == (
            "offload", "device", "remat")


@pytest.mark.parametrize("flat,match", [
    ({}, "vocab_size"),
    ({"vocab_size": 8, "squared_relu": True}, "exclusive"),
    ({"vocab_size": 8, "recompute_granularity": "full"}, "recompute_method"),
    ({"vocab_size": 8, "recompute_granularity": "selective", "recompute_num_layers": 2},
     "selective"),
    ({"vocab_size": 8, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
     "recompute_modules"),
    ({"vocab_size": 8, "remat_policy": "custom", "query_proj": "sideways"}, "remat_tensors"),
    ({"vocab_size": 8, "remat_policy": "save_everything"}, "remat_policy"),
    ({"vocab_size": 8, "normalization": "ScaleNorm"}, "normalization"),
    ({"vocab_size": 8, "position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"vocab_size": 8, "rope_type": "ntk"}, "rope_type"),
    ({"vocab_size": 8, "group_query_attention": True, "num_query_groups": 5}, "num_query_groups"),
    ({"vocab_size": 8, "qk_layernorm": True, "qk_l2_norm": True}, "qk_l2_norm"),
    ({"vocab_size": 8, "param_scan_axis": 2}, "param_scan_axis"),
    ({"vocab_size": 8, "dtype": "int8"}, "dtype"),
])
def test_invalid_configs_raise(flat, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_config(flat)


def test_custom_remat_needs_its_tensors():
    with pytest.raises(ValueError, match="remat_tensors"):
        ModelConfig(remat_policy="custom")


def test_every_remat_policy_name_resolves():
    for name in REMAT_POLICIES:
        tensors = (("context", "device"),) if name == "custom" else ()
        checkpoint_policy(ModelConfig(remat_policy=name, remat_tensors=tensors))


def test_legacy_recompute_switches():
    base = {"vocab_size": 64}
    cfg = ModelConfig.from_config({**base, "checkpoint_activations": True})
    assert (cfg.remat_policy, cfg.recompute_method, cfg.recompute_num_layers) == (
        "full", "uniform", 1)
    cfg = ModelConfig.from_config({**base, "recompute_activations": True})
    assert cfg.recompute_modules == ("core_attn",) and cfg.remat_policy == "none"
    assert ModelConfig.from_config(base).remat_policy == "none"


def test_bias_gelu_fusion_uses_the_tanh_approximation_like_megatron():
    base = {"vocab_size": 64, "swiglu": False, "add_bias_linear": True}
    assert ModelConfig.from_config(base).activation == "gelu_tanh"
    assert ModelConfig.from_config({**base, "bias_gelu_fusion": False}).activation == "gelu"
    assert ModelConfig.from_config({**base, "add_bias_linear": False}).activation == "gelu"
