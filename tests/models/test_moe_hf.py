"""Mixtral and Qwen3-MoE: logit parity with `transformers` (fp32, tiny random configs) through
from_hf, round trip through to_hf, both checkpoint layouts of the experts, refused exports."""
import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import SEQ, VOCAB, max_diff, tokens
from safetensors.numpy import load_file, save_file

from jaxtrain.models import forward, from_hf, to_hf
from jaxtrain.models.moe import MoEConfig

TOL = 1e-4
_BASE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
_QWEN = dict(_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16)
CASES = {
    "mixtral": (tr.MixtralConfig, tr.MixtralForCausalLM,
                dict(_BASE, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_top1_tied": (tr.MixtralConfig, tr.MixtralForCausalLM,
                          dict(_BASE, num_local_experts=3, num_experts_per_tok=1,
                               tie_word_embeddings=True)),
    "qwen3_moe_dense_layer": (tr.Qwen3MoeConfig, tr.Qwen3MoeForCausalLM,
                              dict(_QWEN, mlp_only_layers=[1])),
    "qwen3_moe_norm_topk_sparse_step": (tr.Qwen3MoeConfig, tr.Qwen3MoeForCausalLM,
                                        dict(_QWEN, norm_topk_prob=True, decoder_sparse_step=2)),
}
fwd = jax.jit(forward, static_argnums=2,
              compiler_options={"xla_backend_optimization_level": 0})


def _hf_model(case, path):
    config_cls, model_cls, kw = CASES[case]
    model = model_cls(config_cls(**kw, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(1.0 + noise if "norm" in name and p.ndim == 1 else noise)
    model.save_pretrained(path)
    return model


def _logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks))).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    model = _hf_model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.moe is not None
    ref = _logits(model, tokens())
    assert max_diff(fwd(params, tokens(), cfg), ref) <= TOL
    to_hf(params, cfg, tmp_path / "out")
    back = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                   attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert max_diff(_logits(back, tokens()), ref) <= TOL
    cfg2, params2 = from_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_qwen3_moe_layer_pattern_and_router_mode(tmp_path):
    _hf_model("qwen3_moe_dense_layer", tmp_path)
    cfg, params = from_hf(tmp_path)
    assert cfg.moe.layer_freq == (1, 0, 1) and cfg.moe.pre_softmax   # norm_topk_prob false
    assert cfg.ffn_hidden_size == 64 and cfg.moe.ffn_hidden_size == 16
    assert params["layers"]["mlp"]["wo"].shape == (64, 1, 32)
    assert params["moe_layers"]["moe"]["experts"]["wo"].shape == (4, 2, 16, 32)
    config = json.loads((to_hf(params, cfg, tmp_path / "out") / "config.json").read_text())
    assert config["mlp_only_layers"] == [1] and config["norm_topk_prob"] is False


