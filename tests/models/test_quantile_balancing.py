"""Megatron's quantile balancing (moe_router_load_balancing_type quantile_balancing): the
experts of logits - qb_beta, the column quantile that would balance them, the once-per-batch
EMA and centring, against a transcription of Megatron's qb_dual_update and
_update_router_qb_beta (with JAXTRAIN_UPSTREAM also its own function), and a run that trains
the bias from the command line."""
import ast
import dataclasses
import importlib.util
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.conftest import trained_rows
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
    rows = trained_rows(cli, run, tmp_path)
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("extra, match", [
    (["seq_length=15"], "must be divisible by num_experts"),
    (["moe_router_load_balancing_type=[quantile_balancing,aux_loss]",
      "moe_aux_loss_coeff=[0,0.01]"], "the only"),
    (["moe_router_quantile_balancing_ema=1.0"], "moe_router_quantile_balancing_ema 1.0"),
])
def test_dry_run_refuses(cli, extra, match):
    base = ["--dry-run", "mock_data=true", "micro_batch_size=1", "global_batch_size=8",
            "seq_length=16", "hidden_size=32", "num_attention_heads=4", "num_layers=2",
            "ffn_hidden_size=64", "vocab_size=97", "max_position_embeddings=16",
            "num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=16",
            "moe_router_load_balancing_type=quantile_balancing", "moe_aux_loss_coeff=0"]
    code, _, err = cli(*base, *extra)
    assert code == 2 and match in err and "Traceback" not in err, err


# --- Kimi K3's quantile rule (Primus moe_router_bias_update_rule: quantile) ---------------

K3_QB = UPSTREAM / "primus/primus/backends/megatron/core/transformer/kimi_k3/moe"
K3 = MoEConfig(num_experts=6, topk=2, score_function="sigmoid", expert_bias=True,
               bias_rule="quantile", k3_bins=16, k3_range=(-0.5, 0.5),
               load_balancing=("seq_aux_loss",), aux_loss_coeff=(1e-3,))


def compute_margin_histogram(scores, bias, topk, bins, lo, hi):
    """Primus's compute_margin_histogram, transcribed (the clamp counts left out)."""
    tau = torch.topk(scores + bias, k=min(topk + 1, scores.shape[1]), dim=1).values[:, -1:]
    raw = ((scores - tau - lo) / ((hi - lo) / bins)).floor()
    idx = raw.clamp(0, bins - 1).long() + torch.arange(scores.shape[1])[None] * bins
    return torch.bincount(idx.reshape(-1), minlength=scores.shape[1] * bins).view(-1, bins)


def compute_quantile_bias(hist, topk, experts, lo, hi, center=True):
    """Primus's quantile_from_histogram + compute_quantile_bias, transcribed."""
    bins = hist.shape[-1]
    cum = hist.double().cumsum(-1)
    total = cum[..., -1:]
    target = total * (1.0 - topk / experts)
    idx = torch.searchsorted(cum.contiguous(), target.contiguous()).clamp(max=bins - 1)
    prev = torch.where(idx == 0, 0.0, torch.gather(cum, -1, (idx - 1).clamp(min=0)))
    here = torch.gather(hist.double(), -1, idx).clamp(min=1.0)
    frac = ((target - prev) / here).clamp(0.0, 1.0)
    value = lo + (hi - lo) / bins * (idx.double() + frac)
    value = torch.where(total > 0, value, torch.full_like(value, 0.5 * (lo + hi))).squeeze(-1)
    bias = -value
    return bias - bias.mean(-1, keepdim=True) if center else bias


def _primus_qb():
    """Primus's own functions: the histogram from its eager kernel file, the quantile from
    k3_quantile_balancing.py (its two functions, pure torch)."""
    spec = importlib.util.spec_from_file_location("k3_qb_ref", K3_QB / "qb_kernels/_eager/"
                                                  "reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    src = (K3_QB / "k3_quantile_balancing.py").read_text()
    fns = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)
           and n.name in ("quantile_from_histogram", "compute_quantile_bias")]
    scope = {"torch": torch}
    exec(compile(ast.Module(fns, []), "k3_quantile_balancing.py", "exec"), scope)
    hist = lambda s, b, k, n, lo, hi: ref.compute_margin_histogram(  # noqa: E731
        s, b, topk=k, num_bins=n, margin_min=lo, margin_max=hi)[0]
    bias = lambda h, k, e, lo, hi: scope["compute_quantile_bias"](  # noqa: E731
        h, topk=k, num_experts=e, margin_min=lo, margin_max=hi)
    return hist, bias


