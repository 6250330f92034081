"""pgs ``model.name_or_path``: a Hugging Face config.json gives the architecture.

Per family, a pgs file naming a tiny local model directory (config.json only) builds the same
ModelConfig as ``config_from_hf`` of that file; the dry run prints it; hub ids resolve in the
local Hugging Face cache only; unbuilt families and fields are refused by name; published
configs give the published parameter counts (abstract shapes only).
"""
import dataclasses
import json
import math
import subprocess
import sys

import jax
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.config.dialects import hf as hf_dialect
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import FAMILIES, config_from_hf
from jaxtrain.models.params import abstract
from tests.conftest import ROOT, TINY_HF_LLAMA, write_hf_model

tr = pytest.importorskip("transformers")

_B = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=96, vocab_size=300, max_position_embeddings=256)
_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
         "truncate": False, "rope_theta": 1000.0, "original_max_position_embeddings": 64}
_OSS = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters=_YARN)
_DS = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8,
           num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
           n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16, vocab_size=300, max_position_embeddings=256)

_GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=3)

# Tiny random configs of every family (one case or more per family).
CASES = {
    "llama3": lambda: tr.LlamaConfig(**_B, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "llama_bias_linear_rope": lambda: tr.LlamaConfig(
        **_B, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}),
    "mistral": lambda: tr.MistralConfig(**_B, sliding_window=32, head_dim=32),
    "qwen2": lambda: tr.Qwen2Config(**_B, use_sliding_window=True, sliding_window=16,
                                    max_window_layers=0),
    "qwen3": lambda: tr.Qwen3Config(**_B, head_dim=32, tie_word_embeddings=True),
    "mixtral": lambda: tr.MixtralConfig(**_B, num_local_experts=4, num_experts_per_tok=2,
                                        router_jitter_noise=0.01),
    "qwen3_moe": lambda: tr.Qwen3MoeConfig(**_B, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, mlp_only_layers=[0],
                                           norm_topk_prob=True),
    "deepseek_v3": lambda: tr.DeepseekV3Config(**_DS, rope_parameters={
        **_YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True}),
    "deepseek_v3_plain_rope": lambda: tr.DeepseekV3Config(**{**_DS, "n_group": 1,
                                                             "topk_group": 1}),
    "deepseek_v32": lambda: tr.DeepseekV32Config(**{**_DS, "n_group": 1, "topk_group": 1},
                                                 index_topk=8, index_head_dim=16,
                                                 index_n_heads=2),
    "glm_moe_dsa": lambda: tr.GlmMoeDsaConfig(**{**_DS, "n_group": 1, "topk_group": 1},
                                              index_topk=8, index_head_dim=16,
                                              index_n_heads=2, index_topk_freq=2),
    "deepseek_v4": lambda: tr.DeepseekV4Config(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=16, partial_rotary_factor=0.5,
        n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32}),
    "gpt_oss": lambda: tr.GptOssConfig(**_OSS),
    "gpt_oss_windows_everywhere": lambda: tr.GptOssConfig(
        **_OSS, layer_types=["sliding_attention"] * 4),
    "gpt_oss_window_pattern": lambda: tr.GptOssConfig(
        **_OSS, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                             "full_attention"]),
    "gpt2": lambda: tr.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  vocab_size=300),
    "gemma": lambda: tr.GemmaConfig(**_B, head_dim=32),
    "gemma2": lambda: tr.Gemma2Config(**_B, head_dim=32, sliding_window=16,
                                      query_pre_attn_scalar=24),
    "gemma3": lambda: tr.Gemma3TextConfig(**{**_B, "num_hidden_layers": 6}, head_dim=32,
                                          sliding_window=16, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gemma3_vlm": lambda: tr.Gemma3Config(text_config=dict(**_B, head_dim=32,
                                                           sliding_window=16)),
    "olmo2": lambda: tr.Olmo2Config(**_B),
    "olmo3": lambda: tr.Olmo3Config(**_B, sliding_window=16),
    "qwen3_next": lambda: tr.Qwen3NextConfig(
        **_B, head_dim=16, **_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[2], norm_topk_prob=False),
    "qwen3_5_text": lambda: tr.Qwen3_5TextConfig(
        **_B, head_dim=16, **_GDN, layer_types=["linear_attention", "full_attention"] * 2),
    "qwen3_5_moe_text": lambda: tr.Qwen3_5MoeTextConfig(
        **_B, head_dim=16, **_GDN, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3_5": lambda: tr.Qwen3_5Config(text_config=dict(
        **_B, head_dim=16, **_GDN, layer_types=["linear_attention", "full_attention"] * 2,
        tie_word_embeddings=True)),
    "qwen3_5_moe": lambda: tr.Qwen3_5MoeConfig(text_config=dict(
        **_B, head_dim=16, **_GDN, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "llama4_text": lambda: tr.Llama4TextConfig(
        **_B, head_dim=16, num_local_experts=4, intermediate_size_mlp=48,
        interleave_moe_layer_step=2, attention_chunk_size=8),
    "llama4": lambda: tr.Llama4Config(text_config=dict(
        **_B, head_dim=16, num_local_experts=4, use_qk_norm=False), vision_config=dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)),
    "gemma4_text": lambda: tr.Gemma4TextConfig(
        **{**_B, "num_hidden_layers": 6}, head_dim=16, global_head_dim=32,
        hidden_size_per_layer_input=0, sliding_window=16, attention_k_eq_v=True,
        num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16),
    "gemma4": lambda: tr.Gemma4Config(text_config=dict(
        **_B, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
        sliding_window=16), audio_config=None, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8)),
    "phi3": lambda: tr.Phi3Config(**_B, pad_token_id=0, eos_token_id=1, sliding_window=32,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}),
    "smollm3": lambda: tr.SmolLM3Config(**_B, pad_token_id=0, bos_token_id=1, eos_token_id=1),
    "granite": lambda: tr.GraniteConfig(**_B, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                        embedding_multiplier=12.0, attention_multiplier=0.015625,
                                        residual_multiplier=0.22, logits_scaling=8.0),
    "gpt_neox": lambda: tr.GPTNeoXConfig(hidden_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, intermediate_size=96,
                                         vocab_size=300, max_position_embeddings=256),
    "nemotron_h": lambda: tr.NemotronHConfig(
        hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, vocab_size=300,
        max_position_embeddings=128),
    "mamba2": lambda: tr.Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8,
                                      head_dim=16, n_groups=2, state_size=16, vocab_size=300),
    "lfm2": lambda: tr.Lfm2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96, vocab_size=300,
                                  layer_types=["conv", "full_attention", "conv"],
                                  block_multiple_of=16),
    "lfm2_moe": lambda: tr.Lfm2MoeConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_dense_layers=1, vocab_size=300, layer_types=["conv", "full_attention", "conv"]),
    "granitemoehybrid": lambda: tr.GraniteMoeHybridConfig(
        hidden_size=64, num_hidden_layers=2, layers_block_type=["mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, vocab_size=300,
        residual_multiplier=0.5, logits_scaling=4.0, embedding_multiplier=6.0,
        attention_multiplier=0.1),
    "gpt2_exact_gelu": lambda: tr.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                             vocab_size=300, activation_function="gelu",
                                             tie_word_embeddings=False),
    "kimi_linear": lambda: tr.KimiLinearConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, num_local_experts=4, linear_head_dim=16, linear_num_heads=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
}
# ModelConfig fields a run sets, not a config.json (dtype, attention kernel, remat, ...).
RUN_FIELDS = ("dtype", "weight_dtype", "attention_impl", "attention_softmax_in_fp32", "quant",
              "scan_layers", "param_scan_axis", "remat_policy", "remat_tensors",
              "recompute_method", "recompute_num_layers", "recompute_layer_ids",
              "recompute_modules", "use_iota_embed", "logits_dot_in_fp32")
