"""Optimizers as optax transformations, chosen and parameterised by the resolved config.

``OptimConfig.from_config(cfg)`` reads the knobs; ``build_optimizer(opt_cfg, lr_schedule,
params_axes)`` returns one ``optax.GradientTransformation``:

    [cast grads to main_grads_dtype] -> [train.mona] -> [train.adagc | clip_grad]
        -> per-leaf optimizer (optax.partition) -> [train.llrd_decay] -> [train.hyperball]

the per-leaf optimizer and the two steps after it wrapped in a master copy of the weights with
``main_params_dtype`` fp16. The bracketed pgs extras (and ``train.adamc``, a weight-decay
schedule inside the per-leaf optimizer) are :mod:`jaxtrain.optim.pgs_extras`'s.

Two dialects choose the optimizer. Megatron's ``optimizer`` (also MaxText configs): ``adam`` and
``sgd`` (:mod:`jaxtrain.optim.adam`), ``muon`` / ``dist_muon`` (:mod:`jaxtrain.optim.muon`, with
Adam for the leaves Muon does not take). pgs's ``train.optimizer`` (palingenesis; pgs files, or
``train.optimizer`` given explicitly): ``adamw`` (:mod:`jaxtrain.optim.adam`), ``muon``
(:mod:`jaxtrain.optim.muon`), ``adamw8bit`` / ``paged_adamw8bit`` / ``lion8bit`` and
``plugins.schedule_free`` (:mod:`jaxtrain.optim.pgs`).

Shared knobs: ``clip_grad`` (global L2 norm, ``max / (norm + 1e-6)`` as Megatron and
``torch.nn.utils.clip_grad_norm_``; 0 turns it off), ``weight_decay`` or a ``wd_schedule``
(start/end_weight_decay; required when ``weight_decay_incr_style`` is not constant),
``decoupled_lr`` (embedding and output layer on ``decoupled_lr_schedule``),
``use_precision_aware_optimizer`` with its dtypes (:mod:`jaxtrain.optim.precision`), and
host-resident optimizer state (:mod:`jaxtrain.optim.offload`).

The package, one concern per module:

    config      OptimConfig: the optimizer knobs, checked, in the optimizer's own terms
    leaves      each parameter's kind; which leaves decay and which Muon takes; partition labels
    adam        Megatron's Adam (pgs's AdamW) and SGD
    muon        Megatron's TensorParallelMuon and pgs's torch Muon
    pgs         bitsandbytes' 8-bit AdamW and Lion (paged too), schedule-free AdamW
    pgs_extras  pgs's MONA, AdaGC, AdamC, layer-wise LR decay and Hyperball
    precision   the precision-aware optimizer: gradient rounding, moment dtypes, master weights
    quantized   the stored formats of low-precision moments (cast, scaled, 8-bit blockwise)
    offload     optimizer state in host memory (memory kinds)
    schedules   the LR and weight-decay schedules, and the global-batch ramp-up
    optimizers  this module: build_optimizer, gradient clipping, the weight-decay and
                decoupled-LR choices, and the names callers import from here
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.optim import adam, muon, pgs, pgs_extras
from jaxtrain.optim import quantized as q
from jaxtrain.optim.adam import AdamState, scale_by_adam_stored
from jaxtrain.optim.config import (DTYPES, JORDAN, MATMUL_PRECS, MEGATRON, MEGATRON_OPTIMIZERS,
                                   NS_COEFFICIENTS, PGS, PGS_MUON_LR_MULT, PGS_OPTIMIZERS,
                                   QUINTIC, SCALE_MODES, TP_MODES, OptimConfig)
from jaxtrain.optim.freeze import is_frozen
from jaxtrain.optim.leaves import (Leaf, Path, batch_axes_of, by_path, decayed, leaf_plan,
                                   muon_member)
from jaxtrain.optim.muon import (MuonState, muon_scale_factor, newton_schulz,
                                 scale_by_megatron_muon)
from jaxtrain.optim.offload import (HOST_MEMORY, UNPINNED_HOST_MEMORY, opt_state_memory_kind,
                                    with_opt_state_memory_kind)
from jaxtrain.optim.pgs import (LION_BETAS, LionState, scale_by_lion_stored,
                                schedule_free_eval_params)
from jaxtrain.optim.precision import MasterState, keep_master_copy, round_grads
from jaxtrain.optim.schedules import warmup_steps_of

__all__ = [
    # the entry points
    "OptimConfig", "build_optimizer", "param_labels", "clip_by_global_norm",
    # the names callers import from here, defined in the family modules
    "AdamState", "DTYPES", "HOST_MEMORY", "JORDAN", "LION_BETAS", "Leaf", "LionState",
    "MATMUL_PRECS", "MEGATRON", "MEGATRON_OPTIMIZERS", "MasterState", "MuonState",
    "NS_COEFFICIENTS", "PGS", "PGS_MUON_LR_MULT", "PGS_OPTIMIZERS", "Path", "QUINTIC",
    "SCALE_MODES", "TP_MODES", "UNPINNED_HOST_MEMORY", "keep_master_copy", "leaf_plan",
    "muon_scale_factor", "newton_schulz", "opt_state_memory_kind", "round_grads",
    "scale_by_adam_stored", "scale_by_lion_stored", "scale_by_megatron_muon",
    "schedule_free_eval_params", "with_opt_state_memory_kind",
]


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Megatron's and torch's clipping: scale by ``min(1, max_norm / (norm + 1e-6))``."""
    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), updates))
        coeff = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        return jax.tree.map(lambda g: (g * coeff).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _weight_decay(opt: OptimConfig, wd_schedule):
    if wd_schedule is not None:
        return wd_schedule
    if opt.weight_decay_incr_style != "constant":
        raise ValueError(f"weight_decay_incr_style {opt.weight_decay_incr_style} needs "
                         f"wd_schedule (jaxtrain.optim.schedules.make_weight_decay_schedule)")
    return opt.weight_decay


def _decoupled_schedule(opt: OptimConfig, lr_schedule, decoupled_lr_schedule):
    if decoupled_lr_schedule is not None:
        return decoupled_lr_schedule
    floor = opt.min_lr if opt.decoupled_min_lr is None else opt.decoupled_min_lr
    if opt.min_lr == 0.0 and floor == 0.0 and opt.lr_warmup_init == 0.0 and opt.lr > 0:
        ratio = opt.decoupled_lr / opt.lr  # same shape, peak decoupled_lr: exact here
        return lambda count: lr_schedule(count) * ratio
    raise ValueError("decoupled_lr with a nonzero min_lr, decoupled_min_lr or lr_warmup_init "
                     "needs decoupled_lr_schedule (schedules.make_lr_schedule(..., "
                     "decoupled=True))")


def _decays(opt: OptimConfig, rule):
    """``rule`` with pgs's layer-wise LR decay groups (which decay the >= 2-D embeddings, unlike
    its plain AdamW) and without the matrices Hyperball holds on their sphere (no decay)."""
    if opt.flavour == PGS and opt.llrd_decay < 1:
        plain = rule
        rule = lambda leaf: plain(leaf) or leaf.kind in pgs_extras.EMBEDDINGS  # noqa: E731
    if not opt.hyperball:
        return rule
    return lambda leaf: rule(leaf) and not pgs_extras.hyperball_member(leaf)


def _adagc_warmup(opt: OptimConfig, lr_schedule) -> int:
    if opt.adagc_warmup_steps is not None:
        return opt.adagc_warmup_steps
    if not callable(lr_schedule):
        return 0  # a constant LR has no warm-up
    steps = warmup_steps_of(lr_schedule)
    if steps is None:
        raise ValueError("train.adagc clips globally during the LR warm-up: build the schedule "
                         "with schedules.make_lr_schedule or set OptimConfig.adagc_warmup_steps")
    return steps


def _elementwise(opt: OptimConfig, plan, lr, wd, part: str) -> optax.GradientTransformation:
    """The element-wise optimizer for the leaves of one LR group."""
    mask = by_path(plan, _decays(opt, decayed(opt, part)))
    if opt.name == "sgd":
        return adam.sgd(opt, lr, wd, mask)
    if opt.name == "lion8bit":
        return pgs.lion8bit(plan, lr, wd, mask)
    return adam.adam(opt, plan, lr, wd, mask)  # adam / adamw / 8-bit adamw / Muon's Adam


def build_optimizer(opt_cfg: OptimConfig, lr_schedule, params_axes, *, wd_schedule=None,
                    decoupled_lr_schedule=None) -> optax.GradientTransformation:
    """The optax transformation for ``opt_cfg``.

    ``lr_schedule``: optax schedule (step -> LR). ``params_axes``: the logical-axes tree of the
    parameters (``jaxtrain.models.logical_axes``), used to tell matrices, stacked axes, norms,
    biases, the embedding and the output layer apart. ``wd_schedule``: step -> weight decay
    (start/end_weight_decay). ``decoupled_lr_schedule``: the embedding/output-layer schedule
    when ``decoupled_lr`` is set (derived from ``lr_schedule`` when that is exact).
    """
    plan = leaf_plan(params_axes)
    wd = _weight_decay(opt_cfg, wd_schedule)
    pre = []
    if opt_cfg.use_precision_aware_optimizer and opt_cfg.main_grads_dtype != "fp32":
        pre.append(round_grads(DTYPES[opt_cfg.main_grads_dtype]))
    if opt_cfg.mona:
        pre.append(pgs_extras.mona(plan, opt_cfg.mona_beta_a, opt_cfg.mona_lite))
    if opt_cfg.adagc:   # replaces the global clip (which it applies during its warm-up)
        pre.append(pgs_extras.adagc(plan, opt_cfg.adagc_lambda, opt_cfg.adagc_beta,
                                    _adagc_warmup(opt_cfg, lr_schedule), opt_cfg.clip_grad))
    elif opt_cfg.clip_grad > 0:
        pre.append(clip_by_global_norm(opt_cfg.clip_grad))
    if opt_cfg.schedule_free:
        if opt_cfg.main_params_dtype != "fp32":
            raise ValueError("main_params_dtype fp16 keeps a master copy for Megatron's Adam/SGD/"
                             "Muon; the schedule-free optimizers keep their own weights: use fp32")
        extras = [k for k, on in (("train.mona", opt_cfg.mona), ("train.adamc", opt_cfg.adamc),
                                  ("train.llrd_decay", opt_cfg.llrd_decay < 1),
                                  ("train.hyperball", opt_cfg.hyperball),
                                  ("train.freeze_non_attention", opt_cfg.freeze_linear),
                                  ("the frozen DeepSeek-V4 indexer (v4_indexer_distill_loss_coeff "
                                   "0)", opt_cfg.freeze_indexer)) if on]
        if extras:
            raise ValueError(f"{', '.join(extras)} cannot be combined with plugins.schedule_free "
                             f"(it has no LR schedule or per-layer LR to act on)")
        return optax.chain(*pre, pgs.schedule_free(opt_cfg, plan, wd))

    member = muon_member(opt_cfg) if opt_cfg.uses_muon else (lambda leaf: False)
    decoupled = opt_cfg.decoupled_lr is not None

    def label(leaf: Leaf) -> str:
        if opt_cfg.freeze_linear and is_frozen(leaf.path):
            return "frozen"
        if opt_cfg.freeze_indexer and "indexer" in leaf.path:
            return "frozen"
        if member(leaf):
            return "muon"
        if decoupled and leaf.kind in ("embedding", "output"):
            return "decoupled"
        return "main"

    used = {label(leaf) for leaf in plan.values()}
    part = "muon-adam" if opt_cfg.uses_muon else "main"
    main_wd = (pgs_extras.adamc_weight_decay(wd, lr_schedule, opt_cfg.lr) if opt_cfg.adamc
               else wd)
    transforms = {"frozen": optax.set_to_zero()} if "frozen" in used else {}
    if "main" in used:
        transforms["main"] = _elementwise(opt_cfg, plan, lr_schedule, main_wd, part)
    if "decoupled" in used:
        dec = _decoupled_schedule(opt_cfg, lr_schedule, decoupled_lr_schedule)
        dec_wd = (pgs_extras.adamc_weight_decay(wd, dec, opt_cfg.decoupled_lr)
                  if opt_cfg.adamc else wd)
        transforms["decoupled"] = _elementwise(opt_cfg, plan, dec, dec_wd, part)
    if "muon" in used:
        transforms["muon"] = muon.muon(
            plan, opt_cfg, lr_schedule, main_wd,
            by_path(plan, _decays(opt_cfg, lambda leaf: True)) if opt_cfg.hyperball else None)
    core = optax.partition(transforms, by_path(plan, label))
    post = []
    if opt_cfg.llrd_decay < 1:
        post.append(pgs_extras.llrd(plan, opt_cfg.llrd_decay, opt_cfg.layer_stacks))
    if opt_cfg.hyperball:
        post.append(pgs_extras.hyperball(plan, opt_cfg.hyperball_lr, lr_schedule, opt_cfg.lr))
    if post:
        core = optax.chain(core, *post)
    if opt_cfg.use_precision_aware_optimizer and opt_cfg.main_params_dtype != "fp32":
        core = keep_master_copy(core, q.Codec.for_dtype(DTYPES[opt_cfg.main_params_dtype]),
                                batch_axes_of(plan))
    return optax.chain(*pre, core)


def param_labels(opt_cfg: OptimConfig, params_axes) -> dict[Path, str]:
    """path -> 'muon' / 'adam' (the Adam part) / '<name>' for inspection and logging."""
    plan = leaf_plan(params_axes)
    member = muon_member(opt_cfg) if opt_cfg.uses_muon else (lambda leaf: False)
    other = "adam" if opt_cfg.uses_muon else opt_cfg.name
    return {p: ("muon" if member(leaf) else other) for p, leaf in plan.items()}
