"""Context-parallel attention (jaxtrain.parallel.context) on 4 CPU devices against the one-device
reference attention: ring (p2p), all-gather and all-to-all (Ulysses), on Megatron's
load-balanced layout, forward and gradients, with causal masks, packed segments, sliding
windows, soft-capping, sinks and attention dropout (fp32); hierarchical a2a+p2p and the ring
with the flash kernel (interpreted). Run by test_context_attention.py in a process with 8 CPU
devices (the cases marked slow with -m slow)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.models.attention import dot_product_attention
from jaxtrain.ops import key_words
from jaxtrain.parallel import context
from kernels.flash_attention import BlockSizes

CASES = {
    "causal": dict(),
    "segments": dict(segments=True),
    "window": dict(window=5),
    "softcap_sinks": dict(softcap=3.0, sinks=True),
}


def _inputs(seed=0, B=2, T=32, N=4, K=4, H=8):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)).astype(np.float32))
               for n in (N, K, K))
    seg = jnp.asarray(np.repeat(np.sort(rng.integers(0, 3, size=(B, T)), 1), 1, 0))
    sinks = jnp.asarray(rng.normal(size=(N,)).astype(np.float32))
    return q, k, v, seg, sinks


def _reference(q, k, v, seg, sinks, case):
    return dot_product_attention(q, k, v, causal=True,
                                 segment_ids=seg if case.get("segments") else None,
                                 sliding_window=case.get("window"), softcap=case.get("softcap"),
                                 sinks=sinks if case.get("sinks") else None)


# variant -> (strategy, its options, token layout): the ring on Megatron's balanced layout
# (half-block steps) and on the natural one, hierarchical a2a+p2p with all-to-all groups of 2,
# the ring's blocks by the flash kernel (interpreted; windows fall back to the XLA blocks)
VARIANTS = {
    "p2p": ("p2p", dict(balanced=True), "balanced"),
    "p2p_natural": ("p2p", {}, "natural"),
    "all_gather": ("all_gather", {}, "balanced"),
    "a2a": ("a2a", {}, "balanced"),
    "a2a+p2p": ("a2a+p2p", dict(inner=2), "balanced"),
    "p2p_kernel": ("p2p", dict(balanced=True, kernel=dict(block_sizes=BlockSizes(16, 16),
                                                          interpret=True)), "balanced"),
}


def _order(layout, T, cp):
    return context.balanced_order(T, cp) if layout == "balanced" else np.arange(T)


def _cp(variant, q, k, v, seg, sinks, case, cp=4, host=True, **options):
    strategy, opts, layout = VARIANTS[variant]
    mesh = Mesh(np.asarray(jax.devices()[:cp]), ("context",))
    B, T = q.shape[:2]
    order = _order(layout, T, cp)
    pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, T))
    lay = lambda x: x[:, order]   # noqa: E731
    fn = functools.partial(context.STRATEGIES[strategy], axis="context", causal=True,
                           window=case.get("window"), softcap=case.get("softcap"),
                           **{**opts, **options})
    seq = P(None, "context")
    use_seg = bool(case.get("segments"))

    def body(q, k, v, pos, seg, sinks):
        s = seg if use_seg else None
        return fn(q, k, v, pos, pos, s, s, sinks=sinks if case.get("sinks") else None)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, seq, seq, P()),
                            out_specs=seq, check_vma=False)
    if not host:   # traced (under grad): the layout's gathers and the shard_map as they are
        return sharded(lay(q), lay(k), lay(v), pos, lay(seg), sinks)[:, np.argsort(order)]
    put = lambda x: jax.device_put(x, NamedSharding(mesh, seq))   # noqa: E731
    out = jax.jit(sharded)(put(lay(q)), put(lay(k)), put(lay(v)), put(pos), put(lay(seg)), sinks)
    return np.asarray(out)[:, np.argsort(order)]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "p2p_kernel"])
def test_dropout_draws_the_one_device_mask(variant):
    """Attention dropout: every block drops the probabilities the unsplit attention drops with
    the same key (the mask hashes global rows, heads and token indices); forward and, for the
    ring, gradients."""
    q, k, v, seg, sinks = _inputs(4)
    B, N = q.shape[0], q.shape[2]
    case, key = dict(segments=True, sinks=True), jax.random.key(7)
    drop = context.Dropout(0.3, key_words(key), jnp.arange(B), jnp.arange(N))
    w = jnp.asarray(np.random.default_rng(5).normal(size=q.shape).astype(np.float32))

    def ref(q, k, v):
        return dot_product_attention(q, k, v, segment_ids=seg, sinks=sinks, dropout_rate=0.3,
                                     dropout_rng=key)

    want = np.asarray(ref(q, k, v))
    np.testing.assert_allclose(_cp(variant, q, k, v, seg, sinks, case, dropout=drop), want,
                               rtol=2e-5, atol=2e-5)
    undropped = np.asarray(_reference(q, k, v, seg, sinks, case))
    assert np.abs(want - undropped).max() > 0.1   # the mask drops something
    if variant == "p2p":
        def cp_loss(q, k, v):
            return jnp.sum(jnp.asarray(_cp(variant, q, k, v, seg, sinks, case, dropout=drop,
                                           host=False)) * w)
        got = jax.jit(jax.grad(cp_loss, argnums=(0, 1, 2)))(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(got, grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _slow_pairs():
    """By default every variant runs the segments case; plain causal, the window (also in the
    gradient and eight-device cases) and soft-cap with sinks run with -m slow."""
    def slow(c, v):
        return c != "segments"
    return [pytest.param(c, v, marks=pytest.mark.slow) if slow(c, v) else (c, v)
            for c in CASES for v in VARIANTS]


@pytest.mark.parametrize("case, variant", _slow_pairs())
def test_forward_matches_one_device(variant, case):
    q, k, v, seg, sinks = _inputs()
    want = np.asarray(_reference(q, k, v, seg, sinks, CASES[case]))
    got = _cp(variant, q, k, v, seg, sinks, CASES[case])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant, cp, inner", [pytest.param("p2p", 8, None,
                                                             marks=pytest.mark.slow),
                                                ("a2a+p2p", 8, 4), ("a2a+p2p", 8, 2)])
def test_eight_devices(variant, cp, inner):
    """The balanced ring at CP 8, and both hierarchical splits of 8 (4 x 2, 2 x 4), with
    segments, a window and sinks."""
    q, k, v, seg, sinks = _inputs(3, N=8, K=8)
    case = dict(segments=True, window=11, sinks=True)
    want = np.asarray(_reference(q, k, v, seg, sinks, case))
    got = _cp(variant, q, k, v, seg, sinks, case, cp=cp, **({} if inner is None else
                                                             dict(inner=inner)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow)
                                     if v == "p2p_natural" else v for v in VARIANTS])
def test_gradients_match_one_device(variant):
    """dq, dk, dv through the ring's transpose (K/V cotangents travel back), the all-gather's
    reduce-scatter and the all-to-alls, with segments and a window."""
    q, k, v, seg, sinks = _inputs(1)
    case = dict(segments=True, window=9)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape).astype(np.float32))

    def ref_loss(q, k, v):
        return jnp.sum(_reference(q, k, v, seg, sinks, case) * w)

    def cp_loss(q, k, v):
        cp = 4
        strategy, opts, layout = VARIANTS[variant]
        mesh = Mesh(np.asarray(jax.devices()[:cp]), ("context",))
        order = _order(layout, q.shape[1], cp)
        pos = jnp.broadcast_to(jnp.asarray(order, jnp.int32), q.shape[:2])
        seq = P(None, "context")
        fn = functools.partial(context.STRATEGIES[strategy], axis="context", causal=True,
                               window=case["window"], **opts)
        out = jax.shard_map(lambda q, k, v, p, s: fn(q, k, v, p, p, s, s), mesh=mesh,
                            in_specs=(seq,) * 5, out_specs=seq, check_vma=False)(
            q[:, order], k[:, order], v[:, order], pos, seg[:, order])
        return jnp.sum(out * w[:, order])

    want = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(cp_loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_balanced_order_and_bad_sizes():
    order = context.balanced_order(16, 2)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="2 x 3 equal chunks"):
        context.balanced_order(16, 3)
    q, k, v, seg, sinks = _inputs(K=2)
    with pytest.raises(ValueError, match="divide by the all-to-all size 4"):
        _cp("a2a", q, k, v, seg, sinks, {})
    with pytest.raises(ValueError, match="divide by the all-to-all size 4"):
        _cp("a2a+p2p", q, k, v, seg, sinks, {}, inner=4)


def test_balanced_ring_does_half_of_each_later_block():
    """On the load-balanced layout each ring step after the first attends half a block (the
    other half is hidden by the causal mask): the compiled ring's FLOPs fall to about
    (1 + (cp - 1) / 2) / cp of the plain ring's (0.625 at CP 4)."""
    cp, B, T, N, H = 4, 1, 256, 2, 16
    mesh = Mesh(np.asarray(jax.devices()[:cp]), ("context",))
    x = jnp.ones((B, T, N, H))
    pos = jnp.broadcast_to(jnp.asarray(context.balanced_order(T, cp)), (B, T))
    seq = P(None, "context")

    def flops(balanced):
        fn = functools.partial(context.ring_attention, axis="context", balanced=balanced)
        f = jax.shard_map(lambda q, k, v, p: fn(q, k, v, p, p), mesh=mesh, in_specs=(seq,) * 4,
                          out_specs=seq, check_vma=False)
        return jax.jit(f).lower(x, x, x, pos).compile().cost_analysis()["flops"]

    assert flops(True) / flops(False) == pytest.approx(0.625, abs=0.03)


@pytest.mark.parametrize("window, expected", [(None, True), (5, False)])
def test_the_ring_attends_with_the_kernel_unless_windowed(window, expected):
    q, k, v, seg, sinks = _inputs()
    cp, T = 4, q.shape[1]
    mesh = Mesh(np.asarray(jax.devices()[:cp]), ("context",))
    pos = jnp.broadcast_to(jnp.asarray(context.balanced_order(T, cp)), q.shape[:2])
    fn = functools.partial(context.ring_attention, axis="context", balanced=True, window=window,
                           kernel=dict(block_sizes=BlockSizes(16, 16), interpret=True))
    seq = P(None, "context")
    f = jax.shard_map(lambda q, k, v, p: fn(q, k, v, p, p), mesh=mesh, in_specs=(seq,) * 4,
                      out_specs=seq, check_vma=False)
    assert ("pallas_call" in str(jax.make_jaxpr(f)(q, k, v, pos))) == expected
