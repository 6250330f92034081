"""Learning-rate and weight-decay schedules, and the global-batch ramp-up.

Three families, after the public sources:

- **megatron** (``lr_decay_style``): Megatron-LM's ``OptimizerParamScheduler``
  (megatron/core/optimizer_param_scheduler.py). It counts *samples*: every iteration-valued
  knob is multiplied by ``global_batch_size``. Linear warmup from ``lr_warmup_init``; then
  constant, linear ``1 - r``, cosine ``(1 + cos(pi r)) / 2``, inverse-square-root
  ``max(min_lr, lr * sqrt(warmup) / sqrt(n))`` or WSD (flat until the last
  ``lr_wsd_decay_*``, then ``lr_wsd_decay_style``: linear, cosine, exponential
  ``2 * 0.5^r - 1`` or minus_sqrt ``1 - sqrt(r)``); ``min_lr`` past the decay horizon. Weight
  decay moves from ``start_weight_decay`` to ``end_weight_decay`` over the run (linear, or
  cosine ``(cos(pi (1 - r)) + 1) / 2``). ``rampup_batch_size`` follows Megatron-LM's
  ``RampupBatchsizeNumMicroBatchesCalculator`` (megatron/core/num_microbatches_calculator.py):
  ``start + floor(consumed / (samples / n)) * increment`` with
  ``n = (global_batch_size - start) / increment``, the full batch once ``consumed > samples``;
  it needs sample-based training (``train_samples``). ``step_batch_size_schedule`` follows
  its ``StepBatchsizeNumMicroBatchesCalculator``: ``"THRESHOLD:BATCH ..."`` pairs (K/M/B/T
  suffixes), thresholds in tokens turned into samples by ``// seq_length`` (Megatron-LM always
  passes the sequence length), each batch from its threshold on; the global batch is the last
  one, and iteration-valued LR knobs count ``micro_batch_size x data-parallel size`` samples
  per iteration, as Megatron-LM's ``args.global_batch_size`` then is.
- **pgs** (``train.lr_scheduler``): palingenesis's ``build_scheduler``
  (mii-llm/palingenesis, src/palingenesis/optim.py), a ``LambdaLR`` multiplier on the peak LR.
  It counts *optimizer steps*: warmup ``int(steps * warmup_ratio)`` steps from 0, then
  power_decay ``(1 - p)^4``, wsd (flat for 80% of the post-warmup steps, then ``(1 - q)^4``;
  not Megatron's WSD), cosine, linear or constant, floored at ``min_learning_rate``. pgs
  distill files warm up over ``train.warmup_steps`` with ``(step + 1) / warmup``, as its
  trainer does.
- **maxtext** (MaxText files, unless ``lr_decay_style`` is set; ``lr_schedule_type``): MaxText's
  ``create_learning_rate_schedule`` (maxtext_utils.py), over optimizer steps, with ``S`` =
  learning_rate_schedule_steps (``lr_decay_iters``, else the run) and
  ``W = int(S * warmup_steps_fraction)``: ``lr * k / W`` for ``k < W`` (from 0); cosine:
  ``final + (lr - final) * (1 + cos(pi * (k - W) / (S - W - 1))) / 2`` up to ``S``; wsd: ``lr``
  until ``S - D`` (``D = int(S * wsd_decay_steps_fraction)``), then linear over ``D - 1`` steps
  or the cosine over ``D`` down to ``final``; and 0 from ``S`` on when the run is longer.
  ``final = lr * learning_rate_final_fraction`` (an explicit ``min_lr`` replaces it).

``ScheduleConfig.from_config`` picks the family and converts the knobs into the family's unit;
``lr_at`` / ``pgs_lr_at`` / ``weight_decay_at`` are pure ``jnp`` functions (jit-safe, float64
under ``jax.enable_x64``); ``make_lr_schedule`` gives an ``optax.Schedule`` of the optimizer
step, where step ``k`` is the LR of the ``k``-th update (0-based), as the references do.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping

import jax.numpy as jnp
import optax

from jaxtrain.config.areas import optim as _optim_knobs
from jaxtrain.config.batch_schedule import StepSchedule, parse_step_schedule
from jaxtrain.config import complete
from jaxtrain.config.areas import schedule as _schedule_knobs

MEGATRON = "megatron"
PGS = "pgs"
MAXTEXT = "maxtext"
MAXTEXT_STYLES = _schedule_knobs._MAXTEXT_SCHEDULES
MAXTEXT_WSD_STYLES = _schedule_knobs._MAXTEXT_WSD_STYLES

# The accepted values are the registry's (jaxtrain/config/areas/schedule.py, optim.py).
MEGATRON_STYLES = _schedule_knobs._DECAY_STYLES
WSD_STYLES = _schedule_knobs._WSD_DECAY_STYLES
PGS_STYLES = _schedule_knobs._PGS_SCHEDULERS
WD_STYLES = _optim_knobs._WD_INCR_STYLES

PGS_POWER = 4.0  # exponent of pgs's power_decay and of the decay tail of its wsd
PGS_WSD_STABLE = 0.8  # share of pgs's post-warmup steps that wsd holds at the peak

Rampup = tuple[int, int, int] | StepSchedule   # (start, increment, samples), or steps


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Everything the schedules need, in the family's unit: samples (megatron) or optimizer
    steps (pgs). Frozen and hashable, so it can be closed over or passed static under jit.

    ``warmup``/``decay``/``wsd_decay``/``wd_incr`` are lengths in that unit; Megatron's warmup
    may be fractional (``lr_warmup_fraction × decay``), pgs's is a whole number of steps.
    ``decay`` is the decay horizon (Megatron: ``lr_decay_*``, else the run; pgs: the run).
    """

    family: str
    style: str
    lr: float
    min_lr: float = 0.0
    warmup_init: float = 0.0
    warmup: float = 0.0
    decay: float = 1.0
    wsd_decay: float | None = None
    wsd_style: str = "exponential"
    warmup_offset: int = 0  # pgs distill warms up with (step + 1) / warmup
    global_batch_size: int | None = None
    rampup: Rampup | None = None
    running_multiple: int | None = None  # micro x data-parallel size, to round a ramped batch
    wd_style: str = "constant"
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_incr: float = 1.0
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    run: float | None = None  # maxtext: steps of the run (LR 0 from ``decay`` to here)

    def __post_init__(self):
        _check(self)

    @property
    def unit(self) -> str:
        """What the schedule counts: 'samples' (megatron) or 'steps' (pgs, maxtext)."""
        return "samples" if self.family == MEGATRON else "steps"

    @property
    def has_decoupled_lr(self) -> bool:
        """True when the embedding and output layer follow their own peak/floor LR."""
        return self.decoupled_lr is not None

    def peak_and_floor(self, decoupled: bool = False) -> tuple[float, float]:
        """(max, min) LR of the main parameters, or of the embedding/output layer: decoupled_lr
        and decoupled_min_lr, each falling back to lr and min_lr when unset."""
        if not decoupled or self.decoupled_lr is None:
            return self.lr, self.min_lr
        floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        return self.decoupled_lr, floor

    @classmethod
    def from_config(cls, cfg: Mapping, *, total_steps: int | None = None) -> ScheduleConfig:
        """Read the schedule knobs of a resolved config.

        ``total_steps`` is the run length the trainer settled on (train_iters, or pgs's
        epochs × steps per epoch); when given it replaces ``train_iters``. Sample-based runs
        (``train_samples``) take their horizons from samples whatever ``total_steps`` is.
        """
        cfg = complete(cfg)
        is_set = getattr(cfg, "is_set", None) or (lambda key: cfg.get(key) is not None)
        family = cfg.get("lr_schedule_family") or MEGATRON
        common = dict(
            lr=_float(cfg, "lr"), min_lr=_float(cfg, "min_lr"),
            warmup_init=_float(cfg, "lr_warmup_init"),
            decoupled_lr=_opt_float(cfg, "decoupled_lr"),
            decoupled_min_lr=_opt_float(cfg, "decoupled_min_lr"),
            **_weight_decay_knobs(cfg))
        if family == PGS:
            return cls(**common, **_pgs_knobs(cfg, total_steps))
        if family == MAXTEXT:
            return cls(**{**common, **_maxtext_knobs(cfg, is_set, total_steps)})
        return cls(**common, **_megatron_knobs(cfg, is_set, total_steps))


