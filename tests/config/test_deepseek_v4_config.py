"""DeepSeek-V4's knobs (Primus's model_type deepseek_v4 keys, MaxText's deepseek4 block): each
reaches the model it describes (the model-level effects are tests/models/test_deepseek_v4_hf.py),
the keys without model_type deepseek_v4 are refused by name, the indexer stays frozen without
its loss, and a tiny model with multi-token prediction trains from the command line."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain.config.errors import ConfigError
from jaxtrain.models import ModelConfig, logical_axes
from jaxtrain.models import init as init_params
from jaxtrain.optim.config import OptimConfig
from jaxtrain.optim.optimizers import build_optimizer

# Primus's llama_base, deepseek_v4_base and deepseek_v4_flash keys at a tiny size
V4 = {"position_embedding_type": "rope", "normalization": "RMSNorm", "add_bias_linear": False,
      "untie_embeddings_and_output_weights": True, "attention_dropout": 0.0,
      "hidden_dropout": 0.0, "model_type": "deepseek_v4", "num_layers": 4, "hidden_size": 32,
      "num_attention_heads": 4, "num_query_groups": 1, "kv_channels": 16,
      "qk_pos_emb_head_dim": 8, "q_lora_rank": 12, "o_groups": 2, "o_lora_rank": 8,
      "compress_ratios": "[0, 4, 8, 4, 0]", "compress_rope_theta": 40000.0,
      "index_topk": 2, "index_head_dim": 12, "index_n_heads": 4, "attn_sliding_window": 6,
      "attn_sink": True, "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6,
      "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
      "moe_shared_expert_intermediate_size": 16, "moe_router_score_function": "sqrtsoftplus",
      "moe_router_enable_expert_bias": True, "num_hash_layers": 2, "swiglu": True,
      "swiglu_limit": 10.0, "activation_func_clamp_value": 10.0, "vocab_size": 64,
      "max_position_embeddings": 64, "norm_epsilon": 1e-6, "mtp_num_layers": 1}


def _cfg(**changes) -> ModelConfig:
    return ModelConfig.from_config({**V4, **changes})


def test_primus_keys_build_the_model():
    cfg = _cfg()
    assert cfg.compress_ratios == (0, 4, 8, 4)   # the fifth entry is the MTP layer's
    assert (cfg.compress_sparse_ratio, cfg.compress_dense_ratio) == (4, 8)
    assert (cfg.compress_rotary_base, cfg.o_groups, cfg.o_lora_rank) == (40000.0, 2, 8)
    assert (cfg.compress_index_heads, cfg.compress_index_head_dim,
            cfg.compress_index_topk) == (4, 12, 2)
    assert (cfg.sliding_window, cfg.attention_sinks, cfg.num_query_groups) == (6, True, 1)
    assert (cfg.hc_streams, cfg.hc_head, cfg.hc_sinkhorn_iters, cfg.hc_style) == (
        2, True, 5, "deepseek")
    assert cfg.moe.hash_layers == 2 and cfg.glu_clamp == 10.0 and cfg.mtp_num_layers == 1


@pytest.mark.parametrize("knob, value, field, expect", [
    ("compress_ratios", [0, 4, 16, 4], "compress_ratios", (0, 4, 16, 4)),
    ("compress_rope_theta", 10000.0, "compress_rotary_base", 10000.0),
    ("index_topk", 5, "compress_index_topk", 5),
    ("index_head_dim", 16, "compress_index_head_dim", 16),
    ("index_n_heads", 8, "compress_index_heads", 8),
    ("v4_indexer_distill_loss_coeff", 0.1, "compress_index_loss_coeff", 0.1),
    ("attn_sliding_window", 0, "sliding_window", None),
    ("attn_sink", False, "attention_sinks", False),
    ("o_groups", 4, "o_groups", 4),
    ("o_lora_rank", 4, "o_lora_rank", 4),
    ("hc_mult", 3, "hc_streams", 3),
    ("hc_sinkhorn_iters", 7, "hc_sinkhorn_iters", 7),
    ("hc_eps", 1e-5, "hc_eps", 1e-5),
    ("swiglu_limit", 0.0, "glu_clamp", 10.0),   # activation_func_clamp_value still clamps
])
def test_each_knob_reaches_the_model(knob, value, field, expect):
    changes = {knob: value}
    if knob == "v4_indexer_distill_loss_coeff":
        changes["mtp_num_layers"] = 0   # the MTP layers' indexer loss is refused
    assert getattr(_cfg(**changes), field) == expect
    assert getattr(_cfg(), field) != expect or knob == "swiglu_limit"


def test_the_clamp_knobs_must_agree_and_either_clamps():
    assert _cfg(activation_func_clamp_value=None).glu_clamp == 10.0
    assert _cfg(swiglu_limit=0.0, activation_func_clamp_value=None).glu_clamp is None
    with pytest.raises(ConfigError, match="activation_func_clamp_value = 10.0 and swiglu_limit"):
        _cfg(swiglu_limit=7.0)


def test_hash_layers_knob_reaches_the_router():
    assert _cfg(num_hash_layers=0).moe.hash_layers == 0
    assert "hash_routes" not in jax.eval_shape(lambda: init_params(_cfg(num_hash_layers=0),
                                                                   jax.random.key(0)))


@pytest.mark.parametrize("bad, message", [
    (dict(model_type="gpt"), "DeepSeek-V4's settings, and model_type is 'gpt'"),
    (dict(compress_ratios=None), "needs compress_ratios"),
    (dict(o_lora_rank=0), "o_lora_rank 0"),
    (dict(compress_ratios=[0, 4, 8, 16]), "one besides the sparse"),
    (dict(compress_ratios=[0, 4]), "compress_ratios has 2 entries for 4 layers"),
    (dict(mtp_use_separate_hc_head=False), "mtp_use_separate_hc_head false"),
    (dict(v4_indexer_distill_loss_coeff=0.1), "indexer loss (v4_indexer_distill_loss_coeff)"),
    (dict(num_query_groups=2), "one shared key/value head"),
])
def test_refused_by_name(bad, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(").replace(
            ")", r"\)")):
        _cfg(**bad)


def test_indexer_is_frozen_without_its_loss():
    """v4_indexer_distill_loss_coeff 0: the indexers get no update, weight decay included (as
    Primus's requires_grad False); with a weight they train."""
    cfg = _cfg(mtp_num_layers=0)
    params = init_params(cfg, jax.random.key(0))
    params.pop("hash_routes")
    grads = jax.tree.map(jnp.ones_like, params)
    axes = logical_axes(cfg)
    axes.pop("hash_routes")

    def step(coeff):
        opt = OptimConfig.from_config({**V4, "v4_indexer_distill_loss_coeff": coeff,
                                       "optimizer": "adam", "weight_decay": 0.1})
        tx = build_optimizer(opt, optax.constant_schedule(1e-2), axes)
        updates, _ = tx.update(grads, tx.init(params), params)
        return updates["csa_moe_layers"]["attn"]

    frozen, trained = step(0.0), step(0.5)
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(frozen["indexer"]))
    assert all(float(jnp.abs(u).max()) > 0 for u in jax.tree.leaves(trained["indexer"]))
    assert float(jnp.abs(frozen["wq_a"]).max()) > 0


def test_cli_trains_a_tiny_deepseek_v4_with_mtp(tmp_path, cli):
    run = ["mock_data=true", "seq_length=16", "micro_batch_size=2", "global_batch_size=2",
           "lr_warmup_iters=0", "bf16=false", "log_interval=1", "exp_name=run",
           f"workspace={tmp_path}", "train_iters=3", "lr=0.01",
           *(f"{k}={json.dumps(v) if isinstance(v, (list, bool)) or v is None else v}"
             for k, v in V4.items())]
    code, _, err = cli("--dry-run", *run)
    assert code == 0, err
    code, _, err = cli(*run)
    assert code == 0, err
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] != rows[0]["loss"]
    assert all(np.isfinite(r["mtp_1_loss"]) for r in rows)
