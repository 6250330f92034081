"""Megatron's quantile balancing (moe_router_load_balancing_type quantile_balancing): the
experts of logits - qb_beta, the column quantile that would balance them, the once-per-batch
EMA and centring, against a transcription of Megatron's qb_dual_update and
_update_router_qb_beta (with JAXTRAIN_UPSTREAM also its own function), and a run that trains
the bias from the command line."""
import ast
import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxtrain.models import init
from jaxtrain.models.moe import MoEConfig, route, update_router_state, zero_stats
from jaxtrain.models.moe.router import quantile_experts
from model_helpers import tiny

UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
MOE_UTILS = UPSTREAM / "megatron-lm/megatron/core/transformer/moe/moe_utils.py"


def qb_dual_update(scores, k, beta, update_beta=True):
    """Megatron's qb_dual_update, transcribed."""
    m, n = scores.shape
    top = (scores - beta).topk(k + 1, dim=1)
    if not update_beta:
        return top.indices[:, :-1], beta
    alpha = top.values[:, -1:]
    return top.indices[:, :-1], (scores - alpha).topk(m * k // n + 1, dim=0).values[-1]


def _megatron_own():
    """Megatron-LM's qb_dual_update from its source file (pure torch)."""
    tree = ast.parse(MOE_UTILS.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "qb_dual_update")
    scope = {"torch": torch, "Tuple": tuple}
    exec(compile(ast.Module([fn], []), str(MOE_UTILS), "exec"), scope)
    return scope["qb_dual_update"]


@pytest.mark.parametrize("own", [False, True])
def test_experts_and_quantile_match_megatron(own):
    if own and not MOE_UTILS.is_file():
        pytest.skip("JAXTRAIN_UPSTREAM has no Megatron-LM")
    ref = _megatron_own() if own else qb_dual_update
    r = np.random.default_rng(0)
    for N, E, k in ((24, 8, 2), (64, 16, 4), (30, 6, 1)):
        x = r.normal(size=(N, E)).astype(np.float32)
        beta = (r.normal(size=E) * 0.3).astype(np.float32)
        idx, q = quantile_experts(jnp.asarray(x), jnp.asarray(beta), k, True)
        want_idx, want_q = ref(torch.tensor(x), k, torch.tensor(beta))
        np.testing.assert_array_equal(np.asarray(idx), want_idx.numpy())
        np.testing.assert_array_equal(np.asarray(q), want_q.numpy())
        idx, q = quantile_experts(jnp.asarray(x), jnp.asarray(beta), k, False)
        np.testing.assert_array_equal(np.asarray(idx), want_idx.numpy())
        np.testing.assert_array_equal(np.asarray(q), beta)


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_route_weighs_the_picked_experts_by_their_scores(score):
    """The experts come from logits - beta; the weights are the score function's at them
    (Megatron's topk_routing_with_score_function with precomputed indices)."""
    m = MoEConfig(num_experts=8, topk=2, score_function=score,
                  load_balancing=("quantile_balancing",), aux_loss_coeff=(0.0,),
                  topk_scaling_factor=1.5)
    r = np.random.default_rng(1)
    logits = r.normal(size=(16, 8)).astype(np.float32)
    beta = (r.normal(size=8) * 0.5).astype(np.float32)
    probs, idx, _, _, stats = route(jnp.asarray(logits), m, train=True,
                                    qb_beta=jnp.asarray(beta))
    want_idx, want_q = qb_dual_update(torch.tensor(logits), 2, torch.tensor(beta))
    np.testing.assert_array_equal(np.asarray(idx), want_idx.numpy())
    picked = np.take_along_axis(logits, want_idx.numpy(), 1)
    if score == "sigmoid":
        s = 1 / (1 + np.exp(-picked))
        want = s / (s.sum(-1, keepdims=True) + 1e-20)
    else:
        want = np.exp(picked) / np.exp(picked).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(probs), 1.5 * want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats["qb"]), want_q.numpy())
    assert float(stats["objective"]) == 0.0