def test_fused_expert_layout_loads_too(tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2F, D], experts.down_proj
    [E, D, F]) reads the same as the per-expert one save_pretrained writes."""
    model = _hf_model("mixtral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(3):
        pre = f"model.layers.{i}.block_sparse_moe.experts."
        w = {n: np.stack([tensors.pop(f"{pre}{e}.{n}.weight") for e in range(4)])
             for n in ("w1", "w2", "w3")}
        tensors[pre + "gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], axis=1)
        tensors[pre + "down_proj"] = w["w2"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg, params = from_hf(tmp_path)
    assert max_diff(fwd(params, tokens(), cfg), _logits(model, tokens())) <= TOL


@pytest.mark.parametrize("change, field", [
    (dict(score_function="sigmoid"), "moe.score_function"),
    (dict(shared_expert_size=8), "moe.shared_expert_size"),
    (dict(layer_freq=(1, 0, 1)), "moe.layer_freq"),
])
def test_refused_exports_name_the_field(tmp_path, change, field):
    _hf_model("mixtral", tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    moe = MoEConfig(**{**{f: getattr(cfg.moe, f) for f in ("num_experts", "topk",
                                                             "ffn_hidden_size")}, **change})
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        to_hf(params, cfg.replace(moe=moe), tmp_path / "out", family="mixtral")


def test_jitter_and_positions(tmp_path):
    _, _, kw = CASES["mixtral"]
    model = tr.MixtralForCausalLM(tr.MixtralConfig(**kw, router_jitter_noise=0.1,
                                                    attn_implementation="eager")).eval()
    model.save_pretrained(tmp_path)
    cfg, params = from_hf(tmp_path)
    assert cfg.moe.input_jitter_eps == 0.1      # router input only, and only in training
    positions = np.tile(np.arange(5, 5 + SEQ), (2, 1))
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(tokens())),
                    position_ids=torch.tensor(positions)).logits.numpy()
    ours = jax.jit(lambda p, x, pos: forward(p, x, cfg, positions=pos))(params, tokens(),
                                                                       positions)
    assert max_diff(ours, ref) <= TOL


# DeepSeek-V3: one dense layer, then MoE layers with 4 groups of 4 experts (2 kept), top-4,
# two shared-expert widths, routed_scaling_factor, MLA with q and kv latents.
_DSV3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
             first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
             topk_group=2, moe_intermediate_size=8, n_shared_experts=2,
             routed_scaling_factor=2.5, norm_topk_prob=True)


# HF scores a group by the sum of its top-2 experts whatever num_experts_per_tok; Megatron by
# its top num_experts_per_tok // topk_group. The first config agrees under both rules; the others
# import with group_score_topk 2 (HF's rule), which Megatron's rule would route differently.
_DSV3_GROUPS = {
    "k4_g4_top2": {},                                                         # 4 // 2 = 2
    "k8_g8_top4": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8,
                       topk_group=4),                                         # DeepSeek-V3's
    "k8_g8_top2": dict(n_routed_experts=32, num_experts_per_tok=8, n_group=8,
                       topk_group=2),                                         # 8 // 2 = 4
    "k6_g4_top2": dict(num_experts_per_tok=6),                                # 6 // 2 = 3
    "k2_g4_top2": dict(num_experts_per_tok=2),                                # 2 // 2 = 1
    "k3_g4_top2": dict(num_experts_per_tok=3),                                # 3 // 2 = 1
}


def _deepseek_moe_model(path, **change):
    model = tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(**{**_DSV3, **change},
                                                         attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # large enough to reroute tokens
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(_DSV3_GROUPS))
@pytest.mark.slow
def test_deepseek_v3_moe_parity_and_round_trip(case, tmp_path):
    """Group-limited sigmoid routing on score + e_score_correction_bias (a group scored by its
    top-2 sum, as HF scores it), renormalised and scaled top-k weights, shared experts, a dense
    first layer; eval is dropless on both sides."""
    change = _DSV3_GROUPS[case]
    hf = {**_DSV3, **change}
    model = _deepseek_moe_model(tmp_path / "hf", **change)
    cfg, params = from_hf(tmp_path / "hf")
    m = cfg.moe
    assert (m.layer_freq, m.num_groups, m.group_topk, m.topk, m.group_score_topk) == (
        (0, 1, 1), hf["n_group"], hf["topk_group"], hf["num_experts_per_tok"], 2)
    assert (m.score_function, m.expert_bias, m.topk_scaling_factor, m.shared_expert_size,
            m.capacity_factor) == ("sigmoid", True, 2.5, 16, None)
    bias = params["moe_layers"]["moe"]["router"]["expert_bias"]
    assert bias.dtype == np.float32 and float(np.abs(bias).min()) > 0
    ref = _logits(model, tokens())
    assert max_diff(fwd(params, tokens(), cfg), ref) <= TOL
    # The bias changes which experts run (it is not in the weights): without it, other logits.
    unbiased = jax.tree_util.tree_map_with_path(
        lambda p, a: a * 0 if "expert_bias" in jax.tree_util.keystr(p) else a, params)
    assert max_diff(fwd(unbiased, tokens(), cfg), ref) > 1e-2
    if m.topk // m.group_topk != 2:     # Megatron's group score routes other experts here
        megatron_rule = dataclasses.replace(cfg, moe=dataclasses.replace(m,
                                                                         group_score_topk=None))
        assert max_diff(fwd(params, tokens(), megatron_rule), ref) > 1e-2
        with pytest.raises(ValueError, match="group_score_topk"):   # HF cannot express it
            to_hf(params, megatron_rule, tmp_path / "refused")

    to_hf(params, cfg, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["n_group"], written["topk_group"]) == (hf["n_group"], hf["topk_group"])
    back = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                   attn_implementation="eager").eval()
    assert max_diff(_logits(back, tokens()), ref) <= TOL
    cfg2, params2 = from_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("change, field", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(n_group=16, topk_group=4), "n_group"),    # groups of one expert: no top-2 in HF
])
def test_deepseek_v3_moe_refusals(change, field):
    from jaxtrain.models.hf import config_from_hf
    with pytest.raises(ValueError, match=field):
        config_from_hf({**_DSV3, "model_type": "deepseek_v3", **change})
