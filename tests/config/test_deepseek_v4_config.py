"""DeepSeek-V4's knobs (Primus's model_type deepseek_v4 keys, MaxText's deepseek4 block): each
reaches the model it describes (the model-level effects are tests/models/test_deepseek_v4_hf.py),
the keys without model_type deepseek_v4 are refused by name, the indexer stays frozen without
its loss, and a tiny model with multi-token prediction trains from the command line."""
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.conftest import trained_rows
from jaxtrain.config.errors import ConfigError
from jaxtrain.models import ModelConfig, logical_axes
from jaxtrain.models import init as init_params
from jaxtrain.optim.config import OptimConfig
from jaxtrain.optim.optimizers import build_optimizer

UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
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

# V4 as command-line overrides
V4_ARGS = [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) or v is None else v}"
           for k, v in V4.items()]


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
    ("use_v4_fp8_indexer", True, "compress_index_fp8", True),
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
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    params.pop("hash_routes")
    grads = jax.tree.map(jnp.ones_like, params)
    axes = logical_axes(cfg)
    axes.pop("hash_routes")

    def step(coeff):
        opt = OptimConfig.from_config({**V4, "v4_indexer_distill_loss_coeff": coeff,
                                       "optimizer": "adam", "weight_decay": 0.1})
        tx = build_optimizer(opt, optax.constant_schedule(1e-2), axes)
        update = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])  # not op by op: faster
        return update(grads, params)["csa_moe_layers"]["attn"]

    frozen, trained = step(0.0), step(0.5)
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(frozen["indexer"]))
    assert all(float(jnp.abs(u).max()) > 0 for u in jax.tree.leaves(trained["indexer"]))
    assert float(jnp.abs(frozen["wq_a"]).max()) > 0


@pytest.mark.slow
def test_cli_trains_a_tiny_deepseek_v4_with_mtp(tmp_path, cli):
    run = ["mock_data=true", "seq_length=16", "micro_batch_size=2", "global_batch_size=2",
           "lr_warmup_iters=0", "bf16=false", "log_interval=1", "exp_name=run",
           f"workspace={tmp_path}", "train_iters=3", "lr=0.01", *V4_ARGS]
    rows = trained_rows(cli, run, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] != rows[0]["loss"]
    assert all(np.isfinite(r["mtp_1_loss"]) for r in rows)


# MaxText's deepseek4-tiny (configs/models/maxtext/deepseek4-tiny.yml) at 5 of its 43 layers
DEEPSEEK4_TINY = ["model_name=deepseek4-tiny", "override_model_config=true",
                  "base_num_decoder_layers=5", "vocab_size=128"]


def test_maxtext_deepseek4_block_builds_maxtexts_model():
    from jaxtrain.config import load_config
    cfg = load_config("base.yml", DEEPSEEK4_TINY, enforce_status=True)
    m = ModelConfig.from_config({**cfg})
    assert m.compress_ratios == (0, 0, 4, 128, 4) and m.compress_rotary_base == 160000.0
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (4, 1, 32)
    assert (m.qk_pos_emb_head_dim, m.q_lora_rank, m.o_groups, m.o_lora_rank) == (32, 16, 4, 16)
    assert (m.compress_index_heads, m.compress_index_head_dim, m.compress_index_topk) == (
        4, 32, 16)
    assert (m.sliding_window, m.attention_sinks, m.rope_type) == (32, True, "rope")
    assert (m.hc_streams, m.hc_head, m.hc_init_gate, m.hc_sinkhorn_iters) == (4, True, 0.01, 20)
    moe = m.moe
    assert (moe.num_experts, moe.topk, moe.hash_layers, moe.score_function) == (
        16, 4, 3, "sqrtsoftplus")
    # the routed experts clamp, the shared one not (MaxText's MlpBlock); a selection-only bias
    assert m.glu_clamp is None and moe.glu_limit == 10.0 and moe.activation is None
    assert moe.expert_bias and moe.bias_update_rate == 0.001 and moe.shared_expert_size == 64
    assert moe.aux_softmax_biased and moe.load_balancing == ("seq_aux_loss",)
    np.testing.assert_allclose(moe.aux_loss_coeff, (0.0001 * 4 / 5,))


def test_maxtext_balance_loss_is_softmax_of_biased_scores_and_skips_hash_layers():
    """MaxText's DeepSeek balance loss: per sequence, mean over experts of (routed share x
    mean softmax(score + bias)) x E^2; none on hash-routed layers."""
    from jaxtrain.models.moe import MoEConfig
    from jaxtrain.models.moe.router import route
    m = MoEConfig(num_experts=4, topk=2, score_function="sqrtsoftplus", expert_bias=True,
                  load_balancing=("seq_aux_loss",), aux_loss_coeff=(1.0,),
                  aux_softmax_biased=True)
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    bias = jnp.asarray([0.3, -0.2, 0.0, 0.1], jnp.float32)
    _, idx, _, _, stats = route(logits, m, train=True, bias=bias, seqs=2)
    s = np.sqrt(np.log1p(np.exp(np.asarray(logits, np.float64)))) + np.asarray(bias)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    f = np.zeros((6, 4))
    np.put_along_axis(f, np.asarray(idx), 1.0, axis=1)
    ref = np.mean([np.mean(f[b * 3:b * 3 + 3].mean(0) * p[b * 3:b * 3 + 3].mean(0)) * 16
                   for b in range(2)])
    np.testing.assert_allclose(float(stats["lb"][0]) * 2, ref, rtol=1e-5)   # E/k: k in coeff
    forced = jnp.tile(jnp.asarray([[0, 1]]), (6, 1))
    *_, hashed = route(logits, m, train=True, bias=bias, seqs=2, forced=forced,
                       hashed=jnp.asarray(True))
    assert float(hashed["lb"][0]) == 0.0


