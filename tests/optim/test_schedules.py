"""LR and weight-decay schedules against independent reference formulas.

The references below are written out from the upstream code: Megatron-LM's scheduler
(``OptimizerParamScheduler``, megatron/core/optimizer_param_scheduler.py; counted in samples),
its rampup_batch_size (``RampupBatchsizeNumMicroBatchesCalculator``,
megatron/core/num_microbatches_calculator.py) and palingenesis's scheduler (mii-llm/palingenesis;
counted in optimizer steps). Exact comparisons run in float64 (``jax.enable_x64``).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.optim import schedules as S
from jaxtrain.optim.schedules import ScheduleConfig

REL = 1e-7


def cfg(*overrides, path=None, world_size=None):
    """A resolved config; of overrides naming one key, the last wins."""
    merged = dict(o.split("=", 1) for o in overrides)
    return load_config(path, [f"{k}={v}" for k, v in merged.items()], world_size=world_size,
                       enforce_status=False)


def sched(*overrides, total_steps=None, path=None, world_size=None):
    return ScheduleConfig.from_config(cfg(*overrides, path=path, world_size=world_size),
                                      total_steps=total_steps)


def close(got, want, scale=1.0):
    got = float(got)
    assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-12 * scale), (got, want)


# --- reference formulas, written out independently ------------------------------------------


def ref_megatron_lr(n, *, hi, lo, init, warmup, decay, style, wsd=None, wsd_style=None):
    """Megatron's LR after n samples (warmup, decay, wsd also in samples)."""
    if warmup > 0 and n <= warmup:
        return init + (hi - init) * n / warmup
    if style == "constant":
        return hi
    if n > decay:
        return lo
    if style == "inverse-square-root":
        return max(lo, hi * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    if style == "WSD":
        stable_until = decay - wsd
        if n <= stable_until:
            coeff = 1.0
        else:
            r = (n - stable_until) / wsd
            coeff = {"linear": 1 - r,
                     "cosine": 0.5 * (1 + math.cos(math.pi * r)),
                     "exponential": 2 * 0.5 ** r - 1,
                     "minus_sqrt": 1 - math.sqrt(r)}[wsd_style]
    else:
        r = (n - warmup) / (decay - warmup)
        coeff = 1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r))
    return lo + coeff * (hi - lo)


def ref_pgs_lr(step, *, hi, lo, total, ratio, style):
    """pgs: peak × multiplier; warmup int(total × ratio) steps from 0; floor ratio lo / hi."""
    warm = int(total * ratio)
    floor = lo / hi
    if step < warm:
        mult = step / max(1, warm)
    elif style == "constant":
        mult = 1.0
    else:
        p = min((step - warm) / max(1, total - warm), 1.0)
        if style == "cosine":
            mult = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
        elif style == "linear":
            mult = max(floor, 1 - p * (1 - floor))
        elif style == "power_decay":
            mult = floor + (1 - floor) * (1 - p) ** 4
        else:  # wsd
            mult = 1.0 if p < 0.8 else floor + (1 - floor) * (1 - (p - 0.8) / 0.2) ** 4
    return hi * mult


def ref_wd(n, *, start, end, incr, style):
    if n > incr or style == "constant":
        return end
    r = n / incr
    coeff = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
    return start + coeff * (end - start)


def ref_batch(consumed, gbs, start, incr, samples):
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // incr)
    return start + int(consumed / per_increment) * incr


def ref_consumed(step, gbs, rampup, multiple=None):
    """Samples before update `step`, stepping one update at a time."""
    consumed = 0
    for _ in range(step):
        b = ref_batch(consumed, gbs, *rampup)
        if multiple:
            b = b // multiple * multiple
        consumed += b
    return consumed


def ref_train_iters(train_samples, gbs, rampup):
    """Megatron's update_train_iters, one ramp step at a time."""
    iters = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += ref_batch(consumed, gbs, *rampup)
        iters += 1
    if train_samples > consumed:
        iters += (train_samples - consumed) // gbs
    return iters


# --- Megatron styles ------------------------------------------------------------------------

GBS, WARM, ITERS, WSD_ITERS = 4, 10, 110, 40
HI, LO, INIT = 1e-3, 1e-5, 1e-4
MEGATRON_CASES = [("constant", None), ("linear", None), ("cosine", None),
                  ("inverse-square-root", None)] + [("WSD", w) for w in S.WSD_STYLES]
# warmup start, mid-warmup, end of warmup, just after, mid-decay, WSD tail, end, past end
STEPS = [0, 1, WARM // 2, WARM - 1, WARM, WARM + 1, 40, (WARM + ITERS) // 2, 70, 80, 95,
         ITERS - 1, ITERS, ITERS + 1, ITERS + 50]