@pytest.mark.parametrize("own", [False, True])
def test_k3_histogram_and_bias_match_primus(own):
    if own and not K3_QB.is_dir():
        pytest.skip("JAXTRAIN_UPSTREAM has no Primus")
    from jaxtrain.models.moe.router import margin_histogram
    from jaxtrain.models.moe.step import _k3_bias
    hist_ref, bias_ref = _primus_qb() if own else (
        lambda s, b, k, n, lo, hi: compute_margin_histogram(s, b, k, n, lo, hi),
        lambda h, k, e, lo, hi: compute_quantile_bias(h, k, e, lo, hi))
    r = np.random.default_rng(3)
    logits = (r.normal(size=(40, 6)) * 2).astype(np.float32)
    bias = (r.normal(size=6) * 0.1).astype(np.float32)
    hist = margin_histogram(jnp.asarray(logits), jnp.asarray(bias), K3)
    want = hist_ref(torch.sigmoid(torch.tensor(logits)), torch.tensor(bias), 2, 16, -0.5, 0.5)
    np.testing.assert_array_equal(np.asarray(hist), want.numpy())
    stacked = jnp.stack([hist, jnp.zeros_like(hist)])   # the second layer saw nothing
    old = jnp.asarray(r.normal(size=(2, 6)), jnp.float32)
    new = np.asarray(_k3_bias(stacked, K3)(old, jnp.arange(2)))
    want_bias = bias_ref(torch.tensor(np.asarray(hist))[None], 2, 6, -0.5, 0.5)[0].numpy()
    np.testing.assert_allclose(new[0], want_bias, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new[1], np.asarray(old[1]))   # an empty histogram: kept
    raw = np.asarray(_k3_bias(stacked, dataclasses.replace(K3, k3_center=False))(
        old, jnp.arange(2)))[0]
    np.testing.assert_allclose(raw - raw.mean(), want_bias, rtol=1e-5, atol=1e-6)
    assert abs(raw.mean()) > 1e-3   # not centred
    wide = np.asarray(margin_histogram(jnp.asarray(logits), jnp.asarray(bias),
                                       dataclasses.replace(K3, k3_range=(-1.0, 1.0))))
    assert not np.array_equal(wide, np.asarray(hist))
    ema = dataclasses.replace(K3, k3_ema=0.9)
    blended = np.asarray(_k3_bias(stacked, ema)(old, jnp.arange(2)))[0]
    np.testing.assert_allclose(blended, 0.9 * np.asarray(old[0]) + 0.1 * want_bias, rtol=1e-5,
                               atol=1e-6)


def test_k3_rule_sets_the_bias_from_the_steps_histograms():
    """The train step: the expert bias is set (not stepped) from the histograms of the step's
    microbatches pooled, as Primus's finalize step does."""
    from tests.models.test_moe_step import _forward, _run
    from tests.train.test_step import model_cfg

    from jaxtrain.models.moe.step import _k3_bias
    mcfg = model_cfg(num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    mcfg = mcfg.replace(moe=dataclasses.replace(mcfg.moe, bias_rule="quantile", k3_bins=64))
    for before, after, _ in _run(mcfg, 2):
        pooled = sum(np.asarray(st["k3_hist"]) for st, _ in _forward(before, mcfg))
        old = np.asarray(before.params["moe_layers"]["moe"]["router"]["expert_bias"])
        want = _k3_bias(jnp.asarray(pooled), mcfg.moe)(jnp.asarray(old).reshape(1, -1),
                                                         jnp.arange(1))
        new = np.asarray(after.params["moe_layers"]["moe"]["router"]["expert_bias"])
        np.testing.assert_allclose(new.reshape(1, -1), np.asarray(want), rtol=1e-6)
        assert abs(float(new.mean())) < 1e-6 and np.abs(new).max() > 0


def test_k3_update_interval_pools_the_histograms_between_updates():
    """quantile_balancing_update_interval 2 (Primus's counter of global batches): batch 1
    leaves the bias and pools its histogram in the routers' k3_hist leaf (untrained, not in
    the optimizer); batch 2 sets the bias from the two batches' histograms pooled and empties
    the pool; batch 3 pools again."""
    from tests.models.test_moe_step import _forward, _run
    from tests.train.test_step import model_cfg

    from jaxtrain.models.moe.step import _k3_bias
    mcfg = model_cfg(num_layers=1, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    mcfg = mcfg.replace(moe=dataclasses.replace(mcfg.moe, bias_rule="quantile", k3_bins=64,
                                                k3_interval=2))
    router = lambda state: state.params["moe_layers"]["moe"]["router"]   # noqa: E731
    seen = []
    for n, (before, after, _) in enumerate(_run(mcfg, 3), start=1):
        seen.append(sum(np.asarray(st["k3_hist"]) for st, _ in _forward(before, mcfg)))
        old = np.asarray(router(before)["expert_bias"])
        new, pool = (np.asarray(router(after)[k]) for k in ("expert_bias", "k3_hist"))
        if n == 2:
            pooled = jnp.asarray(seen[0] + seen[1])
            want = _k3_bias(pooled, mcfg.moe)(jnp.asarray(old).reshape(1, -1), jnp.arange(1))
            np.testing.assert_allclose(new.reshape(1, -1), np.asarray(want), rtol=1e-6)
            alone = _k3_bias(jnp.asarray(seen[1]), mcfg.moe)(
                jnp.asarray(old).reshape(1, -1), jnp.arange(1))
            assert np.abs(np.asarray(alone) - np.asarray(want)).max() > 1e-4
            assert not pool.any()
        else:
            np.testing.assert_array_equal(new, old)
            np.testing.assert_array_equal(pool.reshape(seen[-1].shape), seen[-1])
        assert "k3_hist" not in str(jax.tree_util.tree_structure(after.opt_state))
