"""jaxtrain's presets of the model families people train (configs/models, Megatron keys): each
builds the published architecture, the one transformers' config of the real model translates
to, with the published parameter count (abstract shapes only)."""
import dataclasses
import math

import jax
import pytest
import transformers as tr

from jaxtrain.config import load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models.hf import config_from_hf
from jaxtrain.models.params import abstract
from tests.conftest import ROOT

_LLAMA4_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}
# preset, transformers' config of the real model, published total parameters (model cards; the
# Llama 4 cards count the 0.872B vision encoder and projector, not built here)
PRESETS = [
    ("llama4_scout_17B_16E",
     lambda: tr.Llama4TextConfig(rope_parameters=_LLAMA4_ROPE, max_position_embeddings=10485760),
     109e9 - 0.872e9),
    ("llama4_maverick_17B_128E",
     lambda: tr.Llama4TextConfig(num_local_experts=128, interleave_moe_layer_step=2,
                                 use_qk_norm=False, max_position_embeddings=1048576),
     400e9 - 0.872e9),
    ("qwen3_next_80B_A3B", lambda: tr.Qwen3NextConfig(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, intermediate_size=5120, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        vocab_size=151936, max_position_embeddings=262144, rope_parameters={
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}), 80e9),
    ("qwen3.5_35B_A3B", lambda: tr.Qwen3_5MoeTextConfig(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=256, num_experts_per_tok=8, vocab_size=248320,
        max_position_embeddings=262144, rope_parameters={
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}), 35e9),
]
# Gemma 4's shapes as MaxText's gemma4-31b / gemma4-26b model files give them; the model cards
# (google/gemma-4-31B, google/gemma-4-26B-A4B) count 30.7B and 25.2B (3.8B active) parameters
_GEMMA4 = dict(vocab_size=262144, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
               hidden_size_per_layer_input=0, sliding_window=1024, final_logit_softcapping=30.0,
               max_position_embeddings=262144, rope_parameters={
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                      "partial_rotary_factor": 0.25}})
PRESETS += [
    ("gemma4_31B", lambda: tr.Gemma4TextConfig(
        **_GEMMA4, hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, num_global_key_value_heads=4, intermediate_size=21504), 30.7e9),
    ("gemma4_26B_A4B", lambda: tr.Gemma4TextConfig(
        **_GEMMA4, hidden_size=2816, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, num_global_key_value_heads=2, intermediate_size=2112,
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704),
     25.2e9),
]
# Gemma 4 E2B / E4B (shapes of MaxText's gemma4-e2b / gemma4-e4b). Their cards count 5.1B and
# 8B "with embeddings" including the vision and audio encoders, not built here, so the text
# model's size is the count of transformers' own Gemma4ForCausalLM of the same config
# (test_small_gemma4_presets_count_as_transformers; 4.63B and 7.46B).
_SMALL = dict(_GEMMA4, sliding_window=512, max_position_embeddings=131072, attention_k_eq_v=False,
              hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144)