SAMPLES = [3, 39, 41, 201, 281, 437, 439, 440, 441]  # between and off step boundaries


def megatron_overrides(style, wsd_style):
    over = [f"lr_decay_style={style}", f"lr={HI}", f"min_lr={LO}", f"lr_warmup_init={INIT}",
            f"lr_warmup_iters={WARM}", f"train_iters={ITERS}", f"global_batch_size={GBS}"]
    if wsd_style:
        over += [f"lr_wsd_decay_style={wsd_style}", f"lr_wsd_decay_iters={WSD_ITERS}"]
    return over


@pytest.mark.parametrize("style,wsd_style", MEGATRON_CASES,
                         ids=[s if w is None else f"WSD-{w}" for s, w in MEGATRON_CASES])
def test_megatron_style_matches_reference(style, wsd_style):
    s = sched(*megatron_overrides(style, wsd_style))
    assert (s.family, s.style, s.unit) == ("megatron", style, "samples")
    assert (s.warmup, s.decay) == (WARM * GBS, ITERS * GBS)

    def want(n):
        return ref_megatron_lr(n, hi=HI, lo=LO, init=INIT, warmup=WARM * GBS,
                               decay=ITERS * GBS, style=style, wsd=WSD_ITERS * GBS,
                               wsd_style=wsd_style)

    schedule = S.make_lr_schedule(s)
    with jax.enable_x64(True):
        for step in STEPS:
            close(schedule(step), want(step * GBS), HI)
            close(S.lr_at(s, step * GBS), want(step * GBS), HI)
        for n in SAMPLES:
            close(S.lr_at(s, n), want(n), HI)
    # float32 under jit, vectorised over steps
    got = np.asarray(jax.jit(schedule)(jnp.arange(ITERS + 20)))
    ref = np.array([want(i * GBS) for i in range(ITERS + 20)])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)


def test_megatron_hand_computed_values():
    base = ["lr=1e-3", "min_lr=1e-4", "lr_warmup_iters=10", "train_iters=110",
            "global_batch_size=4"]
    lin = S.make_lr_schedule(sched(*base, "lr_decay_style=linear"))
    cos = sched(*base, "lr_decay_style=cosine")
    wsd = S.make_lr_schedule(sched(*base, "lr_decay_style=WSD", "lr_wsd_decay_iters=20"))
    sqrt_tail = S.make_lr_schedule(sched(*base, "lr_decay_style=WSD", "lr_wsd_decay_iters=20",
                                         "lr_wsd_decay_style=minus_sqrt"))
    isr = sched("lr_decay_style=inverse-square-root", "lr=1e-3", "min_lr=0",
                "lr_warmup_iters=4", "train_iters=100", "global_batch_size=1")
    with jax.enable_x64(True):
        for step, lr in [(0, 0.0), (5, 5e-4), (10, 1e-3), (60, 5.5e-4), (110, 1e-4),
                         (111, 1e-4)]:
            close(lin(step), lr)
        close(S.lr_at(cos, 240), 5.5e-4)  # half way: (1 + cos π/2) / 2 = 1/2
        close(S.lr_at(cos, 40 + 400 / 3), 7.75e-4)  # a third: (1 + cos π/3) / 2 = 3/4
        close(wsd(90), 1e-3)  # stable until 110 - 20 iterations
        close(wsd(100), 1e-4 + (math.sqrt(2) - 1) * 9e-4)  # exponential: 2·0.5^½ − 1
        close(wsd(110), 1e-4)
        close(sqrt_tail(95), 5.5e-4)  # minus_sqrt: 1 − √¼
        close(S.lr_at(isr, 16), 5e-4)  # 1e-3 · √4 / √16
        close(S.lr_at(isr, 64), 2.5e-4)
        close(S.lr_at(isr, 101), 0.0)  # past the decay horizon: min_lr


def test_inverse_square_root_without_warmup_uses_one_sample():
    s = sched("lr_decay_style=inverse-square-root", "lr=1e-2", "min_lr=1e-5",
              "lr_warmup_iters=0", "train_iters=100", "global_batch_size=1")
    with jax.enable_x64(True):
        close(S.lr_at(s, 0), 1e-2)
        close(S.lr_at(s, 25), 1e-2 / 5)
        close(S.lr_at(s, 99), 1e-2 / math.sqrt(99))


# --- pgs styles -----------------------------------------------------------------------------

PGS_TOTAL = 200
PGS_STEPS = [0, 1, 10, 19, 20, 21, 56, 110, 164, 165, 182, 199, 200, 201, 260]


