"""Sink attention and per-layer sliding windows: the softmax column on both attention paths,
gpt-oss parity at the attention-module level, scanned layers, the Primus knobs, HF mapping."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import SEQ, VOCAB, max_diff, random_params, tiny, tokens
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss

import kernels.flash_attention as fa
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig, forward, from_hf, to_hf
from jaxtrain.models import config as model_config
from jaxtrain.models import hf as hf_io
from jaxtrain.models import layers as L
from jaxtrain.models.attention import attention, dot_product_attention
from jaxtrain.models.transformer import attention_block

FAST_COMPILE = {"xla_backend_optimization_level": 0}
SINKS = dict(attention_sinks=True, sliding_window=5, sliding_window_layers=(True, False))


def _qkv(B=2, T=12, N=4, K=2, H=8, Hv=8, seed=0):
    rng = np.random.RandomState(seed)
    return (jnp.asarray(rng.randn(B, T, N, H), jnp.float32),
            jnp.asarray(rng.randn(B, T, K, H), jnp.float32),
            jnp.asarray(rng.randn(B, T, K, Hv), jnp.float32),
            jnp.asarray(rng.randn(N) * 2, jnp.float32))


def test_sink_column_matches_numpy():
    """softmax over [scores, sink] without the sink's column; GQA, window, causal."""
    q, k, v, sinks = _qkv()
    got = dot_product_attention(q, k, v, sliding_window=4, scale=0.3, sinks=sinks)
    qn, kn, vn, sn = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)
    s = np.einsum("btnh,bsnh->bnts", qn, kn) * 0.3
    t, j = np.arange(12)[:, None], np.arange(12)[None]
    s = np.where((j <= t) & (t - j < 4), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    sink = np.exp(sn[None, :, None] - s.max(-1))
    want = np.einsum("bnts,bsnh->btnh", e / (e.sum(-1) + sink)[..., None], vn)
    assert max_diff(got, want) < 1e-5
    assert max_diff(dot_product_attention(q, k, v, sinks=jnp.full(4, -1e9)),
                    dot_product_attention(q, k, v)) < 1e-6


def test_flash_kernel_takes_sinks_and_narrow_values():
    """The dispatch hands sinks to the Pallas kernel (interpreted) and zero-pads a narrower v
    (MLA) for it; the result equals the xla path."""
    q, k, v, sinks = _qkv(Hv=6)
    kw = dict(sliding_window=5, scale=0.25, sinks=sinks)
    want = attention(q, k, v, impl="xla", **kw)
    got = attention(q, k, v, impl="flash", block_sizes=fa.BlockSizes(16, 16), **kw)
    assert got.shape == (2, 12, 4, 6)
    assert max_diff(got, want) < 1e-5
    with pytest.raises(ValueError, match="no attention sinks"):
        attention(q, k, v, impl="cudnn", sinks=sinks)


# ------------------------------------------------------------ gpt-oss attention, per layer

def _gpt_oss_config():
    return tr.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 1000.0,
                         "original_max_position_embeddings": 16},
        attn_implementation="eager")


def test_gpt_oss_attention_parity():
    """Each layer's attention (layer 0 windowed, layer 1 full; sinks; q/k/v/o biases; YaRN)
    equals transformers' GptOssAttention fed the weights our export writes (a dense-MLP
    variant of the config: the attention alone)."""
    hfc = _gpt_oss_config()
    cfg = hf_io.config_from_hf({**hfc.to_dict(), "num_local_experts": 0})
    assert (cfg.attention_sinks, cfg.sliding_window, cfg.sliding_window_layers) == (
        True, 5, (True, False))
    assert cfg.add_bias_linear and cfg.rope_type == "yarn" and not cfg.yarn_truncate
    params = random_params(cfg, scale=0.5)
    tensors = hf_io._hf_tensors(jax.device_get(params), cfg, "gpt_oss")

    B, T = 2, SEQ
    x = np.random.RandomState(1).randn(B, T, cfg.hidden_size).astype(np.float32)
    positions = np.tile(np.arange(4, 4 + T), (B, 1))
    rotary = hf_oss.GptOssRotaryEmbedding(hfc)
    pos_t = torch.tensor(positions)
    ctx = {"segment_ids": None, "deterministic": True, "rng": None,
           "rope": L.rope_tables(jnp.asarray(positions), cfg)}
    t, s = np.arange(T)[:, None], np.arange(T)[None]
    for i, window in enumerate((5, None)):
        layer = hf_oss.GptOssAttention(hfc, i).eval()
        pre = f"model.layers.{i}.self_attn."
        layer.load_state_dict({k[len(pre):]: torch.tensor(v) for k, v in tensors.items()
                               if k.startswith(pre)})
        visible = (s <= t) & ((t - s < window) if window else True)
        mask = torch.tensor(np.where(visible, 0.0, np.finfo(np.float32).min)[None, None],
                            dtype=torch.float32).expand(B, 1, T, T)
        with torch.no_grad():
            xt = torch.tensor(x)
            ref = layer(xt, rotary(xt, pos_t), mask)[0].numpy()
        p = jax.tree.map(lambda a: jnp.take(a, i, cfg.param_scan_axis), params["layers"]["attn"])
        ours = attention_block(p, jnp.asarray(x), ctx, jnp.int32(i + 1), None, cfg)[0]
        assert max_diff(ours, ref) <= 1e-4, (i, max_diff(ours, ref))