MOE_RUN_FIELDS = ("load_balancing", "aux_loss_coeff", "z_loss_coeff", "bias_update_rate",
                  "capacity_factor", "pad_to_capacity", "drop_policy", "dispatcher",
                  "grouped_gemm", "per_layer_logging", "expert_tensor_parallel",
                  "force_balancing")


def _pgs_file(write, model_dir, extra=""):
    return write("sft.yml", f"model:\n  name_or_path: {model_dir}\ntrain:\n  max_steps: 3\n"
                 + extra)


def _model_dir(tmp_path, case):
    return write_hf_model(tmp_path / case, CASES[case]().to_dict())


def _same_architecture(ours: ModelConfig, ref: ModelConfig):
    """``ref`` with ``ours``'s run fields: the architecture must then be equal."""
    ref = ref.replace(**{k: getattr(ours, k) for k in RUN_FIELDS})
    if ref.moe is not None and ours.moe is not None:
        ref = ref.replace(moe=dataclasses.replace(
            ref.moe, **{k: getattr(ours.moe, k) for k in MOE_RUN_FIELDS}))
    diff = {f.name: (getattr(ours, f.name), getattr(ref, f.name))
            for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(ref, f.name)}
    assert not diff


def test_every_family_has_cases():
    assert {CASES[c]().model_type for c in CASES} == set(FAMILIES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_pgs_file_builds_the_config_json_architecture(case, tmp_path, write):
    model = _model_dir(tmp_path, case)
    cfg = load_config(_pgs_file(write, model))
    assert cfg.dialect == "pgs-train"
    assert cfg.origin("num_layers") == f"model.name_or_path {model / 'config.json'}"
    hf = json.loads((model / "config.json").read_text())
    _same_architecture(ModelConfig.from_config({**cfg}), config_from_hf(hf))


def test_translation_reads_each_field(tmp_path, write):
    """The knobs say what the files say (spot checks of the less common fields)."""
    def model(case):
        return ModelConfig.from_config({**load_config(
            _pgs_file(write, _model_dir(tmp_path, case)))})

    llama = model("llama3")
    assert (llama.use_rope_scaling, llama.rope_low_freq_factor, llama.rope_high_freq_factor,
            llama.original_max_position_embeddings, llama.rotary_base) == (True, 2.0, 8.0, 64,
                                                                           500000.0)
    linear = model("llama_bias_linear_rope")
    assert linear.rotary_seq_len_interpolation_factor == 2.5 and linear.add_bias_linear
    assert (linear.activation, linear.gated_linear_unit) == ("gelu_tanh", True)
    oss = model("gpt_oss")
    assert (oss.sliding_window, oss.sliding_window_layers) == (8, (True, False, True, False))
    assert oss.attention_sinks and (oss.moe.activation, oss.moe.glu_limit) == ("swiglu_oai", 7.0)
    assert oss.moe.router_bias and (oss.yarn_beta_fast, oss.yarn_beta_slow) == (16.0, 2.0)
    assert not oss.yarn_truncate and oss.rope_type == "yarn"
    assert model("gpt_oss_window_pattern").sliding_window_layers == (False, True, True, False)
    assert model("gpt_oss_windows_everywhere").sliding_window_layers is None
    ds = model("deepseek_v3")
    assert ds.multi_latent_attention and ds.moe.layer_freq == (0, 1, 1)
    assert (ds.moe.num_groups, ds.moe.group_topk, ds.moe.group_score_topk) == (4, 2, 2)
    assert ds.moe.expert_bias and ds.moe.score_function == "sigmoid"
    assert ds.moe.topk_scaling_factor == 2.5 and ds.moe.shared_expert_size == 16
    gpt2 = model("gpt2_exact_gelu")
    assert (gpt2.activation, gpt2.position_embedding_type) == ("gelu", "learned_absolute")
    assert gpt2.vocab_size == 300          # a checkpoint's vocabulary is not padded


def test_file_knobs_win_over_the_model(tmp_path, write):
    model = write_hf_model(tmp_path / "m")
    cfg = load_config(_pgs_file(write, model, "num_layers: 3\n"), ["hidden_dropout=0.2"])
    assert (cfg["num_layers"], cfg["hidden_dropout"], cfg["hidden_size"]) == (3, 0.2, 32)
    assert cfg.origin("hidden_size").startswith("model.name_or_path")


def test_dry_run_prints_the_architecture(tmp_path, write, cli):
    model = write_hf_model(tmp_path / "m", num_hidden_layers=5)
    code, _, err = cli(_pgs_file(write, model), "--dry-run", "mock_data=true")
    assert code == 2 and "no *.safetensors weights in" in err and "Traceback" not in err
    model = write_hf_model(tmp_path / "m", weights=True, num_hidden_layers=5)
    code, out, err = cli(_pgs_file(write, model), "--dry-run", "mock_data=true")
    assert code == 0, err
    assert f"num_layers: 5  # model.name_or_path {model / 'config.json'}" in out
    assert f"model.name_or_path: {model}" in out and "normalization: RMSNorm" in out


def test_hub_id_without_a_local_copy_exits_2(write, cli):
    code, _, err = cli(_pgs_file(write, "Qwen/Qwen3-8B"), "--dry-run")
    assert code == 2 and "Traceback" not in err
    assert "model.name_or_path = 'Qwen/Qwen3-8B'" in err and "hf download Qwen/Qwen3-8B" in err
    code, _, err = cli(_pgs_file(write, "./not-here"), "--dry-run")
    assert code == 2 and "'./not-here': no such model directory" in err


def test_pgs_default_model_is_looked_up(write, tmp_path, monkeypatch):
    path = write("sft.yml", "train:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="'meta-llama/Llama-3.1-8B-Instruct'.*pgs's default"):
        load_config(path)
    _cache_snapshot(tmp_path / "hf", monkeypatch, "meta-llama/Llama-3.1-8B-Instruct",
                    LLAMA_3_1_8B)
    cfg = load_config(path)
    assert (cfg["num_layers"], cfg["num_query_groups"], cfg["ffn_hidden_size"]) == (32, 8, 14336)
    # null: no Hugging Face model, the architecture knobs alone (here Megatron's defaults)
    assert load_config(path, ["model.name_or_path=null"])["num_layers"] == 24


def _cache_snapshot(home, monkeypatch, repo, config, revision="0123abc", ref=True):
    """A Hugging Face cache under ``home`` (HF_HOME) holding ``repo``'s config.json."""
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    write_hf_model(root / "snapshots" / revision, config)
    if ref:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / "main").write_text(revision)
    return root / "snapshots" / revision


def test_hub_ids_resolve_in_the_local_cache(tmp_path, write, monkeypatch):
    snap = _cache_snapshot(tmp_path / "hf", monkeypatch, "org/tiny", TINY_HF_LLAMA)
    _cache_snapshot(tmp_path / "hf", monkeypatch, "org/tiny", {**TINY_HF_LLAMA,
                                                               "num_hidden_layers": 7},
                    revision="old", ref=False)      # refs/main names the snapshot to use
    cfg = load_config(_pgs_file(write, "org/tiny"))
    assert cfg["num_layers"] == 2 and cfg.origin("num_layers") == (
        f"model.name_or_path {snap / 'config.json'}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))   # wins over HF_HOME
    with pytest.raises(ConfigError, match="no copy in the Hugging Face cache"):
        load_config(_pgs_file(write, "org/tiny"))


def test_pgs_distill_student(tmp_path, write, monkeypatch):
    _cache_snapshot(tmp_path / "hf", monkeypatch, "Qwen/Qwen3-0.6B",
                    CASES["qwen3"]().to_dict())
    path = write("opd.yml", """
        model: {student: Qwen/Qwen3-0.6B}
        train: {steps: 100}
    """)
    cfg = load_config(path)
    assert cfg.dialect == "pgs-distill" and cfg["model.name_or_path"] == "Qwen/Qwen3-0.6B"
    assert cfg["qk_layernorm"] and cfg["num_layers"] == 4
    with pytest.raises(ConfigError, match="names its student model"):
        load_config(write("opd2.yml", "train:\n  steps: 100\nrollout:\n  temperature: 1.0\n"))


def test_the_model_directory_is_the_tokenizer(tmp_path, write):
    from jaxtrain.data.sources import training_data
    from tests.data import helpers

    model = write_hf_model(helpers.hf_tokenizer_dir(tmp_path / "m"))
    rows = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in helpers.texts(20)])
    path = _pgs_file(write, model, f"data: {{dataset: {rows}, max_seq_length: 8, "
                                   f"packing: true}}\n")
    cfg = load_config(path, ["micro_batch_size=2", "lr_warmup_iters=0"], world_size=1)
    assert (cfg["tokenizer_type"], cfg["tokenizer_model"]) == ("HuggingFaceTokenizer",
                                                               str(model))
    assert training_data(cfg).samples.arrays["tokens"].shape[1] == 9
    other = helpers.hf_tokenizer_dir(tmp_path / "tok")
    assert load_config(path, [f"tokenizer_model={other}"])["tokenizer_model"] == other
    bare = write_hf_model(tmp_path / "bare")      # config.json only: no tokenizer from it
    assert load_config(_pgs_file(write, bare))["tokenizer_model"] is None


