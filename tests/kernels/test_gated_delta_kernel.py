"""The Pallas kernel of the chunked gated delta rule's walk across chunks: forward and backward
against the lax.scan walk (interpreted here), the whole rule with the kernel against the
token-by-token recurrence (chunks that do and do not divide the length, packed segments,
bf16), the Gated DeltaNet layer switched to it, and its lowering to Triton for NVIDIA and AMD
(jax.export, no GPU needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gated_delta import chunk_recurrence, chunk_scan, reference
from kernels.gated_delta.scan import value_blocks
from tests.kernels.test_gated_delta import SEGMENTS, _inputs, _rel

TRITON_CALL = "__gpu$xla.gpu.triton"


def _walk_inputs(N=3, B=2, H=2, C=16, Dk=12, Dv=20, seed=0, per_channel=False):
    """Walk inputs of the shapes the preparation gives (Dk, Dv not powers of two: padded); the
    decays one per head, or one per key channel (Kimi Delta Attention)."""
    r = np.random.default_rng(seed)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return (f32(r.normal(size=(N, B, H, C, Dv))), f32(r.normal(size=(N, B, H, C, Dk)) * 0.3),
            f32(np.tril(r.normal(size=(N, B, H, C, C))) * 0.3),
            f32(r.normal(size=(N, B, H, C, Dk))), f32(r.normal(size=(N, B, H, C, Dk)) * 0.3),
            f32(r.uniform(size=(N, B, H, Dk) if per_channel else (N, B, H))),
            f32(r.normal(size=(B, H, Dk, Dv))))


def _loss(walk):
    def loss(*args):
        o, s = walk(*args)
        return jnp.sum(o * jnp.sin(o)) + jnp.sum(s * s)
    return loss


def test_few_rows_split_the_state_columns_into_blocks():
    """Few (sequence, head) rows split S's columns so that about 128 programs walk (blocks of at
    least 16 columns); many rows keep whole states."""
    assert [value_blocks(r, d) for r, d in ((4, 32), (16, 128), (64, 128), (128, 128), (1, 16),
                                            (2, 256))] == [2, 8, 2, 1, 1, 16]


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_key_channel"])
def test_walk_forward_and_backward_equal_the_scan(per_channel):
    args = _walk_inputs(per_channel=per_channel)
    assert value_blocks(2 * 2, 32) == 2  # these widths walk in two blocks of value columns
    o, s = jax.jit(chunk_scan)(*args)
    o_ref, s_ref = chunk_recurrence(*args)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    got = jax.jit(jax.grad(_loss(chunk_scan), argnums=range(7)))(*args)
    ref = jax.grad(_loss(chunk_recurrence), argnums=range(7))(*args)
    for g, g_ref in zip(got, ref):
        assert g.shape == g_ref.shape and _rel(g, g_ref) < 1e-5


rule = jax.jit(reference.chunked_gated_delta_rule, static_argnames=("chunk_size", "scan"))
truth = jax.jit(reference.recurrent_gated_delta_rule)


@pytest.mark.parametrize("chunk", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_rule_with_the_kernel_equals_the_recurrence(chunk):
    """T = 23: one chunk of 32, or a chunk of 16 and a padded one; packed segments restart the
    state (the preparation zeroes the decays the kernel carries); gradients of every input."""
    args = _inputs()
    o, s = rule(*args, segment_ids=SEGMENTS, chunk_size=chunk, scan=chunk_scan)
    o_ref, s_ref = truth(*args, segment_ids=SEGMENTS)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    w = jnp.asarray(np.random.default_rng(4).normal(size=o.shape), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(rule(*a, segment_ids=SEGMENTS, chunk_size=chunk,
                                             scan=chunk_scan)[0] * w), argnums=range(5))(*args)
    grads_ref = jax.grad(lambda *a: jnp.sum(truth(*a, segment_ids=SEGMENTS)[0] * w),
                         argnums=range(5))(*args)
    for g, g_ref in zip(grads, grads_ref):
        assert _rel(g, g_ref) < 1e-5


def test_kimi_delta_rule_with_the_kernel_equals_the_recurrence():
    """A decay per key channel (Kimi Delta Attention) through the kernel: T = 23 in chunks of
    16 with packed segments, forward and the gradients of every input."""
    from tests.kernels.test_kimi_delta import _inputs as kda_inputs

    args = kda_inputs(2)
    o, s = rule(*args, segment_ids=SEGMENTS, chunk_size=16, scan=chunk_scan)
    o_ref, s_ref = truth(*args, segment_ids=SEGMENTS)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    w = jnp.asarray(np.random.default_rng(4).normal(size=o.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(rule(*a, segment_ids=SEGMENTS, chunk_size=16,
                                                     scan=chunk_scan)[0] * w),
                             argnums=range(5)))(*args)
    grads_ref = jax.grad(lambda *a: jnp.sum(truth(*a, segment_ids=SEGMENTS)[0] * w),
                         argnums=range(5))(*args)
    for g, g_ref in zip(grads, grads_ref):
        assert g.shape == g_ref.shape and _rel(g, g_ref) < 1e-5


@pytest.mark.slow
def test_bf16_inputs_stay_close():
    args = _inputs(5)
    o_ref, _ = truth(*args)
    o, _ = rule(*(a.astype(jnp.bfloat16) for a in args), chunk_size=16, scan=chunk_scan)
    assert o.dtype == jnp.bfloat16 and _rel(o, o_ref) < 3e-2


def test_chunk_lengths_the_kernel_refuses():
    with pytest.raises(ValueError, match="powers of two of at least 16"):
        chunk_scan(*_walk_inputs(C=8))
    from jaxtrain.models import ModelConfig
    with pytest.raises(ValueError, match="linear_chunk_size.*Pallas kernel"):
        ModelConfig(num_layers=2, linear_attention_layers=(True, False), linear_chunk_size=24,
                    linear_attention_impl="pallas")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_linear_attention_impl_runs_the_kernel_in_the_model(kind):
    """linear_attention_impl pallas puts the kernel in the model's program (the knob flipped
    back, none) with the same logits, for Gated DeltaNet and Kimi Delta Attention layers."""
    from jaxtrain.models import ModelConfig, forward
    from tests.models.model_helpers import random_params, tokens

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97,
                      linear_attention_layers=(True, False), linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4 if kind == "gdn" else 2, linear_chunk_size=16,
                      linear_attention_kind=kind, linear_attention_impl="pallas")
    params = random_params(cfg)
    fwd = lambda c: jax.jit(lambda p, x: forward(p, x, c))  # noqa: E731
    toks = tokens()
    assert "gated_delta_scan_fwd" in str(jax.make_jaxpr(lambda p: forward(p, toks, cfg))(params))
    xla = cfg.replace(linear_attention_impl="xla")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda p: forward(p, toks, xla))(params))
    assert _rel(fwd(cfg)(params, toks), fwd(xla)(params, toks)) < 1e-5
    knobs = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
             "experimental_attention_variant": "gdn", "linear_attention_freq": 2,
             "gdn_chunk_size": 16, "vocab_size": 97}
    assert ModelConfig.from_config({**knobs, "linear_attention_impl": "pallas"}
                                   ).linear_attention_impl == "pallas"
    assert ModelConfig.from_config(knobs).linear_attention_impl == "xla"


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("dtype, per_channel", [(jnp.bfloat16, False), (jnp.float32, False),
                                                (jnp.bfloat16, True)])
def test_exports_triton_kernels(platform, dtype, per_channel):
    """The forward and backward walks lower through Pallas' Triton path (power-of-two tiles,
    the Triton lowering rules) at a real model's widths: chunks of 64, Dk = Dv = 128, a decay
    per head or per key channel."""
    N, B, H, C, D = 4, 1, 2, 64, 128
    shapes = ((N, B, H, C, D),) * 2 + ((N, B, H, C, C),) + ((N, B, H, C, D),) * 2 + (
        (N, B, H, D) if per_channel else (N, B, H), (B, H, D, D))
    args = [jax.ShapeDtypeStruct(s, dtype if i < 5 else jnp.float32)
            for i, s in enumerate(shapes)]
    walk = lambda *a: chunk_scan(*a, interpret=False)  # noqa: E731
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    export = lambda f: jax.export.export(jax.jit(f), platforms=[platform],  # noqa: E731
                                         disabled_checks=checks)(*args).mlir_module()
    forward = export(walk)
    backward = export(jax.grad(_loss(walk), argnums=range(7)))
    assert forward.count(TRITON_CALL) == 1 and 'name = "gated_delta_scan_fwd"' in forward
    assert backward.count(TRITON_CALL) == 2 and 'name = "gated_delta_scan_bwd"' in backward
