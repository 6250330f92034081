"""Megatron's latent MoE (moe_latent_size) from its knob: the experts' width, the projections
around them, FLOPs, and the families that cannot hold it refused on export. Logit parity with
transformers' NemotronH latent MoE is in tests/models/test_nemotron_h_hf.py, expert/tensor
parallelism in tests/models/test_moe_parallel.py."""
import jax
import numpy as np
import pytest

from jaxtrain.config import load_config
from jaxtrain.metrics import flop_terms
from jaxtrain.models import ModelConfig, forward, init, to_hf
from jaxtrain.models.params import abstract

MOE = ["hidden_size=32", "num_attention_heads=4", "num_layers=2", "vocab_size=64",
       "seq_length=16", "max_position_embeddings=16", "bf16=false", "num_experts=4",
       "moe_router_topk=2", "moe_ffn_hidden_size=24"]


def model(*args):
    return ModelConfig.from_config(load_config(None, [*MOE, *args]))


def test_latent_size_narrows_the_experts_and_adds_the_projections():
    cfg = model("moe_latent_size=12", "add_bias_linear=true")
    assert cfg.moe.latent_size == 12
    moe = abstract(cfg)["moe_layers"]["moe"]
    assert moe["experts"]["wi_0"].shape == (4, 2, 12, 24)   # [E, L, latent, F]
    assert moe["experts"]["wo"].shape == (4, 2, 24, 12)
    assert moe["latent_in"]["w"].shape == (32, 2, 12) and moe["latent_in"]["b"].shape == (12, 2)
    assert moe["latent_out"]["w"].shape == (12, 2, 32) and moe["latent_out"]["b"].shape == (32, 2)
    assert moe["router"]["w"].shape == (32, 2, 4)   # the router reads the full-width token
    plain = model()
    assert plain.moe.latent_size is None and "latent_in" not in abstract(plain)["moe_layers"]["moe"]
    toks = np.random.RandomState(0).randint(0, 64, (2, 8))
    logits = forward(init(cfg, jax.random.key(0)), toks, cfg)
    assert logits.shape == (2, 8, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_flops_count_the_narrow_experts():
    wide, narrow = model(), model("moe_latent_size=8")
    (fw, _), (fn, _) = flop_terms(wide, abstract(wide)), flop_terms(narrow, abstract(narrow))
    experts = lambda d: 3 * d * 24 * 2 / 4 * 4   # noqa: E731  wi_0, wi_1, wo: k/E of E experts
    assert fw - fn == pytest.approx(6 * 2 * (experts(32) - experts(8) - 2 * 32 * 8))


def test_export_to_a_family_without_latent_moe_is_refused(tmp_path):
    cfg = model("moe_latent_size=12")
    with pytest.raises(ValueError, match="moe.latent_size"):
        to_hf(init(cfg, jax.random.key(0)), cfg, tmp_path)


def test_bad_latent_size_is_named():
    with pytest.raises(ValueError, match="moe_latent_size"):
        model("moe_latent_size=0")
