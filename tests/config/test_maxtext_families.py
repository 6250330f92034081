"""MaxText's model families: ``base.yml model_name=<name>`` builds the model MaxText builds.

Every MaxText model file of a family jaxtrain builds resolves (from jaxtrain's copies in
configs/models/maxtext, no MaxText checkout needed) to a ModelConfig whose parameter count, from
abstract shapes only, matches the published size, and whose architecture switches are the
family's. Each MaxText key the dialect rules map (config/dialects/maxtext_model.py) is checked to
change the model, and what jaxtrain cannot build is refused by name."""
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.conftest import ROOT
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models import layers as L
from jaxtrain.models import params as P

CHECKOUT = pathlib.Path("/work/corpus/maxtext")          # a MaxText checkout, where present
PRESETS = ROOT / "configs" / "models" / "maxtext"


@pytest.fixture(autouse=True)
def _presets_only(monkeypatch, tmp_path):
    """Resolve model names from jaxtrain's presets: no MAXTEXT_PATH, no models/ next to cwd."""
    monkeypatch.delenv("MAXTEXT_PATH", raising=False)
    monkeypatch.chdir(tmp_path)


def resolve(name, *overrides, enforce_status=True):
    cfg = load_config("base.yml", [f"model_name={name}", *overrides],
                      enforce_status=enforce_status)
    return cfg, ModelConfig.from_config({**cfg})


def count(m: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(P.abstract(m)))


# (model_name, published total parameters, source). Sizes as the models' own documentation
# gives them; Hugging Face's "Model size" is the count of the released safetensors.
PUBLISHED = [
    ("llama2-7b", 6.74e9, "meta-llama/Llama-2-7b-hf on Hugging Face: model size 6.74B params"),
    ("llama3-8b", 8.03e9, "meta-llama/Meta-Llama-3-8B on Hugging Face: 8.03B params"),
    ("llama3.1-405b", 405.9e9, "meta-llama/Llama-3.1-405B: 405B (model card), 406B params on "
                               "Hugging Face"),
    ("mistral-7b", 7.24e9, "mistralai/Mistral-7B-v0.1 on Hugging Face: 7.24B params (Mistral's "
                           "announcement: 7.3B)"),
    ("mixtral-8x7b", 46.7e9, "Mistral AI, 'Mixtral of experts' (Dec 2023): 46.7B total "
                             "parameters"),
    ("mixtral-8x22b", 140.6e9, "Mistral AI, 'Cheaper, Better, Faster, Stronger' (Apr 2024): "
                               "141B total, 39B active"),
    ("qwen2.5-7b", 7.62e9, "Qwen/Qwen2.5-7B model card: Number of Parameters 7.61B"),
    ("qwen2.5-14b", 14.8e9, "Qwen/Qwen2.5-14B model card: Number of Parameters 14.7B"),
    ("qwen3-8b", 8.19e9, "Qwen/Qwen3-8B model card: Number of Parameters 8.2B"),
    ("qwen3-32b", 32.8e9, "Qwen/Qwen3-32B model card: Number of Parameters 32.8B"),
    ("qwen3-30b-a3b", 30.5e9, "Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated"),
    ("qwen3-235b-a22b", 235.1e9, "Qwen/Qwen3-235B-A22B model card: 235B total, 22B activated"),
    ("deepseek2-16b", 15.7e9, "deepseek-ai/DeepSeek-V2-Lite model card: 15.7B total params, "
                              "2.4B activated"),
    ("deepseek2-236b", 236e9, "deepseek-ai/DeepSeek-V2 model card: 236B total, 21B activated"),
    ("deepseek3-671b", 671e9, "deepseek-ai/DeepSeek-V3 model card: 671B main model weights "
                              "(685B with the 14B multi-token-prediction module, not built)"),
    ("gpt-oss-20b", 20.9e9, "OpenAI, gpt-oss-120b & gpt-oss-20b model card (arXiv 2508.10925): "
                            "20.9B total"),
    ("gpt-oss-120b", 116.8e9, "the same model card: 116.8B total"),
    ("gemma-2b", 2.51e9, "google/gemma-2b on Hugging Face: 2.51B params"),
    ("gemma-7b", 8.54e9, "google/gemma-7b on Hugging Face: 8.54B params"),
    ("gemma2-2b", 2.61e9, "google/gemma-2-2b on Hugging Face: 2.61B params"),
    ("gemma2-9b", 9.24e9, "google/gemma-2-9b on Hugging Face: 9.24B params"),
    ("gemma2-27b", 27.2e9, "google/gemma-2-27b on Hugging Face: 27.2B params"),
    ("gemma3-4b", 3.884e9, "Gemma 3 technical report, Table 1: 675M embedding + 3,209M "
                           "non-embedding parameters (the 417M vision encoder not built)"),
    ("gemma3-12b", 11.771e9, "Gemma 3 technical report, Table 1: 1,012M + 10,759M"),
    ("gemma3-27b", 27.016e9, "Gemma 3 technical report, Table 1: 1,416M + 25,600M"),
    ("olmo3-7b", 7.30e9, "allenai/Olmo-3-1025-7B on Hugging Face: 7.3B params"),
    ("olmo3-32b", 32.2e9, "allenai/Olmo-3-1125-32B on Hugging Face: 32.2B params"),
    ("qwen3-next-80b-a3b", 80e9, "Qwen/Qwen3-Next-80B-A3B-Instruct model card: 80B in total, "
                                 "3B activated (its multi-token-prediction layer not built)"),
    ("qwen3.5-35b-a3b", 35e9, "Qwen/Qwen3.5-35B-A3B model card: 35B in total, 3B activated "
                              "(the text decoder; the vision encoder not built)"),
    ("qwen3.5-397b-a17b", 397e9, "Qwen/Qwen3.5-397B-A17B model card: 397B in total, 17B "
                                 "activated (the vision encoder not built)"),
    ("gemma4-31b", 30.7e9, "google/gemma-4-31B model card: 30.7B (the text decoder; the vision "
                           "encoder not built)"),
    ("gemma4-26b", 25.2e9, "google/gemma-4-26B-A4B model card: 25.2B in total, 3.8B active "
                           "(the vision encoder not built)"),
    # Meta's Llama 4 model cards count the vision encoder and projector too: 0.872B by the
    # released vision_config (34 layers of width 1408, a 4096 -> 5120 projector)
    ("llama4-17b-16e", 109e9 - 0.872e9, "meta-llama/Llama-4-Scout-17B-16E model card: 109B in "
                                        "total, 17B activated, less its vision encoder"),
    ("llama4-17b-128e", 400e9 - 0.872e9, "meta-llama/Llama-4-Maverick-17B-128E model card: 400B "
                                         "in total, 17B activated, less its vision encoder"),
]