# --- reading the config --------------------------------------------------------------------


def _float(cfg, key, default=None):
    value = cfg.get(key, default)
    if value is None:
        value = default
    if value is None:
        raise ValueError(f"schedule: {key} must be set")
    return float(value)


def _opt_float(cfg, key):
    value = cfg.get(key)
    return None if value is None else float(value)


def _maxtext_knobs(cfg, is_set, total_steps) -> dict:
    """MaxText's create_learning_rate_schedule inputs, in optimizer steps."""
    get = cfg.get
    run = total_steps if total_steps is not None else get("train_iters")
    if not run or run <= 0:
        raise ValueError("MaxText's LR schedule needs the run length (steps)")
    horizon = get("lr_decay_iters") or run
    fraction = get("lr_warmup_fraction")
    warmup = int(horizon * (0.1 if fraction is None else fraction))
    lr = _float(cfg, "lr")
    final = (_float(cfg, "min_lr") if is_set("min_lr")
             else lr * float(get("learning_rate_final_fraction")))
    style = get("lr_schedule_type")
    wsd = int(horizon * float(get("wsd_decay_steps_fraction"))) if style == "wsd" else None
    return dict(family=MAXTEXT, style=style, min_lr=final, warmup_init=0.0,
                warmup=float(warmup), decay=float(horizon),
                wsd_decay=None if wsd is None else float(wsd),
                wsd_style=get("wsd_decay_style"), run=float(run),
                wd_incr=float(run), global_batch_size=_batch(cfg))


