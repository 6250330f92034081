"""Quantized training end to end (issue 11): a tiny model trained with fp8=hybrid (delayed
scaling, emulated on CPU) and with quantization=int8 reaches the unquantized loss within a
stated margin; the fp8 state is saved, restored and continues bit-exactly; layers kept in bf16.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain import loop, models
from jaxtrain.config import load_config
from jaxtrain.logs import run_dir
from jaxtrain.models import quant_state
from jaxtrain.quant import QuantConfig

# jaxtrain's generated corpus (512-token BPE): learnable, unlike mock data
TINY = ["dataset_type=corpus", "seq_length=32", "max_position_embeddings=32", "num_layers=2",
        "hidden_size=32", "num_attention_heads=2", "swiglu=true", "micro_batch_size=4",
        "global_batch_size=8", "lr=3e-3", "lr_warmup_iters=0", "lr_decay_style=constant",
        "bf16=false", "hidden_dropout=0", "attention_dropout=0", "log_interval=1",
        "exp_name=run"]
STEPS = 12
# The quantized runs end within this much of the unquantized loss. Measured (unquantized
# 6.24 -> 5.25 at 12 steps, -> 1.62 at 100): fp8 hybrid delayed +3e-4 / -0.013, int8
# +6e-4 / -0.003, fp8 tensorwise +4e-3 / -0.010. At 200 steps in bf16 compute, the mean of
# steps 181-200 (bf16 1.0232): fp8 hybrid delayed -0.0005, int8 -0.0023.
MARGIN = 0.05


pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def train(directory, *extra, steps=STEPS, base=TINY) -> dict:
    cfg = load_config(None, [*base, f"workspace={directory}", f"train_iters={steps}", *extra],
                      world_size=1)
    loop.train(cfg)
    rows = [json.loads(line) for line in (run_dir(cfg) / "metrics.jsonl").read_text()
            .splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory):
    return train(tmp_path_factory.mktemp("plain"))


def check_close(losses, reference, steps):
    assert sorted(losses) == list(range(1, steps + 1))
    assert losses[steps] < losses[1] - 0.5  # it learned
    assert abs(losses[steps] - reference[steps]) < MARGIN
    assert losses != reference  # the quantization did change the numbers


@pytest.mark.slow
def test_fp8_hybrid_delayed_trains_saves_and_resumes_exactly(tmp_path, unquantized):
    """fp8=hybrid with the delayed recipe: within MARGIN of the unquantized run; its amax
    histories and scales are checkpointed, and a run stopped at step 6 and resumed from the
    checkpoint reproduces the uninterrupted run's losses bit for bit."""
    fp8 = ["fp8=hybrid", "fp8_recipe=delayed", "fp8_amax_history_len=8"]
    whole = train(tmp_path / "whole", *fp8, f"save={tmp_path / 'whole_ckpt'}", "save_interval=6")
    check_close(whole, unquantized, STEPS)

    saved = tmp_path / "whole_ckpt" / f"step_{STEPS}"
    meta = json.loads((saved / "meta" / "metadata").read_text())
    assert "fp8" in meta["items"]
    state = ocp.PyTreeCheckpointer().restore(saved / "fp8")
    wq = state["layers"]["attn"]["wq"]
    assert np.asarray(wq["x"]["amax_history"]).shape == (2, 8)
    assert np.all(np.asarray(wq["g"]["amax_history"]) > 0)   # 12 calls filled the ring of 8
    assert not np.allclose(np.asarray(wq["w"]["scale"]), 1.0)

    ckpt = tmp_path / "ckpt"
    train(tmp_path / "split", *fp8, f"save={ckpt}", "save_interval=6", "exit_interval=6")
    resumed = train(tmp_path / "split", *fp8, f"save={ckpt}", "save_interval=6",
                    "auto_continue_train=true")
    assert {s: resumed[s] for s in range(7, STEPS + 1)} == {
        s: whole[s] for s in range(7, STEPS + 1)}


@pytest.mark.slow
def test_int8_trains_close_to_unquantized(tmp_path, unquantized):
    check_close(train(tmp_path, "quantization=int8"), unquantized, STEPS)