@pytest.mark.parametrize("name,published,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_parameter_count_matches_the_published_size(name, published, source):
    cfg, m = resolve(name)
    assert cfg.dialect == "maxtext"
    assert abs(count(m) / published - 1) < 0.01, (name, count(m), source)


def test_gpt3_175b_parameter_count():
    # Brown et al. 2020, Table 2.1: 175.0B. MaxText's gpt3-175b has 16384 learned positions (the
    # paper's 2048), 0.1% more. The file also sets target_eval_loss (2.69), which ends its run
    # early.
    cfg, m = resolve("gpt3-175b")
    assert abs(count(m) / 175.0e9 - 1) < 0.01
    assert cfg["target_eval_loss"] == 2.69


def _mla_moe_count(V, D, L, dense_layers, F, heads, q_lora, kv_lora, nope, rope, v, E, Fe,
                   shared, expert_bias):
    """DeepSeek-style model by its Hugging Face config.json shapes (independent arithmetic)."""
    q = D * heads * (nope + rope) if not q_lora else D * q_lora + q_lora + q_lora * heads * (
        nope + rope)
    attn = q + D * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * D
    moe = D * E + E * (3 * D * Fe) + 3 * D * Fe * shared + (E if expert_bias else 0)
    per_dense, per_moe = attn + 2 * D + 3 * D * F, attn + 2 * D + moe
    return 2 * V * D + D + dense_layers * per_dense + (L - dense_layers) * per_moe


def test_kimi_k2():
    """MaxText routes model names outside deepseek3*/deepseek4* through its plain top-k, where a
    routed_bias is a learned bias added into the scores that weigh the experts
    (moe_router_score_bias, not the selection-only expert bias). Its size is Kimi-K2's (plus
    one bias of 384 per MoE layer): the model card (moonshotai/Kimi-K2-Instruct) says "Total
    Parameters 1T"; config.json's shapes give 1.026T (third-party write-ups round to 1.04T)."""
    cfg, m = resolve("kimi-k2-1t")
    assert (m.moe.score_bias, m.moe.expert_bias) == (True, False)
    assert count(m) == _mla_moe_count(163840, 7168, 61, 1, 18432, 64, 1536, 512, 128, 64, 128,
                                      384, 2048, 1, False) + 60 * 384
    assert abs(count(m) / 1.0e12 - 1) < 0.03
    with pytest.raises(ConfigError, match="routed_bias_update_rate.*trains the routing bias"):
        resolve("kimi-k2-1t", "routed_bias_update_rate=0.01", "override_model_config=true")
    m = resolve("kimi-k2-1t", "routed_bias=false", "override_model_config=true")[1]
    assert not m.moe.score_bias and count(m) == _mla_moe_count(
        163840, 7168, 61, 1, 18432, 64, 1536, 512, 128, 64, 128, 384, 2048, 1, False)
    assert (m.moe.score_function, m.moe.topk_scaling_factor, m.moe.num_groups) == (
        "sigmoid", 2.827, None)
    assert (m.yarn_scaling_factor, m.yarn_beta_fast, m.yarn_beta_slow, m.rotary_base) == (
        32, 1, 1, 50000)


def test_deepseek3_count_by_config_shapes():
    m = resolve("deepseek3-671b")[1]
    assert count(m) == _mla_moe_count(129280, 7168, 61, 3, 18432, 128, 1536, 512, 128, 64, 128,
                                      256, 2048, 1, True)


# --------------------------------------------------------------------- architecture switches

def test_gemma_families():
    """MaxText's gemma blocks: plain RMSNorm scales, a tanh-GELU gated MLP, tied logits divided
    by sqrt(emb_dim); gemma2's layer pairs (num_decoder_layers is half the depth) with a window
    on the local one, sandwich norms and soft-caps; gemma3's five local layers per global one,
    q/k norms, the local RoPE base and the query scale of its model name."""
    m = resolve("gemma-7b")[1]
    assert (m.apply_layernorm_1p, m.activation, m.gated_linear_unit) == (False, "gelu_tanh", True)
    assert m.normalize_embedding_logits and not m.untie_embeddings_and_output_weights
    assert (m.embedding_multiplier, m.post_attention_norm, m.sliding_window) == (None, False, None)
    m = resolve("gemma2-9b")[1]
    assert m.num_layers == 42 and m.sliding_window == 4096
    assert m.sliding_window_layers == (True, False) * 21
    assert (m.post_attention_norm, m.post_mlp_norm) == (True, True)
    assert (m.attn_logit_softcapping, m.final_logit_softcapping) == (50.0, 30.0)
    assert m.query_pre_attn_scalar is None   # MaxText's gemma2 scales by head_dim ** -0.5
    m = resolve("gemma3-27b")[1]
    assert m.sliding_window_layers == ((True,) * 5 + (False,)) * 10 + (True, True)
    assert (m.qk_layernorm, m.local_rotary_base, m.rotary_base) == (True, 1e4, 1e6)
    assert m.rotary_seq_len_interpolation_factor == 8.0   # the global layers' linear scaling
    assert m.query_pre_attn_scalar == 5376 // 32
    assert resolve("gemma3-4b")[1].query_pre_attn_scalar is None
    over = "override_model_config=true"
    assert resolve("gemma2-2b", "use_post_ffw_norm=false", over)[1].post_mlp_norm is False
    assert resolve("gemma3-4b", "local_rope_max_timescale=500", over)[1].local_rotary_base == 500
    assert resolve("gemma2-2b", "sliding_window_size=0", over)[1].sliding_window is None
    with pytest.raises(ConfigError, match="query scale from the model name"):
        load_config("base.yml", ["decoder_block=gemma3", "base_emb_dim=64", "head_dim=32"])
    with pytest.raises(ConfigError, match="MaxText's gemma block does not read use_post_attn_no"):
        resolve("gemma-2b", "use_post_attn_norm=true")
    with pytest.raises(ConfigError, match="does not read local_rope_max_timescale"):
        resolve("gemma2-2b", "local_rope_max_timescale=500")


def test_olmo3_family():
    """MaxText's olmo3 block: output norms only, q/k norms across heads for olmo3* names, three
    windowed layers to one global, YaRN on every layer."""
    m = resolve("olmo3-7b")[1]
    assert (m.pre_norm, m.post_attention_norm, m.post_mlp_norm) == (False, True, True)
    assert (m.qk_layernorm, m.qk_norm_across_heads) == (True, True)
    assert m.sliding_window == 4096 and m.sliding_window_layers == (True, True, True, False) * 8
    assert (m.rope_type, m.yarn_scaling_factor, m.rotary_base) == ("yarn", 8.0, 5e5)
    assert m.local_rotary_base is None
    per_head = load_config("base.yml", ["decoder_block=olmo3", "use_qk_norm=true",
                                        "base_num_decoder_layers=4"])
    m = ModelConfig.from_config({**per_head})
    assert m.qk_layernorm and not m.qk_norm_across_heads and not m.pre_norm
    with pytest.raises(ConfigError, match="leaves out 2 of the 6 layers"):
        load_config("base.yml", ["decoder_block=olmo3", "base_num_decoder_layers=6",
                                 "inhomogeneous_layer_cycle_interval=4"])


def test_qwen3_hybrid_families():
    """MaxText's qwen3_next / qwen3_5 blocks: Gated DeltaNet layers (gdn_* sizes, chunk, q/k L2
    norm) with full attention every inhomogeneous_layer_cycle_interval layers (output gate,
    1 + w q/k norms, RoPE on partial_rotary_factor), every layer MoE with a gated shared expert
    as wide as the routed ones; qwen3_5's use_mrope is plain RoPE on text."""
    cfg, m = resolve("qwen3-next-80b-a3b")
    assert cfg["experimental_attention_variant"] == "gdn" and cfg["linear_attention_freq"] == 4
    assert m.linear_attention_layers == (True, True, True, False) * 12
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim,
            m.linear_value_head_dim, m.linear_conv_kernel_dim, m.linear_chunk_size) == (
        16, 32, 128, 128, 4, 64)
    assert m.linear_qk_l2_norm and m.attention_output_gate and m.apply_layernorm_1p
    assert m.qk_layernorm and m.rotary_percent == 0.25 and m.rotary_base == 1e7
    assert (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size) == (512, 10, 512)
    assert m.moe.shared_expert_size == 512 and m.moe.shared_expert_gate
    cfg, m = resolve("qwen3.5-35b-a3b")
    assert not cfg["use_mrope"] and m.rotary_percent == 0.25 and m.vocab_size == 248320
    assert cfg["mrope_section"] == [24, 20, 20]   # the file's [11, 11, 10]: plain RoPE on text
    small = ["decoder_block=qwen3_5", "base_num_decoder_layers=6", "num_experts=4",
             "num_experts_per_tok=2",
             "base_moe_mlp_dim=32", "base_mlp_dim=32", "gdn_num_key_heads=2",
             "gdn_num_value_heads=4", "inhomogeneous_layer_cycle_interval=3",
             "gdn_chunk_size=16", "use_qk_norm_in_gdn=false", "partial_rotary_factor=0.5",
             "gdn_key_head_dim=8", "gdn_value_head_dim=8", "gdn_conv_kernel_dim=3"]
    m = ModelConfig.from_config({**load_config("base.yml", small)})
    assert m.linear_attention_layers == (True, True, False) * 2
    assert (m.linear_chunk_size, m.linear_qk_l2_norm, m.rotary_percent) == (16, False, 0.5)
    assert (m.linear_key_head_dim, m.linear_conv_kernel_dim) == (8, 3)
    with pytest.raises(ConfigError, match="leaves out 2 of the 6 layers"):
        load_config("base.yml", [*small, "inhomogeneous_layer_cycle_interval=4"])
    with pytest.raises(ConfigError, match="every layer of this block with MoE"):
        load_config("base.yml", ["decoder_block=qwen3_next", "base_num_decoder_layers=4"])
    with pytest.raises(ConfigError, match="llama2 block does not read partial_rotary_factor"):
        load_config("base.yml", ["decoder_block=llama2", "partial_rotary_factor=0.5"])
    with pytest.raises(ConfigError, match="use_mrope.*multimodal"):
        load_config("base.yml", ["decoder_block=qwen3", "use_mrope=true"])