def _weight_decay_knobs(cfg) -> dict:
    """weight_decay under the constant style, else start_weight_decay -> end_weight_decay.
    Which of these knobs go together is the config's rule (``learning_rate`` in
    jaxtrain/config/rules.py), checked when a config resolves."""
    style = cfg.get("weight_decay_incr_style")
    if style == "constant":
        start = end = cfg.get("weight_decay") or 0.0
    else:
        start, end = _float(cfg, "start_weight_decay"), _float(cfg, "end_weight_decay")
    return dict(wd_style=style, start_wd=float(start), end_wd=float(end))


def _batch(cfg) -> int | None:
    gbs = cfg.get("global_batch_size")
    if gbs is not None and int(gbs) <= 0:
        raise ValueError(f"global_batch_size must be positive, got {gbs}")
    return None if gbs is None else int(gbs)


def _need_batch(gbs, what) -> int:
    if gbs is None:
        raise ValueError(f"{what} needs global_batch_size")
    return gbs


def _megatron_knobs(cfg, is_set, total_steps) -> dict:
    """Horizons in samples, as Megatron's get_optimizer_param_scheduler converts them. Where
    Megatron ignores a knob of the other unit (lr_decay_samples in an iteration-based run,
    lr_wsd_decay_iters in a sample-based one, ...), it is converted and honoured instead, but
    only when the knob of the run's own unit is unset."""
    get, gbs = cfg.get, _batch(cfg)
    derived = getattr(cfg, "derived", None) or {}
    rampup = batch_ramp(get)
    per_iter = gbs   # samples an iteration-valued knob counts per iteration
    if isinstance(rampup, StepSchedule):   # Megatron's args.global_batch_size: micro x DP
        if not derived.get("data_parallel_size"):
            raise ValueError("step_batch_size_schedule: the schedule needs the data-parallel "
                             "size (resolve the config with a world size)")
        per_iter = int(get("micro_batch_size") or 1) * int(derived["data_parallel_size"])

    def in_samples(key):  # an iteration-valued knob, in samples
        return get(key) * _need_batch(per_iter, f"{key} (iterations to samples)")

    fraction = get("lr_warmup_fraction")
    warmup_iters, warmup_samples = get("lr_warmup_iters") or 0, get("lr_warmup_samples") or 0
    train_samples = get("train_samples")
    if train_samples:  # sample-based run: the *_samples knobs lead
        decay, decay_key = get("lr_decay_samples"), "lr_decay_samples"
        if decay is None:
            decay, decay_key = ((train_samples, "train_samples") if get("lr_decay_iters") is None
                                else (in_samples("lr_decay_iters"), "lr_decay_iters"))
        wd_incr = train_samples
        wsd = get("lr_wsd_decay_samples")
        if wsd is None and get("lr_wsd_decay_iters") is not None:
            wsd = in_samples("lr_wsd_decay_iters")
        if fraction is not None:
            warmup, warmup_key = fraction * decay, "lr_warmup_fraction"
        elif warmup_samples:
            warmup, warmup_key = warmup_samples, "lr_warmup_samples"
        elif warmup_iters and is_set("lr_warmup_iters"):  # Primus's default 40 is no choice
            warmup, warmup_key = in_samples("lr_warmup_iters"), "lr_warmup_iters"
        else:
            warmup, warmup_key = 0, None
    else:  # iteration-based run: the *_iters knobs lead
        iters = total_steps if total_steps is not None else get("train_iters")
        if not iters or iters <= 0:
            raise ValueError("the LR schedule needs the run length: train_iters, train_samples, "
                             "or total_steps from the trainer")
        if rampup is not None and not isinstance(rampup, StepSchedule):
            raise ValueError("rampup_batch_size needs sample-based training: set train_samples "
                             "instead of train_iters")
        per_iter = _need_batch(per_iter, "the Megatron schedule (it counts samples)")
        if get("lr_decay_iters") is not None:
            decay, decay_key = in_samples("lr_decay_iters"), "lr_decay_iters"
        elif get("lr_decay_samples") is not None:
            decay, decay_key = get("lr_decay_samples"), "lr_decay_samples"
        else:
            decay, decay_key = iters * per_iter, "train_iters"
        wd_incr = iters * per_iter
        wsd = (in_samples("lr_wsd_decay_iters") if get("lr_wsd_decay_iters") is not None
               else get("lr_wsd_decay_samples"))
        if fraction is not None:
            warmup, warmup_key = fraction * decay, "lr_warmup_fraction"
        elif warmup_iters:
            warmup, warmup_key = in_samples("lr_warmup_iters"), "lr_warmup_iters"
        else:
            warmup, warmup_key = warmup_samples, "lr_warmup_samples"
    if decay <= 0:
        raise ValueError(f"{decay_key} = {get(decay_key)}: the LR decay horizon must be "
                         f"positive ({decay} samples)")
    if warmup_key and not 0 <= warmup < decay:
        raise ValueError(f"{warmup_key} = {get(warmup_key)} gives a warmup of {warmup:g} "
                         f"samples, which must be shorter than the LR decay horizon, "
                         f"{decay_key} = {get(decay_key)} ({decay:g} samples); lower "
                         f"{warmup_key} or raise {decay_key}")
    multiple = None
    if get("decrease_batch_size_if_needed") and derived.get("data_parallel_size"):
        multiple = int(get("micro_batch_size") or 1) * int(derived["data_parallel_size"])
    return dict(family=MEGATRON, style=get("lr_decay_style"),
                warmup=float(warmup), decay=float(decay),
                wsd_decay=None if wsd is None else float(wsd),
                wsd_style=get("lr_wsd_decay_style"),
                global_batch_size=gbs, rampup=rampup, running_multiple=multiple,
                wd_incr=float(wd_incr))


