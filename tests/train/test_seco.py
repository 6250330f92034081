"""SeCO / SpaCO (jaxtrain.seco): exact chunked gradients, SpaCO's relay scaling, the step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import models
from jaxtrain.loss import model_loss
from jaxtrain.seco import _chunk, seco_loss_and_grads, spaco_scale, spaco_selected

V, T = 96, 20


def model_cfg(**kw):
    base = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, num_layers=2, vocab_size=V, seq_length=T,
                max_position_embeddings=T, position_embedding_type="rope",
                normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
                make_vocab_size_divisible_by=1, bf16=False, dtype="float32",
                weight_dtype="float32", use_iota_embed=False)
    return models.ModelConfig.from_config({**base, **kw})


def sequence(seed=0, masked=True):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, V, size=(1, T + 1)).astype(np.int32)
    w = (rng.random((1, T)) > 0.3).astype(np.float32) if masked else np.ones((1, T), np.float32)
    w[:, -3:] = 0.0   # trailing padding
    return jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:]), jnp.asarray(w / w.sum())


def max_err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def setup():
    cfg = model_cfg()
    params = models.init(cfg, jax.random.key(0))
    tok, tgt, w = sequence()
    loss, grads = jax.value_and_grad(
        lambda p: model_loss(p, {"tokens": tok, "targets": tgt}, w, cfg)[0])(params)
    return cfg, params, tok, tgt, w, loss, grads


@pytest.mark.parametrize("chunk", [4, 7, 32])   # 7: a shorter last chunk (pgs allows it)
@pytest.mark.slow
def test_seco_equals_plain_loss_and_grads(setup, chunk):
    cfg, params, tok, tgt, w, ref_loss, ref_grads = setup
    loss, grads = jax.jit(lambda p: seco_loss_and_grads(p, tok, tgt, w, cfg, chunk))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert max_err(grads, ref_grads) < 1e-6


@pytest.mark.slow
def test_sliding_window_learned_positions_and_kv_offload_exact():
    cfg = model_cfg(sliding_window=5, position_embedding_type="learned_absolute")
    params = models.init(cfg, jax.random.key(3))
    tok, tgt, w = sequence(1, masked=False)
    ref = jax.value_and_grad(lambda p: model_loss(p, {"tokens": tok, "targets": tgt}, w,
                                                  cfg)[0])(params)
    got = jax.jit(lambda p: seco_loss_and_grads(p, tok, tgt, w, cfg, 6,
                                                kv_offload=True))(params)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    assert max_err(got[1], ref[1]) < 1e-6


def _transfers(jaxpr, depth=0, out=None):
    """(scan depth, destination memory space, shape) of every device_put in ``jaxpr``."""
    from jax.extend.core import jaxprs_in_params
    out = [] if out is None else out
    for e in jaxpr.eqns:
        if e.primitive.name == "device_put":
            out += [(depth, str(d), tuple(v.aval.shape))
                    for d, v in zip(e.params["devices"], e.invars)]
        for sub in jaxprs_in_params(e.params):
            _transfers(sub, depth + (e.primitive.name == "scan"), out)
    return out


def test_kv_offload_streams_layer_slices_and_never_the_whole_buffer(setup):
    """With seco_kv_offload the K/V buffer [L,1,T,K,H] is made in host memory and never copied
    to the device whole: each layer copies its own slice [1,T,K,H] inside the layer scan, the
    chunk's own K/V goes to the host; the only whole-buffer copies to the device are the K/V
    gradient's (k and v; kept on the device as pgs does)."""
    cfg, params, tok, tgt, w, *_ = setup
    moves = _transfers(jax.make_jaxpr(lambda p: seco_loss_and_grads(
        p, tok, tgt, w, cfg, 4, kv_offload=True))(params).jaxpr)
    buffer, layer = (2, 1, T, 2, 8), (1, T, 2, 8)
    to_device = [(d, shape) for d, where, shape in moves if "Device" in where]
    assert [shape for _, shape in to_device].count(buffer) == 2
    assert all(d >= 2 for d, shape in to_device if shape == layer) and (2, layer) in to_device
    assert (0, "MemorySpace.Host", buffer) in moves                 # the buffer made on host
    assert (1, "MemorySpace.Host", (2, 1, 4, 2, 8)) in moves        # each chunk's own K/V
    plain = _transfers(jax.make_jaxpr(lambda p: seco_loss_and_grads(
        p, tok, tgt, w, cfg, 4))(params).jaxpr)
    assert plain == []