SMALL_GEMMA4 = [
    ("gemma4_E2B", lambda: tr.Gemma4TextConfig(
        **_SMALL, hidden_size=1536, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, intermediate_size=6144, num_kv_shared_layers=20,
        use_double_wide_mlp=True, layer_types=[
            "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)])),
    ("gemma4_E4B", lambda: tr.Gemma4TextConfig(
        **_SMALL, hidden_size=2560, num_hidden_layers=42, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=10240, num_kv_shared_layers=18)),
]
PRESETS += [(name, hf, None) for name, hf in SMALL_GEMMA4]
# Megatron's hybrid stack (patterns from Megatron-LM's confs for these models) and Mamba-2;
# published sizes: Nemotron-H 8B counts 8.10B (its card rounds to 8B), Nemotron 3 Nano 31.6B,
# Nemotron 3 Super 120B (latent MoE; jaxtrain counts 120.67B), mamba2-370m 368M
_NH = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_NH8 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_NANO = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_SUPER = ("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
          "EMEMEMEME")
PRESETS += [
    ("nemotron_h_8B", lambda: tr.NemotronHConfig(
        hidden_size=4096, layers_block_type=[_NH[c] for c in _NH8], intermediate_size=21504,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, n_groups=8, ssm_state_size=128, vocab_size=131072,
        max_position_embeddings=8192), 8.10e9),
    ("nemotron3_nano_30B_A3B", lambda: tr.NemotronHConfig(
        hidden_size=2688, layers_block_type=[_NH[c] for c in _NANO], intermediate_size=1856,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
        mamba_head_dim=64, n_groups=8, ssm_state_size=128, vocab_size=131072,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, max_position_embeddings=8192), 31.6e9),
    ("nemotron3_super_120B_A12B", lambda: tr.NemotronHConfig(
        hidden_size=4096, layers_block_type=[_NH[c] for c in _SUPER], intermediate_size=2688,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, n_groups=8, ssm_state_size=128, vocab_size=131072,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, n_group=1,
        topk_group=1, routed_scaling_factor=5.0, max_position_embeddings=8192), 120e9),
    ("mamba2_370M", lambda: tr.Mamba2Config(
        hidden_size=1024, num_hidden_layers=48, num_heads=32, head_dim=64, n_groups=1,
        state_size=128, vocab_size=50288, tie_word_embeddings=True), 0.368e9),
]
# LFM2 (model cards: 8.3B total parameters, 1.17B)
_LFM8 = ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv",
         "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv",
         "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv"]
_LFM1 = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
         "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
         "full_attention", "conv"]
PRESETS += [
    ("lfm2_8B_A1B", lambda: tr.Lfm2MoeConfig(num_hidden_layers=24, layer_types=_LFM8), 8.3e9),
    ("lfm2_1.2B", lambda: tr.Lfm2Config(hidden_size=2048, num_hidden_layers=16,
                                        intermediate_size=12288, layer_types=_LFM1), 1.17e9),
]
# DeepSeek-V3.2 (the real checkpoint's YaRN; the model card's 685B include the 14B
# multi-token-prediction layer, not built: 671B as DeepSeek-V3 plus 0.85B of indexers) and GLM-5
# (transformers' GlmMoeDsaConfig defaults; Z.ai: 744B total, 40B active)
_DSV32_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
               "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
               "mscale": 1.0, "mscale_all_dim": 1.0}
PRESETS += [
    ("deepseek_v32_671B", lambda: tr.DeepseekV32Config(rope_parameters=_DSV32_YARN),
     671e9 + 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)),
    ("glm5_744B_A40B", lambda: tr.GlmMoeDsaConfig(), 744e9),
]
# DeepSeek-V4 (transformers' defaults are Flash's; the checkpoints' YaRN on the compressed
# layers). Flash's card counts 284B; Pro's 1.6T includes its multi-token-prediction layer
# (25.4B), not built: 1.573T here. The hash routes are a table of expert ids, not weights.
_DSV4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536}
_DSV4_PRO = dict(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
                 q_lora_rank=1536, moe_intermediate_size=3072, o_groups=16, n_routed_experts=384,
                 index_topk=1024, routed_scaling_factor=2.5,
                 compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
PRESETS += [
    ("deepseek_v4_flash_284B",
     lambda: tr.DeepseekV4Config(rope_parameters=_DSV4_YARN,
                                 compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0]), 284e9),
    ("deepseek_v4_pro_1.6T",
     lambda: tr.DeepseekV4Config(rope_parameters=_DSV4_YARN, **_DSV4_PRO), 1.6e12 - 25.4e9),
]
# Kimi Linear 48B-A3B (transformers' KimiLinearConfig defaults are the published model's; its
# card says 48B total, 3B active; the shapes give 49.13B: test_kimi_linear_preset_counts_as_
# transformers)
KIMI_LINEAR = ("kimi_linear_48B_A3B", lambda: tr.KimiLinearConfig(), None)
PRESETS += [KIMI_LINEAR]
# Fields the preset's run settles, not the architecture (Megatron pads the vocabulary; HF
# files never do; MoE run settings such as the balancing loss).
RUN = ("dtype", "weight_dtype", "attention_impl", "attention_softmax_in_fp32", "vocab_size",
       "use_iota_embed", "init_method_std",
       # transformers' Mamba-2 mixers clamp dt at time_step_min, Megatron's do not (the presets
       # follow Megatron); Mamba2's residual_in_fp32 is a precision choice of the run
       "mamba_dt_floor", "fp32_residual_connection", "mamba_chunk_size")