def _pgs_knobs(cfg, total_steps) -> dict:
    """pgs's build_scheduler inputs, in optimizer steps."""
    get, gbs = cfg.get, _batch(cfg)

    def in_steps(key):  # a sample-valued knob, in whole steps
        return get(key) // _need_batch(gbs, f"{key} (samples to steps)")

    steps = total_steps if total_steps is not None else get("train_iters")
    if steps is None or steps <= 0:
        raise ValueError("the pgs LR schedule counts optimizer steps: pass total_steps "
                         "(epochs × steps per epoch) or set train_iters / train.max_steps")
    horizon = steps
    if get("lr_decay_iters") is not None:
        horizon = get("lr_decay_iters")
    elif get("lr_decay_samples") is not None:
        horizon = in_steps("lr_decay_samples")
    fraction = get("lr_warmup_fraction")
    if fraction is not None:
        warmup = int(horizon * fraction)  # truncated, as pgs's int(num_steps * warmup_ratio)
    elif get("lr_warmup_iters"):
        warmup = int(get("lr_warmup_iters"))  # pgs distill's train.warmup_steps
    elif get("lr_warmup_samples"):
        warmup = in_steps("lr_warmup_samples")
    else:
        warmup = 0
    return dict(family=PGS, style=get("train.lr_scheduler"),
                warmup=float(warmup), decay=float(horizon),
                warmup_offset=int(get("lr_warmup_offset") or 0),
                global_batch_size=gbs, wd_incr=float(steps))


def _check(s: ScheduleConfig):
    """ValueError for what the formulas cannot evaluate (Megatron's scheduler asserts)."""
    if s.family == MEGATRON:
        if s.style not in MEGATRON_STYLES:
            raise ValueError(f"lr_decay_style {s.style!r} is not one of {MEGATRON_STYLES}")
        if s.decay <= 0:
            raise ValueError(f"the LR decay horizon must be positive, got {s.decay} samples")
        if not 0 <= s.warmup < s.decay:
            raise ValueError(f"the warmup ({s.warmup} samples) must be shorter than the decay "
                             f"horizon ({s.decay} samples); lower lr_warmup_* or raise "
                             f"lr_decay_*/the run length")
        if s.style == "WSD":
            if not s.wsd_decay or s.wsd_decay <= 0:
                raise ValueError("lr_decay_style WSD needs a positive lr_wsd_decay_iters or "
                                 "lr_wsd_decay_samples")
            if s.wsd_style not in WSD_STYLES:
                raise ValueError(f"lr_wsd_decay_style {s.wsd_style!r} is not one of "
                                 f"{WSD_STYLES}")
    elif s.family == MAXTEXT:
        if s.style not in MAXTEXT_STYLES:
            raise ValueError(f"lr_schedule_type {s.style!r} is not one of {MAXTEXT_STYLES}")
        if s.decay <= 0 or s.warmup < 0 or s.warmup > s.decay:
            raise ValueError(f"MaxText schedule: need 0 <= warmup ({s.warmup}) <= "
                             f"learning_rate_schedule_steps ({s.decay}) and a positive schedule")
        if s.style == "wsd":
            if s.wsd_style not in MAXTEXT_WSD_STYLES:
                raise ValueError(f"wsd_decay_style {s.wsd_style!r} is not one of "
                                 f"{MAXTEXT_WSD_STYLES}")
            if s.warmup + (s.wsd_decay or 0) > s.decay:
                raise ValueError("wsd: warmup_steps_fraction + wsd_decay_steps_fraction must "
                                 "not exceed 1")
    elif s.family == PGS:
        if s.style not in PGS_STYLES:
            raise ValueError(f"train.lr_scheduler {s.style!r} is not one of {PGS_STYLES}")
        if s.decay <= 0 or s.warmup < 0 or s.warmup != int(s.warmup):
            raise ValueError(f"pgs schedule: need whole, non-negative warmup steps and a positive "
                             f"run length, got warmup {s.warmup}, steps {s.decay}")
        if s.warmup_offset not in (0, 1):
            raise ValueError(f"warmup_offset must be 0 or 1, got {s.warmup_offset}")
    else:
        raise ValueError(f"schedule family {s.family!r} is not {MEGATRON!r}, {PGS!r} or "
                         f"{MAXTEXT!r}")
    if s.min_lr < 0:
        raise ValueError(f"min_lr must not be negative, got {s.min_lr}")
    if s.min_lr > s.lr:
        raise ValueError(f"min_lr ({s.min_lr}) must not exceed lr ({s.lr})")
    if s.warmup_init > s.lr:
        raise ValueError(f"lr_warmup_init ({s.warmup_init}) must not exceed lr ({s.lr})")
    if s.decoupled_min_lr is not None and s.decoupled_lr is None:
        raise ValueError("decoupled_min_lr is set but decoupled_lr is not; set decoupled_lr "
                         "(the embedding/output layer's peak LR) or drop decoupled_min_lr")
    if s.decoupled_lr is not None:
        hi, lo = s.peak_and_floor(decoupled=True)
        if not 0 <= lo <= hi:
            raise ValueError(f"need 0 <= decoupled_min_lr (or min_lr: {lo}) <= decoupled_lr "
                             f"({hi})")
    if s.wd_style not in WD_STYLES:
        raise ValueError(f"weight_decay_incr_style {s.wd_style!r} is not one of {WD_STYLES}")
    if s.start_wd < 0 or s.end_wd < s.start_wd:
        raise ValueError(f"need 0 <= start_weight_decay ({s.start_wd}) <= end_weight_decay "
                         f"({s.end_wd}); Megatron only increases weight decay")
    if s.wd_style == "constant" and s.start_wd != s.end_wd:
        raise ValueError("weight_decay_incr_style constant needs start == end weight decay")
    if s.wd_style != "constant" and s.wd_incr <= 0:
        raise ValueError(f"the weight-decay increment needs a positive run length, got "
                         f"{s.wd_incr}")
    if s.global_batch_size is not None and s.global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {s.global_batch_size}")
    if s.rampup is not None:
        _check_rampup(s.rampup, s.global_batch_size)


