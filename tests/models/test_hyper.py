"""Manifold-constrained hyper-connections (models/hyper.py): the DeepSeek/MaxText convention
against transformers' DeepSeek-V4 hyper-connection module, Megatron's convention against its
formulas, mHC-lite, the model with several residual streams (training, cached decoding,
recompute) and the knobs of both dialects."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_helpers import random_params, tiny, tokens
from test_decode import TOL, _greedy_by_forward

from tests.conftest import trained_rows
from jaxtrain.config import ConfigError, load_config
from jaxtrain.metrics import flop_terms
from jaxtrain.models import ModelConfig, forward, generate, to_hf
from jaxtrain.models import hyper
from jaxtrain.models.moe import MoEConfig
from jaxtrain.models.params import abstract

N, D = 3, 8


def _streams(seed=0, n=N, d=D):
    return np.random.RandomState(seed).standard_normal((2, 5, n, d)).astype(np.float32)


def _half(cfg, seed=1):
    """One half's parameters, wider than their init so that every term shows."""
    rng = np.random.RandomState(seed)
    p = {k: jnp.asarray(0.5 * rng.standard_normal(s.shape), jnp.float32)
         for k, s in hyper.specs(cfg).items() if k != "norm"}
    if cfg.hc_style == "deepseek":
        p["norm"] = {"scale": jnp.asarray(1 + 0.2 * rng.standard_normal(N * D), jnp.float32)}
    return p


def test_deepseek_convention_matches_transformers_deepseek_v4():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
    hf_cfg = DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=7, rms_norm_eps=1e-5)
    module = DeepseekV4HyperConnection(hf_cfg)
    cfg = tiny(hidden_size=D, num_attention_heads=2, num_query_groups=2, hc_streams=N,
               hc_sinkhorn_iters=7, norm_epsilon=1e-5)
    p = _half(cfg)
    p["norm"]["scale"] = jnp.ones(N * D)   # transformers' norm has no weight
    with torch.no_grad():
        module.fn.copy_(torch.tensor(np.asarray(p["w"]).T))
        module.base.copy_(torch.tensor(np.asarray(p["b"])))
        module.scale.copy_(torch.tensor(np.asarray(p["alpha"])))
        x = _streams()
        post, comb, collapsed = module(torch.tensor(x))
        out = torch.tensor(np.random.RandomState(2).standard_normal((2, 5, D)), dtype=torch.float32)
        ref = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2),
                                                                   torch.tensor(x))
    h, mix = hyper.collapse(p, jnp.asarray(x), cfg)
    np.testing.assert_allclose(np.asarray(h), collapsed.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mix[0]), post.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mix[1]), comb.transpose(-1, -2).numpy(), atol=1e-6)
    merged = hyper.merge(mix, jnp.asarray(x), jnp.asarray(out.numpy()))
    np.testing.assert_allclose(np.asarray(merged), ref.numpy(), rtol=1e-5, atol=1e-5)


def _megatron_reference(p, x, iters):
    """Megatron-LM's HyperConnectionModule in numpy, from its formulas (float64)."""
    B, T, n, d = x.shape
    flat = x.reshape(B, T, n * d).astype(np.float64)
    r = 1.0 / (np.linalg.norm(flat, axis=-1, keepdims=True) / math.sqrt(n * d) + 1e-6)
    a = np.asarray(p["alpha"], np.float64)
    gates = np.concatenate([np.full(n, a[0]), np.full(n, a[1]), np.full(n * n, a[2])])
    h = r * (flat @ np.asarray(p["w"], np.float64)) * gates + np.asarray(p["b"], np.float64)
    pre, post = 1 / (1 + np.exp(-h[..., :n])), 2 / (1 + np.exp(-h[..., n:2 * n]))
    m = h[..., 2 * n:].reshape(B, T, n, n)
    m = np.exp(m - m.max(-1, keepdims=True))
    for _ in range(iters):
        m = m / np.maximum(m.sum(-1, keepdims=True), 1e-6)
        m = m / np.maximum(m.sum(-2, keepdims=True), 1e-6)
    return (np.einsum("btn,btnd->btd", pre, x), post, m)


