"""Multi-latent attention: logits parity with transformers' DeepseekV3ForCausalLM (dense layers,
YaRN with mscale on the softmax), HF round trips, the knobs, the flash path and mla_up_proj."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import SEQ, VOCAB, max_diff, random_params, tiny, tokens

from jaxtrain.config import ConfigError
from jaxtrain.models import ModelConfig, forward, from_hf, logical_axes, to_hf
from jaxtrain.models import layers as L
from jaxtrain.models.hf import config_from_hf, hf_config
from jaxtrain.models.mla import mla_qkv
from jaxtrain.parallel.mesh import MeshConfig
from jaxtrain.parallel.sharding import axis_rules

TOL = 1e-4
# Dense layers only (first_k_dense_replace = layers): MLA alone.
_DS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=2,
           max_position_embeddings=64)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
         "rope_theta": 10000.0, "mscale": 0.8, "mscale_all_dim": 0.7}
CASES = {
    "q_lora_yarn_mscale": {"rope_parameters": _YARN},
    "direct_q_half_split_rope_tied": {
        "q_lora_rank": None, "rope_interleave": False, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
}
MLA = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True)


def _hf_model(case, path):
    model = tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(**{**_DS, **CASES[case]},
                                                         attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return model


def _hf_logits(model, toks, positions=None):
    kw = {} if positions is None else {"position_ids": torch.tensor(np.asarray(positions))}
    with torch.no_grad():
        return model(torch.tensor(np.asarray(toks)), **kw).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_v3_parity_and_round_trip(case, tmp_path):
    model = _hf_model(case, tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.multi_latent_attention and cfg.head_dim == 12 and cfg.rotary_dim == 4
    toks = tokens()
    positions = np.tile(np.arange(3, 3 + SEQ), (2, 1))
    ref = _hf_logits(model, toks, positions)
    ours = jax.jit(lambda p, x, pos: forward(p, x, cfg, positions=pos))(params, toks, positions)
    assert max_diff(ours, ref) <= TOL
    if cfg.rope_type == "yarn":   # the case exercises the softmax mscale (1.2x here)
        assert cfg.mla_softmax_scale * cfg.head_dim ** 0.5 > 1.1

    to_hf(params, cfg, tmp_path / "out")
    again = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                    attn_implementation="eager").eval()
    assert max_diff(_hf_logits(again, toks, positions), ref) <= TOL
    cfg2, params2 = from_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_native_mla_exports_and_matches_hf(tmp_path):
    """A config built in jaxtrain (Megatron-style: yarn from the MLA knobs) exports exactly."""
    cfg = tiny(**MLA, rope_type="yarn", yarn_scaling_factor=8.0, yarn_mscale=1.0,
               yarn_mscale_all_dim=1.0, original_max_position_embeddings=16, norm_epsilon=1e-6)
    params = random_params(cfg)
    to_hf(params, cfg, tmp_path)
    hf = tr.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    toks = tokens()
    ours = jax.jit(lambda p, x: forward(p, x, cfg))(params, toks)
    assert max_diff(ours, _hf_logits(hf, toks)) <= TOL


@pytest.mark.parametrize("patch,field", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 16, "rope_theta": 1e4}},
     "rope_parameters"),
])
def test_unsupported_deepseek_configs_raise(patch, field):
    hf = {**tr.DeepseekV3Config(**_DS).to_dict(), **patch}
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf)


@pytest.mark.parametrize("changes,field", [
    ({"qk_layernorm": False}, "qk_layernorm"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"rope_type": "yarn", "yarn_scaling_factor": 4.0, "yarn_mscale": 0.0,
      "yarn_mscale_all_dim": 1.0}, "yarn_mscale_all_dim"),
])
def test_export_rejects_unrepresentable_mla(changes, field):
    with pytest.raises(ValueError, match=field):
        hf_config(tiny(**{**MLA, **changes}))


def test_mla_knobs():
    flat = {"vocab_size": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16,
            "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12,
            "rotary_scaling_factor": 40.0, "mscale": 0.9, "mscale_all_dim": 0.8,
            "qk_layernorm": True, "add_bias_linear": True,
            "recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]}
    cfg = ModelConfig.from_config(flat)
    assert cfg.rope_type == "yarn"                      # Megatron: MLA defaults to yarn
    assert cfg.original_max_position_embeddings == 4096
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.v_head_dim) == (24, 16, 24, 12)
    assert (cfg.yarn_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim) == (40.0, 0.9, 0.8)
    assert cfg.add_bias_linear and not cfg.add_qkv_bias  # MLA: only the output bias
    m = 0.1 * 0.8 * np.log(40.0) + 1
    assert np.isclose(cfg.mla_softmax_scale, m * m / np.sqrt(24))
    attn = random_params(cfg)["layers"]["attn"]
    assert sorted(attn) == ["bo", "kv_a_norm", "q_a_norm", "wk_b", "wkv_a", "wo", "wq_a", "wq_b",
                            "wv_b"]
    assert attn["wkv_a"].shape == (64, 2, 16 + 8) and attn["wk_b"].shape == (16, 2, 4, 16)
    assert ModelConfig.from_config({**flat, "rope_type": "rope"}).rope_type == "rope"
    dense = {**flat, "multi_latent_attention": False, "recompute_modules": ["core_attn"]}
    assert ModelConfig.from_config(dense).rope_type == "rope"
    rules = axis_rules(MeshConfig())
    for spec in jax.tree.leaves(logical_axes(cfg), is_leaf=lambda x: hasattr(x, "index")):
        assert all(name is None or name in rules for name in spec)
    assert logical_axes(cfg)["layers"]["attn"]["wq_a"] == jax.sharding.PartitionSpec(
        "embed", "layers", "lora")


@pytest.mark.parametrize("flat,match", [
    ({"group_query_attention": True, "num_query_groups": 2}, "grouped-query"),
    ({"rotary_interleaved": True}, "rotary_interleaved"),
    ({"add_qkv_bias": True}, "add_qkv_bias"),
    ({"multi_latent_attention": False, "recompute_granularity": "selective",
      "recompute_modules": ["mla_up_proj"]}, "mla_up_proj"),
])
def test_mla_rules(flat, match):
    base = {"vocab_size": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "multi_latent_attention": True}
    with pytest.raises((ValueError, ConfigError), match=match):
        ModelConfig.from_config({**base, **flat})


_XLA = tiny(**{**MLA, "q_lora_rank": None}, position_embedding_type="learned_absolute",
            rope_type="yarn", yarn_scaling_factor=4.0, yarn_mscale_all_dim=1.0,
            original_max_position_embeddings=8)


def _logits_and_grads(cfg, params, toks):
    def loss(p):
        logits = forward(p, toks, cfg)
        return jnp.mean(logits ** 2), logits

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile(
        {"xla_backend_optimization_level": 0})
    (_, logits), grads = fn(params)
    return logits, grads


def _assert_same(got, want):
    (logits, grads), (want_logits, want_grads) = got, want
    assert max_diff(logits, want_logits) <= 1e-5 * max(1.0, float(jnp.abs(want_logits).max()))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert max_diff(g, w) <= 1e-5 * max(1e-2, float(jnp.abs(w).max()))


def test_up_proj_recompute_matches():
    """mla_up_proj puts the up projections under a checkpoint (recomputed in the backward)
    with the same q/k/v and gradients."""
    cfg = _XLA.replace(recompute_modules=("mla_up_proj",))
    p = jax.tree.map(lambda a: a[:, 0], random_params(_XLA)["layers"]["attn"])
    x = jnp.asarray(np.random.RandomState(0).randn(2, 8, 32), jnp.float32)
    ctx = {"rope": L.rope_tables(jnp.tile(jnp.arange(8), (2, 1)), _XLA)}

    def loss(c):
        return jax.jit(jax.value_and_grad(
            lambda p: sum(jnp.sum(jnp.sin(t)) for t in mla_qkv(p, x, ctx, c))))

    jaxpr = str(jax.make_jaxpr(lambda p: mla_qkv(p, x, ctx, cfg))(p))
    assert "remat" in jaxpr or "checkpoint" in jaxpr
    assert "remat" not in str(jax.make_jaxpr(lambda p: mla_qkv(p, x, ctx, _XLA))(p))
    (want, want_g), (got, got_g) = loss(_XLA)(p), loss(cfg)(p)
    assert abs(float(got - want)) < 1e-5
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert max_diff(g, w) < 1e-5


@pytest.mark.slow
def test_flash_matches_xla():
    """On the flash kernel (interpreted; v zero-padded to the q/k width) MLA gives the xla
    logits and gradients."""
    import kernels.flash_attention as fa
    params, toks = random_params(_XLA), tokens(2, 16)
    flash = _XLA.replace(attention_impl="flash", flash_block_sizes=fa.BlockSizes(16, 16))
    _assert_same(_logits_and_grads(flash, params, toks), _logits_and_grads(_XLA, params, toks))