# Attention fields, which no layer of an attention-free hybrid model reads
ATTENTION = ("num_attention_heads", "num_query_groups", "kv_channels", "attention_dropout")
# Llama-3 scaling's settings, read only with use_rope_scaling.
LLAMA3_SCALING = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "original_max_position_embeddings")
MOE_RUN = ("load_balancing", "aux_loss_coeff", "z_loss_coeff", "grouped_gemm", "dispatcher")


def _preset(name) -> ModelConfig:
    return ModelConfig.from_config({**load_config(str(ROOT / "configs" / "models" /
                                                      f"{name}.yaml"))})


@pytest.mark.parametrize("name, hf, published", PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_is_the_published_model(name, hf, published):
    ours, ref = _preset(name), config_from_hf(hf().to_dict())
    if published is not None:
        assert abs(_count(ours) / published - 1) < 0.01
    ref = ref.replace(**{k: getattr(ours, k) for k in RUN})
    if not ours.use_rope_scaling:
        ref = ref.replace(**{k: getattr(ours, k) for k in LLAMA3_SCALING})
    if ours.hybrid_layers is not None and "*" not in ours.hybrid_layers:
        ref = ref.replace(**{k: getattr(ours, k) for k in ATTENTION})
    if ours.moe is not None:
        if ours.moe.layer_freq == 1 and not ours.moe.branch_norms:   # no layer reads it
            ref = ref.replace(ffn_hidden_size=ours.ffn_hidden_size)
        ref = ref.replace(moe=dataclasses.replace(ref.moe, **{k: getattr(ours.moe, k)
                                                            for k in MOE_RUN}))
    diff = {f.name: (getattr(ours, f.name), getattr(ref, f.name))
            for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(ref, f.name)}
    assert not diff


def _count(cfg: ModelConfig) -> int:
    tree = abstract(cfg)
    tree.pop("hash_routes", None)   # expert ids of hash routing, not weights
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["deepseek_v4_flash_284B", "deepseek_v4_pro_1.6T"])
def test_deepseek_v4_presets_count_as_transformers(name):
    """As many weights as transformers' DeepseekV4ForCausalLM of the published config (meta
    device): its parameters and expert-bias buffers (its tid2eid tables are our hash_routes),
    and ours less the learned scale of the hyper-connection norm (MaxText's; transformers' has
    none, exported folded into the mapping) and the unused expert bias of the hash-routed
    layers."""
    import torch
    hf = next(p[1] for p in PRESETS if p[0] == name)
    with torch.device("meta"):
        model = tr.DeepseekV4ForCausalLM(hf())
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    cfg = _preset(name)
    scales = 2 * cfg.num_layers * cfg.hc_streams * cfg.hidden_size
    assert _count(cfg) - scales - cfg.moe.hash_layers * cfg.moe.num_experts == theirs


@pytest.mark.parametrize("name, hf", SMALL_GEMMA4, ids=[p[0] for p in SMALL_GEMMA4])
def test_small_gemma4_presets_count_as_transformers(name, hf):
    """The E2B/E4B presets have as many parameters (and layer scalars) as transformers'
    Gemma4ForCausalLM of the published config, built on the meta device (shapes only), whose
    KV-sharing layers have no key/value projections."""
    import torch
    with torch.device("meta"):
        model = tr.Gemma4ForCausalLM(hf())
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    ours = _preset(name)
    assert _count(ours) == theirs
    shared = ours.kv_shared_layers
    assert shared == {"gemma4_E2B": 20, "gemma4_E4B": 18}[name]
    assert _count(ours.replace(kv_shared_layers=0, double_wide_shared_mlp=False)) != theirs


def test_kimi_linear_preset_counts_as_transformers():
    """As many weights as transformers' KimiLinearForCausalLM of the published config (meta
    device): its parameters and expert-bias buffers; 3B active (8 of 256 experts, the input
    embedding not counted)."""
    import torch
    with torch.device("meta"):
        model = tr.KimiLinearForCausalLM(KIMI_LINEAR[1]())
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    cfg = _preset(KIMI_LINEAR[0])
    assert _count(cfg) == theirs
    m = cfg.moe
    idle = (cfg.num_layers - 1) * (m.num_experts - m.topk) * 3 * cfg.hidden_size * m.ffn_hidden_size
    assert abs((_count(cfg) - idle - cfg.vocab_size * cfg.hidden_size) / 3e9 - 1) < 0.05
