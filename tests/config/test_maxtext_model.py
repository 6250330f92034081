"""MaxText's model-architecture keys: aliases of our knobs, MaxText's defaults in MaxText files,
and each key changing the model as documented (config level; no compiles)."""
import math
import textwrap

import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models import layers as L
from jaxtrain.models import params as P

# The model part of the side-by-side comparison with MaxText on one machine: MaxText's
# pre_train.train on its base.yml with these overrides (4 layers, hidden 256, 4 heads x 64,
# SwiGLU ffn 1024, vocab 32000, fp32, full remat, scanned layers, synthetic data).
PERF = textwrap.dedent("""
    base_emb_dim: 256
    base_num_query_heads: 4
    base_num_kv_heads: 4
    base_mlp_dim: 1024
    base_num_decoder_layers: 4
    head_dim: 64
    vocab_size: 32000
    attention: dot_product
    dtype: float32
    weight_dtype: float32
    remat_policy: full
    scan_layers: true
    hardware: gpu
    dataset_type: synthetic
""")


def model(write, text, *overrides):
    cfg = load_config(write("run.yml", text), overrides)
    return cfg, ModelConfig.from_config({**cfg})   # as loop.py hands it over: a plain dict


def maxtext_llama2_param_count(vocab, emb, heads, kv_heads, head_dim, mlp, layers, tied=False):
    """MaxText's llama2 decoder by its layer shapes: token_embedder [V,D]; per layer two RMSNorm
    scales [D], query [D,N,H], key/value [D,K,H], out [N,H,D], mlp wi_0/wi_1 [D,F], wo [F,D];
    decoder_norm [D]; logits_dense [D,V] unless logits_via_embedding."""
    per_layer = (2 * emb + emb * heads * head_dim + 2 * emb * kv_heads * head_dim
                 + heads * head_dim * emb + 3 * emb * mlp)
    return vocab * emb * (1 if tied else 2) + layers * per_layer + emb


def count(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(P.abstract(cfg)))


def test_perf_recipe_model_resolves_like_maxtext(write):
    cfg, m = model(write, PERF)
    assert cfg.dialect == "maxtext" and not cfg.warnings
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (4, 256, 4, 4)
    assert (m.head_dim, m.kv_channels, m.ffn_hidden_size, m.vocab_size) == (64, 64, 1024, 32000)
    assert (m.activation, m.gated_linear_unit) == ("silu", True)
    assert (m.normalization, m.norm_epsilon) == ("RMSNorm", 1e-5)
    assert (m.position_embedding_type, m.rotary_base, m.rotary_interleaved) == ("rope", 1e4, False)
    assert m.rotary_seq_len_interpolation_factor is None and not m.use_rope_scaling
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert m.hidden_dropout == m.attention_dropout == 0.0 and m.attention_impl == "xla"
    assert (m.dtype, m.weight_dtype, m.remat_policy, m.scan_layers) == (
        "float32", "float32", "full", True)
    expected = maxtext_llama2_param_count(32000, 256, 4, 4, 64, 1024, 4)
    assert expected == 20_580_608 and count(m) == expected


def test_gpu_model_files_cap_packed_segments(write):
    """MaxText's GPU model files set max_segments_per_seq: 32 (packing on, synthetic data):
    they load, and each synthetic row holds 2..32 attention segments as MaxText's do."""
    from jaxtrain.data.sources import training_data

    cfg, _ = model(write, PERF + "max_segments_per_seq: 32\nmax_target_length: 256\n")
    assert cfg["max_segments_per_seq"] == 32 and cfg["packing"]
    most = training_data(cfg).samples.arrays["segment_ids"].max(axis=1)
    assert most.min() == 2 and most.max() == 32


