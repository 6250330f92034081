"""The kernel's reference agrees with the model's attention on every feature both have."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models.attention import dot_product_attention
from kernels.flash_attention import reference_attention

# (B, T, S, Hq, Hkv, D, kwargs); every row keeps at least one visible key, since the model
# averages over fully masked rows where the reference returns zeros.
CASES = [
    (2, 12, 12, 4, 2, 8, dict(causal=True)),
    (1, 6, 14, 4, 1, 8, dict(causal=True, sliding_window=3)),
    (1, 12, 12, 6, 2, 8, dict(causal=False, sliding_window=3)),
    (2, 12, 12, 4, 4, 8, dict(causal=True, segment_ids="packed", logit_softcap=2.0)),
    (1, 12, 12, 8, 2, 16, dict(causal=False, segment_ids="packed", scale=0.3)),
    (1, 9, 9, 2, 1, 8, dict(causal=True, sliding_window=4, segment_ids="packed",
                            logit_softcap=1.5)),
]


def _model(q, k, v, *, causal, segment_ids=None, sliding_window=None, logit_softcap=None,
           scale=None):
    return dot_product_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                 sliding_window=sliding_window, softcap=logit_softcap,
                                 scale=scale)


@pytest.mark.parametrize("B, T, S, Hq, Hkv, D, kwargs", CASES)
@pytest.mark.slow
def test_reference_matches_model_attention(B, T, S, Hq, Hkv, D, kwargs):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in [(B, T, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)])
    if kwargs.get("segment_ids") == "packed":
        kwargs = {**kwargs, "segment_ids": jnp.asarray(
            (np.arange(T)[None, :] >= np.array([[T // 3], [T // 2]])[:B]).astype(np.int32))}

    @jax.jit
    def both(q, k, v):
        """(output, grads) of the reference and of the model attention."""
        def out_and_grads(attend):
            loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v, **kwargs)))
            return attend(q, k, v, **kwargs), jax.grad(loss, (0, 1, 2))(q, k, v)

        return out_and_grads(reference_attention), out_and_grads(_model)

    (ref_out, ref_grads), (model_out, model_grads) = both(q, k, v)
    np.testing.assert_allclose(ref_out, model_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(ref_grads, model_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sinks_are_a_softmax_column_without_value():
    """A sink equals an extra key whose score is the sink logit and whose value is zero."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 5, 2, 8)), jnp.float32) for _ in range(3))
    sinks = jnp.array([0.7, -1.3])
    # Key 0 is the sink: q . k0 * scale equals the sink logit per head, v0 = 0.
    k_sink = jnp.zeros((1, 1, 2, 8)).at[0, 0, :, 0].set(sinks * 8 ** 0.5)
    q, k = q.at[..., 0].set(1.0), k.at[..., 0].set(0.0)
    with_sink, explicit = jax.jit(lambda q, k, v: (
        reference_attention(q, k, v, causal=False, sinks=sinks),
        reference_attention(q, jnp.concatenate([k_sink, k], 1),
                            jnp.concatenate([jnp.zeros((1, 1, 2, 8)), v], 1), causal=False)))(
        q, k, v)
    np.testing.assert_allclose(with_sink, explicit, rtol=1e-5, atol=1e-6)