@pytest.mark.parametrize("config,words", [
    ({"model_type": "gemma4",
      "text_config": {**TINY_HF_LLAMA, "use_bidirectional_attention": "all"}},
     ["use_bidirectional_attention='all'", "causal decoders"]),
    ({"model_type": "qwen3_5", "vision_config": {}}, ["text_config=None", "has none"]),
    ({"model_type": "gemma3n"}, ["'gemma3n'", "planned for issue #25"]),
    ({**TINY_HF_LLAMA, "model_type": "llama4_text", "num_experts_per_tok": 2},
     ["num_experts_per_tok=2", "top-1"]),
    ({"model_type": "llava", "vision_config": {}, "text_config": {}},
     ["'llava'", "multimodal", "rejects"]),
    ({"model_type": "my_own_net"}, ["'my_own_net'", "not a family jaxtrain builds"]),
    ({**TINY_HF_LLAMA, "hidden_act": "xielu"}, ["hidden_act='xielu'"]),
    ({**TINY_HF_LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     ["rope_type='longrope'"]),
])
def test_unbuilt_models_are_refused_by_name(config, words, tmp_path, write, cli):
    model = write_hf_model(tmp_path / "m", config)
    code, _, err = cli(_pgs_file(write, model), "--dry-run")
    assert code == 2 and "Traceback" not in err
    assert f"model.name_or_path = '{model}'" in err
    for word in words:
        assert word in err, err


def test_problems_are_reported_together(write, cli):
    """A missing model does not hide the file's other mistakes."""
    code, _, err = cli(write("sft.yml", "train:\n  learning_rat: 1.0e-5\n"), "--dry-run")
    assert code == 2 and "did you mean train.learning_rate" in err
    assert "'meta-llama/Llama-3.1-8B-Instruct'" in err


def test_the_translation_does_not_import_jax():
    """The dry run reads config.json without starting JAX."""
    code = ("import sys, jaxtrain.config.dialects.hf as h; "
            f"print(h.knobs({TINY_HF_LLAMA!r})['num_layers'], 'jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.stdout.split() == ["2", "False"], done.stderr


# ---- published configs: parameter counts from the abstract shapes alone -------------------

# meta-llama/Llama-3.1-8B config.json
LLAMA_3_1_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
                "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192,
                                 "rope_type": "llama3"},
                "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
# Qwen/Qwen3-8B config.json
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36}
# deepseek-ai/DeepSeek-V3 config.json (671B without its multi-token-prediction layer)
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
               "rms_norm_eps": 1e-6, "rope_theta": 10000, "routed_scaling_factor": 2.5,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                "type": "yarn"},
               "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1}