def test_gpt_oss_full_model_parity_and_round_trip(tmp_path):
    """GptOssForCausalLM (sinks, alternating windows, YaRN, biased router, clamped-GLU experts
    with biases) against from_hf in fp32; to_hf writes a checkpoint HF reads back the same."""
    model = tr.GptOssForCausalLM(_gpt_oss_config()).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.moe.activation == "swiglu_oai" and cfg.moe.router_bias
    toks = tokens()
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(toks))).logits.numpy()
    assert max_diff(jax.jit(lambda p, x: forward(p, x, cfg))(params, toks), ref) <= 1e-4

    to_hf(params, cfg, tmp_path / "out")
    again = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(again(torch.tensor(np.asarray(toks))).logits.numpy(), ref) <= 1e-4
    cfg2, params2 = from_hf(tmp_path / "out")
    assert cfg2 == cfg
    _, bf16 = from_hf(tmp_path / "out", weight_dtype="bfloat16")
    assert bf16["moe_layers"]["attn"]["sinks"].dtype == jnp.float32          # sinks stay fp32
    assert bf16["moe_layers"]["attn"]["wq"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_unrepresentable_sink_configs_raise():
    with pytest.raises(ValueError, match="attention_bias"):
        hf_io.config_from_hf({**_gpt_oss_config().to_dict(), "attention_bias": False})
    with pytest.raises(ValueError, match="'moe'"):   # gpt-oss checkpoints are MoE
        to_hf(random_params(tiny(**SINKS)), tiny(**SINKS), "/nonexistent")
    with pytest.raises(ValueError, match="attention_sinks"):
        hf_io.hf_config(tiny(attention_sinks=True), "llama")
    with pytest.raises(ValueError, match="sliding_window_layers"):
        hf_io.hf_config(tiny(sliding_window=4, sliding_window_layers=(False, True)), "mistral")


# ------------------------------------------------------------ scanned layers

def test_per_layer_window_through_scan():
    """Scanned and unrolled layers agree (the scanned pattern is checked against HF by the
    gpt-oss model test)."""
    cfg = tiny(**{**SINKS, "sliding_window": 3})
    params, toks = random_params(cfg), tokens(2, SEQ)
    run = jax.jit(lambda p, c: forward(p, toks, c), static_argnums=1)
    assert max_diff(run(params, cfg.replace(scan_layers=False)), run(params, cfg)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_model_on_flash_matches_xla_with_sinks(scan):
    """Sinks + alternating windows (lax.cond between kernel variants inside the scan): flash
    logits and gradients, the sinks' included, equal xla's."""
    xla = tiny(**SINKS, scan_layers=scan)
    flash = xla.replace(attention_impl="flash", flash_block_sizes=fa.BlockSizes(16, 16))
    params, toks = random_params(xla), tokens(2, 24)

    def run(cfg):
        def loss(p):
            logits = forward(p, toks, cfg)
            return jnp.mean(logits ** 2), logits
        fn = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile(FAST_COMPILE)
        (_, logits), grads = fn(params)
        return logits, grads

    want, want_g = run(xla)
    got, got_g = run(flash)
    assert max_diff(got, want) <= 1e-5 * max(1.0, float(jnp.abs(want).max()))
    assert float(jnp.abs(want_g["layers"]["attn"]["sinks"]).max()) > 0
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert max_diff(g, w) <= 1e-5 * max(1e-2, float(jnp.abs(w).max()))


# ------------------------------------------------------------ Primus knobs

BASE = {"vocab_size": 128, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "attention_dropout": 0.0}


@pytest.mark.parametrize("knobs,want", [
    ({"use_sink_attention": True}, (True, None, None)),
    ({"use_sink_attention": True, "sink_sliding_window": 128},
     (True, 129, (True, False, True, False))),
    ({"use_sink_attention": True, "sink_sliding_window": 128,
      "sink_window_even_layers_only": False}, (True, 129, None)),
    ({"sink_sliding_window": 128}, (False, None, None)),   # Primus: windows only with sinks
    ({"sliding_window_size": 7, "use_sink_attention": True}, (True, 7, None)),
])
def test_primus_sink_knobs(knobs, want):
    cfg = ModelConfig.from_config({**BASE, **knobs})
    assert (cfg.attention_sinks, cfg.sliding_window, cfg.sliding_window_layers) == want
    assert ("sinks" in random_params(cfg)["layers"]["attn"]) == want[0]


def test_sink_knobs_through_the_registry():
    cfg = load_config(None, ["vocab_size=128", "num_layers=2", "use_sink_attention=true",
                             "sink_sliding_window=4", "attention_backend=flash",
                             "attention_dropout=0"])
    model = ModelConfig.from_config(cfg)
    assert model.attention_impl == "flash" and model.window_of_layer(0) == 5
    assert model.window_of_layer(1) is None


def test_refusals(monkeypatch):
    with pytest.raises(ConfigError, match="sink_sliding_window"):
        ModelConfig.from_config({**BASE, "use_sink_attention": True, "sliding_window_size": 7,
                                 "sink_sliding_window": 4})
    with pytest.raises(ValueError, match="sliding_window_layers"):
        tiny(sliding_window=4, sliding_window_layers=(True,))
    monkeypatch.setattr(model_config, "accelerator", lambda: "cuda")
    with pytest.raises(ConfigError, match="attention sinks.*attention = 'cudnn_flash_jax'"):
        ModelConfig.from_config({**BASE, "use_sink_attention": True, "dtype": "bfloat16",
                                 "attention": "cudnn_flash_jax"})