def test_megatron_convention_matches_its_formulas():
    cfg = tiny(hidden_size=D, num_attention_heads=2, num_query_groups=2, hc_streams=N,
               hc_style="megatron", hc_sinkhorn_iters=5)
    p = _half(cfg)
    assert "norm" not in p
    x = _streams(3)
    h, (post, res) = hyper.collapse(p, jnp.asarray(x), cfg)
    ref_h, ref_post, ref_res = _megatron_reference(p, x, 5)
    np.testing.assert_allclose(np.asarray(h), ref_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(post), ref_post, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(res), ref_res, rtol=1e-5, atol=1e-6)
    out = np.random.RandomState(4).standard_normal((2, 5, D)).astype(np.float32)
    merged = hyper.merge((post, res), jnp.asarray(x), jnp.asarray(out))
    ref = np.einsum("btij,btjd->btid", ref_res, x) + ref_post[..., None] * out[:, :, None]
    np.testing.assert_allclose(np.asarray(merged), ref, rtol=1e-5, atol=1e-5)


def test_lite_mixes_permutations_and_sinkhorn_rounds_matter():
    lite = tiny(hidden_size=D, num_attention_heads=2, num_query_groups=2, hc_streams=N,
                hc_lite=True)
    assert hyper.specs(lite)["w"].shape == (N * D, 2 * N + math.factorial(N))
    p = _half(lite)
    _, _, res = hyper.maps(p, jnp.asarray(_streams()), lite)
    np.testing.assert_allclose(np.asarray(res.sum(-1)), 1.0, atol=1e-6)   # exactly stochastic
    np.testing.assert_allclose(np.asarray(res.sum(-2)), 1.0, atol=1e-6)
    sink = lite.replace(hc_lite=False)
    q = _half(sink)
    few = hyper.maps(q, jnp.asarray(_streams()), sink.replace(hc_sinkhorn_iters=1))[2]
    many = hyper.maps(q, jnp.asarray(_streams()), sink.replace(hc_sinkhorn_iters=30))[2]
    assert float(jnp.abs(few - many).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(many.sum(-1)), 1.0, atol=1e-4)


MODELS = {
    "deepseek_mla_moe": dict(num_layers=3, hc_streams=4, multi_latent_attention=True,
                             q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                             qk_pos_emb_head_dim=4, v_head_dim=8, num_query_groups=4,
                             moe=MoEConfig(num_experts=4, topk=2, layer_freq=(0, 1, 1))),
    "megatron_dense": dict(hc_streams=2, hc_style="megatron"),
    "lite_hybrid": dict(num_layers=3, hc_streams=3, hc_lite=True, hybrid_layers="*-*"),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_cached_greedy_matches_full_forward(case):
    cfg = tiny(**MODELS[case])
    params, prompt = random_params(cfg, scale=0.2), tokens(2, 5)
    toks, logits = generate(params, cfg, prompt, 6, return_logits=True)
    ref_toks, ref_logits = _greedy_by_forward(params, cfg, prompt, 6)
    np.testing.assert_array_equal(np.asarray(toks), ref_toks)
    assert np.abs(np.asarray(logits) - ref_logits).max() <= TOL


def test_streams_change_the_model_and_reach_every_parameter():
    cfg = tiny(hc_streams=3)
    params, x = random_params(cfg, scale=0.2), tokens()
    plain = tiny()
    same = {k: v for k, v in params["layers"].items() if not k.endswith("_hc")}
    run = jax.jit(forward, static_argnums=2)  # compiled once, faster than op by op
    one = run({**params, "layers": same}, x, plain)
    assert float(jnp.abs(run(params, x, cfg) - one).max()) > 1e-3
    grads = jax.jit(jax.grad(lambda p: forward(p, x, cfg).std()))(params)
    for half in ("attn_hc", "mlp_hc"):
        for name, g in grads["layers"][half].items():
            assert float(jnp.abs(jax.tree.leaves(g)[0]).max()) > 0, (half, name)


def test_recompute_module_mhc_recomputes_the_mappings_with_the_same_gradients():
    cfg = tiny(hc_streams=2)
    params, x = random_params(cfg, scale=0.2), tokens()
    loss = (lambda c: lambda p: forward(p, x, c).std())
    again = cfg.replace(recompute_modules=("mhc",))
    g1, g2 = jax.grad(loss(cfg))(params), jax.grad(loss(again))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)
    count = (lambda c: str(jax.make_jaxpr(loss(c))(params)).count("remat"))
    assert count(cfg) == 0 and count(again) > 0
    with pytest.raises(ValueError, match="'mhc' needs hyper-connections"):
        tiny(recompute_modules=("mhc",))


def test_flops_count_the_mixing():
    cfg = tiny(hc_streams=4)
    dense, _ = flop_terms(cfg, abstract(cfg))
    base, _ = flop_terms(tiny(), abstract(tiny()))
    mapping = 6 * 2 * 2 * (4 * 32) * (2 * 4 + 16)   # 6 x (2 layers x 2 halves) x [nD, 2n+n^2]
    assert dense - base == mapping + 3 * 4 * (4 * 4 * 32 + 2 * 16 * 32)