def test_spaco_scale_and_selection():
    assert spaco_scale(8, 4) == 2.0 and spaco_scale(8, 6) == pytest.approx(8 / 6)
    assert spaco_scale(8, 2) == 2.0          # capped (pgs compensation_cap)
    assert spaco_scale(8, 0) == 1.0 and spaco_scale(4, 9) == 1.0   # exact SeCO
    a = spaco_selected(jax.random.key(5), 10, 3)
    assert int(a.sum()) == 3
    np.testing.assert_array_equal(a, spaco_selected(jax.random.key(5), 10, 3))
    assert bool(spaco_selected(jax.random.key(5), 10, 0).all())


@jax.jit
def _spaco_reference(params, tok, tgt, w, selected, s):
    """pgs's SpaCO gradient (chunks of 4) by plain autodiff through the chunk chain: a
    selected chunk's K/V reaches later chunks as sg(kv) + s·(kv − sg(kv)) (its relay scaled by
    s), an unselected chunk's as sg(kv); the objective is the selected chunks' losses."""
    from jaxtrain.seco import _kv_shapes
    cfg, chunk = model_cfg(), 4

    def total(p):
        kv = _kv_shapes(cfg, T, jnp.float32)
        out = 0.0
        for c in range(T // chunk):
            sl = slice(c * chunk, (c + 1) * chunk)
            pos = jnp.arange(c * chunk, (c + 1) * chunk, dtype=jnp.int32)[None]
            lc, own = _chunk(p, kv, tok[:, sl], pos, tgt[:, sl], w[:, sl], c * chunk, None, cfg,
                             train=False, with_loss=True, objective=None,
                             half_precision=False)
            sg = jax.lax.stop_gradient
            on = selected[c].astype(jnp.float32)
            seen = jax.tree.map(lambda o: sg(o) + on * s * (o - sg(o)), own)
            kv = jax.tree.map(lambda b, o: b.at[:, :, sl].set(o), kv, seen)
            out = out + on * lc
        return out

    return jax.grad(total)(params)


@pytest.mark.slow
def test_spaco_relays_scaled_cotangents_of_the_drawn_chunks(setup):
    cfg, params, tok, tgt, w, ref_loss, ref_grads = setup
    chunk, budget, n = 4, 3, 5
    key = jax.random.key(11)
    loss, grads = jax.jit(lambda p: seco_loss_and_grads(p, tok, tgt, w, cfg, chunk,
                                                        spaco_budget=budget, rng=key))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)   # the whole sequence's loss
    _, pick = jax.random.split(key)
    selected = spaco_selected(pick, n, budget)
    assert int(selected.sum()) == budget
    ref = _spaco_reference(params, tok, tgt, w, selected, n / budget)
    assert max_err(grads, ref) < 1e-6
    # every chunk selected, no scaling: the plain gradient (the reference is the true chain)
    assert max_err(_spaco_reference(params, tok, tgt, w, jnp.ones(n, bool), 1.0),
                   ref_grads) < 1e-6


@pytest.mark.slow
def test_spaco_own_loss_terms_average_to_t_over_k(setup):
    """t = 1 of k = 5: no relay (no other chunk is recomputed), so a draw's gradient is its
    chunk's own-loss term and the mean over the k draws is (1/k) Σ own terms: pgs's estimator
    scales only the relay, so own-loss terms enter with probability t/k (not unbiased)."""
    cfg, params, tok, tgt, w, _, _ = setup
    n = 5
    spaco = jax.jit(lambda p, k: seco_loss_and_grads(p, tok, tgt, w, cfg, 4, spaco_budget=1,
                                                     rng=k)[1])
    seen = {}
    for seed in range(200):
        key = jax.random.key(seed)
        c = int(jnp.argmax(spaco_selected(jax.random.split(key)[1], n, 1)))
        if c not in seen:
            seen[c] = spaco(params, key)
        if len(seen) == n:
            break
    assert sorted(seen) == list(range(n))
    own = [_spaco_reference(params, tok, tgt, w, jnp.arange(n) == c, 2.0) for c in range(n)]
    for c in range(n):
        assert max_err(seen[c], own[c]) < 1e-6
    mean = jax.tree.map(lambda *g: sum(g) / n, *seen.values())
    assert max_err(mean, jax.tree.map(lambda *g: sum(g) / n, *own)) < 1e-6


@pytest.mark.slow
def test_refuses_batch_above_one(setup):
    cfg, params, tok, tgt, w, _, _ = setup
    with pytest.raises(ValueError, match="one sequence"):
        seco_loss_and_grads(params, jnp.tile(tok, (2, 1)), jnp.tile(tgt, (2, 1)),
                            jnp.tile(w, (2, 1)), cfg, 4)


