"""Multi-token prediction in Megatron's hybrid models: each depth's module runs the sublayers
its pattern names after '/' in hybrid_layer_pattern ("M*-E/*E/*E": two depths of attention then
MoE). The hybrid "*-*-/*-/*-" equals the plain two-layer model with two MTP depths (whose MTP
matches Megatron's GPTModel in test_mtp_megatron.py) with the same weights; the MoE sublayers
of the MTP depths count as MoE layers (statistics, expert bias); the knobs and refusals."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.loss import model_loss
from jaxtrain.metrics import flop_terms
from jaxtrain.models import ModelConfig
from jaxtrain.models.moe import MoEConfig, moe_layer_ids
from jaxtrain.models.moe.step import update_expert_bias
from jaxtrain.models.mtp import shift_left
from jaxtrain.models.params import abstract, init

SIZES = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
             max_position_embeddings=16, position_embedding_type="none")


def _batch(seed=0):
    rng = np.random.RandomState(seed)
    toks = jnp.asarray(rng.randint(0, 64, (2, 12)), jnp.int32)
    micro = {"tokens": toks, "targets": jnp.roll(toks, -1, 1)}
    w = jnp.asarray(rng.rand(2, 12) > 0.2, jnp.float32)
    return micro, w / w.sum()


def _as_hybrid(params):
    """The plain model's parameters in the hybrid "*-*-/*-/*-" layout."""
    mixer = ("attn_norm", "attn")
    split = lambda t: ({k: t[k] for k in mixer},   # noqa: E731
                       {k: v for k, v in t.items() if k not in mixer})
    attn, mlp = split(params["layers"])
    mtp_attn, mtp_mlp = split(params["mtp"]["layer"])
    mtp = {k: v for k, v in params["mtp"].items() if k != "layer"}
    return {**{k: v for k, v in params.items() if k not in ("layers", "mtp")},
            "attention_layers": attn, "mlp_layers": mlp,
            "mtp": {**mtp, "layers": {"0": mtp_attn, "1": mtp_mlp}}}


def test_hybrid_mtp_equals_the_plain_model():
    plain = ModelConfig(num_layers=2, mtp_num_layers=2, **SIZES)
    hybrid = ModelConfig(num_layers=4, hybrid_layers="*-*-", mtp_num_layers=2,
                         mtp_hybrid_layers="*-", **SIZES)
    params = jax.tree.map(lambda a: a * 8, init(plain, jax.random.key(0)))
    mapped = _as_hybrid(params)
    assert jax.tree.map(np.shape, mapped) == jax.tree.map(lambda s: s.shape, abstract(hybrid))
    micro, w = _batch()
    mtp_w = [shift_left(w, k) for k in (1, 2)]

    def run(cfg, p):
        lm, stats = model_loss(p, micro, w, cfg, mtp_weights=mtp_w)
        return lm + 0.3 * jnp.sum(stats["mtp"]), (lm, stats["mtp"])

    (_, (lm_p, mtp_p)), g_p = jax.value_and_grad(run, 1, has_aux=True)(plain, params)
    (_, (lm_h, mtp_h)), g_h = jax.value_and_grad(run, 1, has_aux=True)(hybrid, mapped)
    np.testing.assert_allclose(lm_h, lm_p, rtol=1e-6)
    np.testing.assert_allclose(mtp_h, mtp_p, rtol=1e-6)
    assert float(jnp.abs(mtp_p[0] - mtp_p[1])) > 1e-4   # the depths differ
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 g_h, _as_hybrid(g_p))


def _moe_hybrid(**kw):
    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16, expert_bias=True,
                    score_function="sigmoid", bias_update_rate=0.5)
    fields = dict(num_layers=3, hybrid_layers="M*E", mtp_num_layers=2,
                  mtp_hybrid_layers="*E", moe=moe, mamba_num_heads=8, mamba_head_dim=8,
                  mamba_state_dim=8, mamba_num_groups=2, **SIZES)
    return ModelConfig(**{**fields, **kw})


