"""Primus's hybrid Kimi Delta Attention stacks (``spec: [..., kda_hybrid_stack_spec(_no_te)]``,
the Zebra-Llama KDA models): the M slots of the hybrid pattern become FLA's KDA layers.

No transformers model has this variant (value heads wider than key heads, twice as many value
heads as key heads, the decay's bottleneck as wide as a value head, a bias on the output gate),
so the mixer is checked against a torch transcription of Primus's ``KimiDeltaAttention.forward``
written here (token-by-token recurrence, fp32); with ``JAXTRAIN_UPSTREAM`` the gate and the
recurrence are Primus's own pure-torch functions instead (``torch_kda_gate``,
``_torch_chunk_kda_fwd``), loaded from its file.
"""
import ast
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_helpers import max_diff, random_params

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig, abstract, forward
from jaxtrain.models.linear_attention import linear_attention_block

SPEC = "spec=[primus.backends.megatron.core.models.hybrid.hybrid_mamba_mla_layer_specs,{}]"
KNOBS = ["model_type=mamba", "num_layers=4", "hybrid_layer_pattern=M-*-", "hidden_size=32",
         "num_attention_heads=4", "ffn_hidden_size=48", "vocab_size=97",
         "make_vocab_size_divisible_by=1", "seq_length=16", "max_position_embeddings=64",
         "normalization=RMSNorm", "swiglu=true", "bf16=false", "position_embedding_type=none",
         "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8",
         "linear_value_head_dim=16", "linear_conv_kernel_dim=3", "gdn_chunk_size=4",
         "norm_epsilon=1e-6"]
UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
KDA_FILE = (UPSTREAM / "primus/primus/backends/megatron/core/models/hybrid/"
            "kimi_delta_attention.py")


def kda_config(*extra, spec="kda_hybrid_stack_spec_no_te") -> ModelConfig:
    return ModelConfig.from_config(load_config(None, [*KNOBS, SPEC.format(spec), *extra]))


@pytest.fixture(scope="module")
def kda():
    cfg = kda_config()
    return cfg, random_params(cfg, seed=5, scale=0.3)


def _t(a):
    return torch.from_numpy(np.array(a, np.float32))


def _gate(a, A_log, dt_bias):
    """Primus's KDA gate: -exp(A_log) * softplus(a + dt_bias), per value head and key channel."""
    H = a.shape[-2]
    return -A_log.view(H, 1).exp() * F.softplus(a + dt_bias.view(H, -1))


