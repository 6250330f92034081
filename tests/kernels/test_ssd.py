"""Mamba-2's state-space scan: the chunked form against the token-by-token recurrence (forward
and backward, fp32 tight, bf16 loose), chunk lengths that do and do not divide the length, an
initial state, packed segments against each sequence run alone, and the recurrence against
transformers' own Mamba-2 step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.ssd import reference

chunked_ssd = jax.jit(reference.chunked_ssd, static_argnames=("chunk_size",))
recurrent_ssd = jax.jit(reference.recurrent_ssd)

B, T, H, P, G, N = 2, 23, 4, 6, 2, 5
SEGMENTS = np.array([[1] * 7 + [2] * 9 + [3] * 7, [4] * 2 + [5] * 21])


def _inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, H, P))
    dt = np.log1p(np.exp(rng.normal(size=(B, T, H))))          # softplus: positive steps
    A = -np.exp(rng.uniform(-1, 1, size=H))
    Bm, Cm = rng.normal(size=(B, T, G, N)), rng.normal(size=(B, T, G, N))
    return tuple(jnp.asarray(a, dtype if a.ndim > 1 else np.float32)
                 for a in (x, dt, A, Bm, Cm))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


@pytest.mark.parametrize("chunk, segments", [(1, True), (4, False), (5, True), (8, True),
                                             (64, False)])
def test_chunked_equals_recurrent(chunk, segments):
    args = _inputs()
    seg = SEGMENTS if segments else None
    s0 = jnp.asarray(np.random.default_rng(3).normal(size=(B, H, P, N)), jnp.float32)
    y_ref, s_ref = recurrent_ssd(*args, segment_ids=seg, initial_state=s0)
    y, s = chunked_ssd(*args, segment_ids=seg, initial_state=s0, chunk_size=chunk)
    assert _rel(y, y_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


def test_gradients_equal_the_recurrence():
    """d(sum(y * w) + sum(state * v)) for every input, the initial state included."""
    args = _inputs(2)
    rng = np.random.default_rng(4)
    s0 = jnp.asarray(rng.normal(size=(B, H, P, N)), jnp.float32)
    wy, ws = rng.normal(size=(B, T, H, P)), rng.normal(size=(B, H, P, N))

    def loss(fn, *a):
        y, s = fn(*a[:5], segment_ids=SEGMENTS, initial_state=a[5])
        return jnp.sum(y * wy) + jnp.sum(s * ws)

    ref = jax.grad(lambda *a: loss(recurrent_ssd, *a), argnums=tuple(range(6)))(*args, s0)
    got = jax.grad(lambda *a: loss(lambda *b, **k: chunked_ssd(*b, chunk_size=5, **k), *a),
                   argnums=tuple(range(6)))(*args, s0)
    for name, g, r in zip(("x", "dt", "A", "B", "C", "state"), got, ref):
        assert _rel(g, r) < 1e-4, name


def test_bfloat16_inputs_stay_close():
    args32 = _inputs(5)
    args16 = tuple(a.astype(jnp.bfloat16) if a.ndim > 1 else a for a in args32)
    y_ref, _ = recurrent_ssd(*args32)
    y, _ = chunked_ssd(*args16, chunk_size=8)
    assert y.dtype == jnp.bfloat16 and _rel(y, y_ref) < 3e-2


def test_segments_restart_the_state():
    """Each packed sequence's outputs equal the recurrence over that sequence alone."""
    args = _inputs(1)
    y, _ = chunked_ssd(*args, segment_ids=SEGMENTS, chunk_size=4)
    for b in range(B):
        for s in np.unique(SEGMENTS[b]):
            m = SEGMENTS[b] == s
            alone, _ = recurrent_ssd(*(a[b:b + 1, m] if a.ndim > 1 else a for a in args))
            assert _rel(y[b:b + 1, m], alone) < 1e-5
    whole, _ = chunked_ssd(*args, chunk_size=4)
    assert _rel(y, whole) > 1e-2   # without segments the sequences mix


def test_recurrence_matches_transformers_step():
    """One token of the recurrence equals transformers' Mamba-2 state update (with a state)."""
    torch = pytest.importorskip("torch")
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_selective_state_update
    x, dt, A, Bm, Cm = _inputs(6)
    rng = np.random.default_rng(7)
    s0 = rng.normal(size=(B, H, P, N)).astype(np.float32)
    y, s = recurrent_ssd(x[:, :1], dt[:, :1], A, Bm[:, :1], Cm[:, :1],
                         initial_state=jnp.asarray(s0))
    state = torch.tensor(s0)
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    out = mamba2_selective_state_update(
        state, t(x[:, 0]), t(dt[:, 0])[..., None].expand(-1, -1, P),
        t(A)[:, None, None].expand(-1, P, N), t(Bm[:, 0]), t(Cm[:, 0]))
    assert _rel(y[:, 0], out.numpy()) < 1e-5 and _rel(s, state.numpy()) < 1e-5


def test_state_dtype_rounds_the_states_entering_each_chunk():
    """mamba_ssm's state_dtype (Megatron's mamba_training_ssm_states_dtype): the states read at
    each chunk's start are stored in it, the carry across chunks and the final state stay
    float32; float32 changes nothing."""
    args = _inputs(6)
    y32, s32 = chunked_ssd(*args, chunk_size=4)
    y_f, s_f = reference.chunked_ssd(*args, chunk_size=4, state_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y_f), np.asarray(y32))
    y16, s16 = reference.chunked_ssd(*args, chunk_size=4, state_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(s16), np.asarray(s32))
    assert 1e-5 < _rel(y16, y32) < 3e-2
    one, _ = reference.chunked_ssd(*args, chunk_size=T, state_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(chunked_ssd(*args, chunk_size=T)[0]))