# openai/gpt-oss-20b config.json (20.9B parameters)
GPT_OSS_20B = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
               "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
               "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "rope_theta": 150000, "swiglu_limit": 7.0,
               "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                "truncate": False},
               "layer_types": ["sliding_attention", "full_attention"] * 12,
               "tie_word_embeddings": False, "attention_bias": True, "hidden_act": "silu"}


# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (80B in total; its MTP layer is not built)
QWEN3_NEXT_80B = {"model_type": "qwen3_next", "hidden_size": 2048, "intermediate_size": 5120,
                  "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                  "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 262144,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                  "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                  "linear_num_value_heads": 32, "full_attention_interval": 4,
                  "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                  "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True}


@pytest.mark.parametrize("config,published", [
    (LLAMA_3_1_8B, 8.03e9), (QWEN3_8B, 8.19e9), (DEEPSEEK_V3, 671e9), (GPT_OSS_20B, 20.91e9),
    (QWEN3_NEXT_80B, 80e9)],
    ids=["Llama-3.1-8B", "Qwen3-8B", "DeepSeek-V3", "gpt-oss-20b", "Qwen3-Next-80B-A3B"])
def test_published_configs_give_published_sizes(config, published, tmp_path, write):
    model = write_hf_model(tmp_path / "m", config)
    cfg = ModelConfig.from_config({**load_config(_pgs_file(write, model))})
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract(cfg)))
    assert abs(count - published) / published < 0.01, count