def test_maxtext_defaults_in_maxtext_files_only(write):
    cfg, m = model(write, "decoder_block: llama2\n")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (16, 2048, 16, 16)
    assert (m.head_dim, m.ffn_hidden_size, m.vocab_size, m.rotary_base) == (128, 7168, 32000, 1e4)
    assert (m.normalization, m.position_embedding_type, m.use_iota_embed) == ("RMSNorm", "rope", False)
    assert cfg["seed"] == 0 and cfg["make_vocab_size_divisible_by"] == 1
    # head_dim does not follow the width: MaxText's 128 stays with a small model
    assert model(write, "base_emb_dim: 256\nbase_num_query_heads: 4\n"
                 "base_num_kv_heads: 4\n")[1].kv_channels == 128
    # Megatron's defaults are untouched
    meg = load_config(None, ["vocab_size=1000"])
    assert meg.dialect == "megatron" and meg["normalization"] == "LayerNorm" and meg["num_layers"] == 24
    assert meg["kv_channels"] == 64 and not meg["group_query_attention"]
    assert meg["float32_logits"] is None and meg["decoder_block"] is None


@pytest.mark.parametrize("scale,sizes", [
    (2, (256, 8, 8, 2048, 4)), (4, (512, 8, 8, 2048, 4)), (8, (512, 8, 8, 2048, 8))])
def test_global_parameter_scale(write, scale, sizes):
    cfg, m = model(write, PERF, f"global_parameter_scale={scale}")
    got = (m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size, m.num_layers)
    assert got == sizes and m.kv_channels == 64
    assert cfg["global_parameter_scale"] == 1 and cfg.origin("hidden_size") in ("derived", str(
        cfg.origin("hidden_size")))


def test_global_parameter_scale_must_be_a_power_of_two(write):
    with pytest.raises(ConfigError, match="global_parameter_scale must be a power of two"):
        model(write, PERF, "global_parameter_scale=3")


def test_derived_size_names_warn_and_point_at_the_base_key(write):
    cfg, m = model(write, PERF + "emb_dim: 512\n")
    assert m.hidden_size == 256
    assert any("emb_dim" in w and "base_emb_dim" in w for w in cfg.warnings)


@pytest.mark.parametrize("acts,expected", [
    (["silu", "linear"], ("silu", True)), (["linear", "silu"], ("silu", True)),
    (["gelu", "linear"], ("gelu_tanh", True)), (["gelu"], ("gelu_tanh", False)),
    (["relu"], ("relu", False))])
def test_mlp_activations(write, acts, expected):
    m = model(write, PERF, f"mlp_activations={acts}")[1]
    assert (m.activation, m.gated_linear_unit) == expected


def test_mlp_activations_errors(write):
    with pytest.raises(ConfigError, match="mlp_activations .* not supported"):
        model(write, PERF, "mlp_activations=['tanh', 'linear']")
    with pytest.raises(ConfigError, match="mlp_activations and swiglu, squared_relu both choose"):
        model(write, PERF + "mlp_activations: [silu, linear]\nswiglu: false\nsquared_relu: true\n")
    # MaxText's default yields to a Megatron switch written in the file
    m = model(write, PERF + "swiglu: false\nsquared_relu: true\n")[1]
    assert (m.activation, m.gated_linear_unit) == ("squared_relu", False)


def test_scalar_aliases_change_the_model(write):
    m = model(write, PERF, "normalization_layer_epsilon=1e-6", "rope_max_timescale=500000")[1]
    assert (m.norm_epsilon, m.rotary_base) == (1e-6, 5e5)
    m = model(write, PERF, "base_num_kv_heads=2", "head_dim=32")[1]
    assert (m.num_kv_heads, m.kv_channels) == (2, 32)


def test_logits_via_embedding(write):
    m = model(write, PERF, "logits_via_embedding=true", "normalize_embedding_logits=false")[1]
    assert not m.untie_embeddings_and_output_weights
    assert count(m) == maxtext_llama2_param_count(32000, 256, 4, 4, 64, 1024, 4, tied=True)
    assert not m.normalize_embedding_logits
    assert model(write, PERF, "logits_via_embedding=true")[1].normalize_embedding_logits
    assert not model(write, PERF, "normalize_embedding_logits=true")[1].normalize_embedding_logits


def test_dropout_keys(write):
    cfg, m = model(write, PERF + "hidden_dropout: 0.1\nattention_dropout: 0.2\n")
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.2)
    m = model(write, PERF + "hidden_dropout: 0.1\nattention_dropout: 0.2\nenable_dropout: false\n")[1]
    assert m.hidden_dropout == m.attention_dropout == 0.0
    assert ModelConfig.from_config({"vocab_size": 128, "enable_dropout": False}).hidden_dropout == 0
    with pytest.raises(ConfigError, match="dropout_rate is not supported.*hidden_dropout"):
        model(write, PERF, "dropout_rate=0.1")


