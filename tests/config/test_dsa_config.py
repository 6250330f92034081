"""DeepSeek sparse attention from its knobs: Megatron's experimental_attention_variant dsa with
the dsa_indexer_* arguments, MaxText's use_indexer with indexer_* (its deepseek3.2-671b model
file), the indexer's parameter count, and what the dry run refuses by name."""
import math

import jax
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models.params import abstract

MLA = ["hidden_size=64", "num_attention_heads=4", "num_layers=2", "vocab_size=128",
       "seq_length=32", "max_position_embeddings=32", "multi_latent_attention=true",
       "q_lora_rank=32", "kv_lora_rank=16", "qk_head_dim=16", "qk_pos_emb_head_dim=8",
       "v_head_dim=16", "bf16=false"]
DSA = ["experimental_attention_variant=dsa", "dsa_indexer_n_heads=4",
       "dsa_indexer_head_dim=16", "dsa_indexer_topk=8"]


def model(*args, file=None):
    return ModelConfig.from_config(load_config(file, [*MLA, *args]))


def test_megatron_arguments_build_the_indexer():
    cfg = model(*DSA, "dsa_indexer_loss_coeff=0.01", "dsa_indexer_use_sparse_loss=true",
                "dsa_indexer_rope_interleaved=true", "dsa_indexer_scoring_relu=false",
                "dsa_indexer_k_norm_epsilon=1e-6")
    assert (cfg.dsa_index_heads, cfg.dsa_index_head_dim, cfg.dsa_index_topk) == (4, 16, 8)
    assert cfg.dsa_loss_coeff == 0.01 and cfg.dsa_sparse_loss and not cfg.dsa_loss_layer_mean
    assert cfg.dsa_rope_interleaved and not cfg.dsa_scoring_relu
    assert cfg.dsa_k_norm_epsilon == 1e-6
    indexer = abstract(cfg)["layers"]["attn"]["indexer"]
    assert indexer["wq_b"].shape == (32, 2, 4, 16)   # [q_lora_rank, L, heads, width]
    assert indexer["wk"].shape == (64, 2, 16) and indexer["weights_proj"].shape == (64, 2, 4)
    plain = model(*DSA[1:])   # the dsa_indexer_* sizes alone switch nothing on
    assert plain.dsa_index_heads == 0
    assert model(*DSA).dsa_loss_coeff == 0.0   # Megatron's None: no indexer loss


def test_maxtext_knobs_build_the_indexer():
    cfg = model("use_indexer=true", "indexer_n_heads=2", "indexer_head_dim=16",
                "indexer_topk=4", "indexer_loss_scaling_factor=0.5",
                "indexer_sparse_training=true", "indexer_mask_exact_topk=false",
                "indexer_use_approx_top_k=true", "indexer_approx_top_k_recall=0.9")
    assert (cfg.dsa_index_heads, cfg.dsa_index_head_dim, cfg.dsa_index_topk) == (2, 16, 4)
    assert cfg.dsa_loss_coeff == 0.5 and cfg.dsa_sparse_loss and cfg.dsa_loss_layer_mean
    assert not cfg.dsa_exact_topk and cfg.dsa_approx_topk_recall == 0.9
    assert cfg.dsa_k_norm_epsilon == 1e-6   # Flax's LayerNorm default
    assert model("use_indexer=true").dsa_approx_topk_recall is None
    assert model("use_indexer=true", "mla_qk_head_chunk_size=2").dsa_head_chunk == 2
    remat = model("use_indexer=true", "remat_policy=custom", "indexer_cutoff_threshold=offload")
    assert ("indexer_cutoff_threshold", "offload") in remat.remat_tensors


def _count(m):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract(m)))