def test_llama4_family():
    """MaxText's llama4 block: NoPE every nope_layer_interval layers (temperature tuning there),
    chunked attention and L2 q/k norms (use_qk_norm) on the RoPE layers, Llama-3.1 RoPE on
    interleaved pairs, MoE every interleave_moe_layer_step layers with a sigmoid top-1 router
    scaling the expert input and shared_experts experts as wide as the routed ones."""
    _, m = resolve("llama4-17b-16e")
    assert m.no_rope_layers == (False, False, False, True) * 12
    assert m.qk_l2_norm and m.qk_norm_rope_layers_only and not m.qk_layernorm
    assert (m.attention_chunk_size, m.attn_temperature_tuning) == (8192, True)
    assert m.rotary_interleaved and m.use_rope_scaling
    moe = m.moe
    assert (moe.num_experts, moe.topk, moe.layer_freq, moe.score_function) == (
        16, 1, 1, "sigmoid")
    assert moe.apply_probs_on_input and moe.shared_expert_size == moe.ffn_hidden_size == 8192
    _, m = resolve("llama4-17b-128e")
    assert not m.qk_l2_norm and not m.use_rope_scaling
    assert m.moe.layer_freq == (0, 1) * 24 and m.ffn_hidden_size == 16384
    small = ["decoder_block=llama4", "base_num_decoder_layers=6", "num_experts=4",
             "base_moe_mlp_dim=32", "base_mlp_dim=48", "nope_layer_interval=3",
             "interleave_moe_layer_step=3", "inhomogeneous_layer_cycle_interval=3",
             "shared_experts=2", "use_qk_norm=true"]
    m = ModelConfig.from_config({**load_config("base.yml", small)})
    assert m.no_rope_layers == (False, False, True) * 2
    assert m.moe.layer_freq == (0, 0, 1) * 2 and m.moe.shared_expert_size == 64
    assert m.attention_chunk_size is None and not m.attn_temperature_tuning
    with pytest.raises(ConfigError, match="nope_layer_interval.*index in the cycle"):
        load_config("base.yml", [*small, "nope_layer_interval=2"])
    with pytest.raises(ConfigError, match="num_experts_per_tok.*use 1"):
        load_config("base.yml", [*small, "num_experts_per_tok=2"])
    with pytest.raises(ConfigError, match="load_balance_loss_weight.*softmax"):
        load_config("base.yml", [*small, "load_balance_loss_weight=0.01"])
    with pytest.raises(ConfigError, match="llama2 block does not read nope_layer_interval"):
        load_config("base.yml", ["decoder_block=llama2", "nope_layer_interval=4"])


