"""Grouped GEMM kernels against lax.ragged_dot: forward, gradients, group tables, arguments.

The kernels run with interpret=None: Pallas interpret mode on CPU, the real Triton kernels
on a GPU backend (JAX_PLATFORMS=cuda or rocm). group_sizes are runtime values, so each test
compiles once per shape and dtype and then runs every group-size pattern through it:
random sizes with empty groups, one group taking every row, sum(group_sizes) < m,
sum(group_sizes) > m (groups cut at m), and all groups empty.
Tolerances, as max |kernel - reference| / max |reference|: fp32 1e-5 (and 1e-5 elementwise
relative); bf16 1e-2 and fp16 2e-3 against ragged_dot on the same values in fp32 (one
rounding of the fp32 accumulator to the output dtype).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from kernel_helpers import compile_fast

from kernels.grouped_gemm import (
    Tiling,
    grouped_matmul,
    reference_transposed_grouped_matmul,
    transposed_grouped_matmul,
    work_list,
)


def _patterns(m, g, seed=0):
    """Group-size vectors [g] covering the edge cases named in the module docstring."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, m + 1, g - 1))
    random = np.diff(np.concatenate([[0], cuts, [m]]))
    random[1] = 0  # at least one empty group
    random[-1] += m - random.sum()
    one_group = np.zeros(g, int)
    one_group[g // 2] = m
    short = np.diff(np.concatenate([[0], np.sort(rng.integers(0, m // 2, g - 1)), [m // 2]]))
    short[0] = 0
    over = np.full(g, m // (g - 1) + 1)
    over[2] = 0
    return {"random_with_empty": random, "one_group_all_rows": one_group,
            "sum_below_m": short, "sum_above_m": over, "all_empty": np.zeros(g, int)}


def _arrays(rng, dtype, *shapes):
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes]


def _gmm_and_grads(fn, **kwargs):
    """(lhs, rhs, sizes, cot) -> (out, d lhs, d rhs) through fn's VJP."""
    def run(lhs, rhs, sizes, cot):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, **kwargs), lhs, rhs)
        return (out, *vjp(cot.astype(out.dtype)))
    return run


def _ragged_dot(lhs, rhs, sizes, preferred_element_type=None):
    # HIGHEST keeps a GPU backend from using TF32 for the fp32 truth (no-op on CPU).
    return lax.ragged_dot(lhs, rhs, sizes, precision=lax.Precision.HIGHEST,
                          preferred_element_type=preferred_element_type)


def _check(got, want, tol, label):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got)), label
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, (label, err, scale)


GMM_CASES = {
    # m, k, n, g, dtype, tiling, preferred_element_type
    "fp32_small_tiles": (70, 40, 24, 6, jnp.float32, Tiling(16, 16, 16), None),
    "fp32_tuned_tiling": (100, 72, 50, 4, jnp.float32, None, None),
    "fp32_separate_tgmm_tiles": (45, 33, 70, 5, jnp.float32,
                                 Tiling(32, 16, 32, tgmm_block_m=16, tgmm_block_k=32,
                                        tgmm_block_n=16), None),
    "bf16": (64, 48, 40, 5, jnp.bfloat16, Tiling(16, 32, 16), None),
    "bf16_fp32_out": (50, 32, 20, 4, jnp.bfloat16, Tiling(32, 16, 16), jnp.float32),
    "fp16": (40, 24, 36, 4, jnp.float16, Tiling(16, 16, 32), None),
}
SLOW_CASES = {"fp32_separate_tgmm_tiles", "bf16_fp32_out", "fp16"}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in GMM_CASES])
def test_forward_and_gradients_match_ragged_dot(name):
    m, k, n, g, dtype, tiling, preferred = GMM_CASES[name]
    rng = np.random.default_rng(1)
    lhs, rhs, cot = _arrays(rng, dtype, (m, k), (g, k, n), (m, n))
    sizes0 = jnp.zeros((g,), jnp.int32)
    kernel = compile_fast(_gmm_and_grads(grouped_matmul, tiling=tiling, interpret=None,
                                         preferred_element_type=preferred),
                          lhs, rhs, sizes0, cot)
    # The truth: ragged_dot on the same values in fp32 (for fp32 inputs, ragged_dot itself).
    as32 = lambda x: x.astype(jnp.float32)
    reference = compile_fast(_gmm_and_grads(_ragged_dot), as32(lhs), as32(rhs), sizes0,
                             as32(cot))
    out_dtype = preferred or dtype
    for pattern, sizes in _patterns(m, g).items():
        sizes = jnp.asarray(sizes, jnp.int32)
        got = kernel(lhs, rhs, sizes, cot)
        want = reference(as32(lhs), as32(rhs), sizes, as32(cot))
        assert [x.dtype for x in got] == [out_dtype, dtype, dtype]
        for label, a, b in zip(["out", "d_lhs", "d_rhs"], got, want):
            _check(a, b, TOL[dtype], f"{pattern}: {label}")
            if dtype == jnp.float32:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(
                    np.max(np.abs(b)) or 1.0), err_msg=f"{pattern}: {label}")
        total = min(int(sizes.sum()), m)
        np.testing.assert_array_equal(got[0][total:], 0)  # rows in no group
        np.testing.assert_array_equal(got[1][total:], 0)