def test_maxtext_deepseek32_file_adds_the_indexers_to_deepseek3(monkeypatch, tmp_path):
    monkeypatch.delenv("MAXTEXT_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    v32 = ModelConfig.from_config(load_config("base.yml", ["model_name=deepseek3.2-671b"]))
    v3 = ModelConfig.from_config(load_config("base.yml", ["model_name=deepseek3-671b"]))
    assert (v32.dsa_index_heads, v32.dsa_index_head_dim, v32.dsa_index_topk) == (64, 128, 2048)
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert _count(v32) - _count(v3) == 61 * per_layer


@pytest.mark.parametrize("args, names", [
    (["context_parallel_size=2"], "context_parallel_size 2"),
    (["dsa_indexer_loss_coeff=0.1", "mtp_num_layers=1"], "mtp_num_layers 1"),
    (["dsa_indexer_loss_coeff=0.1", "calculate_per_token_loss=true"],
     "calculate_per_token_loss"),
    (["dsa_indexer_topk_freq=2", "mtp_num_layers=1"], "mtp_num_layers 1"),
    (["use_indexer=true"], "use_indexer"),
])
def test_refused_by_name(args, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, [*MLA, *DSA, *args])


@pytest.mark.parametrize("freq, offset, shared", [
    (1, 0, None), (2, 0, (False, True, False, True, False, True)),
    (2, 1, (False, True, False, True, False, True)),
    (3, 2, (False, False, True, True, False, True)),
    (2, 5, (False,) * 5 + (True,))])
def test_index_sharing_follows_megatrons_layer_rule(freq, offset, shared):
    """Megatron's is_dsa_skip_topk_layer: 1-based layer L reuses an earlier selection unless
    max(L - max(offset, 1), 0) is a multiple of dsa_indexer_topk_freq."""
    cfg = model(*DSA, "num_layers=6", f"dsa_indexer_topk_freq={freq}",
                f"dsa_indexer_skip_topk_offset={offset}")
    assert cfg.dsa_shared_layers == shared
    if shared:
        tree = abstract(cfg)
        assert "indexer" not in tree["dsa_shared_layers"]["attn"]
        assert tree["dsa_shared_layers"]["attn"]["wq_b"].shape[1] == sum(shared)


def test_index_sharing_matches_megatron_core():
    from tests.megatron_ref import megatron_core
    megatron_core()
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa
    if not hasattr(mdsa, "is_dsa_skip_topk_layer"):
        pytest.skip("this megatron-core has no DSA index sharing")
    for freq in (1, 2, 3):
        for offset in (0, 1, 2, 4):
            cfg = model(*DSA, "num_layers=7", f"dsa_indexer_topk_freq={freq}",
                        f"dsa_indexer_skip_topk_offset={offset}")
            want = tuple(mdsa.is_dsa_skip_topk_layer(n, offset, freq) for n in range(1, 8))
            assert (cfg.dsa_shared_layers or (False,) * 7) == want


def test_pipeline_stages_start_on_a_computing_layer():
    from jaxtrain.parallel.stages import plan

    args = [*MLA, *DSA, "num_layers=4", "dsa_indexer_topk_freq=2",
            "pipeline_model_parallel_size=2"]
    # offset 1: layers 1 and 3 compute, so the second stage (layers 3-4) starts on one
    assert plan(load_config(None, [*args, "dsa_indexer_skip_topk_offset=1"]), 4, 4) is not None
    with pytest.raises(ConfigError, match=r"stages starting at layer\(s\) \[3\]"):
        plan(load_config(None, [*args, "dsa_indexer_skip_topk_offset=2"]), 4, 4)


def test_needs_its_sizes_and_multi_latent_attention():
    with pytest.raises(ConfigError, match="dsa_indexer_n_heads"):
        model("experimental_attention_variant=dsa")
    with pytest.raises(ConfigError, match="multi_latent_attention"):
        ModelConfig.from_config(load_config(None, [*MLA, *DSA, "multi_latent_attention=false"]))


def test_hybrid_dsa_layers_equal_the_plain_dsa_model():
    """Megatron's hybrid 'D' symbol (test_dsa_gpt_mamba_equivalence): "D-D-" builds the DSA
    model's two layers as four sublayers, with the same logits."""
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.models import forward
    from jaxtrain.models.params import init

    args = [*DSA, "dsa_indexer_topk=4", "ffn_hidden_size=96", "seq_length=16"]
    plain = model(*args)
    hybrid = model(*args, "hybrid_layer_pattern=D-D-", "num_layers=4")
    assert hybrid.hybrid_layers == "*-*-" and hybrid.dsa_index_heads == 4
    params = jax.tree.map(lambda a: a * 10, init(plain, jax.random.PRNGKey(0)))
    layers = params["layers"]
    mixer = ("attn_norm", "attn")
    remapped = {**{k: v for k, v in params.items() if k != "layers"},
                "attention_layers": {k: layers[k] for k in mixer},
                "mlp_layers": {k: v for k, v in layers.items() if k not in mixer}}
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 128, (2, 16)))
    np.testing.assert_allclose(forward(remapped, toks, hybrid), forward(params, toks, plain),
                               atol=2e-5)
    with pytest.raises(ConfigError, match="mixes DSA"):
        model(*args, "hybrid_layer_pattern=D+D-", "num_layers=4")