def _recurrence(q, k, v, g, beta):
    """The delta rule token by token (q/k L2-normed, q scaled by D_k^-0.5): o [B,T,H,Dv]."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1)


def primus_kda(p, x, cfg, gate=_gate, rule=_recurrence):
    """Primus's KimiDeltaAttention.forward (no-TE spec, FLA's fused gated norm) in torch from
    our parameters: one input projection [q|k|v|f_a|g_a|beta], a depthwise causal conv + SiLU
    over q|k|v, key heads repeated to the value heads, the decay from f_b(f_a) through ``gate``,
    the recurrence ``rule``, RMSNorm(o)·w·sigmoid(g_b(g_a) + bias), the output projection."""
    D, Hk, Hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    P = {k: _t(v) for k, v in p.items() if k != "norm"}
    x = _t(x)
    B, T, _ = x.shape
    in_proj = torch.cat([P[n].reshape(D, -1) for n in ("wq", "wk", "wv", "wf_a", "wg_a", "wb")],
                        1)
    qkv_w = Hk * Dk * 2 + Hv * Dv
    fused = x @ in_proj
    qkv, f_a, g_a, b = torch.split(fused, [qkv_w, Dv, Dv, Hv], -1)
    conv = torch.cat([P["conv_" + n].reshape(W, -1) for n in "qkv"], 1).T[:, None, :]
    qkv = F.silu(F.conv1d(qkv.transpose(1, 2), conv, padding=W - 1, groups=qkv_w)[..., :T])
    q, k, v = torch.split(qkv.transpose(1, 2), [Hk * Dk, Hk * Dk, Hv * Dv], -1)
    q, k = (t.reshape(B, T, Hk, Dk).repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    v = v.reshape(B, T, Hv, Dv)
    g = gate((f_a @ P["wf_b"].reshape(Dv, -1)).view(B, T, Hv, Dk), P["A_log"], P["dt_bias"])
    o = rule(q, k, v, g, torch.sigmoid(b))
    z = (g_a @ P["wg_b"].reshape(Dv, -1)).view(B, T, Hv, Dv) + P["bg_b"]
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + cfg.norm_epsilon)
    o = o * _t(p["norm"]["scale"]) * torch.sigmoid(z)
    return o.reshape(B, T, -1) @ P["wo"].reshape(Hv * Dv, D)


def _stacked(params, cfg):
    """(the linear stack's name, layer 0's mixer) with the layer axis taken out properly."""
    name = next(k for k, v in params.items() if isinstance(v, dict) and "linear_attn" in v)
    mixer = jax.tree.map(lambda a: np.take(np.asarray(a), 0, axis=cfg.param_scan_axis)
                         if a.ndim > 1 else np.asarray(a)[0], params[name]["linear_attn"])
    return name, mixer


def test_the_spec_builds_fla_kda_in_the_m_slots(kda):
    cfg, params = kda
    assert cfg.hybrid_layers == "G-*-" and cfg.linear_attention_kind == "kda"
    assert (cfg.kda_decay_rank, cfg.kda_gate_bias) == (16, True)
    assert kda_config(spec="kda_hybrid_stack_spec").kda_decay_rank == 16   # TE spec: the same
    shapes = {k: v.shape for k, v in _stacked(params, cfg)[1].items() if k != "norm"}
    assert shapes["wf_a"] == (32, 16) and shapes["wf_b"] == (16, 4, 8)
    assert shapes["bg_b"] == (4, 16) and shapes["wq"] == (32, 2, 8)


def test_mixer_matches_primus_forward(kda):
    """Hv = 2 Hk, Dv = 2 Dk, the decay through a Dv-wide bottleneck, the gate's bias: the
    layer's output equals the torch transcription (fp32), and each of those changes read."""
    cfg, params = kda
    _, p = _stacked(params, cfg)
    x = np.random.default_rng(0).normal(size=(2, 9, 32)).astype(np.float32)
    ours = np.asarray(linear_attention_block(p, jnp.asarray(x), {}, cfg))
    want = primus_kda(p, x, cfg).numpy()
    assert max_diff(ours, want) < 1e-4 and np.abs(want).max() > 0.1
    no_bias = dict(p, bg_b=np.zeros_like(p["bg_b"]))
    assert max_diff(linear_attention_block(no_bias, jnp.asarray(x), {}, cfg), ours) > 1e-3


@pytest.mark.skipif(not KDA_FILE.is_file(), reason="JAXTRAIN_UPSTREAM has no Primus")
def test_mixer_against_primus_own_gate_and_recurrence(kda):
    """The same, with Primus's own torch_kda_gate and chunked pure-torch KDA
    (_torch_chunk_kda_fwd, chunks of 4 over 9 tokens) from its file."""
    tree = ast.parse(KDA_FILE.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name in ("torch_kda_gate", "_torch_chunk_kda_fwd")]
    assert len(keep) == 2
    scope = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(KDA_FILE), "exec"), scope)
    cfg, params = kda
    _, p = _stacked(params, cfg)
    x = np.random.default_rng(1).normal(size=(2, 9, 32)).astype(np.float32)
    ours = np.asarray(linear_attention_block(p, jnp.asarray(x), {}, cfg))
    want = primus_kda(
        p, x, cfg, gate=lambda a, A_log, dt: scope["torch_kda_gate"](a, A_log, dt),
        rule=lambda q, k, v, g, b: scope["_torch_chunk_kda_fwd"](
            q, k, v, g, b, chunk_size=4, use_qk_l2norm_in_kernel=True)).numpy()
    assert max_diff(ours, want) < 1e-4


def test_the_model_trains_and_decodes_like_its_forward(kda):
    """The whole hybrid (KDA, MLP, attention, MLP) decodes as its full forward."""
    from jaxtrain.models import decode

    cfg, params = kda
    toks = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 10)), jnp.int32)
    full = np.asarray(forward(params, toks, cfg))
    cache = decode.init_cache(cfg, 2, 12)
    last, cache = decode.prefill(params, cfg, toks[:, :6], cache)
    assert max_diff(last, full[:, 5]) < 1e-4
    step, _ = decode.decode_step(params, cfg, toks[:, 6:7], cache)
    assert max_diff(step, full[:, 6]) < 1e-4


