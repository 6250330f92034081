"""fp16 loss scaling, pgs spike skipping and Megatron's spiky-value checks, step by step."""
import logging
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import loss_scale as ls
from jaxtrain import spikes
from jaxtrain.checks import Checks, SpikeWatch, TrainingError


def _megatron_scaler(events, initial, min_scale, window, hysteresis):
    """Megatron's DynamicGradScaler written out plainly: the scale after each event."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for found_inf in events:
        if found_inf:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2.0
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_dynamic_loss_scale_matches_megatron(hysteresis):
    cfg = ls.LossScaleConfig(dynamic=True, initial=2.0**16, min_scale=4.0, window=3,
                             hysteresis=hysteresis)
    rng = np.random.default_rng(hysteresis)
    events = list(rng.random(60) < 0.4) + [True] * 30 + [False] * 10
    state, got = cfg.init(), []
    for e in events:
        state = ls.update(state, jnp.bool_(e), cfg)
        got.append(float(state.scale))
    assert got == _megatron_scaler(events, 2.0**16, 4.0, 3, hysteresis)
    assert min(got) == 4.0


def test_static_loss_scale_never_moves():
    cfg = ls.LossScaleConfig(dynamic=False, initial=128.0, min_scale=1.0, window=1, hysteresis=1)
    state = cfg.init()
    for e in (True, False, True):
        state = ls.update(state, jnp.bool_(e), cfg)
    assert float(state.scale) == 128.0


def _pgs_detector(norms, z_threshold):
    """pgs's detector written out plainly: the spike flags."""
    mean = var = 0.0
    flags = []
    for count, g in enumerate(norms, 1):
        if count <= 50:
            if count == 1:
                mean, var = g, 0.0
            else:
                old = mean
                mean += (g - mean) / count
                var += (g - old) * (g - mean)
            flags.append(False)
            continue
        if count == 51:
            var /= count - 1
        std = var ** 0.5
        if std < 1e-8:
            std = abs(mean) * 0.1
        z = (g - mean) / std
        if z < z_threshold:
            mean = 0.99 * mean + 0.01 * g
            var = 0.99 * var + 0.01 * (g - mean) ** 2
        flags.append(z > z_threshold)
    return flags


def test_spike_detection_matches_pgs_and_flags_exactly_the_spike():
    rng = np.random.default_rng(0)
    norms = list(1.0 + 0.05 * rng.standard_normal(120))
    norms[80] = 9.0
    stats, flags = spikes.init(), []
    for g in norms:
        stats, spiked = spikes.check(stats, jnp.float32(g), 5.0)
        flags.append(bool(spiked))
    assert flags == _pgs_detector(norms, 5.0)
    assert [i for i, f in enumerate(flags) if f] == [80]


def test_spike_watch_uses_first_hundred_as_reference():
    watch = SpikeWatch("loss")
    assert all(watch(i, 2.0) is None for i in range(100))
    assert watch(101, 19.0) is None
    assert "10.0x" in watch(102, 20.0)
    assert watch(103, math.nan) is None


def test_nan_check_is_fatal_and_spikes_only_warn(caplog):
    class T:
        check_nan, check_spiky_loss, check_large_grads = True, True, True
    checks = Checks(T, logging.getLogger("test"))
    checks(1, {"loss": 1.0, "grad_norm": 1.0})
    with pytest.raises(TrainingError, match="NaN or Inf"):
        checks(2, {"loss": math.nan, "grad_norm": 1.0})
    T.check_nan = False
    Checks(T, logging.getLogger("test"))(3, {"loss": math.nan, "grad_norm": math.inf})