def pgs_file(write, style, ratio=0.1):
    return write("sft.yaml", f"""
        model: {{name_or_path: null}}
        train:
          learning_rate: 3.0e-4
          min_learning_rate: 3.0e-5
          warmup_ratio: {ratio}
          lr_scheduler: {style}
          epochs: 2
    """)


@pytest.mark.parametrize("style", S.PGS_STYLES)
def test_pgs_style_matches_reference(write, style):
    s = sched(path=pgs_file(write, style), total_steps=PGS_TOTAL)
    assert (s.family, s.style, s.unit, s.warmup, s.decay) == ("pgs", style, "steps", 20, 200)
    schedule = S.make_lr_schedule(s)
    with jax.enable_x64(True):
        for step in PGS_STEPS:
            want = ref_pgs_lr(step, hi=3e-4, lo=3e-5, total=PGS_TOTAL, ratio=0.1, style=style)
            close(schedule(step), want, 3e-4)
            close(S.pgs_lr_at(s, step), want, 3e-4)
    got = np.asarray(jax.jit(schedule)(jnp.arange(PGS_TOTAL + 10)))
    ref = [ref_pgs_lr(i, hi=3e-4, lo=3e-5, total=PGS_TOTAL, ratio=0.1, style=style)
           for i in range(PGS_TOTAL + 10)]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-10)


def test_pgs_hand_computed_values():
    def at(style, step, min_lr="0", ratio="0"):
        s = sched(f"train.lr_scheduler={style}", "lr=1.0", f"min_lr={min_lr}",
                  f"lr_warmup_fraction={ratio}", total_steps=100)
        return S.make_lr_schedule(s)(step)

    with jax.enable_x64(True):
        close(at("power_decay", 0), 1.0)
        close(at("power_decay", 50), 0.0625)  # (1 − ½)^4
        close(at("power_decay", 100), 0.0)
        close(at("wsd", 79), 1.0)
        close(at("wsd", 80), 1.0)  # 80% reached: the tail starts at (1 − 0)^4
        close(at("wsd", 90), 0.0625)  # q = ½
        close(at("wsd", 100), 0.0)
        close(at("cosine", 50), 0.5)
        close(at("linear", 25), 0.75)
        close(at("linear", 50, min_lr="0.1"), 0.55)
        close(at("power_decay", 150, min_lr="0.1"), 0.1)  # past the end: the floor
        close(at("constant", 77), 1.0)
        close(at("cosine", 5, ratio="0.1"), 0.5)  # warmup from 0 over int(100 · 0.1) steps
        close(at("constant", 10, ratio="0.1"), 1.0)


def test_pgs_warmup_steps_truncate_like_pgs():
    s = sched("train.lr_scheduler=linear", "lr=1.0", "min_lr=0", "lr_warmup_fraction=0.29",
              total_steps=100)
    assert s.warmup == 28  # int(100 * 0.29) = int(28.999999999999996)
    with jax.enable_x64(True):
        close(S.pgs_lr_at(s, 27), 27 / 28)
        close(S.pgs_lr_at(s, 28), 1.0)


def test_pgs_distill_warms_up_from_step_plus_one(write):
    path = write("opd.yaml", """
        model: {student: null}
        teachers:
          big: {model: Qwen/Qwen3-8B, backend: hf}
        train:
          steps: 100
          warmup_steps: 10
          learning_rate: 1.0e-5
    """)
    s = sched(path=path)
    assert (s.family, s.style, s.warmup, s.decay, s.warmup_offset) == ("pgs", "cosine", 10,
                                                                       100, 1)
    schedule = S.make_lr_schedule(s)
    with jax.enable_x64(True):
        for step in (0, 4, 9, 10, 55, 99, 100, 120):
            if step < 10:
                want = 1e-5 * (step + 1) / 10
            else:
                t = min((step - 10) / 90, 1.0)
                want = 1e-5 * 0.5 * (1 + math.cos(math.pi * t))
            close(schedule(step), want, 1e-5)


def test_pgs_file_reads_warmup_ratio_and_min_learning_rate(write):
    s = sched(path=pgs_file(write, "cosine", ratio=0.25), total_steps=100)
    assert (s.warmup, s.lr, s.min_lr) == (25, 3e-4, 3e-5)
    assert s.warmup != sched(path=pgs_file(write, "cosine", ratio=0.05), total_steps=100).warmup