def test_transposed_grouped_matmul_and_its_gradients():
    m, k, n, g = 58, 24, 40, 5
    rng = np.random.default_rng(2)
    lhs, grad, cot = _arrays(rng, jnp.float32, (m, k), (m, n), (g, k, n))
    tiling = Tiling(16, 16, 16)

    def run(fn, **kwargs):
        def both(lhs, grad, sizes, cot):
            out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, **kwargs), lhs, grad)
            return (out, *vjp(cot))
        return compile_fast(both, lhs, grad, jnp.zeros((g,), jnp.int32), cot)

    kernel = run(transposed_grouped_matmul, tiling=tiling, interpret=None)
    reference = run(reference_transposed_grouped_matmul)
    for pattern, sizes in _patterns(m, g, seed=3).items():
        sizes = jnp.asarray(sizes, jnp.int32)
        got, want = kernel(lhs, grad, sizes, cot), reference(lhs, grad, sizes, cot)
        for label, a, b in zip(["out", "d_lhs", "d_grad"], got, want):
            _check(a, b, 1e-5, f"{pattern}: {label}")
        empty = np.asarray(sizes) == 0
        np.testing.assert_array_equal(got[0][empty], 0)


@pytest.mark.parametrize("block_m", [16, 64])
def test_work_list_stores_every_row_once(block_m):
    """Each row is stored by exactly one item, the one of its segment; items fit the bound."""
    rng = np.random.default_rng(4)
    m, g = 150, 7
    patterns = list(_patterns(m, g).values()) + [rng.integers(0, 40, g) for _ in range(20)]
    table = jax.jit(work_list, static_argnums=(1, 2))
    for sizes in patterns:
        work = jax.tree.map(np.asarray, table(jnp.asarray(sizes, jnp.int32), m, block_m))
        assert work.tile.shape == (-(-m // block_m) + g,)
        ends = np.minimum(np.cumsum(sizes), m)
        owner = np.searchsorted(ends, np.arange(m), side="right")  # g: past every group
        hits = np.zeros(m, int)
        for tile, group, lo, hi in zip(work.tile, work.group, work.lo, work.hi):
            rows = np.arange(tile * block_m, (tile + 1) * block_m)
            rows = rows[(rows >= lo) & (rows < hi)]
            assert np.all(owner[rows] == group), (sizes, group)
            hits[rows] += 1
        np.testing.assert_array_equal(hits, 1)


def test_empty_dims_give_zeros_and_bad_shapes_raise():
    out = grouped_matmul(jnp.zeros((0, 8)), jnp.ones((3, 8, 5)), jnp.zeros(3, jnp.int32))
    assert out.shape == (0, 5)
    assert transposed_grouped_matmul(jnp.ones((4, 8)), jnp.ones((4, 5)),
                                     jnp.zeros(0, jnp.int32)).shape == (0, 8, 5)
    with pytest.raises((TypeError, ValueError)):
        grouped_matmul(jnp.ones((4, 8)), jnp.ones((3, 7, 5)), jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="must be"):
        transposed_grouped_matmul(jnp.ones((4, 8)), jnp.ones((5, 5)), jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="floating point"):
        grouped_matmul(jnp.ones((4, 8), jnp.int8), jnp.ones((3, 8, 5), jnp.int8),
                       jnp.ones(3, jnp.int32))