# --------------------------------------------------------------------------- the knobs

BASE = ["hidden_size=32", "num_attention_heads=4", "num_layers=2", "vocab_size=64",
        "seq_length=16", "max_position_embeddings=16", "bf16=false"]


def model(*args):
    return ModelConfig.from_config(load_config(None, [*BASE, *args]))


def test_maxtext_and_megatron_knobs():
    mt = model("mhc_expansion_rate=4", "sinkhorn_iterations=7", "enable_mhc_lite=true")
    assert (mt.hc_streams, mt.hc_style, mt.hc_sinkhorn_iters, mt.hc_lite) == (4, "deepseek",
                                                                               7, True)
    assert model("sinkhorn_iterations=7").hc_streams == 1   # no streams, nothing to mix
    mg = model("enable_mhc_connections=true", "mhc_num_residual_streams=3",
               "mhc_sinkhorn_iterations=9", "mhc_init_gating_factor=0.5",
               "recompute_modules=[mhc]", "recompute_granularity=selective")
    assert (mg.hc_streams, mg.hc_style, mg.hc_sinkhorn_iters) == (3, "megatron", 9)
    assert "mhc" in mg.recompute_modules
    alpha = hyper.specs(mg)["alpha"].init(jax.random.key(0), (3,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(alpha), 0.5)
    assert abstract(mg)["layers"]["attn_hc"]["w"].shape == (96, 2, 15)
    assert model("mhc_num_residual_streams=3").hc_streams == 1   # the switch is off


@pytest.mark.parametrize("args, names", [
    (["mhc_expansion_rate=2", "enable_mhc_connections=true"], "set one"),
    (["enable_mhc_connections=true", "mtp_num_layers=1"], "mtp_num_layers"),
    (["enable_mhc_connections=true", "enable_mhc_lite=true", "mhc_expansion_rate=1"],
     "enable_mhc_lite"),
    (["mhc_expansion_rate=8", "enable_mhc_lite=true"], "enable_mhc_lite"),
    (["mhc_expansion_rate=2", "parallel_residual=true"], "parallel_residual"),
])
def test_refused_by_name(args, names):
    with pytest.raises((ConfigError, ValueError), match=names):
        model(*args)


def test_no_hugging_face_family_has_streams(tmp_path):
    cfg = tiny(hc_streams=2)
    with pytest.raises(ValueError, match="hc_streams"):
        to_hf(random_params(cfg), cfg, tmp_path)


def test_cli_trains_megatron_hyper_connections(tmp_path, cli):
    run = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
           "num_layers=2", "hidden_size=16", "num_attention_heads=2", "micro_batch_size=2",
           "global_batch_size=4", "lr_warmup_iters=0", "bf16=false", "log_interval=1",
           "exp_name=run", f"workspace={tmp_path}", "train_iters=3", "lr=0.01",
           "enable_mhc_connections=true", "mhc_num_residual_streams=2",
           "recompute_granularity=selective", "recompute_modules=[mhc]"]
    rows = trained_rows(cli, run, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] < rows[0]["loss"]


def test_dry_run_refuses_mtp_and_accepts_pipelines(cli):
    """The stages send the streams (tests/parallel: PP 2 x VPP 2 = PP 1); the MTP modules
    read one stream (refused with exit 2)."""
    code, _, err = cli("--dry-run", *BASE, "mhc_expansion_rate=2", "mock_data=true",
                       "mtp_num_layers=1")
    assert code == 2 and "mtp_num_layers: is not built with hyper-connections" in err
    assert "Traceback" not in err
    code, _, err = cli("--dry-run", *BASE, "mhc_expansion_rate=2", "mock_data=true",
                       "pipeline_model_parallel_size=2")
    assert code == 0, err


def test_seco_chunks_carry_the_streams():
    from jaxtrain.loss import model_loss
    from jaxtrain.seco import seco_loss_and_grads
    cfg = tiny(hc_streams=2, hc_style="megatron", max_position_embeddings=16)
    params, tok, tgt = random_params(cfg, scale=0.2), tokens(1, 12), tokens(1, 12, seed=1)
    w = jnp.full((1, 12), 1 / 12, jnp.float32)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: model_loss(p, {"tokens": tok, "targets": tgt}, w, cfg)[0]))(params)
    loss, grads = jax.jit(lambda p: seco_loss_and_grads(p, tok, tgt, w, cfg, 5))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads,
                 ref_grads)