# --- the schedules (pure jnp) ----------------------------------------------------------------


def _real(x):
    """x as the default float dtype (float64 under jax.enable_x64, else float32)."""
    return jnp.asarray(x, dtype=float)


def lr_at(sched: ScheduleConfig, consumed_samples, *, decoupled: bool = False):
    """Megatron's LR after ``consumed_samples`` samples (the scheduler's count of updates
    applied), for the main parameters or (``decoupled``) the embedding and output layer."""
    _family(sched, MEGATRON, "lr_at")
    hi, lo = sched.peak_and_floor(decoupled)
    n = _real(consumed_samples)
    warmup, decay = sched.warmup, sched.decay
    if sched.style == "constant":
        after = jnp.full_like(n, hi)
    elif sched.style == "inverse-square-root":
        scaled = hi * math.sqrt(max(warmup, 1.0)) / jnp.sqrt(jnp.maximum(n, 1.0))
        after = jnp.where(n > decay, lo, jnp.maximum(lo, scaled))
    else:
        if sched.style == "WSD":
            anneal_start = decay - sched.wsd_decay
            r = jnp.clip((n - anneal_start) / sched.wsd_decay, 0.0, 1.0)
            coeff = jnp.where(n <= anneal_start, 1.0, _wsd_tail(sched.wsd_style, r))
        else:
            r = jnp.clip((n - warmup) / (decay - warmup), 0.0, 1.0)
            coeff = 1.0 - r if sched.style == "linear" else 0.5 * (jnp.cos(jnp.pi * r) + 1.0)
        after = jnp.where(n > decay, lo, lo + coeff * (hi - lo))
    if warmup > 0:
        init = sched.warmup_init
        return jnp.where(n <= warmup, init + (hi - init) * n / warmup, after)
    return after