def test_mtp_moe_sublayers_count_as_moe_layers():
    cfg = _moe_hybrid()
    assert moe_layer_ids(cfg) == (2, 4, 6)   # decoder layer 2, then each depth's 'E'
    params = init(cfg, jax.random.key(1))
    micro, w = _batch(1)
    _, stats = model_loss(params, micro, w, cfg, train=True,
                          mtp_weights=[shift_left(w, k) for k in (1, 2)])
    assert stats["counts"].shape == (3, 4)
    counts = jnp.asarray([[4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 4]], jnp.float32)
    new = update_expert_bias(params, counts, cfg)
    bias = np.asarray(new["mtp"]["layers"]["1"]["moe"]["router"]["expert_bias"])   # [E, D]
    np.testing.assert_allclose(bias[:, 0], [0.5, -0.5, 0.5, 0.5])   # depth 1: row 1
    np.testing.assert_allclose(bias[:, 1], [0.5, 0.5, 0.5, -0.5])   # depth 2: row 2
    np.testing.assert_allclose(np.asarray(new["moe_mlp_layers"]["moe"]["router"]["expert_bias"]
                                          )[:, 0], [-0.5, 0.5, 0.5, 0.5])


def test_flops_count_the_mtp_sublayers():
    cfg = _moe_hybrid()
    fewer = _moe_hybrid(mtp_num_layers=1)
    (dense, attn), (dense1, attn1) = (flop_terms(c, abstract(c)) for c in (cfg, fewer))
    assert attn == pytest.approx(attn1 + 6 * 4 * 16)   # one more depth: one more '*' layer
    assert dense > dense1


BASE = ["hidden_size=32", "num_attention_heads=4", "vocab_size=64", "seq_length=16",
        "max_position_embeddings=16", "bf16=false", "position_embedding_type=none",
        "ffn_hidden_size=48", "mamba_num_heads=8", "mamba_head_dim=8", "mamba_state_dim=8",
        "mamba_num_groups=2", "num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=16"]


def model(*args):
    return ModelConfig.from_config(load_config(None, [*BASE, *args]))


def test_the_pattern_after_slash_builds_the_mtp_layers():
    cfg = model("num_layers=4", "hybrid_layer_pattern=M*-E/*E/*E")
    assert (cfg.hybrid_layers, cfg.mtp_hybrid_layers, cfg.mtp_num_layers) == ("M*-E", "*E", 2)
    mtp = abstract(cfg)["mtp"]
    assert set(mtp["layers"]) == {"0", "1"} and "attn" in mtp["layers"]["0"]
    assert mtp["layers"]["1"]["moe"]["router"]["w"].shape == (32, 2, 4)   # [D, depths, E]
    inferred = model("num_layers=4", "hybrid_layer_pattern=M*-E/*E/*E", "mtp_num_layers=5")
    assert inferred.mtp_num_layers == 2   # Megatron: the pattern's depths win
    legacy = model("num_layers=4", "hybrid_layer_pattern=M*-E", "mtp_num_layers=3",
                   "mtp_hybrid_override_pattern=*-")
    assert (legacy.mtp_hybrid_layers, legacy.mtp_num_layers) == ("*-", 3)


@pytest.mark.parametrize("args, says", [
    (["num_layers=4", "hybrid_layer_pattern=M*-E/*E/E*"], "same pattern"),
    (["num_layers=4", "hybrid_layer_pattern=M*-E", "mtp_num_layers=1"], "after '/'"),
    (["num_layers=4", "hybrid_layer_pattern=M*-E/*X"], "X"),
    (["num_layers=4", "hybrid_layer_pattern=M*-E/*E", "pipeline_model_parallel_size=2"],
     "pipeline_model_parallel_size 2"),
    (["num_layers=4", "hybrid_layer_pattern=M*-E/*E", "mtp_use_repeated_layer=true"],
     "mtp_use_repeated_layer"),
])
def test_refused_by_name(args, says):
    with pytest.raises((ConfigError, ValueError), match=says):
        model(*args)


def test_cli_trains_a_hybrid_model_with_mtp(tmp_path, cli):
    run = [*BASE, "mock_data=true", "num_layers=4", "hybrid_layer_pattern=M*-E/*E/*E",
           "mtp_loss_scaling_factor=0.3", "micro_batch_size=2", "global_batch_size=4",
           "lr_warmup_iters=0", "log_interval=1", "exp_name=run", f"workspace={tmp_path}",
           "train_iters=3", "lr=0.01", "moe_router_enable_expert_bias=true",
           "moe_router_score_function=sigmoid"]
    code, _, err = cli(*run)
    assert code == 0, err
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "mtp_1_loss", "mtp_2_loss", "grad_norm"))
        assert r["mtp_1_loss"] != r["loss"] != r["mtp_2_loss"]