def test_schedule_family_selection(write):
    assert sched().family == "megatron"
    assert sched("train.lr_scheduler=cosine").family == "pgs"  # explicit in a flat config
    path = write("sft.yaml", "model: {name_or_path: null}\ntrain: {max_steps: 50}\n")
    pgs_default = sched(path=path)
    assert (pgs_default.family, pgs_default.style, pgs_default.decay) == ("pgs", "cosine", 50)
    with pytest.raises(ConfigError, match="keep one"):   # found by the dry run
        sched("train.lr_scheduler=wsd", "lr_decay_style=WSD", "lr_wsd_decay_iters=10")


def test_total_steps_sets_the_run_length():
    a = sched("lr_decay_style=linear", "lr_warmup_iters=0", "global_batch_size=2")
    b = sched("lr_decay_style=linear", "lr_warmup_iters=0", "global_batch_size=2",
              total_steps=500)
    assert (a.decay, b.decay, b.wd_incr) == (2000, 1000, 1000)
    path_less = sched("train.lr_scheduler=linear", "lr_warmup_fraction=0.1", total_steps=300)
    assert (path_less.decay, path_less.warmup) == (300, 30)


# --- warmup in its three units, and lr_warmup_init ------------------------------------------


def test_megatron_warmup_by_iters_fraction_and_samples():
    base = ["lr_decay_style=linear", "lr=1e-3", "min_lr=0", "global_batch_size=4"]
    by_iters = sched(*base, "train_iters=100", "lr_warmup_iters=10")
    by_fraction = sched(*base, "train_iters=100", "lr_warmup_fraction=0.1")
    by_fraction_of_decay = sched(*base, "train_iters=100", "lr_decay_iters=50",
                                 "lr_warmup_fraction=0.1")
    by_samples = sched(*base, "train_samples=400", "lr_warmup_iters=0",
                       "lr_warmup_samples=40")
    samples_in_iter_run = sched(*base, "train_iters=100", "lr_warmup_iters=0",
                                "lr_warmup_samples=30")
    iters_in_sample_run = sched(*base, "train_samples=400", "lr_warmup_iters=5")
    default_iters_in_sample_run = sched(*base, "train_samples=400")  # Primus's 40: Megatron
    assert by_iters.warmup == by_fraction.warmup == by_samples.warmup == 40
    assert by_fraction_of_decay.warmup == 20 and by_fraction_of_decay.decay == 200
    assert samples_in_iter_run.warmup == 30 and iters_in_sample_run.warmup == 20
    assert default_iters_in_sample_run.warmup == 0  # ignores it in sample-based runs
    with jax.enable_x64(True):
        for s in (by_iters, by_fraction, by_samples):
            close(S.lr_at(s, 20), 5e-4)
            close(S.lr_at(s, 40), 1e-3)
        close(S.lr_at(by_fraction_of_decay, 10), 5e-4)
        close(S.lr_at(samples_in_iter_run, 15), 5e-4)


def test_lr_warmup_init_is_the_starting_lr():
    for over in (["lr_decay_style=cosine", "lr_warmup_iters=10"],
                 ["train.lr_scheduler=cosine", "lr_warmup_fraction=0.1"]):
        s = sched(*over, "lr=1e-3", "lr_warmup_init=2e-4", "train_iters=100",
                  "global_batch_size=4")
        schedule = S.make_lr_schedule(s)
        with jax.enable_x64(True):
            close(schedule(0), 2e-4)
            close(schedule(5), 6e-4)
            close(schedule(10), 1e-3)


# --- weight decay ---------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment_matches_reference(style):
    s = sched(f"weight_decay_incr_style={style}", "start_weight_decay=0.01",
              "end_weight_decay=0.1", "train_iters=100", "global_batch_size=2")
    schedule = S.make_weight_decay_schedule(s)
    with jax.enable_x64(True):
        for step in (0, 1, 25, 50, 99, 100, 101, 150):
            want = ref_wd(step * 2, start=0.01, end=0.1, incr=200, style=style)
            close(schedule(step), want)
            close(S.weight_decay_at(s, step * 2), want)


def test_weight_decay_hand_computed_and_constant():
    lin = S.make_weight_decay_schedule(sched(
        "weight_decay_incr_style=linear", "start_weight_decay=0.01", "end_weight_decay=0.1",
        "train_iters=100", "global_batch_size=2"))
    cos = S.make_weight_decay_schedule(sched(
        "weight_decay_incr_style=cosine", "start_weight_decay=0.01", "end_weight_decay=0.1",
        "train_iters=100", "global_batch_size=2"))
    const = S.make_weight_decay_schedule(sched("weight_decay=0.05", "train_iters=100"))
    with jax.enable_x64(True):
        close(lin(0), 0.01)
        close(lin(50), 0.055)
        close(cos(50), 0.055)
        close(cos(25), 0.01 + 0.09 * 0.5 * (1 - math.sqrt(0.5)))  # (cos(3π/4) + 1) / 2
        close(cos(100), 0.1)
        close(cos(400), 0.1)
        for step in (0, 50, 500):
            close(const(step), 0.05)