@pytest.mark.parametrize("ema", [0.0, 0.7])
def test_bias_update_is_megatrons(ema):
    """Once per global batch: ema·beta + (1 - ema)·(the quantiles' mean over microbatches),
    less its mean over experts (Megatron's _update_router_qb_beta); per MoE layer."""
    m = MoEConfig(num_experts=4, topk=2, load_balancing=("quantile_balancing",),
                  aux_loss_coeff=(0.0,), qb_ema=ema)
    cfg = tiny(num_layers=3, moe=dataclasses.replace(m, layer_freq=(0, 1, 1)))
    params = init(cfg, jax.random.key(0))
    r = np.random.default_rng(2)
    old = r.normal(size=(2, 4)).astype(np.float32)
    stacked = params["moe_layers"]["moe"]["router"]
    axis = cfg.param_scan_axis
    params["moe_layers"]["moe"]["router"] = {**stacked,
                                             "qb_beta": jnp.moveaxis(jnp.asarray(old), 0, axis)}
    sums = dict(zero_stats(cfg), qb=jnp.asarray(r.normal(size=(2, 4)), jnp.float32))
    new = update_router_state(params, sums, 3, cfg)["moe_layers"]["moe"]["router"]["qb_beta"]
    blend = ema * old + (1 - ema) * np.asarray(sums["qb"]) / 3
    want = blend - blend.mean(-1, keepdims=True)
    np.testing.assert_allclose(np.moveaxis(np.asarray(new), axis, 0), want, rtol=1e-6,
                               atol=1e-7)


def test_train_step_moves_the_bias_once_per_global_batch():
    """The train step (2 microbatches): the new bias is the EMA of the old and the mean of
    the quantiles the step's forwards found, centred; the optimizer never holds it."""
    from tests.models.test_moe_step import _forward, _run
    from tests.train.test_step import model_cfg

    mcfg = model_cfg(num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_router_load_balancing_type="quantile_balancing",
                     moe_aux_loss_coeff=0.0, moe_router_quantile_balancing_ema=0.5)
    for before, after, _ in _run(mcfg, 2):
        quantiles = [np.asarray(st["qb"]) for st, _ in _forward(before, mcfg)]
        old = np.asarray(before.params["moe_layers"]["moe"]["router"]["qb_beta"])
        blend = 0.5 * old + 0.5 * np.mean(quantiles, 0).reshape(old.shape)
        want = blend - blend.mean()
        new = np.asarray(after.params["moe_layers"]["moe"]["router"]["qb_beta"])
        np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-6)
        assert np.abs(new).max() > 0
        assert "qb_beta" not in str(jax.tree_util.tree_structure(after.opt_state))


def test_no_hugging_face_export():
    """No transformers router picks experts by logits - a bias: export refuses it."""
    from jaxtrain.models.hf import check_exportable

    m = MoEConfig(num_experts=4, topk=2, load_balancing=("quantile_balancing",),
                  aux_loss_coeff=(0.0,))
    with pytest.raises(ValueError, match="moe.quantile_balancing"):
        check_exportable(tiny(moe=m), "mixtral")


def test_cli_trains_with_it(tmp_path, cli):
    run = ["mock_data=true", "micro_batch_size=2", "global_batch_size=4", "seq_length=16",
           "num_layers=2", "hidden_size=32", "num_attention_heads=4", "ffn_hidden_size=64",
           "vocab_size=97", "max_position_embeddings=16", "num_experts=4", "moe_router_topk=2",
           "moe_ffn_hidden_size=16", "moe_router_load_balancing_type=quantile_balancing",
           "moe_aux_loss_coeff=0", "bf16=false", "lr=0.01", "lr_warmup_iters=0",
           "train_iters=3", "log_interval=1", "exp_name=run", f"workspace={tmp_path}"]
    code, _, err = cli("--dry-run", *run)
    assert code == 0, err
    code, _, err = cli(*run)
    assert code == 0, err
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("extra, match", [
    (["seq_length=15"], "must be divisible by num_experts"),
    (["moe_router_load_balancing_type=[quantile_balancing,aux_loss]",
      "moe_aux_loss_coeff=[0,0.01]"], "the only"),
    (["pipeline_model_parallel_size=2", "num_layers=2"], "with quantile balancing"),
])
def test_dry_run_refuses(cli, extra, match):
    base = ["--dry-run", "mock_data=true", "micro_batch_size=1", "global_batch_size=8",
            "seq_length=16", "hidden_size=32", "num_attention_heads=4", "num_layers=2",
            "ffn_hidden_size=64", "vocab_size=97", "max_position_embeddings=16",
            "num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=16",
            "moe_router_load_balancing_type=quantile_balancing", "moe_aux_loss_coeff=0"]
    code, _, err = cli(*base, *extra)
    assert code == 2 and match in err and "Traceback" not in err, err
