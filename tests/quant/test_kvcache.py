"""KV-cache quantization math (jaxtrain.quant.kvcache) and its knobs' way into ModelConfig."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig, init_cache
from jaxtrain.quant.kvcache import dequantize_kv, quantize_kv, scale_shape


@pytest.mark.parametrize("dtype,qmax", [("int8", 127.5), ("int4", 7.5)])
@pytest.mark.parametrize("axis,reduced", [("dkv", (3,)), ("heads_and_dkv", (2, 3))])
def test_round_trip_error_is_half_a_step(dtype, qmax, axis, reduced):
    x = np.random.RandomState(0).standard_normal((2, 5, 3, 8)).astype(np.float32)
    x[1, 2] = 0.0                                     # an all-zero token stores zeros
    q, scale = quantize_kv(jnp.asarray(x), axis, dtype)
    assert q.dtype == jnp.dtype(dtype) and scale.dtype == jnp.float32
    assert scale.shape == scale_shape(x.shape, axis) == tuple(
        1 if d in reduced else n for d, n in enumerate(x.shape))
    np.testing.assert_array_equal(scale, np.abs(x).max(reduced, keepdims=True))
    back = np.asarray(dequantize_kv(q, scale, dtype, jnp.float32))
    step = np.asarray(scale) / qmax
    assert (np.abs(back - x) <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert (back[1, 2] == 0).all()
    ints = np.asarray(q.astype(jnp.int32))
    assert ints.max() == (127 if dtype == "int8" else 7)   # +absmax rounds to 128|8, clipped
    assert ints.min() >= (-128 if dtype == "int8" else -8)


def test_knobs_reach_model_config_and_cache():
    flat = load_config(None, ["vocab_size=64", "num_layers=2", "hidden_size=32",
                              "num_attention_heads=4", "quantize_kvcache=true",
                              "kv_quant_axis=dkv", "kv_quant_dtype=int4"])
    cfg = ModelConfig.from_config(flat)
    assert (cfg.quantize_kvcache, cfg.kv_quant_axis, cfg.kv_quant_dtype) == (True, "dkv", "int4")
    cache = init_cache(cfg, 3, 7)
    assert cache["k"].dtype == jnp.int4 and cache["k"].shape == (2, 3, 7, 4, 8)
    assert cache["k_scale"].shape == (2, 3, 7, 4, 1)
    assert cache["v_scale"].dtype == jnp.bfloat16            # the compute dtype (bf16 default)
    plain = init_cache(cfg.replace(quantize_kvcache=False), 3, 7)
    assert plain["k"].dtype == jnp.bfloat16 and "k_scale" not in plain
    assert not ModelConfig.from_config({"vocab_size": 8}).quantize_kvcache


def test_empty_axis_needs_the_cache_unquantized():
    ModelConfig.from_config(load_config(None, ["vocab_size=64", "kv_quant_axis="]))
    quantized = load_config(None, ["vocab_size=64", "quantize_kvcache=true", "kv_quant_axis="])
    with pytest.raises(ValueError, match="kv_quant_axis: cannot be empty when quantize_kvcache"):
        ModelConfig.from_config(quantized)   # the dry run builds the model (preflight)
    with pytest.raises(ConfigError, match="kv_quant_dtype"):
        load_config(None, ["kv_quant_dtype=fp8"])
    with pytest.raises(ValueError, match="kv_quant_axis: cannot be empty"):
        ModelConfig(quantize_kvcache=True, kv_quant_axis="")
    with pytest.raises(ValueError, match="kv_quant_dtype"):
        ModelConfig(kv_quant_dtype="int2")