def test_envy_family():
    """MaxText's envy block: an MoE layer every interleave_moe_layer_step layers (top-1 of a
    softmax router: weight 1, as MaxText builds it, said in a warning), q/k norms as
    use_qk_norm says, a norm after the MLP as use_post_ffw_norm says; the balance loss
    averaged over the MoE layers."""
    cfg, m = resolve("envy-switch-base")
    assert m.moe.layer_freq == (0, 1) * 6 and (m.moe.topk, m.moe.num_experts) == (1, 128)
    assert m.qk_layernorm and m.post_mlp_norm and not m.moe.pre_softmax
    assert m.moe.aux_loss_coeff == pytest.approx((0.01 / 6,))   # 6 MoE layers of 12
    assert any("weighs it 1" in w for w in cfg.warnings)
    _, m = resolve("envy-switch-base", "override_model_config=true", "use_post_ffw_norm=false",
                   "use_qk_norm=false", "interleave_moe_layer_step=1",
                   "inhomogeneous_layer_cycle_interval=1")
    assert not (m.post_mlp_norm or m.qk_layernorm) and m.moe.layer_freq == 1
    with pytest.raises(ConfigError, match="interleave_moe_layer_step.*index in the cycle"):
        resolve("envy-switch-base", "override_model_config=true",
                "inhomogeneous_layer_cycle_interval=3")


def test_gemma4_family():
    """MaxText's gemma4 block: five local layers to one global with the global_* head shape,
    keys as values, proportional RoPE on a quarter of the global pairs (gemma4* names), value
    norms as v_norm_with_scale says, query scale 1, layer scalars; the 26b's MoE layers run the
    mlp_dim dense MLP beside the experts with their own norms and Gemma 4's router."""
    _, m = resolve("gemma4-31b")
    assert m.global_layers == (False,) * 5 + (True,) + (False,) * 5 + (True,) + (
        False, False, False, False, False, True) * 8
    assert m.attention_shape(True) == (4, 512) and m.attention_k_eq_v
    assert (m.global_rotary_percent, m.rotary_base, m.local_rotary_base) == (0.25, 1e6, 1e4)
    assert (m.v_norm, m.query_pre_attn_scalar, m.layer_scalar, m.sliding_window) == (
        "plain", 1.0, True, 1024)
    assert m.qk_layernorm and m.post_attention_norm and m.post_mlp_norm
    _, m = resolve("gemma4-26b")
    moe = m.moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_size) == (
        128, 8, 704, 2112)
    assert moe.branch_norms and moe.router_input_norm and moe.per_expert_scale
    assert not moe.pre_softmax   # norm_topk_prob: the chosen experts' weights sum to one
    _, m = resolve("gemma4-26b", "override_model_config=true", "norm_topk_prob=false",
                   "v_norm_with_scale=true", "share_kv_projections=false",
                   "global_rope_max_timescale=5000", "global_head_dim=0", "global_num_kv_heads=0")
    assert m.moe.pre_softmax and m.v_norm == "scaled" and not m.attention_k_eq_v
    assert m.rotary_base == 5000 and m.attention_shape(True) == (8, 256)
    with pytest.raises(ConfigError, match="global_rope_proportion.*gemma4\\* model names"):
        load_config("base.yml", ["decoder_block=gemma4", "sliding_window_size=8"])
    with pytest.raises(ConfigError, match="local_rope_proportion"):
        resolve("gemma4-31b", "override_model_config=true", "local_rope_proportion=0.5")
    with pytest.raises(ConfigError, match="shared_experts.*use 1"):
        resolve("gemma4-26b", "override_model_config=true", "shared_experts=2")
    with pytest.raises(ConfigError, match="llama2 block does not read share_kv_projections"):
        load_config("base.yml", ["decoder_block=llama2", "share_kv_projections=true"])


@pytest.mark.parametrize("name, period, shared, wide", [("gemma4-e2b", 5, 20, True),
                                                        ("gemma4-e4b", 6, 18, False)])
def test_gemma4_small_family(name, period, shared, wide):
    """MaxText's gemma4_small block: gemma4-e2b's four local layers to one global (five for
    other names), per-layer inputs, the last num_kv_shared_layers layers sharing keys and
    values (E2B's MLPs there twice as wide): the model of jaxtrain's preset of the same
    Gemma 4, which counts as transformers' (test_family_presets)."""
    from tests.config.test_family_presets import _preset
    _, m = resolve(name)
    assert m.global_layers == tuple((i + 1) % period == 0 for i in range(m.num_layers))
    assert (m.per_layer_input_size, m.per_layer_vocab_size) == (256, 262144)
    assert (m.kv_shared_layers, m.double_wide_shared_mlp) == (shared, wide)
    assert m.kv_roles.count("store") == 2 and m.attention_shape(True)[1] == 512
    preset = _preset({"gemma4-e2b": "gemma4_E2B", "gemma4-e4b": "gemma4_E4B"}[name])
    assert count(m) == count(preset)
    with pytest.raises(ConfigError, match="vocab_size_per_layer_input"):
        resolve(name, "override_model_config=true", "vocab_size_per_layer_input=0")
    with pytest.raises(ConfigError, match="gemma4_small block does not read share_kv"):
        resolve(name, "override_model_config=true", "share_kv_projections=true")
    with pytest.raises(ConfigError, match="gemma4 block does not read num_kv_shared_layers"):
        resolve("gemma4-31b", "override_model_config=true", "num_kv_shared_layers=4")


@pytest.mark.slow
def test_normalize_embedding_logits_divides_the_tied_logits():
    """MaxText's gemma keeps sqrt(emb_dim) in its embedding weights and divides the tied logits
    by it; the same model without the division gives logits sqrt(D) times larger."""
    from jaxtrain.models import forward, init

    m = resolve("gemma-2b", "base_emb_dim=64", "base_num_query_heads=2", "base_num_kv_heads=1",
                "head_dim=32", "base_mlp_dim=128", "base_num_decoder_layers=1", "vocab_size=128",
                "override_model_config=true")[1]
    params = init(m, jax.random.key(0))
    toks = np.arange(8)[None] % 128
    a, b = forward(params, toks, m), forward(params, toks, m.replace(
        normalize_embedding_logits=False))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a) * 8.0, rtol=1e-5, atol=1e-5)

def test_llama_family():
    m = resolve("llama2-7b")[1]
    assert (m.normalization, m.norm_epsilon, m.apply_layernorm_1p) == ("RMSNorm", 1e-5, False)
    assert (m.activation, m.gated_linear_unit, m.add_bias_linear, m.add_qkv_bias) == (
        "silu", True, False, False)
    assert m.untie_embeddings_and_output_weights and m.moe is None
    assert (m.rotary_base, m.rotary_interleaved, m.use_rope_scaling) == (1e4, False, False)
    m = resolve("llama3.1-8b")[1]       # MaxText's LLaMARotaryEmbedding: interleaved pairs
    assert (m.rotary_base, m.rotary_interleaved, m.use_rope_scaling) == (5e5, True, True)
    assert (m.rope_scaling_factor, m.original_max_position_embeddings) == (8, 8192)
    m = resolve("mistral-7b")[1]
    assert (m.rotary_base, m.num_kv_heads, m.sliding_window) == (1e6, 8, None)
    m = resolve("mixtral-8x7b")[1]
    assert (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size) == (8, 2, 14336)
    assert (m.moe.score_function, m.moe.pre_softmax, m.moe.topk_scaling_factor) == (
        "softmax", False, None)
    assert not (m.moe.router_bias or m.moe.expert_bias or m.moe.shared_expert_size)