def test_weight_decay_in_pgs_steps():
    s = sched("train.lr_scheduler=cosine", "weight_decay_incr_style=linear",
              "start_weight_decay=0.0", "end_weight_decay=0.2", total_steps=40)
    with jax.enable_x64(True):
        close(S.make_weight_decay_schedule(s)(10), 0.05)


# --- decoupled LR for the embedding and output layer ------------------------------------------


def test_decoupled_lr_has_the_same_shape_with_its_own_peak_and_floor():
    over = megatron_overrides("cosine", None)
    s = sched(*over, "decoupled_lr=5e-3", "decoupled_min_lr=5e-4")
    no_floor = sched(*over, "decoupled_lr=5e-3")
    main, dec = S.make_lr_schedule(s), S.make_lr_schedule(s, decoupled=True)
    dec_no_floor = S.make_lr_schedule(no_floor, decoupled=True)
    plain = sched(*over)
    with jax.enable_x64(True):
        for step in STEPS:
            n = step * GBS
            kw = dict(init=INIT, warmup=WARM * GBS, decay=ITERS * GBS, style="cosine")
            close(main(step), ref_megatron_lr(n, hi=HI, lo=LO, **kw), HI)
            close(dec(step), ref_megatron_lr(n, hi=5e-3, lo=5e-4, **kw), HI)
            close(dec_no_floor(step), ref_megatron_lr(n, hi=5e-3, lo=LO, **kw), HI)
            close(S.make_lr_schedule(plain, decoupled=True)(step), float(main(step)), HI)
    assert s.has_decoupled_lr and not plain.has_decoupled_lr
    pgs = sched("train.lr_scheduler=power_decay", "lr=1e-3", "min_lr=1e-4",
                "decoupled_lr=2e-3", "decoupled_min_lr=0", "lr_warmup_fraction=0",
                total_steps=100)
    with jax.enable_x64(True):
        close(S.pgs_lr_at(pgs, 50, decoupled=True), 2e-3 * 0.0625)
        close(S.pgs_lr_at(pgs, 50), 1e-4 + 9e-4 * 0.0625)


# --- rampup_batch_size ----------------------------------------------------------------------


def test_batch_size_at_sample_counts():
    table = [(0, 16), (333, 16), (334, 32), (666, 32), (667, 48), (999, 48), (1000, 64),
             (1001, 64), (10 ** 9, 64)]
    for consumed, batch in table:
        assert S.batch_size_at(consumed, 64, "16 16 1000") == batch
        assert S.batch_size_at(consumed, 64, [16, 16, 1000]) == batch
        assert batch == ref_batch(consumed, 64, 16, 16, 1000)
    assert S.batch_size_at(5, 64, None) == 64
    assert S.batch_size_at(0, 64, "64 8 1000") == 64  # nothing to ramp
    # rounded down to micro × data-parallel size, or refused
    assert S.batch_size_at(0, 64, "12 4 1000", micro_times_dp=8, decrease_if_needed=True) == 8
    assert S.batch_size_at(620, 64, "12 4 1000", micro_times_dp=8,
                           decrease_if_needed=True) == 40  # 12 + ⌊620 / (1000/13)⌋·4 = 44
    with pytest.raises(ValueError, match="not divisible"):
        S.batch_size_at(0, 64, "12 4 1000", micro_times_dp=8)
    with pytest.raises(ValueError, match="three integers"):
        S.batch_size_at(0, 64, "16 16")
    with pytest.raises(ValueError, match="divisible by the increment"):
        S.batch_size_at(0, 64, "16 10 1000")


@pytest.mark.parametrize("gbs,rampup,multiple", [
    (64, (16, 16, 1000), None), (64, (16, 16, 1000), 8), (1536, (32, 32, 200_000), None),
    (72, (24, 16, 1000), 16), (64, (12, 4, 1000), 8), (64, (1, 1, 5000), None)])
def test_consumed_samples_follow_the_ramp(gbs, rampup, multiple):
    s = ScheduleConfig(family="megatron", style="constant", lr=1.0, global_batch_size=gbs,
                       rampup=rampup, running_multiple=multiple)
    steps = np.arange(400)
    got = np.asarray(jax.jit(lambda k: S.consumed_samples_at_step(s, k))(steps))
    want = [ref_consumed(int(k), gbs, rampup, multiple) for k in steps]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rampup", [(16, 16, 1000), (32, 32, 20_000), (8, 8, 777)])
