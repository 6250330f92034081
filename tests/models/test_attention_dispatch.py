"""Attention dispatch: the knobs that pick an implementation, the checks that refuse one, and
the model on the flash kernel (Pallas interpreter on the CPU) against the plain-XLA model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import max_diff, random_params, tokens

import kernels.flash_attention as fa
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig, forward
from jaxtrain.models import config as model_config
from jaxtrain.models.attention import attention, dot_product_attention

FAST_COMPILE = {"xla_backend_optimization_level": 0}   # interpreted kernels compile slowly
NO_DROPOUT = {"vocab_size": 128, "attention_dropout": 0.0}


@pytest.fixture
def flash_calls(monkeypatch):
    """Counts traces through kernels.flash_attention.flash_attention (then runs it)."""
    calls = []
    real = fa.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fa, "flash_attention", spy)
    return calls


@pytest.fixture
def on_cuda(monkeypatch):
    """Make the config checks see an NVIDIA GPU (nothing is run on it)."""
    monkeypatch.setattr(model_config, "accelerator", lambda: "cuda")


@pytest.mark.slow
def test_model_on_flash_matches_xla(flash_calls):
    """GQA, RoPE, packed segments, a window, softcap and query-key layer scaling: the flash
    model's logits and parameter gradients equal the xla model's in fp32."""
    xla = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, vocab_size=97, max_position_embeddings=64,
                      sliding_window=6, attn_logit_softcapping=5.0,
                      apply_query_key_layer_scaling=True)
    flash = xla.replace(attention_impl="flash",
                        flash_block_sizes=fa.BlockSizes(block_q=16, block_k=16))
    params, toks = random_params(xla), tokens(2, 24)
    seg = jnp.asarray([[0] * 10 + [1] * 9 + [2] * 5, [0] * 3 + [1] * 21], jnp.int32)

    def run(cfg):
        def loss(p):
            logits = forward(p, toks, cfg, segment_ids=seg)
            return jnp.mean(logits ** 2), logits

        fn = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params).compile(FAST_COMPILE)
        (_, logits), grads = fn(params)
        return logits, grads

    want_logits, want_grads = run(xla)
    assert not flash_calls
    got_logits, got_grads = run(flash)
    assert len(flash_calls) == 1                          # one scanned layer body, traced once
    call = flash_calls[0]
    assert (call["sliding_window"], call["logit_softcap"]) == (6, 5.0)
    assert call["segment_ids"] is not None and call["interpret"] is None
    assert max_diff(got_logits, want_logits) <= 1e-5 * max(1.0, float(jnp.abs(want_logits).max()))
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        want = want_grads
        for key in path:
            want = want[key.key]
        bound = 1e-5 * max(1e-2, float(jnp.abs(want).max()))
        assert max_diff(g, want) <= bound, jax.tree_util.keystr(path)


@pytest.mark.parametrize("knobs,impl", [
    ({}, "xla"),
    ({"attention": "dot_product"}, "xla"),
    ({"attention": "flash"}, "flash"),
    ({"attention": "autoselected"}, "xla"),
    ({"attention": "cudnn_flash_te"}, "xla"),
    ({"attention_backend": "flash"}, "flash"),
    ({"attention_backend": "fused"}, "flash"),
    ({"attention_backend": "unfused"}, "xla"),
    ({"attention_backend": "local"}, "xla"),
    ({"attention_backend": "auto"}, "xla"),
    ({"use_flash_attn": False}, "xla"),
    ({"use_flash_attn": True}, "xla"),
    ({"transformer_impl": "local"}, "xla"),
    ({"transformer_impl": "transformer_engine"}, "xla"),
    ({"model.attn_implementation": "eager"}, "xla"),
    ({"model.attn_implementation": "sdpa"}, "xla"),
    ({"model.attn_implementation": "flash_attention_2"}, "flash"),
    ({"use_turbo_attention": True, "enable_primus_turbo": True}, "flash"),
    ({"use_turbo_attention": True}, "xla"),               # Primus: the gate is off
    ({"attention": "flash", "attention_backend": "fused", "use_flash_attn": True,
      "model.attn_implementation": "flash_attention_2", "transformer_impl": "transformer_engine"},
     "flash"),
    ({"attention": "dot_product", "attention_backend": "unfused", "use_flash_attn": False},
     "xla"),
])
def test_knob_spellings_on_cpu(knobs, impl):
    assert ModelConfig.from_config({**NO_DROPOUT, **knobs}).attention_impl == impl


@pytest.mark.parametrize("knobs,impl", [
    ({}, "flash"),
    ({"attention": "cudnn_flash_te"}, "flash"),
    ({"attention_backend": "auto", "use_flash_attn": True}, "flash"),
    ({"model.attn_implementation": "sdpa"}, "flash"),
    ({"attention_dropout": 0.1}, "xla"),                  # the kernel has no dropout
    ({"attention": "cudnn_flash_jax"}, "cudnn"),
])
def test_auto_picks_flash_on_a_gpu(on_cuda, knobs, impl):
    assert ModelConfig.from_config({**NO_DROPOUT, **knobs}).attention_impl == impl


def test_resolved_config_selects_the_kernel():
    """Through the knob registry (statuses no longer stop these knobs) and a flattened Config."""
    cfg = load_config(None, ["vocab_size=128", "attention_dropout=0", "attention_backend=flash"])
    assert ModelConfig.from_config(cfg).attention_impl == "flash"
    assert ModelConfig.from_config({**cfg}).attention_impl == "flash"
    default = load_config(None, ["vocab_size=128"])
    assert ModelConfig.from_config({**default}).attention_impl == "xla"
    with pytest.raises(ConfigError, match="attention = 'paged'.*inference-only"):
        load_config(None, ["attention=paged"])


def test_megatron_unfused_keeps_the_softmax_precision_flag():
    low = {**NO_DROPOUT, "attention_softmax_in_fp32": False}
    assert not ModelConfig.from_config({**low, "attention_backend": "unfused"}
                                       ).attention_softmax_in_fp32
    assert not ModelConfig.from_config({**low, "use_flash_attn": False}).attention_softmax_in_fp32
    assert ModelConfig.from_config({**low, "attention": "dot_product"}).attention_softmax_in_fp32
    assert ModelConfig.from_config({**low, "attention_backend": "flash"}).attention_softmax_in_fp32


@pytest.mark.parametrize("knobs,words", [
    ({"attention_backend": "flash", "use_flash_attn": False},
     ["disagree", "attention_backend = 'flash'", "use_flash_attn = False"]),
    ({"attention": "dot_product", "model.attn_implementation": "flash_attention_2"},
     ["disagree", "attention = 'dot_product'", "model.attn_implementation"]),
    ({"transformer_impl": "local", "attention_backend": "fused"},
     ["disagree", "transformer_impl = 'local'", "attention_backend = 'fused'"]),
    ({"attention": "paged"}, ["attention = 'paged'", "dot_product"]),
    ({"attention_backend": "flash", "attention_dropout": 0.1},
     ["attention_dropout = 0.1", "no dropout", "chosen by attention_backend = 'flash'"]),
    ({"attention": "cudnn_flash_jax"},
     ["needs an NVIDIA GPU", "backend here is cpu", "attention = 'cudnn_flash_jax'"]),
])
def test_refused_combinations(knobs, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_config({**NO_DROPOUT, **knobs})
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_cudnn_refuses_what_it_cannot_do(on_cuda):
    cfg = ModelConfig(dtype="bfloat16", attention_impl="cudnn")
    assert cfg.attention_impl == "cudnn"
    for changes, word in [({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
                          ({"attention_dropout": 0.1}, "attention_dropout"),
                          ({"dtype": "float32"}, "float32 inputs"),
                          ({"kv_channels": 12}, "head dim 12")]:
        with pytest.raises(ConfigError, match=word):
            cfg.replace(**changes)


def test_flash_refuses_untuned_head_dims():
    with pytest.raises(ConfigError, match="head dim 512"):
        ModelConfig(hidden_size=1024, num_attention_heads=2, attention_impl="flash")
    assert ModelConfig(hidden_size=1024, num_attention_heads=2, attention_impl="flash",
                       flash_block_sizes=fa.BlockSizes(16, 16)).head_dim == 512
    with pytest.raises(ValueError, match="flash_block_sizes"):
        ModelConfig(attention_impl="flash", flash_block_sizes=(16, 16))


def test_cudnn_call_carries_segments_and_window(monkeypatch):
    """The cuDNN branch passes segments as a mask and the window as (W-1, 0): run what it
    passes through jax.nn's XLA implementation and compare with the reference."""
    seen = []
    real = jax.nn.dot_product_attention

    def fake(*args, implementation=None, **kwargs):
        seen.append(implementation)
        return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(2, 12, 4, 8), jnp.float32)
    k, v = (jnp.asarray(rng.randn(2, 12, 2, 8), jnp.float32) for _ in range(2))
    seg = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12], jnp.int32)
    kw = dict(causal=True, segment_ids=seg, sliding_window=3, scale=0.3)
    got = attention(q, k, v, impl="cudnn", **kw)
    assert seen == ["cudnn"]
    assert max_diff(got, dot_product_attention(q, k, v, **kw)) < 1e-5
    with pytest.raises(ValueError, match="soft-capping"):
        attention(q, k, v, impl="cudnn", softcap=5.0)
    with pytest.raises(ValueError, match="no attention dropout"):
        attention(q, k, v, impl="flash", dropout_rate=0.1, dropout_rng=jax.random.key(0))