# ---- the knobs the translation writes, read by ModelConfig.from_config --------------------

def _model(**knobs):
    return ModelConfig.from_config({"vocab_size": 128, "num_layers": 4, "hidden_size": 32,
                                    "num_attention_heads": 4, **knobs})


def test_megatron_window_knobs():
    assert (_model(window_size=[3, 0]).sliding_window, _model(window_size=[3, 0])
            .sliding_window_layers) == (4, None)
    every_2nd = _model(window_size="(3, 0)", window_attn_skip_freq=2)
    assert every_2nd.sliding_window_layers == (True, False, True, False)
    listed = _model(window_size=[3, 0], window_attn_skip_freq="[0]+[1]*3")
    assert listed.sliding_window_layers == (False, True, True, True)
    assert _model(window_size=[-1, 0]).sliding_window is None
    for bad, match in ((dict(window_size=[3, 2]), "none ahead"),
                       (dict(window_size=[3, 0], sliding_window_size=4), "set one"),
                       (dict(window_size=[3, 0], window_attn_skip_freq=[1, 0]), "2 entries")):
        with pytest.raises(ConfigError, match=match):
            _model(**bad)


def test_rope_band_and_group_score_knobs():
    m = _model(use_rope_scaling=True, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0)
    assert (m.rope_low_freq_factor, m.rope_high_freq_factor) == (2.0, 8.0)
    moe = _model(num_experts=8, moe_router_topk=4, moe_router_num_groups=4,
                 moe_router_group_topk=2, moe_router_group_score_topk=1).moe
    assert moe.group_score_topk == 1


def test_yarn_range_and_clamped_glu_knobs():
    yarn = _model(rope_type="yarn", rotary_scaling_factor=4.0, yarn_beta_fast=16.0,
                  yarn_beta_slow=2.0, yarn_correction_range_round_to_int=False)
    assert (yarn.yarn_beta_fast, yarn.yarn_beta_slow, yarn.yarn_truncate) == (16.0, 2.0, False)
    oss = dict(num_experts=4, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
               activation_func_clamp_value=5.0)
    assert (_model(**oss).moe.activation, _model(**oss).moe.glu_limit) == ("swiglu_oai", 5.0)
    with pytest.raises(ConfigError, match="clamped GLU"):
        _model(**{**oss, "glu_linear_offset": 0.5})


def test_translation_is_jax_free_and_names_fields():
    with pytest.raises(ValueError, match="attention_bias"):
        hf_dialect.knobs({**TINY_HF_LLAMA, "attention_bias": True})
    assert hf_dialect.windows(8, (True, False, True, False)) == {
        "window_size": [7, 0], "window_attn_skip_freq": 2}
    assert hf_dialect.windows(8, (False, True)) == {"window_size": [7, 0],
                                                    "window_attn_skip_freq": [0, 1]}