def test_parameter_count_of_the_300m_shape():
    """Primus's zebra_llama_300M_kda_pure shape (12 KDA + 12 MLP sublayers, D 1024, 8 heads of
    32/64, conv 4, the Llama-3.2 vocabulary, tied): 303.5 M parameters (Primus's guide says
    0.302 B), counted from the shapes its KimiDeltaAttention builds."""
    cfg = ModelConfig.from_config(load_config(None, [
        "model_type=mamba", "num_layers=24", "is_hybrid_model=true", "hybrid_attention_ratio=0",
        SPEC.format("kda_hybrid_stack_spec_no_te"), "hidden_size=1024", "ffn_hidden_size=4096",
        "num_attention_heads=8", "vocab_size=128256", "seq_length=2048",
        "max_position_embeddings=2048", "normalization=RMSNorm", "swiglu=true",
        "position_embedding_type=none", "linear_num_key_heads=8", "linear_num_value_heads=8",
        "linear_key_head_dim=32", "linear_value_head_dim=64", "linear_conv_kernel_dim=4",
        "untie_embeddings_and_output_weights=false"]))
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract(cfg)))
    in_proj = 1024 * (2 * 256 + 512 + 64 + 64 + 8)
    kda_layer = (in_proj + 4 * 1024 + 64 * 256 + 64 * 512 + 512 + 8 + 256 + 64 + 512 * 1024
                 + 1024)
    mlp_layer = 1024 * 4096 * 3 + 1024
    assert n == 12 * (kda_layer + mlp_layer) + 128256 * 1024 + 1024
    assert round(n / 1e6, 1) == 303.5


@pytest.mark.parametrize("extra, match", [
    (["use_short_conv=false"], "use_short_conv false: Primus's KDA layers"),
    (["use_qk_norm_in_gdn=false"], "use_qk_norm_in_gdn false"),
])
def test_what_primus_kda_always_does_cannot_be_switched_off(extra, match):
    with pytest.raises(ConfigError, match=match):
        kda_config(*extra)


def test_no_hugging_face_export(kda):
    """transformers' Kimi Linear has one head count and width and no gate bias: export names
    what it cannot write."""
    from jaxtrain.models.hf import check_exportable

    cfg, _ = kda
    with pytest.raises(ValueError, match="kda_gate_bias"):
        check_exportable(cfg, "kimi_linear")


def test_cli_trains_a_tiny_kda_hybrid(tmp_path, cli):
    from tests.conftest import trained_rows

    run = ["mock_data=true", "micro_batch_size=1", "global_batch_size=2", "train_iters=3",
           "lr=0.01", "lr_warmup_iters=0", "log_interval=1", f"workspace={tmp_path}",
           "exp_name=run", *KNOBS, SPEC.format("kda_hybrid_stack_spec")]
    rows = trained_rows(cli, run, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] != rows[0]["loss"]


@pytest.mark.skipif(not KDA_FILE.is_file(), reason="JAXTRAIN_UPSTREAM has no Primus")
@pytest.mark.parametrize("name", ["zebra_llama_300M_kda_pure-pretrain",
                                  "zebra_llama_1B_kda-pretrain",
                                  "zebra_llama_1B_gdn_pure_100B-pretrain",
                                  "zebra_llama_300M_gdn_hybrid-pretrain",
                                  "zebra_llama_300M_mamba_hybrid-pretrain"])
def test_primus_zebra_experiments_dry_run(cli, name):
    """Primus's Zebra-Llama experiments dry-run, given the vocabulary size of their Hugging Face
    tokenizer (their ckpt_format torch means jaxtrain's Orbax, with a warning; use_fla_data
    without a cache directory reads Megatron's dataset, as in Primus)."""
    exp = UPSTREAM / f"primus/examples/megatron/configs/MI300X/{name}.yaml"
    code, _, err = cli("--dry-run", str(exp), "vocab_size=128256")
    assert code == 0, err
