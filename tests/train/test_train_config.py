"""Training knobs reach the loop's own config (and, for precision, the model's)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.config import load_config
from jaxtrain.loss import token_nll
from jaxtrain.train_config import TrainConfig


def tcfg(*overrides, world_size=2):
    cfg = load_config(None, ["global_batch_size=8", "micro_batch_size=2", *overrides],
                      world_size=world_size, enforce_status=False)
    return TrainConfig.from_config(cfg)


@pytest.mark.parametrize("override, field, default, flipped", [
    ("calculate_per_token_loss=true", "per_token_loss", False, True),
    ("fp16_lm_cross_entropy=true", "half_precision_loss", False, True),
    ("grad_reduce_in_bf16=true", "accum_dtype", "float32", "bfloat16"),
    ("check_for_nan_in_loss_and_grad=false", "check_nan", True, False),
    ("check_for_spiky_loss=true", "check_spiky_loss", False, True),
    ("check_for_large_grads=true", "check_large_grads", False, True),
    ("--train.spike_detection=true", "spike_detection", False, True),
    ("--train.spike_z_threshold=3", "spike_z_threshold", 5.0, 3.0),
    ("exit_interval=7", "exit_interval", None, 7),
    ("exit_duration_in_mins=9", "exit_duration_in_mins", None, 9),
    ("exit_signal_handler=true", "exit_signal_handler", False, True),
    ("seed=5", "seed", 1234, 5),
    ("memory.loss_num_chunks=4", "loss_chunks", 8, 4),
    ("--memory.chunked_loss=false", "loss_chunks", 8, 0),
    ("train_samples=64", "train_samples", None, 64),
    ("manual_gc=true", "manual_gc", False, True),
])
def test_knob_reaches_train_config(override, field, default, flipped):
    assert getattr(tcfg(), field) == default
    assert getattr(tcfg(override), field) == flipped


def test_batch_knobs():
    t = tcfg()
    assert (t.micro_batch_size, t.global_batch_size, t.num_microbatches,
            t.data_parallel_size) == (2, 8, 2, 2)
    t = tcfg("--train.gradient_accumulation_steps=3", "global_batch_size=null")
    assert (t.global_batch_size, t.num_microbatches) == (12, 3)
    assert tcfg("rampup_batch_size=4 2 100", "train_samples=1000").rampup == (4, 2, 100)


def test_fp16_loss_scaling_knobs():
    assert tcfg().loss_scale is None
    t = tcfg("fp16=true", "initial_loss_scale=1024", "min_loss_scale=2", "loss_scale_window=50",
             "hysteresis=3")
    assert (t.loss_scale.dynamic, t.loss_scale.initial, t.loss_scale.min_scale,
            t.loss_scale.window, t.loss_scale.hysteresis) == (True, 1024.0, 2.0, 50, 3)
    assert not t.check_nan  # Megatron: off under dynamic loss scaling
    t = tcfg("fp16=true", "loss_scale=8")
    assert not t.loss_scale.dynamic and t.loss_scale.initial == 8.0 and t.check_nan
    assert t.accum_dtype == "float16"
    assert tcfg("fp16=true", "accumulate_allreduce_grads_in_fp32=true").accum_dtype == "float32"


def test_precision_switches_choose_the_compute_dtype():
    def dtype(*overrides):
        cfg = load_config(None, ["vocab_size=64", *overrides], enforce_status=False)
        return models.ModelConfig.from_config(cfg).dtype

    assert dtype() == "bfloat16"
    assert dtype("bf16=false") == "float32"
    assert dtype("fp16=true") == "float16"
    assert dtype("dtype=float32") == "float32"


def test_fp16_lm_cross_entropy_computes_in_half_precision():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 50)) * 3, jnp.float32)
    targets = jnp.zeros((2, 3), jnp.int32)
    full, half = token_nll(logits, targets), token_nll(logits, targets, half_precision=True)
    assert not np.array_equal(full, half) and np.allclose(full, half, atol=2e-2)