def _maxtext_angles(positions, head_dim, min_ts, max_ts, linear):
    fraction = 2 * np.arange(head_dim // 2) / head_dim
    timescale = min_ts * (max_ts / min_ts) ** fraction * linear
    return positions[..., None] / timescale


@pytest.mark.parametrize("min_ts,linear", [(1, 1.0), (2, 1.0), (1, 4.0), (3, 2.0)])
def test_rope_timescales_match_maxtext(write, min_ts, linear):
    m = model(write, PERF, f"rope_min_timescale={min_ts}", f"rope_linear_scaling_factor={linear}",
              "rope_max_timescale=20000")[1]
    pos = np.arange(64, dtype=np.float32)[None]
    cos, sin = L.rope_tables(jax.numpy.asarray(pos, dtype="int32"), m)
    want = _maxtext_angles(pos, 64, min_ts, 20000, linear)
    np.testing.assert_allclose(cos, np.cos(want), atol=2e-5)
    np.testing.assert_allclose(sin, np.sin(want), atol=2e-5)


def test_rope_type(write):
    m = model(write, PERF, "rope_type=default")[1]
    assert m.rope_type == "rope" and not m.use_rope_scaling
    m = model(write, PERF, "rope_type=llama3.1")[1]
    assert m.use_rope_scaling and (m.rope_scaling_factor, m.original_max_position_embeddings,
                                   m.rope_low_freq_factor, m.rope_high_freq_factor) == (8, 8192, 1, 4)
    assert not model(write, PERF, "rope_type=llama3.1", "rope_use_scale=false")[1].use_rope_scaling
    # MaxText's llama3.1 rotary embedding rotates interleaved pairs, its default one the halves
    assert model(write, PERF, "rope_type=llama3.1")[1].rotary_interleaved
    assert not model(write, PERF)[1].rotary_interleaved
    assert model(write, PERF, "rope_type=yarn")[1].rope_type == "yarn"   # see test_maxtext_families


def test_attention_precision_knobs(write):
    text = PERF.replace("dtype: float32\n", "dtype: bfloat16\n")
    assert not model(write, text)[1].attention_softmax_in_fp32
    assert model(write, text, "float32_logits=true")[1].attention_softmax_in_fp32
    assert model(write, text, "float32_qk_product=true")[1].attention_softmax_in_fp32
    # other kernels keep float32 (the flash kernel always accumulates in fp32)
    assert model(write, text, "attention=flash")[1].attention_softmax_in_fp32


def test_decoder_block(write):
    assert model(write, PERF, "decoder_block=mistral")[1].normalization == "RMSNorm"
    assert model(write, PERF, "decoder_block=default")[1].parallel_shared_norm
    with pytest.raises(ConfigError, match="qwen3_custom_moe needs a positive "
                                          "attention_output_dim"):
        model(write, PERF, "decoder_block=qwen3_custom_moe")
    with pytest.raises(ConfigError, match="compress_ratios.*decoder_block deepseek4 needs"):
        model(write, PERF, "decoder_block=deepseek4")
    with pytest.raises(ConfigError, match="decoder_block = 'simple' is not supported"):
        model(write, PERF, "decoder_block=simple")
    with pytest.raises(ConfigError, match="decoder_block llama2 is a pre-norm RMSNorm"):
        model(write, "base_config: base.yml\n" + PERF + "normalization: LayerNorm\n")
    with pytest.raises(ConfigError, match="no MoE layer"):
        model(write, PERF, "num_experts=4")
    # in a Megatron file the block sets the family's norm and positions too
    cfg = load_config(write("meg.yml", "decoder_block: llama2\nvocab_size: 128\nswiglu: true\n"
                                       "kv_channels: 64\n"))
    assert (cfg["normalization"], cfg["position_embedding_type"]) == ("RMSNorm", "rope")


def test_mixtral_moe_keys(write):
    moe = ("decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
           "base_moe_mlp_dim=1024")
    cfg, m = model(write, PERF, *moe)
    assert (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size) == (4, 2, 1024)
    assert (m.moe.score_function, m.moe.pre_softmax) == ("softmax", False)
    assert model(write, PERF, "num_experts=1")[1].moe is None        # MaxText: 1 expert = dense
    dense = model(write, PERF, *moe, "capacity_factor=1.25", "sparse_matmul=false")[1].moe
    assert (dense.capacity_factor, dense.capacity_per_sequence) == (1.25, True)
    # keys the mixtral block does not read, or reads in a way jaxtrain's router does not build
    for key in ("shared_experts=1", "first_num_dense_layers=1", "routed_scaling_factor=2.5",
                "routed_score_func=sigmoid", "routed_bias=true", "n_routing_groups=8",
                "topk_routing_group=4", "mlp_bias=true", "routed_bias_update_rate=0.1"):
        with pytest.raises(ConfigError, match=f"{key.split('=')[0]} = .*(does not read|router|"
                                              f"biases|deepseek)"):
            model(write, PERF, *moe, key)


def test_mla_keys(write):
    mla = ("decoder_block=deepseek", "attention_type=mla", "rope_type=yarn")
    m = model(write, PERF, *mla, "qk_nope_head_dim=32", "qk_rope_head_dim=16", "v_head_dim=48",
              "kv_lora_rank=64")[1]
    assert m.multi_latent_attention and m.q_lora_rank is None and m.num_kv_heads == 4
    assert (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank) == (32, 16, 48, 64)
    assert model(write, PERF, *mla, "q_lora_rank=96")[1].q_lora_rank == 96
    assert model(write, PERF, *mla)[1].kv_lora_rank == 512   # MaxText's default
    with pytest.raises(ConfigError, match="attention_type.*'local_sliding' is not supported"):
        model(write, PERF, "attention_type=local_sliding")
    with pytest.raises(ConfigError, match="deepseek block is built of multi-latent attention"):
        model(write, PERF, "attention_type=mla")          # the llama2 block has no MLA
    with pytest.raises(ConfigError, match="deepseek block is built of multi-latent attention"):
        model(write, PERF, "decoder_block=deepseek", "rope_type=yarn")


@pytest.mark.parametrize("key", ["use_post_attn_norm", "use_post_ffw_norm"])
def test_norm_switches_only_in_the_blocks_that_read_them(write, key):
    with pytest.raises(ConfigError, match=f"llama2 block does not read {key}"):
        model(write, PERF, f"{key}=true")
    flag = "post_attention_norm" if key == "use_post_attn_norm" else "post_mlp_norm"
    on = model(write, PERF, "decoder_block=gemma2", f"{key}=true")[1]
    off = model(write, PERF, "decoder_block=gemma2", f"{key}=false")[1]
    assert getattr(on, flag) and not getattr(off, flag)


def test_mapped_and_inert_switches(write):
    cfg, m = model(write, PERF, "fused_qkv=true", "fused_mlp=true")
    assert not cfg.warnings and m == model(write, PERF)[1]
    cfg, m = model(write, PERF, "cast_logits_to_fp32=false")
    assert any("cast_logits_to_fp32" in w for w in cfg.warnings)
    assert load_config(write("s.yml", PERF + "init_weights_seed: 7\n"))["seed"] == 7


@pytest.mark.parametrize("megatron,maxtext", [
    ("hidden_size: 512", "base_emb_dim: 256"), ("kv_channels: 128", "head_dim: 64"),
    ("num_layers: 8", "base_num_decoder_layers: 4"),
    ("untie_embeddings_and_output_weights: true", "logits_via_embedding: true"),
    ("norm_epsilon: 1.0e-6", "normalization_layer_epsilon: 1.0e-5")])
def test_two_spellings_of_one_setting_conflict(write, megatron, maxtext):
    with pytest.raises(ConfigError, match="name the same setting"):
        load_config(write("both.yml", f"{megatron}\n{maxtext}\nvocab_size: 128\n"))


def test_cli_names_the_key_and_exits_2(write, cli):
    code, _, err = cli(write("bad.yml", PERF + "decoder_block: qwen3_custom_moe\n"), "--dry-run")
    assert code == 2 and "decoder_block" in err