@pytest.mark.parametrize("train_samples", [0, 500, 999, 1000, 1023, 1024, 1025, 5000, 50_000])
def test_rampup_train_iters_matches_megatron_count(rampup, train_samples):
    assert (S.rampup_train_iters(train_samples, 64, " ".join(map(str, rampup)))
            == ref_train_iters(train_samples, 64, rampup))


def test_rampup_moves_the_lr_by_samples_consumed():
    s = sched("lr_decay_style=linear", "lr=1e-3", "min_lr=0", "train_samples=5000",
              "global_batch_size=64", "rampup_batch_size=16 16 1000", "lr_warmup_iters=0",
              "lr_warmup_samples=500")
    assert s.rampup == (16, 16, 1000)
    schedule = S.make_lr_schedule(s)
    with jax.enable_x64(True):
        for step in (0, 10, 21, 30, 39, 50, 100):
            n = ref_consumed(step, 64, (16, 16, 1000))
            close(schedule(step), ref_megatron_lr(n, hi=1e-3, lo=0.0, init=0.0, warmup=500,
                                                  decay=5000, style="linear"), 1e-3)
    with pytest.raises(ValueError, match="sample-based"):
        sched("rampup_batch_size=16 16 1000", "global_batch_size=64", total_steps=100)


def test_decrease_batch_size_if_needed_rounds_the_ramp():
    over = ["train_samples=5000", "global_batch_size=64", "micro_batch_size=4",
            "rampup_batch_size=12 4 1000", "lr_warmup_iters=0", "lr_decay_style=linear"]
    s = sched(*over, "decrease_batch_size_if_needed=true", world_size=2)
    assert s.running_multiple == 8
    with jax.enable_x64(True):
        close(S.consumed_samples_at_step(s, 3), 8 + 8 + 8)


# --- every knob moves the schedule ----------------------------------------------------------

ITER_BASE = ("lr=1e-3", "min_lr=1e-5", "train_iters=100", "global_batch_size=4",
             "lr_warmup_iters=10", "lr_decay_style=cosine")
WSD_BASE = ITER_BASE + ("lr_decay_style=WSD", "lr_wsd_decay_iters=30")
SAMPLE_BASE = ("lr=1e-3", "min_lr=1e-5", "train_samples=400", "global_batch_size=4",
               "lr_warmup_iters=0", "lr_warmup_samples=40", "lr_decay_style=cosine")
WD_BASE = ITER_BASE + ("weight_decay_incr_style=linear", "start_weight_decay=0.01",
                       "end_weight_decay=0.1")
PGS_BASE = ("lr=1e-3", "min_lr=1e-5", "train_iters=100", "lr_warmup_fraction=0.1",
            "train.lr_scheduler=cosine")
RAMP_BASE = ("lr=1e-3", "min_lr=0", "train_samples=5000", "global_batch_size=64",
             "micro_batch_size=4", "lr_warmup_iters=0", "lr_decay_style=linear")

FLIPS = {
    "lr": (ITER_BASE, ("lr=2e-3",), {}),
    "min_lr": (ITER_BASE, ("min_lr=1e-4",), {}),
    "lr_decay_style": (ITER_BASE, ("lr_decay_style=linear",), {}),
    "lr_decay_iters": (ITER_BASE, ("lr_decay_iters=50",), {}),
    "lr_decay_samples": (SAMPLE_BASE, ("lr_decay_samples=200",), {}),
    "lr_decay_samples-in-iteration-run": (ITER_BASE, ("lr_decay_samples=200",), {}),
    "lr_warmup_fraction": (ITER_BASE + ("lr_warmup_iters=0", "lr_warmup_fraction=0.1"),
                           ("lr_warmup_fraction=0.3",), {}),
    "lr_warmup_iters": (ITER_BASE, ("lr_warmup_iters=20",), {}),
    "lr_warmup_samples": (SAMPLE_BASE, ("lr_warmup_samples=80",), {}),
    "lr_warmup_init": (ITER_BASE, ("lr_warmup_init=5e-4",), {}),
    "lr_wsd_decay_style": (WSD_BASE, ("lr_wsd_decay_style=cosine",), {}),
    "lr_wsd_decay_iters": (WSD_BASE, ("lr_wsd_decay_iters=50",), {}),
    "lr_wsd_decay_samples": (SAMPLE_BASE + ("lr_decay_style=WSD", "lr_wsd_decay_samples=120"),
                             ("lr_wsd_decay_samples=200",), {}),
    "train_iters": (ITER_BASE, ("train_iters=200",), {}),
    "train_samples": (SAMPLE_BASE, ("train_samples=800",), {}),
    "global_batch_size": (SAMPLE_BASE, ("global_batch_size=8",), {}),
    "weight_decay": (ITER_BASE, ("weight_decay=0.1",), {}),
    "start_weight_decay": (WD_BASE, ("start_weight_decay=0.05",), {}),
    "end_weight_decay": (WD_BASE, ("end_weight_decay=0.2",), {}),
    "weight_decay_incr_style": (WD_BASE, ("weight_decay_incr_style=cosine",), {}),
    "decoupled_lr": (ITER_BASE, ("decoupled_lr=5e-3",), {}),
    "decoupled_min_lr": (ITER_BASE + ("decoupled_lr=5e-3",), ("decoupled_min_lr=1e-3",), {}),
    "train.lr_scheduler": (PGS_BASE, ("train.lr_scheduler=power_decay",), {}),
    "train.lr_scheduler-pgs-warmup_ratio": (PGS_BASE, ("lr_warmup_fraction=0.3",), {}),
    "train.lr_scheduler-pgs-min_learning_rate": (PGS_BASE, ("min_lr=1e-4",), {}),
    "rampup_batch_size": (RAMP_BASE, ("rampup_batch_size=16 16 1000",), {}),
    "decrease_batch_size_if_needed": (RAMP_BASE + ("rampup_batch_size=12 4 1000",),
                                      ("decrease_batch_size_if_needed=true",),
                                      {"world_size": 2}),
}