def test_qwen_family():
    m = resolve("qwen2.5-7b")[1]
    assert (m.add_qkv_bias, m.add_bias_linear, m.qk_layernorm) == (True, False, False)
    assert (m.norm_epsilon, m.rotary_base, m.untie_embeddings_and_output_weights) == (
        1e-6, 1e6, True)
    assert not resolve("qwen2.5-1.5b")[1].untie_embeddings_and_output_weights   # tied
    m = resolve("qwen3-8b")[1]
    assert (m.qk_layernorm, m.qk_l2_norm, m.add_qkv_bias, m.add_bias_linear) == (
        True, False, False, False)
    assert "q_norm" in P.param_specs(m)["layers"]["attn"]
    assert not resolve("qwen3-0.6b")[1].untie_embeddings_and_output_weights
    m = resolve("qwen3-30b-a3b")[1]
    assert m.qk_layernorm and (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size) == (
        128, 8, 768)
    assert (m.moe.score_function, m.moe.pre_softmax, m.moe.layer_freq) == ("softmax", False, 1)
    # norm_topk_prob: MaxText renormalises weights its softmax over the chosen logits already
    # normalised, so both values build the same router
    other = resolve("qwen3-30b-a3b", "norm_topk_prob=false", "override_model_config=true")[1]
    assert other.moe == m.moe


