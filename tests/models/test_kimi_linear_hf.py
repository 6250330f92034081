"""Kimi Linear against transformers: Kimi Delta Attention layers between unrotated
multi-latent attention layers, a dense MLP then DeepSeek-V3-routed MoE layers. Logits (fp32,
tiny random configs with wider-than-init weights), from_hf / to_hf round trips that load in
transformers, greedy decode, packed documents, left-padded decoding, and the checkpoint's own
config.json spelling."""
import jax
import numpy as np
import pytest
import transformers as tr
from model_helpers import (VOCAB, check_left_padded_decode, check_packed_sequences, max_diff,
                           tokens)
from test_hf import (_hf_logits, _randomize, check_greedy_decode,
                     check_parity_and_round_trip)

from jaxtrain.models import forward, from_hf
from jaxtrain.models.hf import config_from_hf

_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=2,
             topk_group=1, num_experts_per_tok=2, num_local_experts=4, linear_head_dim=8,
             linear_num_heads=2, linear_conv_kernel_dim=3, first_k_dense_replace=1,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             layer_types=["linear_attention", "full_attention", "linear_attention",
                          "full_attention"])
CASES = {
    "moe": _BASE,
    # transformers never ties Kimi Linear's output layer, whatever tie_word_embeddings says
    "dense_q_lora": {**_BASE, "q_lora_rank": 8, "first_k_dense_replace": 4,
                     "tie_word_embeddings": True,
                     "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
}


def _model(case, path, seed=0):
    cfg = tr.KimiLinearConfig(**CASES[case], attn_implementation="eager")
    model = _randomize(tr.KimiLinearForCausalLM(cfg).eval(), seed)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    cfg = check_parity_and_round_trip(_model(case, tmp_path / "hf"), tmp_path)
    assert cfg.linear_attention_kind == "kda" and cfg.mla_nope
    assert (cfg.moe is not None) == (case == "moe")


def test_greedy_decode_matches_transformers(tmp_path):
    check_greedy_decode(_model("moe", tmp_path / "hf"), tmp_path / "hf")


@pytest.mark.slow
def test_packed_documents_and_left_padded_decoding(tmp_path):
    _model("dense_q_lora", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    check_packed_sequences(params, cfg, tol=2e-5)
    check_left_padded_decode(params, cfg)


def test_rotating_the_attention_changes_the_logits(tmp_path):
    """The MLA layers rotate nothing: with RoPE on their rotary part the logits move away."""
    model = _model("moe", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    rotated = cfg.replace(mla_nope=False, position_embedding_type="rope")
    ref = _hf_logits(model, tokens())
    assert max_diff(jax.jit(lambda p, x: forward(p, x, rotated))(params, tokens()), ref) > 1e-3


def test_checkpoint_config_spelling():
    """Kimi-Linear's own config.json: linear_attn_config (1-based kda_layers /
    full_attn_layers, head_dim, num_heads, short_conv_kernel_size) and KimiLinearConfig's
    attribute names (num_experts, num_experts_per_token, moe_renormalize, num_expert_group,
    num_shared_experts, model_max_length) give the model of the canonical names."""
    canonical = {**_BASE, "model_type": "kimi_linear", "max_position_embeddings": 4096}
    spelled = {k: v for k, v in canonical.items() if k not in (
        "layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
        "num_local_experts", "num_experts_per_tok", "n_group", "max_position_embeddings")}
    spelled.update(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                       "head_dim": 8, "num_heads": 2,
                                       "short_conv_kernel_size": 3},
                   num_experts=4, num_experts_per_token=2, num_expert_group=2,
                   model_max_length=4096)
    assert config_from_hf(spelled) == config_from_hf(canonical)
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**canonical, "layer_types": ["linear_attention", "sliding"] * 2})


def test_kda_knobs_shape_the_model():
    """linear_attention_kind kda gives the linear layers their low-rank decay and gate
    projections and a decay bias per key channel; mla_nope changes the config (its effect on
    the logits is shown above)."""
    from jaxtrain.config.dialects import hf as translation
    from jaxtrain.models import ModelConfig
    from jaxtrain.models.hf import RUN_KNOBS
    from jaxtrain.models.params import abstract

    knobs = translation.knobs({**_BASE, "model_type": "kimi_linear"})
    kda = ModelConfig.from_config({**RUN_KNOBS, **knobs})
    mixer = abstract(kda)["linear_moe_layers"]["linear_attn"]
    assert {"wf_a", "wf_b", "wg_a", "wg_b"} <= set(mixer) and not {"wz", "wa"} & set(mixer)
    assert mixer["dt_bias"].shape == (2, 1, 8)   # [H, L, Dk] (layer axis 1; one such layer)
    plain = {k: v for k, v in knobs.items() if not k.startswith(("moe", "num_experts"))
             and k not in ("multi_latent_attention", "mla_nope")}
    gdn = ModelConfig.from_config({**RUN_KNOBS, **plain, "linear_attention_kind": "gdn"})
    assert {"wz", "wa"} <= set(abstract(gdn)["linear_layers"]["linear_attn"])
    with pytest.raises(ValueError, match="Gated DeltaNet layers beside multi-latent"):
        ModelConfig.from_config({**RUN_KNOBS, **knobs, "linear_attention_kind": "gdn"})
    assert ModelConfig.from_config({**RUN_KNOBS, **knobs, "mla_nope": False}) != kda
    with pytest.raises(Exception, match="linear_attention_kind kda picks the kind"):
        ModelConfig.from_config({**RUN_KNOBS, "vocab_size": 64, "linear_attention_kind": "kda"})
    assert ModelConfig.from_config({**RUN_KNOBS, **knobs, "linear_attention_impl": "pallas",
                                    "gdn_chunk_size": 16}).linear_attention_impl == "pallas"
    assert np.isclose(kda.moe.topk_scaling_factor, 2.446)


def test_latent_norms_keep_transformers_epsilon(tmp_path):
    """transformers' MLA latent norms (q_a / kv_a) use their default epsilon 1e-6 whatever
    rms_norm_eps says: with rms_norm_eps 0.05 the logits still match, and taking the model's
    epsilon for them instead (mla_latent_norm_epsilon null, Megatron's) moves them away."""
    CASES["wide_eps"] = {**_BASE, "rms_norm_eps": 0.05, "q_lora_rank": 8}
    try:
        model = _model("wide_eps", tmp_path / "hf")
    finally:
        del CASES["wide_eps"]
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.mla_latent_norm_epsilon == 1e-6 and cfg.norm_epsilon == 0.05
    ref = _hf_logits(model, tokens())
    run = jax.jit(lambda p, x, c: forward(p, x, c), static_argnums=2)
    assert max_diff(run(params, tokens(), cfg), ref) <= 1e-4
    plain = cfg.replace(mla_latent_norm_epsilon=None)
    assert max_diff(run(params, tokens(), plain), ref) > 1e-3
