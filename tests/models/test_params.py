"""Parameter declarations: abstract shapes, logical axes and the jitted initializer."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from model_helpers import tiny

from jaxtrain.models import abstract, init, logical_axes


def _check_declared(cfg, params):
    shapes = abstract(cfg)
    axes = logical_axes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for p, s, spec in zip(jax.tree.leaves(params), jax.tree.leaves(shapes), jax.tree.leaves(axes)):
        assert (p.shape, p.dtype) == (s.shape, s.dtype)
        assert isinstance(spec, PartitionSpec) and len(spec) == len(s.shape)
    for spec in jax.tree.leaves(axes["layers"]):
        assert spec[cfg.param_scan_axis] == "layers"


@pytest.mark.slow
def test_init_megatron_normal():
    cfg = tiny(hidden_size=128, ffn_hidden_size=256, num_layers=8, vocab_size=512,
               init_method_std=0.05, position_embedding_type="learned_absolute",
               normalization="LayerNorm", add_bias_linear=True, qk_layernorm=True)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), abstract(cfg))
    params = init(cfg, jax.random.key(0), shardings)
    _check_declared(cfg, params)
    assert params["layers"]["attn"]["wq"].shape == (128, 8, 4, 32)      # [D, L, N, H]
    assert params["layers"]["attn_norm"]["scale"].shape == (128, 8)      # [D, L]
    layers = params["layers"]
    assert abs(float(layers["attn"]["wq"].std()) - 0.05) < 0.003
    assert abs(float(params["embedding"].std()) - 0.05) < 0.003
    assert abs(float(layers["mlp"]["wo"].std()) - 0.05 / 4) < 0.001     # std / sqrt(2L)
    assert abs(float(layers["attn"]["wo"].std()) - 0.05 / 4) < 0.001
    assert float(abs(layers["attn"]["wq"][:, 0] - layers["attn"]["wq"][:, 1]).max()) > 0
    for leaf in (layers["attn_norm"]["scale"], layers["attn"]["q_norm"]["scale"]):
        np.testing.assert_array_equal(leaf, 1.0)
    for leaf in (layers["attn"]["bq"], layers["attn"]["bo"], layers["mlp"]["bi_0"],
                 layers["attn_norm"]["bias"]):
        np.testing.assert_array_equal(leaf, 0.0)


def test_init_xavier_zero_centred_norms_and_weight_dtype():
    cfg = tiny(hidden_size=64, ffn_hidden_size=192, num_layers=2, init_method_xavier_uniform=True,
               apply_layernorm_1p=True, weight_dtype="bfloat16", param_scan_axis=0)
    params = init(cfg, jax.random.key(0))
    _check_declared(cfg, params)
    assert params["layers"]["mlp"]["wi_0"].dtype == np.dtype("bfloat16")
    wi = np.asarray(params["layers"]["mlp"]["wi_0"], np.float32)        # [L, D, F]
    bound = (6 / (64 + 192)) ** 0.5
    assert 0.9 * bound < np.abs(wi).max() <= bound * 1.01     # bf16 rounding
    assert abs(wi.std() - bound / 3 ** 0.5) < 0.01
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"], np.float32), 0.0)