def _wsd_tail(style, r):
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (jnp.cos(jnp.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * jnp.power(0.5, r) - 1.0
    return 1.0 - jnp.sqrt(r)  # minus_sqrt


def pgs_lr_at(sched: ScheduleConfig, step, *, decoupled: bool = False):
    """pgs's LR for optimizer step ``step`` (0-based): its LambdaLR multiplier on the peak,
    floored at min_lr (``min_learning_rate``)."""
    _family(sched, PGS, "pgs_lr_at")
    hi, lo = sched.peak_and_floor(decoupled)
    s = _real(step)
    warmup, steps = sched.warmup, sched.decay
    if sched.style == "constant":
        after = jnp.full_like(s, hi)
    else:
        p = jnp.clip((s - warmup) / max(1.0, steps - warmup), 0.0, 1.0)
        if sched.style == "cosine":
            shape = 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        elif sched.style == "linear":
            shape = 1.0 - p
        elif sched.style == "power_decay":
            shape = (1.0 - p) ** PGS_POWER
        else:  # wsd: flat, then the power tail over the last 20%
            q = jnp.clip((p - PGS_WSD_STABLE) / (1.0 - PGS_WSD_STABLE), 0.0, 1.0)
            shape = jnp.where(p < PGS_WSD_STABLE, 1.0, (1.0 - q) ** PGS_POWER)
        after = lo + (hi - lo) * shape
    if warmup > 0:
        init = sched.warmup_init
        ramp = init + (hi - init) * (s + sched.warmup_offset) / warmup
        return jnp.where(s < warmup, ramp, after)
    return after


def maxtext_lr_at(sched: ScheduleConfig, step, *, decoupled: bool = False):
    """MaxText's LR for optimizer step ``step`` (0-based): its pieces joined at their
    boundaries, each evaluated at the steps since its start (see the module docstring)."""
    _family(sched, MAXTEXT, "maxtext_lr_at")
    hi, lo = sched.peak_and_floor(decoupled)
    k = _real(step)
    warmup, horizon = int(sched.warmup), int(sched.decay)

    def cosine(j, length):  # from hi down to lo over `length` steps (j from 0)
        pct = j / (length - 1) if length > 1 else jnp.ones_like(j)
        a = 0.5 * (jnp.cos(jnp.pi * pct) + 1.0)
        return hi * a + lo * (1.0 - a)

    pieces = []  # (first step, fn of the steps since it)
    if warmup > 0:
        pieces.append((0, lambda j: hi * jnp.clip(j / warmup, 0.0, 1.0)))
    if sched.style == "cosine":
        length = horizon - warmup
        if length > 0:
            pieces.append((warmup, lambda j: cosine(j, length)))
    else:  # wsd
        decay = int(sched.wsd_decay or 0)
        stable = horizon - warmup - decay
        if stable > 0:
            pieces.append((warmup, lambda j: jnp.full_like(j, hi)))
        if decay > 0:
            if sched.wsd_style == "linear":
                span = decay - 1
                fn = ((lambda j: hi + (lo - hi) * jnp.clip(j / span, 0.0, 1.0)) if span > 0
                      else (lambda j: jnp.full_like(j, hi)))
            else:
                fn = lambda j: cosine(j, decay)  # noqa: E731
            pieces.append((warmup + max(stable, 0), fn))
    if sched.run is not None and sched.run > horizon:
        pieces.append((horizon, lambda j: jnp.zeros_like(j)))
    if not pieces:
        return jnp.full_like(k, hi)
    out = pieces[0][1](k - pieces[0][0])
    for start, fn in pieces[1:]:
        out = jnp.where(k < start, out, fn(k - start))
    return out


def weight_decay_at(sched: ScheduleConfig, count):
    """Weight decay after ``count`` units of the schedule (samples for megatron, steps for
    pgs): start_weight_decay → end_weight_decay over the run, then end_weight_decay."""
    c = _real(count)
    if sched.wd_style == "constant":
        return jnp.full_like(c, sched.end_wd)
    r = jnp.clip(c / sched.wd_incr, 0.0, 1.0)
    coeff = r if sched.wd_style == "linear" else 0.5 * (jnp.cos(jnp.pi * (1.0 - r)) + 1.0)
    wd = sched.start_wd + coeff * (sched.end_wd - sched.start_wd)
    return jnp.where(c > sched.wd_incr, sched.end_wd, wd)


def consumed_samples_at_step(sched: ScheduleConfig, step):
    """Samples the Megatron scheduler has counted before update ``step``: step × global batch,
    or, under rampup_batch_size, the sum of the ramped (and rounded) batches before it."""
    _family(sched, MEGATRON, "consumed_samples_at_step")
    gbs = _need_batch(sched.global_batch_size, "converting optimizer steps to samples")
    s = _real(step)
    if sched.rampup is None:
        return s * gbs
    stages = _rampup_stages(gbs, sched.rampup, sched.running_multiple)
    first = _real([st[0] for st in stages])
    base = _real([st[1] for st in stages])
    batch = _real([st[2] for st in stages])
    i = jnp.clip(jnp.searchsorted(first, s, side="right") - 1, 0, len(stages) - 1)
    return base[i] + (s - first[i]) * batch[i]


def make_lr_schedule(sched: ScheduleConfig, *, decoupled: bool = False) -> optax.Schedule:
    """optax schedule: optimizer step (0-based count of updates applied) → LR. ``decoupled``
    gives the embedding/output layer's schedule (the main one when decoupled_lr is unset)."""
    if sched.family == PGS:
        return functools.partial(_pgs_step_lr, sched, decoupled)
    if sched.family == MAXTEXT:
        return functools.partial(_maxtext_step_lr, sched, decoupled)
    _need_batch(sched.global_batch_size, "converting optimizer steps to samples")
    if sched.rampup is not None:
        _rampup_stages(sched.global_batch_size, sched.rampup, sched.running_multiple)
    return functools.partial(_megatron_step_lr, sched, decoupled)


def make_weight_decay_schedule(sched: ScheduleConfig) -> optax.Schedule:
    """optax schedule: optimizer step → weight decay."""
    if sched.family in (PGS, MAXTEXT):
        return functools.partial(weight_decay_at, sched)
    _need_batch(sched.global_batch_size, "converting optimizer steps to samples")
    return functools.partial(_megatron_step_wd, sched)


def warmup_steps_of(schedule) -> int | None:
    """The optimizer steps a schedule made by :func:`make_lr_schedule` spends warming up (pgs:
    ``int(total_steps * warmup_ratio)``; Megatron: the updates begun before ``warmup``
    samples were consumed); None for any other schedule."""
    if not (isinstance(schedule, functools.partial) and schedule.args
            and isinstance(schedule.args[0], ScheduleConfig)):
        return None
    sched = schedule.args[0]
    if sched.family != MEGATRON or sched.warmup <= 0:
        return int(math.ceil(sched.warmup))
    gbs = _need_batch(sched.global_batch_size, "converting the warm-up to optimizer steps")
    if sched.rampup is None:
        return int(math.ceil(sched.warmup / gbs))
    smallest = min(b for _, _, b in _rampup_stages(gbs, sched.rampup, sched.running_multiple))
    steps = jnp.arange(int(math.ceil(sched.warmup / smallest)) + 1)
    return int(jnp.sum(consumed_samples_at_step(sched, steps) < sched.warmup))


def _pgs_step_lr(sched, decoupled, step):
    return pgs_lr_at(sched, step, decoupled=decoupled)


def _maxtext_step_lr(sched, decoupled, step):
    return maxtext_lr_at(sched, step, decoupled=decoupled)


def _megatron_step_lr(sched, decoupled, step):
    return lr_at(sched, consumed_samples_at_step(sched, step), decoupled=decoupled)


def _megatron_step_wd(sched, step):
    return weight_decay_at(sched, consumed_samples_at_step(sched, step))


def _family(sched, family, what):
    if sched.family != family:
        raise ValueError(f"{what} evaluates the {family} schedule, but this one is "
                         f"{sched.family} ({sched.style}); use make_lr_schedule")


# --- rampup_batch_size (Megatron's pinned semantics) -------------------------------------------


def parse_rampup(value) -> Rampup | None:
    """'start increment samples' (or a 3-list) → (start, increment, samples); None stays None
    and a parsed ramp (a tuple or a StepSchedule) as it is."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, StepSchedule):
        return value
    parts = value.split() if isinstance(value, str) else list(value)
    try:
        start, incr, samples = (int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"rampup_batch_size must be three integers 'start increment samples', "
                         f"got {value!r}") from None
    return start, incr, samples


def batch_ramp(get) -> Rampup | None:
    """The run's batch ramp from its knobs (``get``: key -> value): rampup_batch_size, or
    step_batch_size_schedule (thresholds in tokens of seq_length), or None."""
    return parse_rampup(get("rampup_batch_size")) or parse_step_schedule(
        get("step_batch_size_schedule"), get("seq_length"))


def _check_rampup(rampup, gbs):
    if isinstance(rampup, StepSchedule):
        return
    start, incr, samples = rampup
    if start <= 0 or incr <= 0 or samples < 0:
        raise ValueError(f"rampup_batch_size {rampup}: need start > 0, increment > 0 and "
                         f"samples >= 0")
    if gbs is not None and (start > gbs or (gbs - start) % incr):
        raise ValueError(f"rampup_batch_size {rampup}: need start <= global_batch_size ({gbs}) "
                         f"and (global_batch_size - start) divisible by the increment")


def batch_size_at(consumed_samples: int, global_batch_size: int, rampup, *,
                  micro_times_dp: int | None = None, decrease_if_needed: bool = False) -> int:
    """Global batch of the step that starts after ``consumed_samples`` samples.

    ``start + ⌊consumed / (samples / n)⌋ · increment`` with ``n = (gbs − start) / increment``,
    and ``gbs`` once ``consumed > samples``. With ``micro_times_dp`` (micro batch × data-
    parallel size) the batch must divide by it, or, with ``decrease_if_needed``, is rounded
    down to a multiple of it (the batch Megatron then runs and counts).
    """
    rampup = parse_rampup(rampup)
    if rampup is None:
        batch = global_batch_size
    elif isinstance(rampup, StepSchedule):
        batch = rampup.batch_at(consumed_samples)
    else:
        _check_rampup(rampup, global_batch_size)
        start, incr, samples = rampup
        increments = (global_batch_size - start) // incr
        if consumed_samples > samples or increments == 0 or samples == 0:
            batch = global_batch_size  # a ramp of no samples or no increments is already over
        else:
            batch = start + int(consumed_samples / (samples / increments)) * incr
    if micro_times_dp:
        if batch % micro_times_dp:
            if not decrease_if_needed:
                raise ValueError(f"global batch {batch} (at {consumed_samples} samples) is not "
                                 f"divisible by micro_batch_size x data-parallel size "
                                 f"({micro_times_dp}); set decrease_batch_size_if_needed")
            batch = batch // micro_times_dp * micro_times_dp
        if batch <= 0:
            raise ValueError(f"global batch rounds down to 0 at {consumed_samples} samples: "
                             f"the ramp starts below micro_batch_size x data-parallel size "
                             f"({micro_times_dp})")
    return batch


@functools.lru_cache(maxsize=64)
def _rampup_stages(gbs: int, rampup: Rampup, multiple: int | None) -> tuple:
    """(first step, samples consumed before it, batch) for each run of steps that share one
    batch size; the last stage runs at the full batch for ever. The batch only grows with the
    samples consumed, so each stage's length is found by bisection. A step schedule's stages
    end where the samples consumed pass its next threshold."""
    if isinstance(rampup, StepSchedule):
        return _step_stages(rampup, multiple)
    samples = rampup[2]

    def batch(consumed):
        return batch_size_at(consumed, gbs, rampup, micro_times_dp=multiple,
                             decrease_if_needed=multiple is not None)

    stages, step, consumed = [], 0, 0
    while True:
        b = batch(consumed)
        stages.append((step, consumed, b))
        if b == gbs or consumed > samples:
            return tuple(stages)
        # smallest k >= 1 whose batch differs; past `samples` it is the full batch, so k <= hi
        lo, hi = 1, (samples - consumed) // b + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if batch(consumed + mid * b) != b:
                hi = mid
            else:
                lo = mid + 1
        step, consumed = step + lo, consumed + lo * b


def _step_stages(schedule: StepSchedule, multiple: int | None) -> tuple:
    """`_rampup_stages` of a step schedule (batches rounded down to ``multiple``)."""
    stages, step, consumed = [], 0, 0
    while True:
        b = schedule.batch_at(consumed)
        if multiple:
            b = b // multiple * multiple
            if b <= 0:
                raise ValueError(f"step_batch_size_schedule: batch {schedule.batch_at(consumed)} "
                                 f"rounds down to 0 (micro_batch_size x data-parallel size "
                                 f"{multiple})")
        stages.append((step, consumed, b))
        later = [t for t, _ in schedule.entries if t > consumed]
        if not later:
            return tuple(stages)
        k = -(-(later[0] - consumed) // b)
        step, consumed = step + k, consumed + k * b


def rampup_batches(global_batch_size: int, rampup, multiple: int | None = None
                   ) -> tuple[int, ...]:
    """The global batches a batch-size ramp steps through, the full one last (``multiple``:
    rounded down to multiples of it, as ``decrease_batch_size_if_needed`` does)."""
    rampup = parse_rampup(rampup)
    if rampup is None:
        return (global_batch_size,)
    return tuple(dict.fromkeys(
        b for _, _, b in _rampup_stages(global_batch_size, rampup, multiple)))


def rampup_train_iters(train_samples: int, global_batch_size: int, rampup) -> int:
    """Steps of a sample-based run as Megatron's update_train_iters counts them: ramped steps
    while the samples consumed are at most both the ramp's and train_samples, then as many
    whole full batches as fit in what is left."""
    rampup = parse_rampup(rampup)
    if rampup is None:
        return train_samples // global_batch_size
    if isinstance(rampup, StepSchedule):
        return _step_train_iters(train_samples, rampup)
    _check_rampup(rampup, global_batch_size)
    limit = min(rampup[2], train_samples)
    stages = _rampup_stages(global_batch_size, rampup, None)
    iters = consumed = 0
    for i, (first, before, b) in enumerate(stages):
        if before > limit:
            break
        length = stages[i + 1][0] - first if i + 1 < len(stages) else None
        count = (limit - before) // b + 1  # steps of this stage starting at or below the limit
        if length is not None and count >= length:
            iters, consumed = iters + length, stages[i + 1][1]
            continue
        iters, consumed = iters + count, before + count * b
        break
    if train_samples > consumed:
        iters += (train_samples - consumed) // global_batch_size
    return iters


def _step_train_iters(train_samples: int, schedule: StepSchedule) -> int:
    """Megatron's update_train_iters under a step schedule: steps while fewer than
    train_samples samples are consumed (the last step may pass it)."""
    stages = _step_stages(schedule, None)
    iters = 0
    for i, (first, before, b) in enumerate(stages):
        if before >= train_samples:
            break
        need = -(-(train_samples - before) // b)
        length = stages[i + 1][0] - first if i + 1 < len(stages) else None
        if length is None or need <= length:
            return iters + need
        iters += length
    return iters


def ga_ramp_sizes(start: int, full: int, steps: int, micro_times_dp: int):
    """pgs ``train.ga_ramp_start``: the global batch of the step starting after ``consumed``
    samples, when step ``s`` (0-based) accumulates ``start + ⌊(full - start)·s / steps⌋``
    micro-batches (at most ``full``) of ``micro_times_dp`` samples each."""
    counts = [min(full, start + (full - start) * s // max(steps, 1)) for s in range(steps + 1)]
    ends = list(itertools.accumulate(c * micro_times_dp for c in counts))

    def size(consumed: int) -> int:
        s = bisect.bisect_right(ends, consumed)
        return (counts[s] if s < len(counts) else full) * micro_times_dp
    return size