def signature(s):
    steps = jnp.arange(160)
    return np.concatenate([np.asarray(S.make_lr_schedule(s)(steps)),
                           np.asarray(S.make_lr_schedule(s, decoupled=True)(steps)),
                           np.asarray(S.make_weight_decay_schedule(s)(steps))])


@pytest.mark.parametrize("knob", list(FLIPS))
def test_knob_changes_schedule(knob):
    base, flip, kw = FLIPS[knob]
    before, after = sched(*base, **kw), sched(*base, *flip, **kw)
    assert not np.allclose(signature(before), signature(after), rtol=1e-6, atol=0), knob


def test_total_steps_changes_schedule():
    assert not np.allclose(signature(sched(*PGS_BASE, total_steps=100)),
                           signature(sched(*PGS_BASE, total_steps=300)))


# --- use inside optax, and refusals -----------------------------------------------------------


def test_schedule_drives_optax_updates_from_step_zero():
    s = sched("lr_decay_style=linear", "lr=1.0", "min_lr=0", "lr_warmup_iters=2",
              "train_iters=10", "global_batch_size=3")
    opt = optax.sgd(S.make_lr_schedule(s))
    params = {"w": jnp.zeros(())}
    state = opt.init(params)
    seen = []
    for _ in range(4):
        updates, state = opt.update({"w": jnp.ones(())}, state, params)
        seen.append(-float(updates["w"]))
    np.testing.assert_allclose(seen, [0.0, 0.5, 1.0, 0.875], rtol=1e-6)


def test_impossible_settings_raise():
    with pytest.raises(ValueError, match="WSD needs"):
        ScheduleConfig(family="megatron", style="WSD", lr=1.0, decay=10)
    with pytest.raises(ValueError, match="shorter than the decay"):
        ScheduleConfig(family="megatron", style="linear", lr=1.0, warmup=10, decay=10)
    with pytest.raises(ValueError, match="min_lr"):
        ScheduleConfig(family="pgs", style="cosine", lr=1.0, min_lr=2.0, decay=10)
    with pytest.raises(ValueError, match="not one of"):
        ScheduleConfig(family="pgs", style="WSD", lr=1.0, decay=10)
    with pytest.raises(ValueError, match="only increases"):
        sched("weight_decay_incr_style=linear", "start_weight_decay=0.1",
              "end_weight_decay=0.01")
    # which weight-decay knobs go together: the config's rule (config/rules.py learning_rate)
    with pytest.raises(ConfigError, match="linear needs start_weight_decay and end_"):
        sched("weight_decay_incr_style=linear", "start_weight_decay=0.1")
    with pytest.raises(ConfigError, match="need weight_decay_incr_style linear or cosine"):
        sched("end_weight_decay=0.1")
    with pytest.raises(ValueError, match="decoupled_min_lr is set"):
        sched("decoupled_min_lr=1e-5")
    with pytest.raises(ValueError, match="pgs_lr_at evaluates the pgs"):
        S.pgs_lr_at(sched(), 3)
    with pytest.raises(ValueError, match="lr_at evaluates the megatron"):
        S.lr_at(sched("train.lr_scheduler=cosine"), 3)
    with pytest.raises(ValueError, match="counts optimizer steps"):
        sched("train.lr_scheduler=cosine", "train_samples=100")
    with pytest.raises(ValueError, match="global_batch_size"):
        S.make_lr_schedule(ScheduleConfig(family="megatron", style="constant", lr=1.0))


