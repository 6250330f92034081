"""Quantized MoE expert GEMMs (issue 11): the grouped GEMM's forward and backward are the
GEMMs of the quantized operands, block scales never mix two experts' rows, rows without an
expert never set an amax, delayed scaling keeps state for the expert projections, and a tiny
MoE model trains under fp8 close to its unquantized run (-m slow). EP equivalence of the quantized
experts is in tests/models/test_moe_parallel.py (-m slow)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.models import quant_state
from jaxtrain.models.moe import MoEConfig
from jaxtrain.quant import QuantConfig
from jaxtrain.quant import numerics as nx
from jaxtrain.quant.grouped import qdq_group_rows, qgrouped
from tests.quant.test_training import MARGIN, train

SIZES = jnp.array([5, 0, 9, 2], jnp.int32)          # 16 rows in groups, 4 rows past them
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TW = QuantConfig("tensorwise", "e4m3", "e4m3", "e5m2")

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _operands(k=32, n=32, m=20):
    x = jax.random.normal(jax.random.key(0), (m, k))
    w = jax.random.normal(jax.random.key(1), (SIZES.shape[0], k, n))
    return x, w


def _per_group(fn, sizes):
    """Apply fn to each group's rows (start, rows) and collect the results."""
    out, start = [], 0
    for s in np.asarray(sizes):
        out.append(fn(start, int(s)))
        start += int(s)
    return out


@pytest.mark.slow
def test_weight_gradient_blocks_restart_at_each_group():
    """mxfp8 blocks of 32 rows for the weight-gradient GEMM: each group is quantized as if
    padded to whole blocks on its own (a shared block would mix two experts' scales)."""
    sizes = jnp.array([40, 0, 7, 30], jnp.int32)
    a = jax.random.normal(jax.random.key(2), (80, 8)) * 2.0 ** (jnp.arange(80) / 4)[:, None]
    got = qdq_group_rows(a, sizes, 32, E4M3, "mxfp8")

    def one(start, rows):
        if rows == 0:
            return np.zeros((0, 8), np.float32)
        pad = -rows % 32
        part = jnp.pad(a[start:start + rows], ((0, pad), (0, 0)))
        return np.asarray(nx.qdq_blocks(part, {0: 32}, E4M3, "mxfp8"))[:rows]

    want = np.concatenate(_per_group(one, sizes))
    np.testing.assert_array_equal(np.asarray(got)[:77], want)
    # the same rows blocked straight through (ignoring groups) quantize differently
    plain = nx.qdq_blocks(jnp.pad(a, ((0, 16), (0, 0))), {0: 32}, E4M3, "mxfp8")[:80]
    assert not np.array_equal(np.asarray(plain)[:77], want)


@pytest.mark.slow
def test_tensorwise_forward_and_gradients_are_the_quantized_gemms():
    """y = Σ_g xq_g·wq_g, dx = gq·wq_gᵀ, dw_g = xq_gᵀ·gq_g with per-tensor current scales
    (e4m3 forward, e5m2 gradient), checked group by group."""
    x, w = _operands()
    live = (jnp.arange(20) < 16)[:, None]
    cot = jax.random.normal(jax.random.key(3), (20, 32))
    y, vjp = jax.vjp(lambda a, b: qgrouped(a, b, SIZES, TW), x, w)
    dx, dw = vjp(cot)

    q = lambda t, f: nx.qdq_tensor(t, f, nx.current_scale(nx.amax(t), f))  # noqa: E731
    xq, wq, gq = q(jnp.where(live, x, 0), E4M3), q(w, E4M3), q(jnp.where(live, cot, 0), E5M2)
    hi = jax.lax.Precision.HIGHEST
    ys = _per_group(lambda s, r: jnp.dot(xq[s:s + r], wq[_group(s)], precision=hi), SIZES)
    np.testing.assert_allclose(y[:16], jnp.concatenate(ys), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[16:], 0)
    dxs = _per_group(lambda s, r: jnp.dot(gq[s:s + r], wq[_group(s)].T, precision=hi), SIZES)
    np.testing.assert_allclose(dx[:16], jnp.concatenate(dxs), rtol=1e-5, atol=1e-5)
    for g, (s, r) in enumerate(_bounds(SIZES)):
        np.testing.assert_allclose(dw[g], jnp.dot(xq[s:s + r].T, gq[s:s + r], precision=hi),
                                   rtol=1e-5, atol=1e-5)


def _bounds(sizes):
    out, start = [], 0
    for s in np.asarray(sizes):
        out.append((start, int(s)))
        start += int(s)
    return out


def _group(start):
    """The group whose rows begin at ``start`` (the nonempty one)."""
    for g, (s, r) in enumerate(_bounds(SIZES)):
        if s == start and r:
            return g
    raise AssertionError(start)


@pytest.mark.slow
def test_rows_past_the_groups_never_set_the_amax():
    x, w = _operands()
    big = x.at[18].set(1e4)          # a row that belongs to no expert
    np.testing.assert_array_equal(qgrouped(big, w, SIZES, TW), qgrouped(x, w, SIZES, TW))