BF16 = [k for k in TINY if not k.startswith("bf16=")] + ["bf16=true"]


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [["fp8=hybrid", "fp8_recipe=delayed"],
                                   ["quantization=int8"]], ids=["fp8-hybrid-delayed", "int8"])
def test_200_steps_close_to_bf16(tmp_path, knobs):
    """200 steps in bf16 compute: the quantized run's mean loss over the last 20 steps is
    within MARGIN of plain bf16's. (One step's loss after 200 bf16 steps moves by up to 0.08
    with the CPU's thread count, e.g. under pytest-xdist; the 20-step mean by < 0.005.)"""
    steps = 200
    quantized = train(tmp_path / "q", *knobs, steps=steps, base=BF16)
    plain = train(tmp_path / "plain", steps=steps, base=BF16)
    assert quantized[steps] < quantized[1] - 0.5 and quantized != plain

    def tail(losses):
        return float(np.mean([losses[s] for s in range(steps - 19, steps + 1)]))

    assert abs(tail(quantized) - tail(plain)) < MARGIN


@pytest.mark.slow
def test_first_last_layers_stay_unquantized():
    """first_last_layers_bf16 on a 2-layer model: 1 + 1 layers kept leaves nothing quantized;
    1 + 0 quantizes only the second layer."""
    cfg = models.ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64)
    params = models.init(cfg, jax.random.key(0))
    tokens = jnp.arange(16).reshape(2, 8)

    @jax.jit
    def logits(params):
        def run(kept):
            qc = None if kept is None else QuantConfig("tensorwise", "e4m3", "e4m3", "e5m2",
                                                      bf16_start=kept[0], bf16_end=kept[1])
            return models.forward(params, tokens, cfg.replace(quant=qc))
        return [run(k) for k in (None, (1, 1), (1, 0), (0, 0))]

    plain, none_quantized, second_only, both = logits(params)
    np.testing.assert_array_equal(none_quantized, plain)
    assert not np.array_equal(second_only, plain) and not np.array_equal(second_only, both)


def test_delayed_state_rides_along_the_weights():
    """The state tree mirrors the quantized weights (layer axis first) and covers every
    attention and MLP projection."""
    cfg = models.ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=64,
                             quant=QuantConfig("delayed", "e4m3", "e4m3", "e5m2",
                                               history_len=8))
    paths = quant_state.quantized_paths(cfg)
    assert sorted(paths) == sorted([("layers", "attn", w) for w in ("wq", "wk", "wv", "wo")]
                                   + [("layers", "mlp", w) for w in ("wi_0", "wi_1", "wo")])
    state = quant_state.init_state(cfg)
    shapes = jax.tree.map(lambda a: a.shape, state["layers"]["mlp"]["wo"])
    assert shapes == {r: {"amax_history": (3, 8), "scale": (3, 1)} for r in "xwg"}
    assert quant_state.init_state(cfg.replace(quant=QuantConfig("tensorwise", "e4m3", "e4m3",
                                                          "e5m2"))) is None


@pytest.mark.slow
def test_state_update_is_the_same_under_remat_and_unscanned_layers():
    """The overwrite-with-gradient update reaches every layer's slice whether the layers run
    under lax.scan, unrolled, or rematerialized."""
    qc = QuantConfig("delayed", "e4m3", "e4m3", "e5m2", history_len=4)
    cfg = models.ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2,
                             vocab_size=64, quant=qc)
    params, state = models.init(cfg, jax.random.key(0)), quant_state.init_state(cfg)
    tokens = jnp.arange(32).reshape(2, 16) % 64

    @jax.jit
    def new_states(params, state):
        def new(c):
            return jax.grad(lambda q: models.forward(params, tokens, c, quant_state=q).sum())(
                state)
        return new(cfg), new(cfg.replace(remat_policy="full", scan_layers=False))

    scanned, unrolled = new_states(params, state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), scanned, unrolled)
    hist = scanned["layers"]["attn"]["wo"]["g"]["amax_history"]
    assert np.all(np.asarray(hist[:, 0]) > 0) and np.all(np.asarray(hist[:, 1:]) == 0)