# --- step_batch_size_schedule ----------------------------------------------------------------


def ref_step_batch(consumed, entries):
    """Megatron's step schedule: the batch of the last entry whose threshold is reached."""
    return [b for t, b in entries if consumed >= t][-1]


def ref_step_consumed(step, entries):
    consumed = 0
    for _ in range(step):
        consumed += ref_step_batch(consumed, entries)
    return consumed


def ref_step_train_iters(train_samples, entries):
    """Megatron's update_train_iters: steps while fewer than train_samples were consumed."""
    iters = consumed = 0
    while consumed < train_samples:
        consumed += ref_step_batch(consumed, entries)
        iters += 1
    return iters


def test_step_schedule_parses_tokens_into_samples():
    """Thresholds are tokens (K/M/B/T suffixes, float mantissas) // seq_length; entries may be
    given in any order and separated by commas; malformed schedules are refused."""
    from jaxtrain.config.batch_schedule import parse_step_schedule
    got = parse_step_schedule("0:16, 2.4B:320 4.8B:624", 2048)
    assert got.entries == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    assert parse_step_schedule("1K:32 0:8", None).entries == ((0, 8), (1000, 32))
    assert parse_step_schedule(None, 2048) is None
    for bad, match in (("5:16 9:32", "first threshold must be 0"), ("0:16 x", "THRESHOLD"),
                       ("0:16 0:32", "rise strictly"), ("0:0", "positive")):
        with pytest.raises(ValueError, match=match):
            parse_step_schedule(bad, None)


ENTRIES = ((0, 16), (100, 48), (1000, 64), (1500, 32))


@pytest.mark.parametrize("consumed", [0, 15, 99, 100, 101, 999, 1000, 1499, 1500, 10 ** 6])
def test_step_schedule_batch_at(consumed):
    from jaxtrain.config.batch_schedule import StepSchedule
    assert S.batch_size_at(consumed, 32, StepSchedule(ENTRIES)) == ref_step_batch(consumed,
                                                                                   ENTRIES)


def test_step_schedule_consumed_samples_and_run_length():
    """Samples before each update (the LR clock, resumption) and Megatron's iteration count,
    against the step-at-a-time references; the schedule may also shrink the batch."""
    from jaxtrain.config.batch_schedule import StepSchedule
    schedule = StepSchedule(ENTRIES)
    s = ScheduleConfig(family="megatron", style="constant", lr=1.0, global_batch_size=32,
                       rampup=schedule)
    steps = np.arange(120)
    got = np.asarray(jax.jit(lambda k: S.consumed_samples_at_step(s, k))(steps))
    np.testing.assert_array_equal(got, [ref_step_consumed(int(k), ENTRIES) for k in steps])
    for n in (0, 1, 16, 17, 100, 112, 1000, 1001, 1500, 1537, 5000):
        assert S.rampup_train_iters(n, 32, schedule) == ref_step_train_iters(n, ENTRIES), n
    assert S.rampup_batches(32, schedule) == (16, 48, 64, 32)


def test_step_schedule_moves_the_lr_by_samples_consumed():
    """The sample-valued horizons are Megatron's; an iteration-valued one counts micro x
    data-parallel samples per iteration (Megatron's global_batch_size under a schedule)."""
    over = ["lr_decay_style=linear", "lr=1e-3", "min_lr=0", "train_samples=5000",
            "seq_length=8", "micro_batch_size=4", "step_batch_size_schedule=0:16 800:48",
            "lr_warmup_iters=0", "lr_warmup_samples=300"]
    s = sched(*over, world_size=2)
    assert s.global_batch_size == 48 and s.rampup.entries == ((0, 16), (100, 48))
    schedule = S.make_lr_schedule(s)
    entries = ((0, 16), (100, 48))
    with jax.enable_x64(True):
        for step in (0, 3, 7, 10, 30, 80):
            n = ref_step_consumed(step, entries)
            close(schedule(step), ref_megatron_lr(n, hi=1e-3, lo=0.0, init=0.0, warmup=300,
                                                  decay=5000, style="linear"), 1e-3)
    iters = sched(*over[:3], "train_iters=100", *over[4:7], "lr_warmup_iters=10",
                  world_size=2)
    assert (iters.warmup, iters.decay) == (10 * 4 * 2, 100 * 4 * 2)
