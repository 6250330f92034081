"""jaxtrain.ops.tiled_grouped_matmul (the CPU form of the experts' grouped matmul) equals
lax.ragged_dot, forward and backward, and does a fraction of its dense work."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.ops import grouped_matmul, tiled_grouped_matmul

CASES = [  # rows, K, N, group sizes (rows past them give zeros), tile
    (37, 8, 5, [10, 0, 20, 3], None),
    (64, 16, 8, [64], 8),
    (50, 4, 3, [1, 2, 3, 4, 5], 4),
    (20, 4, 4, [0, 0, 0], None),
    (300, 8, 6, [120, 60, 99, 21], None),
]


@pytest.mark.parametrize("M,K,N,sizes,tile,dtype",
                         [(*c, jnp.float32) for c in CASES]
                         + [(*c, jnp.bfloat16) for c in (CASES[0], CASES[4])])
@pytest.mark.slow
def test_equals_ragged_dot_forward_and_backward(M, K, N, sizes, tile, dtype):
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), K, N)), dtype)
    ct = jnp.asarray(rng.standard_normal((M, N)), dtype)
    s = jnp.asarray(sizes, jnp.int32)

    def ref(x, w):
        return jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32).astype(dtype)

    got, pull = jax.vjp(lambda x, w: tiled_grouped_matmul(x, w, s, tile), x, w)
    want, want_pull = jax.vjp(ref, x, w)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=tol, atol=tol)
    for a, b in zip(pull(ct), want_pull(ct)):
        np.testing.assert_allclose(f32(a), f32(b), rtol=tol, atol=tol * 10)
    assert not np.any(f32(got)[sum(sizes):])   # rows past the groups


@pytest.mark.slow
def test_grouped_matmul_takes_it_on_cpu_and_works_less():
    """Through jaxtrain.ops.grouped_matmul on this CPU, and (M + G·tile)·K·N multiply-adds in
    its one dot instead of ragged_dot's G·M·K·N."""
    M, K, N, G = 512, 64, 32, 4
    x, w = jnp.ones((M, K)), jnp.ones((G, K, N))
    s = jnp.asarray([200, 100, 112, 100], jnp.int32)
    np.testing.assert_allclose(grouped_matmul(x, w, s), jax.lax.ragged_dot(x, w, s))
    text = jax.jit(lambda x, w: grouped_matmul(x, w, s)).lower(x, w).as_text()
    assert "ragged_dot" not in text and "dot_general" in text
    flops = jax.jit(lambda x, w: tiled_grouped_matmul(x, w, s)).lower(x, w).compile() \
        .cost_analysis()["flops"]
    assert flops < 0.5 * 2 * G * M * K * N