@pytest.mark.slow
def test_cli_trains_maxtexts_deepseek4_block(tmp_path, cli):
    run = ["base.yml", *DEEPSEEK4_TINY, "dataset_type=synthetic",
           "steps=2", "per_device_batch_size=1", "max_target_length=16",
           f"base_output_directory={tmp_path}", "run_name=run", "enable_checkpointing=false"]
    code, _, err = cli(*run)
    assert code == 0, err


def _dry_run(cli, *extra):
    return cli("--dry-run", "mock_data=true", "seq_length=16", "micro_batch_size=1",
               "global_batch_size=2", *V4_ARGS, *extra)


def test_dry_run_refuses_what_does_not_run_it_yet(cli):
    code, _, err = _dry_run(cli, "memory.seco=true")
    assert code == 2 and "memory.seco with DeepSeek-V4" in err and "Traceback" not in err


def test_dry_run_accepts_pipeline_stages(cli):
    """The stages send the streams and read the hash routes (tests/parallel: PP = PP 1)."""
    code, _, err = _dry_run(cli, "pipeline_model_parallel_size=2",
                            "pipeline_model_parallel_layout=Ett|ttmL")
    assert code == 0, err


@pytest.mark.skipif(not (UPSTREAM / "primus").is_dir(), reason="JAXTRAIN_UPSTREAM has no Primus")
def test_primus_flash_experiment_with_its_launchers_pipeline(monkeypatch, cli):
    """Primus's V4 Flash experiment as its launcher (run_deepseek_v4_flash.sh) runs it: PP 4
    with the tuned layout; the file's own default PP 8 stops on Megatron's rule (43 layers)."""
    file = UPSTREAM / "primus/examples/megatron/configs/MI355X/deepseek_v4_flash-BF16-pretrain.yaml"
    monkeypatch.setenv("PRIMUS_PP", "4")
    code, out, err = cli("--dry-run", file, "pipeline_model_parallel_layout=Et*10|t*12|t*12|t*9mL")
    assert code == 0, err
    assert "pipeline_model_parallel_size: 4" in out and "num_layers: 43" in out
    monkeypatch.setenv("PRIMUS_PP", "8")
    code, _, err = cli("--dry-run", file)
    assert code == 2 and "43 is not divisible by pipeline_model_parallel_size 8" in err


def test_flops_count_the_window_the_entries_and_the_indexer():
    """DeepSeek-V4-Flash: 13B active parameters (its card: 284B total, 13B activated); per
    token at T: 6 N_active plus, per layer, 6 heads (2 x 512) x (the window's 128 keys + the
    entries: T/128, or the indexer's 512 kept of T/4) + the indexer's 2 x 64 x 128 x T/4."""
    from jaxtrain.metrics import flop_terms, flops_per_token
    from jaxtrain.models.params import abstract
    from tests.conftest import ROOT
    from jaxtrain.config import load_config
    cfg = ModelConfig.from_config({**load_config(str(ROOT / "configs" / "models" /
                                                     "deepseek_v4_flash_284B.yaml"))})
    shapes = abstract(cfg)
    dense, _ = flop_terms(cfg, shapes)
    assert abs(dense / 6 / 13e9 - 1) < 0.03
    T, coef = 8192, 6.0 * 64 * 1024
    window = 43 * coef * 128
    csa, hca = cfg.compress_ratios.count(4), cfg.compress_ratios.count(128)
    entries = csa * coef * min(T // 4, 512) + hca * coef * T / 128
    indexer = csa * 2.0 * 64 * 128 * T / 4
    np.testing.assert_allclose(flops_per_token(cfg, shapes, T), dense + window + entries
                               + indexer, rtol=1e-9)


@pytest.mark.parametrize("knob, value, field, expect", [
    ("first_num_hash_layers", 1, "moe.hash_layers", 1),
    ("compressed_rope_max_timescale", 40000, "compress_rotary_base", 40000.0),
    ("sliding_window_size", 16, "sliding_window", 16),
    ("mhc_expansion_rate", 2, "hc_streams", 2),
    ("indexer_topk", 8, "compress_index_topk", 8),
    ("mlp_activations_limit", 5.0, "moe.glu_limit", 5.0),
])
def test_each_maxtext_key_reaches_the_model(knob, value, field, expect):
    from jaxtrain.config import load_config
    get = lambda m, f: getattr(m.moe, f[4:]) if f.startswith("moe.") else getattr(m, f)  # noqa
    base = ModelConfig.from_config({**load_config("base.yml", DEEPSEEK4_TINY)})
    cfg = load_config("base.yml", [*DEEPSEEK4_TINY, f"{knob}={value}"])
    assert get(ModelConfig.from_config({**cfg}), field) == expect != get(base, field)