@pytest.mark.slow
def test_delayed_scaling_uses_the_stored_scales_and_moves_them_on():
    qc = QuantConfig("delayed", "e4m3", "e4m3", "e5m2", history_len=4)
    x, w = _operands()
    meta = {r: nx.delayed_init(4) for r in "xwg"}
    meta["x"]["scale"] = jnp.full((1,), 4.0)
    cot = jnp.ones((20, 32))
    y, vjp = jax.vjp(lambda a, b, s: qgrouped(a, b, SIZES, qc, s), x, w, meta)
    new = vjp(cot)[2]
    ax = float(jnp.max(jnp.abs(x[:16])))
    np.testing.assert_allclose(new["x"]["amax_history"], [ax, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(new["x"]["scale"], [448.0 / ax], rtol=1e-6)
    np.testing.assert_allclose(new["g"]["amax_history"][0], 1.0)
    xq = nx.qdq_tensor(jnp.where((jnp.arange(20) < 16)[:, None], x, 0), E4M3, 4.0)
    want = jax.lax.ragged_dot(xq, nx.qdq_tensor(w, E4M3, 1.0), SIZES)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qc, bound", [
    (TW, 0.06), (QuantConfig("mxfp8", "e4m3", "e4m3", "e4m3"), 0.06),
    (QuantConfig("blockwise", "e4m3", "e4m3", "e5m2"), 0.08),
    (QuantConfig("nvfp4", "e2m1", "e2m1", "e2m1"), 0.2),
    (QuantConfig("qwix", "int8", "int8", None), 0.02),
    (QuantConfig("qwix", None, "int4", None), 0.2)],
    ids=["tensorwise", "mxfp8", "blockwise", "nvfp4", "int8", "int4w"])
@pytest.mark.slow
def test_error_against_the_unquantized_grouped_gemm_is_bounded(qc, bound):
    """Relative (Frobenius) error of y, dx and dw vs lax.ragged_dot."""
    x, w = _operands(k=128, n=128)
    f = lambda a, b: qgrouped(a, b, SIZES, qc)  # noqa: E731
    ref = lambda a, b: jax.lax.ragged_dot(a, b, SIZES)  # noqa: E731
    cot = jax.random.normal(jax.random.key(4), (20, 128))
    got, want = jax.vjp(f, x, w), jax.vjp(ref, x, w)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    (y, dx, dw), (ry, rdx, rdw) = (got[0], *got[1](cot)), (want[0], *want[1](cot))
    assert 0 < rel(y, ry) < bound and 0 < rel(dx, rdx) < bound
    if qc.x is None:   # weight-only: the weight gradient passes straight through
        np.testing.assert_allclose(dw, rdw, rtol=1e-6, atol=1e-5)
    else:
        assert 0 < rel(dw, rdw) < bound


def _moe_cfg(**moe):
    return models.ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2,
                              vocab_size=64, ffn_hidden_size=64,
                              moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32,
                                            shared_expert_size=32, **moe))


def test_expert_projections_are_quantized_and_carry_state():
    cfg = _moe_cfg().replace(quant=QuantConfig("delayed", "e4m3", "e4m3", "e5m2",
                                               history_len=8))
    paths = {"/".join(p) for p in quant_state.quantized_paths(cfg)}
    assert {"moe_layers/moe/experts/wi_0", "moe_layers/moe/experts/wo",
            "moe_layers/moe/shared/wi_0", "moe_layers/attn/wq"} <= paths
    assert not any("router" in p for p in paths)
    state = quant_state.init_state(cfg)
    hist = state["moe_layers"]["moe"]["experts"]["wi_1"]["w"]["amax_history"]
    assert hist.shape == (2, 8)


@pytest.mark.parametrize("moe", [{}, dict(capacity_factor=1.0, pad_to_capacity=True)],
                         ids=["dropless", "padded"])
@pytest.mark.slow
def test_switches_reach_the_moe_stack(moe):
    """first_last_layers_bf16 over both MoE layers leaves the model unquantized; with none
    kept, the experts' GEMMs (dropless and padded buffers) change the logits."""
    cfg = _moe_cfg(**moe)
    params = models.init(cfg, jax.random.key(0))
    tokens = jnp.arange(32).reshape(2, 16) % 64

    def run(kept):
        qc = QuantConfig("tensorwise", "e4m3", "e4m3", "e5m2", bf16_start=kept[0],
                         bf16_end=kept[1])
        return models.forward(params, tokens, cfg.replace(quant=qc))

    plain = models.forward(params, tokens, cfg)
    # (padded buffers run as a grouped GEMM when quantization is configured: same math)
    np.testing.assert_allclose(run((1, 1)), plain, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(run((0, 0)) - plain)) > 1e-3


@pytest.mark.slow
def test_moe_model_trains_under_fp8_close_to_unquantized(tmp_path):
    """A tiny MoE model, fp8=hybrid with delayed scaling, 12 steps: within MARGIN of the
    unquantized run; the experts' amax histories filled."""
    moe = ["num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=32"]
    plain = train(tmp_path / "plain", *moe)
    fp8 = train(tmp_path / "fp8", *moe, "fp8=hybrid", "fp8_recipe=delayed",
                "fp8_amax_history_len=4")
    assert plain[12] < plain[1] - 0.5
    assert abs(fp8[12] - plain[12]) < MARGIN and fp8 != plain
