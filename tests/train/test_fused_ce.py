"""jaxtrain.fused_ce: the output layer + cross-entropy whose gradient is computed in the forward
equals differentiating the plain loss (value and every gradient), whole or chunked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.fused_ce import head_loss, head_params
from jaxtrain.loss import model_loss, row_losses

V, D, B, T = 97, 16, 2, 12


def _cfg(**kw):
    return models.ModelConfig(vocab_size=V, hidden_size=D, num_layers=1, num_attention_heads=2,
                              ffn_hidden_size=32, **kw)


def _inputs(cfg):
    params = models.init(cfg, jax.random.key(0))
    params = jax.tree.map(lambda w: 4.0 * w, params)   # wider than init: errors show
    k = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(k[0], (B, T, D))
    targets = jax.random.randint(k[1], (B, T), 0, V)
    weights = jax.random.uniform(k[2], (B, T)) * (jnp.arange(T) % 5 != 0)
    return params, hidden, targets, weights


@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("variant", [{}, {"untie_embeddings_and_output_weights": False},
                                     {"final_logit_softcapping": 3.0}])
@pytest.mark.slow
def test_value_and_gradients_equal_the_plain_loss(chunks, variant):
    cfg = _cfg(**variant)
    params, hidden, targets, weights = _inputs(cfg)

    def plain(p, h, w):
        return 2.5 * jnp.sum(row_losses(p, h, targets, w, cfg)[0])

    def fused(p, h, w):
        return 2.5 * head_loss(head_params(p, cfg), h, targets, w, cfg, chunks)

    want, want_grads = jax.value_and_grad(plain, argnums=(0, 1, 2))(params, hidden, weights)
    got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(
        params, hidden, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = want_grads
        for key in path:
            w = w[key.idx if hasattr(key, "idx") else key.key]
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert jnp.any(got_grads[1] != 0) and jnp.any(got_grads[2] != 0)


@pytest.mark.slow
def test_fp16_cross_entropy_matches():
    cfg = _cfg()
    params, hidden, targets, weights = _inputs(cfg)
    plain = jnp.sum(row_losses(params, hidden, targets, weights, cfg, half_precision=True)[0])
    fused = head_loss(head_params(params, cfg), hidden, targets, weights, cfg, 4, True)
    exact = head_loss(head_params(params, cfg), hidden, targets, weights, cfg, 4, False)
    np.testing.assert_allclose(fused, plain, rtol=1e-6)
    assert fused != exact


@pytest.mark.parametrize("chunks", [0, 4, 5])
@pytest.mark.slow
def test_model_loss_gradient_in_forward_equals_autodiff(chunks):
    """The train step's path (grad_in_forward) against autodiff through the chunked or whole
    loss: a chunk count that does not divide T takes the largest one that does."""
    cfg = _cfg()
    params, _, targets, weights = _inputs(cfg)
    micro = {"tokens": jax.random.randint(jax.random.key(2), (B, T), 0, V), "targets": targets}

    def loss(p, fused):
        return model_loss(p, micro, weights, cfg, num_chunks=chunks, grad_in_forward=fused)[0]

    want, want_g = jax.value_and_grad(loss)(params, False)
    got, got_g = jax.value_and_grad(loss)(params, True)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got_g, want_g)


def _count(jaxpr, name: str) -> int:
    """How many times primitive ``name`` runs in a jaxpr (scan bodies times their length)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += times * _count(inner, name)
    return total


@pytest.mark.slow
def test_no_logits_recompute_and_no_scatter():
    """What it is for: the fused gradient runs three V-sized matmuls per chunk (autodiff of
    the checkpointed chunks runs four: the logits again) and no scatter."""
    cfg = _cfg()
    params, hidden, targets, weights = _inputs(cfg)

    def fused(p, h):
        return head_loss(head_params(p, cfg), h, targets, weights, cfg, 4)

    def chunked(p, h):
        return jnp.sum(row_losses(p, h, targets, weights, cfg, num_chunks=4)[0])

    def counts(f):
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(params, hidden).jaxpr
        return _count(jaxpr, "dot_general"), _count(jaxpr, "scatter-add")

    assert counts(fused) == (12, 0)
    assert counts(chunked) == (16, 4)