@pytest.mark.slow
def test_step_with_seco_equals_the_plain_step():
    from tests.train.test_step import batch, model_cfg as step_model, train_cfg
    from jaxtrain.step import init_state, make_train_step
    mcfg = step_model()
    b = batch(2, 1, seed=3)
    b["loss_mask"] = b["loss_mask"].at[1, 0, -5:].set(0.0)
    optimizer = optax.adam(1e-2)
    out = {}
    for chunk in (0, 5):
        tcfg = train_cfg(micro_batch_size=1, global_batch_size=2, num_microbatches=2,
                         seco_chunk=chunk)
        state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg,
                           jax.random.key(1))
        step = jax.jit(make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1)))
        out[chunk] = step(state, b)
    np.testing.assert_allclose(out[5][1]["loss"], out[0][1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(out[5][1]["grad_norm"], out[0][1]["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6),
                 out[5][0].params, out[0][0].params)


def test_step_refuses_batches_above_one():
    from tests.train.test_step import model_cfg as step_model, train_cfg
    from jaxtrain.config.errors import ConfigError
    from jaxtrain.step import make_train_step
    with pytest.raises(ConfigError, match="micro_batch_size 1"):
        make_train_step(step_model(), train_cfg(seco_chunk=4), optax.sgd(0.1), lambda n: 0.1)


SECO_ON = ["memory.seco=true", "memory.seco_chunk_size=8"]


@pytest.mark.parametrize("overrides, other", [
    (["micro_batch_size=2", "packing=false"], "micro_batch_size"),
    (["micro_batch_size=1", "global_batch_size=1", "packing=true"], "packing"),
    (["micro_batch_size=1", "global_batch_size=1", "packing=false",
      "data.turn_scaling=progressive"], "data.turn_scaling"),
    (["micro_batch_size=1", "global_batch_size=1", "packing=false", "plugins.cadft=true"],
     "plugins.cadft"),
    (["micro_batch_size=1", "global_batch_size=1", "packing=false",
      "memory.spaco_budget=-1"], "memory.spaco_budget"),
])
def test_bad_combinations_name_both_keys(overrides, other):
    from jaxtrain.config import load_config
    from jaxtrain.config.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, [*SECO_ON, *overrides])
    assert any("memory.seco with" in p and f"{other} =" in p
               for p in str(err.value).splitlines()), str(err.value)


def test_good_config_resolves_to_the_train_config():
    from jaxtrain.config import load_config
    from jaxtrain.train_config import TrainConfig
    cfg = load_config(None, [*SECO_ON, "memory.spaco_budget=3", "micro_batch_size=1",
                             "global_batch_size=2", "packing=false", "train_iters=100"],
                      world_size=1)
    tcfg = TrainConfig.from_config(cfg)
    assert (tcfg.seco_chunk, tcfg.spaco_budget, tcfg.num_microbatches) == (8, 3, 2)
    assert not tcfg.seco_kv_offload


def test_kv_offload_knob_moves_the_step_buffer_to_host():
    """memory.seco_kv_offload reaches the train step: its program keeps the K/V buffer in host
    memory (transfers to and from the host), and without the knob it has none."""
    from tests.train.test_step import batch, model_cfg as step_model, train_cfg
    from jaxtrain.config import load_config
    from jaxtrain.step import init_state, make_train_step
    from jaxtrain.train_config import TrainConfig
    on = TrainConfig.from_config(load_config(
        None, [*SECO_ON, "memory.seco_kv_offload=true", "micro_batch_size=1",
               "global_batch_size=1", "packing=false"], world_size=1))
    assert on.seco_kv_offload
    mcfg, optimizer = step_model(), optax.sgd(0.1)
    moves = {}
    for offload in (False, True):
        tcfg = train_cfg(micro_batch_size=1, global_batch_size=1, num_microbatches=1,
                         seco_chunk=5, seco_kv_offload=offload)
        state = init_state(models.init(mcfg, jax.random.key(0)), optimizer, tcfg,
                           jax.random.key(1))
        step = make_train_step(mcfg, tcfg, optimizer, lambda n: jnp.float32(0.1))
        moves[offload] = _transfers(jax.make_jaxpr(step)(state, batch(1, 1, seed=3)).jaxpr)
    assert moves[False] == [] and any("Host" in where for _, where, _ in moves[True])


def test_cli_exits_2_naming_both_keys(tmp_path):
    from tests.conftest import run_module
    path = tmp_path / "run.yml"
    path.write_text("hardware: cpu\nmock_data: true\nvocab_size: 64\nmicro_batch_size: 2\n"
                    "global_batch_size: 2\npacking: false\n"
                    "memory:\n  seco: true\n  seco_chunk_size: 8\n")
    result = run_module("jaxtrain.train", path, f"workspace={tmp_path}", "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "memory.seco" in result.stderr and "micro_batch_size" in result.stderr
    assert "Traceback" not in result.stderr