def test_deepseek_family():
    m = resolve("deepseek2-16b")[1]
    assert m.multi_latent_attention and m.qk_layernorm and m.q_lora_rank is None
    assert (m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (
        512, 128, 64, 128)
    assert (m.moe.layer_freq[:2], m.moe.ffn_hidden_size, m.ffn_hidden_size) == (
        (0, 1), 1408, 10944)
    assert m.moe.shared_expert_size == 2 * 1408 and m.moe.topk == 6
    # softmax over all experts before the top-k, not renormalised, routed_scaling_factor 1
    assert (m.moe.score_function, m.moe.pre_softmax, m.moe.topk_scaling_factor) == (
        "softmax", True, None)
    assert not m.moe.expert_bias
    # MaxText's MLA softmax scale: (qk_nope + qk_rope)^-0.5 x (0.1 mscale ln(rope_factor) + 1)^2
    want = 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
    assert m.mla_softmax_scale == pytest.approx(want, rel=1e-12)
    assert m.rope_type == "yarn" and L.rope_inv_freq(m)[1] == pytest.approx(1.0)
    assert resolve("deepseek2-236b")[1].moe.topk_scaling_factor == 16.0
    m = resolve("deepseek3-671b")[1]
    assert (m.moe.score_function, m.moe.expert_bias, m.moe.bias_update_rate) == (
        "sigmoid", True, 0.0)
    assert (m.moe.topk_scaling_factor, m.moe.num_groups, m.moe.layer_freq[:4]) == (
        2.5, None, (0, 0, 0, 1))
    m = resolve("deepseek3-671b-batchsplit")[1]     # n_routing_groups 8, topk_routing_group 4
    assert (m.moe.num_groups, m.moe.group_topk, m.moe.topk) == (8, 4, 8)
    from jaxtrain.models.moe import group_score_topk
    assert group_score_topk(m.moe) == 2      # MaxText scores a group by its top-2 experts


def test_gpt_oss():
    cfg, m = resolve("gpt-oss-20b")
    assert (m.add_bias_linear, m.add_qkv_bias, m.attention_sinks) == (True, True, True)
    assert (m.moe.router_bias, m.moe.activation, m.moe.glu_limit) == (True, "swiglu_oai", 7.0)
    assert (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size, m.moe.pre_softmax) == (
        32, 4, 2880, False)
    experts = P.param_specs(m)["moe_layers"]["moe"]["experts"]
    assert {"bi_0", "bi_1", "bo"} <= set(experts)
    # MaxText's dot-product mask sees the token and the 127 before it, on the even layers
    assert m.sliding_window == 128 and m.sliding_window_layers == tuple(
        i % 2 == 0 for i in range(24))
    assert [m.window_of_layer(i) for i in range(3)] == [128, None, 128]
    # YaRN on the two halves, no truncation, rotary output scaled by 0.1 ln(32) + 1
    assert (m.rope_type, m.rotary_interleaved, m.yarn_truncate) == ("yarn", False, False)
    assert L.rope_inv_freq(m)[1] == pytest.approx(0.1 * math.log(32) + 1)
    assert (m.kv_channels, m.num_kv_heads, m.rotary_base) == (64, 8, 150000)


def test_gpt3():
    m = resolve("gpt3-6b", enforce_status=False)[1]
    assert (m.normalization, m.apply_layernorm_1p, m.norm_epsilon) == ("LayerNorm", True, 1e-5)
    assert (m.add_bias_linear, m.add_qkv_bias, m.untie_embeddings_and_output_weights) == (
        True, True, False)
    assert (m.activation, m.gated_linear_unit, m.use_iota_embed) == ("gelu_tanh", False, True)
    assert (m.position_embedding_type, m.max_position_embeddings) == ("learned_absolute", 16384)
    assert P.param_specs(m)["position_embedding"].shape == (16384, 3072)
    assert m.num_kv_heads == m.num_attention_heads == 12


# --------------------------------------------------------------------- each key changes the model

TINY = ["base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=512",
        "base_num_decoder_layers=4", "head_dim=64", "vocab_size=1024", "attention=dot_product"]


def tiny(*overrides):
    run = pathlib.Path("run.yml")          # in the test's own folder (_presets_only)
    run.write_text("base_config: base.yml\n")
    cfg = load_config(run, [*TINY, *overrides])
    assert cfg.dialect == "maxtext"
    return ModelConfig.from_config({**cfg})


def refused(match, *overrides):
    with pytest.raises(ConfigError, match=match):
        tiny(*overrides)


def test_attention_bias_and_qk_norm_keys():
    assert tiny("decoder_block=qwen2", "attention_bias=true").add_qkv_bias
    assert not tiny("decoder_block=qwen2").add_qkv_bias
    m = tiny("decoder_block=qwen2", "attention_bias=true")
    assert not m.add_bias_linear and "bo" not in P.param_specs(m)["layers"]["attn"]
    refused("attention_bias = True.*llama2 block has no attention biases", "attention_bias=true")
    assert tiny("decoder_block=qwen3", "use_qk_norm=true").qk_layernorm
    assert not tiny("decoder_block=qwen3").qk_layernorm
    m = tiny("decoder_block=qwen3", "use_qk_norm=true", "qk_norm_with_scale=false")
    assert (m.qk_l2_norm, m.qk_layernorm) == (True, False)
    refused("use_qk_norm = True.*does not read use_qk_norm", "use_qk_norm=true")
    refused("decoder_block qwen3 is .*qk_layernorm = False", "decoder_block=qwen3",
            "qk_layernorm=true")


MOE = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=128"]


def test_moe_layout_keys():
    m = tiny("decoder_block=qwen3_moe", *MOE)
    assert m.moe.ffn_hidden_size == 128                        # base_moe_mlp_dim
    assert tiny("decoder_block=qwen3_moe", *MOE, "global_parameter_scale=2").moe.ffn_hidden_size \
        == 256                                                 # scaled like base_mlp_dim
    refused("base_moe_mlp_dim.*MaxText's rule", "decoder_block=qwen3_moe", "num_experts=4")
    refused("base_mlp_dim = base_moe_mlp_dim", "decoder_block=mixtral", *MOE)
    ds = ["decoder_block=deepseek", "attention_type=mla", "rope_type=yarn",
          "routed_score_func=softmax", *MOE, "base_mlp_dim=128"]
    m = tiny(*ds, "first_num_dense_layers=1", "shared_experts=2")
    assert m.moe.layer_freq == (0, 1, 1, 1) and m.moe.shared_expert_size == 256
    assert tiny(*ds).moe.layer_freq == 1 and tiny(*ds).moe.shared_expert_size is None
    refused("first_num_dense_layers.*leaves no MoE layer", *ds, "first_num_dense_layers=4")


def test_load_balance_loss_weight():
    """MaxText: mean over MoE layers of E * sum_e(token share x mean prob) per sequence, times
    the weight = top-k x Megatron's seq_aux_loss, averaged (not summed) over the layers."""
    m = tiny("decoder_block=qwen3_moe", *MOE, "load_balance_loss_weight=0.01")
    assert m.moe.load_balancing == ("seq_aux_loss",)
    assert m.moe.aux_loss_coeff == pytest.approx((0.01 * 2 / 4,))
    assert tiny("decoder_block=qwen3_moe", *MOE).moe.aux_loss_coeff == (0.0,)
    refused("load_balance_loss_weight.*softmax of its routing scores", "decoder_block=deepseek",
            "attention_type=mla", "rope_type=yarn", "routed_score_func=softmax", *MOE,
            "load_balance_loss_weight=0.01")


DS = ["decoder_block=deepseek", "attention_type=mla", "rope_type=yarn", *MOE,
      "num_experts=8", "num_experts_per_tok=4", "base_mlp_dim=128", "override_model_config=true"]


def test_deepseek_routing_keys():
    v3 = ["model_name=deepseek3-tiny", *TINY, *DS]

    def ds(*extra):
        run = pathlib.Path("run.yml")
        run.write_text("base_config: base.yml\n")
        cfg = load_config(run, [*v3, *extra])
        return ModelConfig.from_config({**cfg}).moe

    m = ds("routed_score_func=sigmoid", "routed_bias=true", "routed_scaling_factor=2.5",
           "routed_bias_update_rate=0.01")
    assert (m.score_function, m.expert_bias, m.bias_update_rate, m.topk_scaling_factor) == (
        "sigmoid", True, 0.01, 2.5)
    m = ds("routed_score_func=sigmoid", "n_routing_groups=4", "topk_routing_group=2")
    assert (m.num_groups, m.group_topk, m.expert_bias) == (4, 2, True)   # the file's bias
    m = ds("routed_score_func=softmax", "routed_bias=false", "routed_scaling_factor=1.0")
    assert (m.score_function, m.pre_softmax, m.topk_scaling_factor) == ("softmax", True, None)
    for extra, match in [
            (["routed_score_func="], "raw router logits"),
            (["routed_score_func=softmax", "routed_bias=true"], "routed_bias = True"),
            (["routed_score_func=sigmoid", "n_routing_groups=4", "topk_routing_group=1"],
             "top-2 experts"),
            (["routed_score_func=sigmoid", "routed_bias=false", "routed_bias_update_rate=0.1"],
             "routed_bias is off")]:
        with pytest.raises(ConfigError, match=match):
            ds(*extra)
    # other model names (deepseek2, kimi): plain top-k of the biased scores, which weigh the
    # experts (a learned bias), groups ignored
    m = ds("model_name=deepseek2-16b", "routed_score_func=sigmoid", "routed_bias=true")
    assert (m.score_bias, m.expert_bias) == (True, False)
    with pytest.raises(ConfigError, match="n_routing_groups.*ignores it for 'deepseek2-16b'"):
        ds("model_name=deepseek2-16b", "routed_score_func=sigmoid", "n_routing_groups=4",
           "topk_routing_group=2")


def test_gpt_oss_keys():
    oss = ["decoder_block=gpt_oss", *MOE, "base_mlp_dim=128", "mlp_activations=[sigmoid,linear]",
           "mlp_activations_limit=5.0", "attention_bias=true", "mlp_bias=true",
           "routed_bias=true", "attention_sink=true", "sliding_window_size=16",
           "inhomogeneous_layer_cycle_interval=2"]
    m = tiny(*oss)
    assert (m.moe.glu_limit, m.add_bias_linear, m.moe.router_bias) == (5.0, True, True)
    assert (m.sliding_window, m.sliding_window_layers) == (16, (True, False, True, False))
    # scanned with interval 1, MaxText's block is the windowed layer every time
    m = tiny(*oss, "inhomogeneous_layer_cycle_interval=1")
    assert m.sliding_window == 16 and m.sliding_window_layers is None
    m = tiny(*oss, "inhomogeneous_layer_cycle_interval=1", "scan_layers=false")
    assert m.sliding_window_layers == (True, False, True, False)
    refused("set all three alike", *oss, "mlp_bias=false")
    refused("mlp_activations.*use \\[sigmoid, linear\\]", *oss, "mlp_activations=[silu,linear]")
    refused("mlp_activations_limit.*positive limit", *oss, "mlp_activations_limit=-1")
    refused("sliding_window_size.*attention_sink: true", *oss, "attention_sink=false")
    refused("inhomogeneous_layer_cycle_interval.*leaves out", *oss,
            "inhomogeneous_layer_cycle_interval=3")
    refused("mlp_activations_limit = .*does not read", "mlp_activations_limit=7.0")
    refused("sliding_window_size = 16.*llama2 block does not read", "sliding_window_size=16")
    refused("inhomogeneous_layer_cycle_interval = 2.*does not read",
            "inhomogeneous_layer_cycle_interval=2")


def test_trainable_position_size():
    m = tiny("decoder_block=gpt3", "base_num_kv_heads=4", "mlp_activations=[gelu]",
             "trainable_position_size=512")
    assert (m.position_embedding_type, m.max_position_embeddings) == ("learned_absolute", 512)
    m = tiny("decoder_block=gpt3", "base_num_kv_heads=4", "mlp_activations=[gelu]")
    assert m.position_embedding_type == "none"
    refused("trainable_position_size = 512.*does not read", "trainable_position_size=512")
    refused("multi-head attention", "decoder_block=gpt3", "mlp_activations=[gelu]")


def _maxtext_yarn(dim, theta, factor, fast, slow, original, truncate):
    """MaxText's YaRN frequencies (YarnRotaryEmbedding.freqs_cis), written from its formula."""
    half = dim // 2
    freqs = 1.0 / theta ** (2.0 * np.arange(half) / dim)

    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(fast), corr(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    smooth = 1 - np.clip((np.arange(half) - low) / (high - low), 0, 1)
    return freqs / factor * (1 - smooth) + freqs * smooth


@pytest.mark.parametrize("factor,fast,slow,truncate,scaling", [
    (32, 32, 1, False, True), (40, 32, 1, True, False), (8, 16, 2, True, True),
    (32, 1, 1, True, False)])
def test_yarn_keys_match_maxtext(factor, fast, slow, truncate, scaling):
    m = tiny("rope_type=yarn", f"rope_factor={factor}", f"beta_fast={fast}", f"beta_slow={slow}",
             f"rope_truncate={str(truncate).lower()}",
             f"rope_attention_scaling={str(scaling).lower()}",
             "rope_interleave=false", "rope_max_timescale=150000",
             "original_max_position_embeddings=1024")
    inv, attention = L.rope_inv_freq(m)
    np.testing.assert_allclose(inv, _maxtext_yarn(64, 150000, factor, fast, slow, 1024, truncate),
                               rtol=1e-6)
    assert attention == pytest.approx(0.1 * math.log(factor) + 1 if scaling else 1.0)
    assert not m.rotary_interleaved
    assert tiny("rope_type=yarn").rotary_interleaved            # rope_interleave: true


def test_mla_softmax_mscale():
    mla = ["decoder_block=deepseek", "attention_type=mla", "rope_type=yarn", "rope_factor=40",
           "mscale=0.5", "qk_nope_head_dim=32", "qk_rope_head_dim=16"]
    m = tiny(*mla)
    assert m.mla_softmax_scale == pytest.approx(48 ** -0.5 * (0.1 * 0.5 * math.log(40) + 1) ** 2)
    assert L.rope_inv_freq(m)[1] == pytest.approx(1.0)
    m = tiny(*mla, "rope_attention_scaling=true")       # and the rotary part scaled as well
    assert L.rope_inv_freq(m)[1] == pytest.approx(0.1 * math.log(40) + 1)
    assert m.mla_softmax_scale == pytest.approx(48 ** -0.5 * (0.1 * 0.5 * math.log(40) + 1) ** 2)
    # MaxText applies the mscale only when max_position_embeddings > original
    m = tiny(*mla, "max_position_embeddings=4096", "original_max_position_embeddings=4096")
    assert m.mla_softmax_scale == pytest.approx(48 ** -0.5)
    # yarn_softmax_mscale is the knob MaxText files spell mscale
    assert tiny(*mla[:-3], "yarn_softmax_mscale=0.5", *mla[-2:]) == tiny(*mla)
    refused("rope_interleave.*interleaved pairs", *mla, "rope_interleave=false")
    refused("multi-latent attention with rope_type", *mla[:2])


# --------------------------------------------------------------------- refusals by name

def test_default_block_runs_attention_and_mlp_in_parallel_on_one_norm():
    """MaxText's default block: x + attention(norm(x)) + mlp(norm(x)) (the layer itself:
    tests/models/test_transformer.py)."""
    m = tiny("decoder_block=default")
    assert (m.parallel_residual, m.parallel_shared_norm, m.qk_layernorm) == (True, True, False)
    assert "mlp_norm" not in P.param_specs(m)["layers"]
    refused("parallel_residual_shared_norm", "decoder_block=default",
            "parallel_residual_shared_norm=false")


def test_qwen3_custom_moe():
    """attention to attention_output_dim (768), normed, 128 experts of 2048 at that width
    (router too), projected up to emb_dim: one residual add per layer (the layer itself:
    tests/models/test_moe.py). Count by the file's shapes; its two widths must agree."""
    m = resolve("qwen3-custom-30b-a3b")[1]
    assert (m.attention_output_dim, m.moe_width, m.qk_layernorm) == (768, 768, True)
    assert (m.moe.num_experts, m.moe.topk, m.moe.ffn_hidden_size, m.moe.score_function,
            m.moe.shared_expert_size) == (128, 8, 2048, "softmax", None)
    D, A, L, N, K, H, E, F, V = 2048, 768, 48, 16, 2, 256, 128, 2048, 151936
    layer = D * N * H + 2 * D * K * H + N * H * A + 2 * H + D + A + A * E + E * 3 * A * F + A * D
    assert count(m) == 2 * V * D + D + L * layer
    with pytest.raises(ConfigError, match="attention_output_dim.*moe_expert_input_dim"):
        resolve("qwen3-custom-30b-a3b", "moe_expert_input_dim=512", "override_model_config=true")
    refused("attention_output_dim.*qwen3_moe block does not read", "decoder_block=qwen3_moe",
            *MOE, "base_moe_mlp_dim=32", "attention_output_dim=16")


def test_multimodal_models_are_rejected_by_name():
    """use_multimodal is refused; the encoder settings of a text-only file (gemma3's) are inert,
    as MaxText reads them only with use_multimodal."""
    with pytest.raises(ConfigError, match="use_multimodal is not supported.*multimodal"):
        resolve("qwen3-vl-2b")
    cfg, _ = resolve("gemma3-4b")
    assert cfg["vision_encoder_block"] == "gemma3" and not cfg["use_multimodal"]


def _model_names():
    folder = CHECKOUT / "src" / "maxtext" / "configs" / "models"
    names = {p.stem for p in PRESETS.glob("*.yml")}
    return sorted(names | {p.stem for p in folder.glob("*.yml")} if folder.is_dir() else names)


def test_dry_run_of_every_model_name(cli):
    """No traceback for any model name: it loads (exit 0) or is refused (exit 2) naming a key."""
    for name in _model_names():
        code, out, err = cli("base.yml", f"model_name={name}", "--dry-run")
        assert code in (0, 2), (name, err)
        if code == 2:
            assert "config error" in err and ("=" in err or "model_name" in err), (name, err)
        else:
            assert f"model_name: {name}" in out


@pytest.mark.slow
@pytest.mark.skipif(not CHECKOUT.is_dir(), reason="needs a MaxText checkout")
def test_dry_run_of_every_model_name_with_the_checkout_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MAXTEXT_PATH": str(CHECKOUT)}
    for name in _model_names():
        r = subprocess.run([sys.executable, "-m", "jaxtrain.train", "base.yml",
                            f"model_name={name}", "--dry-run"], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode in (0, 2) and "Traceback" not in r.stderr, (name, r.stderr[-2000:])


@pytest.mark.skipif(not CHECKOUT.is_dir(), reason="needs a MaxText checkout")
def test_presets_are_the_checkout_values():
    sys.path.insert(0, str(ROOT / "tools"))
    import maxtext_presets
    assert maxtext_presets.main([str(CHECKOUT), "--commit", "e591f30cbb", "--check"]) == 0


def test_presets_name_their_commit_and_read_back():
    import yaml
    presets = sorted(PRESETS.glob("*.yml"))
    assert len(presets) >= 40
    for path in presets:
        text = path.read_text()
        assert "AI-Hypercomputer/maxtext at commit e591f30cbb" in text.splitlines()[1]
        assert yaml.safe_load(text)["decoder_block"] in (
            "llama2", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek", "gpt3",
            "gpt_oss", "gemma", "gemma2", "gemma3", "olmo3", "qwen3_next", "qwen3_5", "llama4",
            "gemma4", "gemma4_small", "envy", "deepseek4", "qwen3_custom_moe")


FORWARD = {
    "qwen2": ["decoder_block=qwen2", "attention_bias=true"],
    "qwen3_moe": ["decoder_block=qwen3_moe", "use_qk_norm=true", *MOE, "base_moe_mlp_dim=32"],
    "qwen3_custom_moe": ["decoder_block=qwen3_custom_moe", "use_qk_norm=true", *MOE,
                         "base_moe_mlp_dim=32", "attention_output_dim=24",
                         "moe_expert_input_dim=24"],
    "deepseek": ["model_name=deepseek3-tiny", "override_model_config=true",
                 "base_num_decoder_layers=4", "base_emb_dim=64", "base_mlp_dim=128",
                 "base_num_query_heads=4", "base_num_kv_heads=4", "vocab_size=256",
                 "q_lora_rank=32", "kv_lora_rank=32", "qk_nope_head_dim=16",
                 "qk_rope_head_dim=8", "v_head_dim=16", *MOE, "base_moe_mlp_dim=32",
                 "first_num_dense_layers=1"],
    "gpt_oss": ["decoder_block=gpt_oss", *MOE, "base_mlp_dim=32", "base_moe_mlp_dim=32",
                "mlp_activations=[sigmoid,linear]", "mlp_activations_limit=7.0",
                "attention_bias=true", "mlp_bias=true", "routed_bias=true", "attention_sink=true",
                "sliding_window_size=4", "inhomogeneous_layer_cycle_interval=2",
                "rope_type=yarn", "rope_interleave=false", "rope_attention_scaling=true"],
    "gpt3": ["decoder_block=gpt3", "base_num_kv_heads=4", "mlp_activations=[gelu]",
             "trainable_position_size=64", "logits_via_embedding=true",
             "normalize_embedding_logits=false"],
    "gemma2": ["model_name=gemma2-2b", "override_model_config=true", "base_num_decoder_layers=2",
               "base_num_query_heads=4", "base_num_kv_heads=2", "vocab_size=256",
               "sliding_window_size=4"],
    "olmo3": ["model_name=olmo3-7b", "override_model_config=true", "base_num_decoder_layers=4",
              "base_num_query_heads=4", "base_num_kv_heads=2", "vocab_size=256",
              "sliding_window_size=4", "max_position_embeddings=64",
              "original_max_position_embeddings=16"],
    "qwen3_next": ["model_name=qwen3-next-80b-a3b", "override_model_config=true",
                   "base_num_decoder_layers=4", "base_num_query_heads=4", "base_num_kv_heads=2",
                   "vocab_size=256", "num_experts=4", "num_experts_per_tok=2",
                   "base_moe_mlp_dim=32", "base_mlp_dim=32", "gdn_num_key_heads=2",
                   "gdn_num_value_heads=4", "gdn_key_head_dim=8", "gdn_value_head_dim=8",
                   "gdn_chunk_size=8"],
    "llama4": ["model_name=llama4-17b-128e", "override_model_config=true",
               "base_num_decoder_layers=4", "base_num_query_heads=4", "base_num_kv_heads=2",
               "vocab_size=256", "num_experts=4", "base_moe_mlp_dim=32",
               "chunk_attn_window_size=4"],
    "gemma4": ["model_name=gemma4-26b", "override_model_config=true",
               "base_num_decoder_layers=6", "base_num_query_heads=4", "base_num_kv_heads=2",
               "global_head_dim=32", "global_num_kv_heads=1", "vocab_size=256", "num_experts=4",
               "num_experts_per_tok=2", "base_moe_mlp_dim=32", "sliding_window_size=4"],
    "envy": ["model_name=envy-switch-base", "override_model_config=true",
             "base_num_decoder_layers=4", "base_num_query_heads=4", "base_num_kv_heads=4",
             "vocab_size=256", "num_experts=4", "base_moe_mlp_dim=32"],
    "gemma3": ["model_name=gemma3-4b", "override_model_config=true", "base_num_decoder_layers=7",
               "base_num_query_heads=4", "base_num_kv_heads=2", "vocab_size=256",
               "sliding_window_size=4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FORWARD))
def test_tiny_family_runs_forward(family):
    import jax.numpy as jnp
    from jaxtrain.models.transformer import forward
    m = tiny("base_emb_dim=64", "base_mlp_dim=128", "head_dim=16", "vocab_size=256",
             "dtype=float32", "weight_dtype=float32", *FORWARD[family])
    params = P.init(m, jax.random.key(0))
    out = forward(params, jnp.arange(32, dtype=jnp.int32).reshape(2, 16), m)
    logits = out[0] if isinstance(out, tuple) else out
    assert logits.shape == (2, 16, 256) and bool(jnp.all(jnp.isfinite(logits)))


def test_capacity_factor_is_per_sequence_on_the_dense_path():
    from jaxtrain.models import ModelConfig

    args = ["model_name=mixtral-8x7b", "capacity_factor=1.0", "hardware=cpu"]
    dropless = load_config("base.yml", args, enforce_status=False)
    assert dropless["moe_expert_capacity_factor"] is None
    assert any("sparse_matmul" in w for w in dropless.warnings)
    dense = load_config("base.yml", [*args, "sparse_matmul=false"], enforce_status=False)
    moe = ModelConfig.from_config({**dense}).moe
    assert (moe.capacity_factor, moe.capacity_per_sequence, moe.drop_policy) == (
        1.0, True, "position")
