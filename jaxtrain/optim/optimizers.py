"""Optimizers as optax transformations, chosen and parameterised by the resolved config.

``OptimConfig.from_config(cfg)`` reads the knobs; ``build_optimizer(opt_cfg, lr_schedule,
params_axes)`` returns one ``optax.GradientTransformation``:

    [cast grads to main_grads_dtype] -> [clip_grad] -> per-leaf optimizer (optax.partition)

Two dialects choose the optimizer. Megatron's ``optimizer`` (also MaxText configs):

- ``adam``: Megatron's Adam is AdamW (TE/apex ``FusedAdam`` with ``adam_w_mode``): bias-corrected
  moments, ``eps`` outside the root, decoupled decay ``p -= lr * wd * p``. Megatron's default
  ``no_weight_decay_cond`` skips biases and 1-D tensors; a stacked layer axis makes a norm scale
  2-D here, so the rule is applied by leaf name and logical axes (norms, biases and vectors skip
  decay; matrices, embeddings and the output layer decay).
- ``sgd``: TE/apex ``FusedSGD`` (torch ``SGD`` fallback): ``buf = momentum * buf + (g + wd * p)``,
  ``p -= lr * buf``. Megatron passes ``weight_decay`` to SGD, which adds it to the gradient before
  the momentum (L2, *coupled*, not AdamW-style); the same no-decay rule applies.
- ``muon`` / ``dist_muon``: Megatron's ``TensorParallelMuon`` (Emerging-Optimizers) on every
  parameter that is neither 1-D nor the word embedding / output layer (so a learned position
  embedding is Muon's, as in Megatron); Adam (above) for the rest. Per layer (the stacked axis
  is a batch axis), attention ``wq`` [D, N, H] is the matrix D x (N*H), ``wo`` [N, H, D] is
  (N*H) x D. Update: ``m = lerp(m, g, 1 - muon_momentum)``; ``u = lerp(g, m, momentum)`` with
  ``muon_use_nesterov`` else ``m``; Newton-Schulz with the "quintic" coefficient sets
  (``muon_num_ns_steps``, a multiple of 5, as Emerging-Optimizers requires); times
  ``muon_scale_mode``'s factor of (out, in) -- spectral ``sqrt(max(out, in))``, shape_scaling
  ``sqrt(max(1, out/in))``, unit_rms_norm ``sqrt(out/in)`` -- and ``muon_extra_scale_factor``;
  ``p -= lr * (update + wd * p)``. ``muon_fp32_matmul_prec``: medium (and low: torch has nothing
  lower) runs the iteration on bfloat16 inputs with float32 accumulation, as Emerging-Optimizers
  does explicitly; high keeps float32 (XLA precision HIGH: TF32-class on GPU, exact on CPU).
  ``muon_split_qkv``: Megatron fuses Q, K and V into one weight and splits it per component
  when true; here ``wq``, ``wk``, ``wv`` are separate leaves, so true holds by construction, and
  false orthogonalises the fused [D, (N + 2K) * H] matrix (concatenated per layer; the row
  order of Megatron's per-group interleaving does not change the result, which is equivariant
  to permutations). The gated MLP's ``wi_0``/``wi_1`` are Megatron's one fused ``linear_fc1``
  and are orthogonalised together. ``muon_tp_mode``: blockwise orthogonalises each
  tensor-parallel shard on its own (the ``tensor_model_parallel_size`` column/row blocks of each
  matrix, with the shard's shape in the scale factor, as Megatron does; KV heads fewer than the
  TP degree are replicated, hence whole); duplicated and distributed orthogonalise the whole
  matrix (identical maths; under XLA the sharding decides where it runs). Same-shaped stacks
  share one batched Newton-Schulz. ``dist_muon`` (Megatron's layer-wise distributed Muon) only shards state:
  the same update.

pgs's ``train.optimizer`` (palingenesis; pgs files, or ``train.optimizer`` given explicitly):

- ``adamw``: torch AdamW, betas ``(adam_beta1, adam_beta2)`` (pgs: 0.9, 0.95). pgs skips decay
  for 1-D tensors and names containing bias, norm or embed (so the embedding is not decayed).
- ``muon``: ``torch.optim.Muon`` on >= 2-D non-embedding weights (the output head included),
  at 10x the LR, Nesterov (the pgs default of ``muon_use_nesterov``), Jordan's single
  coefficient set, scale ``sqrt(max(1, out/in))`` (torch's "original"; ``muon_scale_mode`` set
  explicitly overrides it); AdamW for the rest, decaying everything but biases and norms.
- ``adamw8bit`` / ``paged_adamw8bit`` / ``lion8bit``: bitsandbytes' 8-bit optimizers with real
  8-bit state (see :mod:`jaxtrain.optim.quantized`: blockwise dynamic quantisation, block
  256): each step dequantises, updates in float32 and requantises. Lion uses bitsandbytes'
  betas (0.95, 0.98): ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, ``m = b2 m + (1 - b2) g``.
  ``paged_adamw8bit`` is ``adamw8bit`` whose state lives in host memory
  (:func:`opt_state_memory_kind`; bitsandbytes pages on demand through CUDA unified memory,
  which XLA has no equivalent of: *mapped* to pinned host memory).
- ``plugins.schedule_free``: replaces the optimizer and the LR schedule, as pgs does:
  ``optax.contrib.schedule_free`` around Adam's second moment (the algorithm of schedulefree's
  ``AdamWScheduleFree``), betas ``(adam_beta1, adam_beta2)``, constant ``lr`` after a linear
  warmup of ``int(train_iters * lr_warmup_fraction)`` steps (pgs passes
  ``total_steps * warmup_ratio``). Evaluate with :func:`schedule_free_eval_params`.

Shared knobs: ``clip_grad`` (global L2 norm, ``max / (norm + 1e-6)`` as Megatron and
``torch.nn.utils.clip_grad_norm_``; 0 turns it off), ``weight_decay`` or a ``wd_schedule``
(start/end_weight_decay; required when ``weight_decay_incr_style`` is not constant),
``decoupled_lr`` (embedding and output layer on ``decoupled_lr_schedule``),
``use_precision_aware_optimizer`` with ``exp_avg_dtype``/``exp_avg_sq_dtype`` (Adam moments
stored as TE's FusedAdam does: bf16 cast, fp16/fp8 per-layer scaled) and ``main_grads_dtype``
(the optimizer reads gradients rounded to it). ``main_params_dtype`` fp16 keeps the master
weights in the optimizer state (:func:`keep_master_copy`) while the parameters are held in the
training dtype. ``optimizer_memory_host_offload`` (MaxText)
puts the state in pinned host memory like ``paged_adamw8bit``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxtrain.config import complete
from jaxtrain.config.areas import optim as _knob_areas
from jaxtrain.optim import quantized as q

MEGATRON = "megatron"
PGS = "pgs"

# The accepted values are the registry's (jaxtrain/config/areas/optim.py).
MEGATRON_OPTIMIZERS = _knob_areas._MEGATRON_OPTIMIZERS
PGS_OPTIMIZERS = _knob_areas._PGS_OPTIMIZERS
SCALE_MODES = _knob_areas._MUON_SCALE_MODES
MATMUL_PRECS = _knob_areas._MUON_MATMUL_PRECS
TP_MODES = _knob_areas._MUON_TP_MODES

LION_BETAS = (0.95, 0.98)  # bitsandbytes Lion8bit as pgs builds it
PGS_MUON_LR_MULT = 10.0  # pgs: "Muon LR is typically 10x AdamW LR"
HOST_MEMORY = "pinned_host"
UNPINNED_HOST_MEMORY = "unpinned_host"

# Newton-Schulz coefficient sets (a, b, c): X <- a X + (b A + c A^2) X, A = X X^T.
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))  # Emerging-Optimizers "quintic"
JORDAN = ((3.4445, -4.7750, 2.0315),)  # torch.optim.Muon / Keller Jordan's original
NS_COEFFICIENTS = {"quintic": QUINTIC, "jordan": JORDAN}

_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16,
           "fp8": jnp.float8_e4m3fn}


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Everything the optimizer needs, in the optimizer's own terms."""

    name: str = "adam"  # adam sgd muon dist_muon | adamw lion8bit adamw8bit paged_adamw8bit
    flavour: str = MEGATRON  # whose semantics: megatron or pgs
    schedule_free: bool = False
    lr: float = 2e-5
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    adam_eps_root: float = 0.0  # MaxText: added to the second moment inside the root
    decay_all: bool = False  # MaxText: weight decay on every parameter (empty adamw_mask)
    sgd_momentum: float = 0.9
    weight_decay: float = 0.0
    weight_decay_incr_style: str = "constant"
    clip_grad: float = 1.0
    muon_momentum: float = 0.95
    muon_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_coefficients: str = "quintic"
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_fp32_matmul_prec: str = "medium"
    muon_split_qkv: bool = True
    muon_fuse_fc1: bool = True
    muon_tp_mode: str = "blockwise"
    muon_lr_mult: float = 1.0
    tp_size: int = 1
    schedule_free_warmup_steps: int = 0
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    optimizer_memory_host_offload: bool = False
    optimizer_cpu_offload: bool = False
    offload_fraction: float = 1.0
    pin_host_memory: bool = True

    def __post_init__(self):
        known = MEGATRON_OPTIMIZERS + PGS_OPTIMIZERS
        _check(self.name in known, f"optimizer {self.name!r} is not one of {known}")
        _check(self.flavour in (MEGATRON, PGS), f"flavour {self.flavour!r}")
        _check(self.muon_scale_mode in SCALE_MODES, f"muon_scale_mode {self.muon_scale_mode!r}")
        _check(self.muon_fp32_matmul_prec in MATMUL_PRECS,
               f"muon_fp32_matmul_prec {self.muon_fp32_matmul_prec!r}")
        _check(self.muon_tp_mode in TP_MODES, f"muon_tp_mode {self.muon_tp_mode!r}")
        _check(self.muon_coefficients in NS_COEFFICIENTS,
               f"muon coefficients {self.muon_coefficients!r}")
        _check(self.muon_num_ns_steps >= 1,
               f"muon_num_ns_steps must be at least 1, got {self.muon_num_ns_steps}")
        n_sets = len(NS_COEFFICIENTS[self.muon_coefficients])
        _check(self.muon_num_ns_steps % n_sets == 0,
               f"muon_num_ns_steps ({self.muon_num_ns_steps}) must be a multiple of {n_sets}: "
               f"Megatron's Newton-Schulz (Emerging-Optimizers, quintic coefficients) cycles "
               f"through its {n_sets} coefficient sets and refuses other counts")
        _check(self.clip_grad >= 0, f"clip_grad must be >= 0, got {self.clip_grad}")
        for key in ("adam_beta1", "adam_beta2", "muon_momentum"):
            # a decay rate of 1 never forgets: Adam's bias correction divides by 1 - beta^t = 0
            _check(0 <= getattr(self, key) < 1,
                   f"{key} must be in [0, 1), got {getattr(self, key)}")
        _check(self.tp_size >= 1, f"tensor_model_parallel_size {self.tp_size}")
        for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                    "exp_avg_sq_dtype"):
            value = getattr(self, key)
            _check(value in _DTYPES, f"{key} {value!r} is not one of {tuple(_DTYPES)}")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ValueError(f"{key} {value} needs use_precision_aware_optimizer (Megatron "
                                 f"keeps optimizer dtypes at fp32 otherwise)")

    @property
    def uses_muon(self) -> bool:
        return not self.schedule_free and self.name in ("muon", "dist_muon")

    @property
    def eight_bit(self) -> bool:
        return not self.schedule_free and self.name in ("lion8bit", "adamw8bit",
                                                        "paged_adamw8bit")

    @property
    def host_offload(self) -> bool:
        """Optimizer state asked to live in host memory (paged 8-bit Adam, MaxText offload,
        Megatron optimizer_cpu_offload)."""
        paged = self.name == "paged_adamw8bit" and not self.schedule_free
        return paged or self.optimizer_memory_host_offload or self.optimizer_cpu_offload

    @property
    def master_params_dtype(self):
        """dtype the train state should keep the master weights in (main_params_dtype)."""
        return jnp.dtype(_DTYPES[self.main_params_dtype])

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "OptimConfig":
        """Read the optimizer knobs of a resolved config (or any mapping of canonical keys)."""
        cfg = complete(cfg)
        get = cfg.get
        is_set = getattr(cfg, "is_set", lambda k: k in cfg)
        flavour = get("optimizer_family") or MEGATRON
        name = get("train.optimizer") if flavour == PGS else get("optimizer")
        pgs_muon = flavour == PGS and name == "muon"
        scale_mode = get("muon_scale_mode")
        if pgs_muon and not is_set("muon_scale_mode"):
            scale_mode = "shape_scaling"  # torch.optim.Muon's "original" adjust_lr
        nesterov = get("muon_use_nesterov")
        if nesterov is None:
            nesterov = flavour == PGS
        steps, frac = get("train_iters"), get("lr_warmup_fraction")
        sf_warmup = (int(steps * frac) if steps and frac is not None
                     else int(get("lr_warmup_iters") or 0))
        return cls(
            name=name, flavour=flavour, schedule_free=bool(get("plugins.schedule_free")),
            lr=float(get("lr")), min_lr=float(get("min_lr") or 0.0),
            lr_warmup_init=float(get("lr_warmup_init") or 0.0),
            decoupled_lr=_opt_float(get("decoupled_lr")),
            decoupled_min_lr=_opt_float(get("decoupled_min_lr")),
            adam_beta1=float(get("adam_beta1")), adam_beta2=float(get("adam_beta2")),
            adam_eps=float(get("adam_eps")),
            adam_eps_root=float(get("adam_eps_root") or 0.0),
            decay_all=bool(get("decay_all_params")) and flavour == MEGATRON,
            sgd_momentum=float(get("sgd_momentum")),
            weight_decay=float(get("weight_decay") or 0.0),
            weight_decay_incr_style=get("weight_decay_incr_style"),
            clip_grad=float(get("clip_grad") or 0.0),
            muon_momentum=float(get("muon_momentum")), muon_nesterov=bool(nesterov),
            muon_num_ns_steps=int(get("muon_num_ns_steps")),
            muon_coefficients="jordan" if pgs_muon else "quintic",
            muon_scale_mode=scale_mode,
            muon_extra_scale_factor=float(get("muon_extra_scale_factor")),
            muon_fp32_matmul_prec=get("muon_fp32_matmul_prec"),
            muon_split_qkv=bool(get("muon_split_qkv")),
            muon_fuse_fc1=flavour == MEGATRON,
            muon_tp_mode=get("muon_tp_mode"),
            muon_lr_mult=PGS_MUON_LR_MULT if pgs_muon else 1.0,
            tp_size=int(get("tensor_model_parallel_size") or 1),
            schedule_free_warmup_steps=sf_warmup,
            use_precision_aware_optimizer=bool(get("use_precision_aware_optimizer")),
            main_grads_dtype=get("main_grads_dtype"),
            main_params_dtype=get("main_params_dtype"),
            exp_avg_dtype=get("exp_avg_dtype"),
            exp_avg_sq_dtype=get("exp_avg_sq_dtype"),
            optimizer_memory_host_offload=bool(get("optimizer_memory_host_offload")),
            optimizer_cpu_offload=bool(get("optimizer_cpu_offload")),
            offload_fraction=float(get("optimizer_offload_fraction")),
            pin_host_memory=bool(get("pin_cpu_params")),
        )


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(message)


def _opt_float(value):
    return None if value is None else float(value)


# ----------------------------------------------------------------------------- leaves

_BATCH_AXES = ("layers", "exp", "experts", "expert")  # stacked copies: one matrix each
_HEAD_AXES = ("q_heads", "kv_heads", "heads", "kv")
_TP_AXES = ("q_heads", "kv_heads", "heads", "mlp")  # what Megatron's TP splits
_BIAS = re.compile(r"bias|b[qkvoi](_\d+)?")
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the optimizer sees it: its path, logical axes and kind (embedding,
    position_embedding, output, norm, bias, matrix or vector)."""

    path: Path
    axes: tuple
    kind: str

    @property
    def batch_axes(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.axes) if a in _BATCH_AXES)

    @property
    def core_axes(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.axes) if a not in _BATCH_AXES)

    def matrix_axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(input axes, output axes) of the matrix this leaf is, per stacked copy. Weights are
        stored [in..., out...]; head axes travel together (wo [N, H, D] is (N*H) x D). A learned
        position embedding is torch's [P, D] = [out, in], as Megatron's scale factor reads it."""
        core = self.core_axes
        if self.kind == "position_embedding":
            return core[1:], core[:1]
        names = [self.axes[i] for i in core]
        k = 0
        while k < len(names) - 1 and names[k] in _HEAD_AXES:
            k += 1
        k = max(k, 1)
        return core[:k], core[k:]


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path(keypath) -> Path:
    return tuple(_key_name(k) for k in keypath)


def _axes_tuple(spec) -> tuple:
    return tuple(spec) if spec is not None else ()


def _is_axes(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, tuple))


def _kind(path: Path, axes: tuple) -> str:
    name, top = path[-1], path[0]
    core = [a for a in axes if a not in _BATCH_AXES]
    if top == "embedding":
        return "embedding"
    if top == "position_embedding":
        return "position_embedding"
    if top == "output":
        return "output"
    if any("norm" in p for p in path) or "norm" in axes:
        return "norm"
    if _BIAS.fullmatch(name):
        return "bias"
    return "matrix" if len(core) >= 2 else "vector"


def leaf_plan(params_axes) -> dict[Path, Leaf]:
    """path -> :class:`Leaf` for a tree of logical-axes PartitionSpecs (or tuples)."""
    flat = jax.tree_util.tree_flatten_with_path(params_axes, is_leaf=_is_axes)[0]
    plan = {}
    for keypath, spec in flat:
        path, axes = _path(keypath), _axes_tuple(spec)
        plan[path] = Leaf(path, axes, _kind(path, axes))
    return plan


def _by_path(plan: Mapping[Path, Any], fn: Callable[[Leaf], Any]) -> Callable:
    """A function tree -> tree of ``fn(leaf)`` by path (works on optax's masked trees)."""
    def label(tree):
        return jax.tree_util.tree_map_with_path(lambda kp, _: fn(plan[_path(kp)]), tree)
    return label


def _decayed(opt_cfg: OptimConfig, part: str) -> Callable[[Leaf], bool]:
    """Which leaves get weight decay: Megatron skips biases, norms and vectors; pgs also skips
    the embedding (names containing 'embed'), except in its Muon+AdamW hybrid."""
    if opt_cfg.decay_all:
        return lambda leaf: True
    if opt_cfg.flavour == PGS and part != "muon-adam":
        kinds = ("matrix", "output")
    else:
        kinds = ("matrix", "output", "embedding", "position_embedding")
    return lambda leaf: leaf.kind in kinds


def _muon_member(opt_cfg: OptimConfig) -> Callable[[Leaf], bool]:
    kinds = ("matrix", "output") if opt_cfg.flavour == PGS else ("matrix", "position_embedding")
    return lambda leaf: leaf.kind in kinds and len(leaf.core_axes) >= 2


# ----------------------------------------------------------------------------- pieces

def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Megatron's and torch's clipping: scale by ``min(1, max_norm / (norm + 1e-6))``."""
    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), updates))
        coeff = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        return jax.tree.map(lambda g: (g * coeff).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def round_grads(dtype) -> optax.GradientTransformation:
    """The optimizer reads gradients rounded to ``dtype`` (Megatron's main_grads_dtype)."""
    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: g.astype(dtype).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


class AdamState(NamedTuple):
    count: jax.Array
    mu: Any  # per leaf: a stored moment (see jaxtrain.optim.quantized)
    nu: Any


def scale_by_adam_stored(b1: float, b2: float, eps: float, mu_codec: q.Codec,
                         nu_codec: q.Codec, batch_axes: Callable[[Path], tuple] = lambda p: (),
                         eps_root: float = 0.0) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` (eps outside the root, ``eps_root`` inside, bias-corrected) whose
    moments are kept in ``mu_codec``/``nu_codec`` storage and computed in float32."""
    def init(params):
        def zeros(codec):
            return jax.tree_util.tree_map_with_path(
                lambda kp, p: q.encode(codec, jnp.zeros(p.shape, jnp.float32),
                                       batch_axes(_path(kp))), params)
        return AdamState(jnp.zeros([], jnp.int32), zeros(mu_codec), zeros(nu_codec))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        bc1 = 1.0 - b1 ** count.astype(jnp.float32)
        bc2 = 1.0 - b2 ** count.astype(jnp.float32)

        def step(kp, g, mu, nu):
            ba = batch_axes(_path(kp))
            g32 = g.astype(jnp.float32)
            m = q.decode(mu_codec, mu, ba)
            v = q.decode(nu_codec, nu, ba)
            m = b1 * m + (1.0 - b1) * g32
            v = b2 * v + (1.0 - b2) * g32 * g32
            u = (m / bc1) / (jnp.sqrt(v / bc2 + eps_root) + eps)
            return u.astype(g.dtype), q.encode(mu_codec, m, ba), q.encode(nu_codec, v, ba)

        out = jax.tree_util.tree_map_with_path(step, updates, state.mu, state.nu)
        treedef = jax.tree.structure(updates)
        u, mu, nu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))
        return u, AdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


class LionState(NamedTuple):
    mu: Any


def scale_by_lion_stored(b1: float, b2: float, mu_codec: q.Codec,
                         batch_axes: Callable[[Path], tuple] = lambda p: ()
                         ) -> optax.GradientTransformation:
    """Lion (Chen et al. 2023): ``sign(b1 m + (1 - b1) g)``; ``m <- b2 m + (1 - b2) g``; the
    moment kept in ``mu_codec`` storage."""
    def init(params):
        return LionState(jax.tree_util.tree_map_with_path(
            lambda kp, p: q.encode(mu_codec, jnp.zeros(p.shape, jnp.float32),
                                   batch_axes(_path(kp))), params))

    def update(updates, state, params=None):
        del params

        def step(kp, g, mu):
            ba = batch_axes(_path(kp))
            g32, m = g.astype(jnp.float32), q.decode(mu_codec, mu, ba)
            u = jnp.sign(b1 * m + (1.0 - b1) * g32)
            return u.astype(g.dtype), q.encode(mu_codec, b2 * m + (1.0 - b2) * g32, ba)

        out = jax.tree_util.tree_map_with_path(step, updates, state.mu)
        treedef = jax.tree.structure(updates)
        u, mu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out)))
        return u, LionState(mu)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- Muon

def muon_scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """Emerging-Optimizers' ``get_muon_scale_factor`` (out, in as torch's [out, in])."""
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    raise ValueError(f"muon_scale_mode {mode!r}")


@functools.partial(jax.jit, static_argnames=("steps", "coefficients", "precision", "eps"))
def newton_schulz(x: jax.Array, steps: int = 5, coefficients: str = "quintic",
                  precision: str = "medium", eps: float = 1e-7) -> jax.Array:
    """Orthogonalise each (..., m, n) matrix: Frobenius-normalise, then ``steps`` iterations
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the wide orientation, cycling through the
    coefficient sets. medium/low: bfloat16 operands, float32 accumulation (Emerging-Optimizers'
    explicit bf16 path); high: float32 operands at XLA precision HIGH."""
    coeffs = NS_COEFFICIENTS[coefficients]
    x = x.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))
    x = x / jnp.maximum(norm, eps)
    dt = jnp.float32 if precision == "high" else jnp.bfloat16
    prec = jax.lax.Precision.HIGH if precision == "high" else None

    # bfloat16 operands, float32 accumulation. XLA:CPU has no BF16 x BF16 = F32 dot: there the
    # operands are widened first (exact: a bf16 product is exact in float32).
    widen = dt == jnp.bfloat16 and jax.default_backend() == "cpu"

    def mm(a, b):
        if widen:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.matmul(a, b, precision=prec, preferred_element_type=jnp.float32)

    def iteration(x, abc):
        a, b, c = abc[0], abc[1], abc[2]
        gram = mm(x, jnp.swapaxes(x, -1, -2)).astype(dt)
        poly = (b * gram.astype(jnp.float32) + c * mm(gram, gram)).astype(dt)
        return (a * x.astype(jnp.float32) + mm(poly, x)).astype(dt), None

    table = jnp.asarray([coeffs[i % len(coeffs)] for i in range(steps)], jnp.float32)
    x = jax.lax.scan(iteration, x.astype(dt), table)[0].astype(jnp.float32)
    return jnp.swapaxes(x, -1, -2) if tall else x


def _to_matrix(x: jax.Array, leaf: Leaf):
    """(B, in, out) view of a leaf and the function that undoes it."""
    ins, outs = leaf.matrix_axes()
    batch = leaf.batch_axes
    perm = batch + ins + outs
    shape = lambda axes: tuple(x.shape[a] for a in axes)  # noqa: E731
    size = lambda axes: math.prod(shape(axes))  # noqa: E731
    mat = jnp.transpose(x, perm).reshape(size(batch), size(ins), size(outs))
    inv = tuple(perm.index(i) for i in range(x.ndim))

    def back(m):
        return jnp.transpose(m.reshape(shape(batch) + shape(ins) + shape(outs)), inv)
    return mat, back


def _tp_side(leaf: Leaf, x: jax.Array, tp: int) -> str | None:
    """'in' or 'out': the side of the matrix Megatron's tensor parallelism splits, if any. KV
    heads fewer than the TP degree (``tp % K == 0``) are replicated on every rank by Megatron,
    so each rank holds (and orthogonalises) the whole matrix."""
    if tp <= 1:
        return None
    ins, outs = leaf.matrix_axes()
    for side, axes in (("in", ins), ("out", outs)):
        named = [a for a in axes if leaf.axes[a] in _TP_AXES]
        if not named:
            continue
        size = x.shape[named[0]]
        if leaf.axes[named[0]] == "kv_heads" and size < tp and tp % size == 0:
            return None
        if named[0] != axes[0] or size % tp:
            raise ValueError(
                f"muon_tp_mode blockwise: {'/'.join(leaf.path)} {x.shape} cannot be split into "
                f"{tp} tensor-parallel blocks along {leaf.axes[named[0]]!r}")
        return side
    return None


def _split_tp(m: jax.Array, side: str | None, tp: int) -> jax.Array:
    """(B, in, out) -> (B*tp, ...): the tensor-parallel blocks along ``side`` as batch."""
    if not side or tp <= 1:
        return m
    b, i, o = m.shape
    if side == "out":
        return m.reshape(b, i, tp, o // tp).transpose(0, 2, 1, 3).reshape(b * tp, i, o // tp)
    return m.reshape(b * tp, i // tp, o)


def _unsplit(m: jax.Array, shape: tuple[int, int, int], side: str | None, tp: int) -> jax.Array:
    if not side or tp <= 1:
        return m
    b, i, o = shape
    if side == "out":
        return m.reshape(b, tp, i, o // tp).transpose(0, 2, 1, 3).reshape(b, i, o)
    return m.reshape(b, i, o)


def _fusion_groups(paths: list[Path], opt: OptimConfig) -> list[tuple[Path, ...]]:
    """Leaves that Megatron keeps as one weight: Q/K/V (when muon_split_qkv is false) and the
    gated MLP's wi_0/wi_1 (Megatron's fused linear_fc1). Everything else alone."""
    present, used, groups = set(paths), set(), []
    families = []
    if not opt.muon_split_qkv:
        families.append(("wq", "wk", "wv"))
    if opt.muon_fuse_fc1:
        families.append(("wi_0", "wi_1"))
    for path in paths:
        if path in used:
            continue
        for fam in families:
            if path[-1] in fam:
                members = tuple(path[:-1] + (n,) for n in fam)
                if all(m in present for m in members):
                    groups.append(members)
                    used.update(members)
                    break
        else:
            groups.append((path,))
            used.add(path)
    return groups


class MuonState(NamedTuple):
    mu: Any


def scale_by_megatron_muon(plan: Mapping[Path, Leaf], opt: OptimConfig
                           ) -> optax.GradientTransformation:
    """Muon's direction for the leaves it receives: EMA momentum (optionally Nesterov), then
    scaled Newton-Schulz per stacked matrix, fused weights and TP blocks as configured."""
    beta = opt.muon_momentum

    def init(params):
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: m + (1.0 - beta) * (g.astype(jnp.float32) - m),
                          updates, state.mu)
        if opt.muon_nesterov:
            direction = jax.tree.map(lambda g, m: g.astype(jnp.float32)
                                     + beta * (m - g.astype(jnp.float32)), updates, mu)
        else:
            direction = mu
        flat, treedef = jax.tree_util.tree_flatten_with_path(direction)
        paths = [_path(kp) for kp, _ in flat]
        value = dict(zip(paths, (x for _, x in flat)))
        # One matrix stack per fused weight (TP blocks as extra batch), on its wide side.
        jobs = []
        for group in _fusion_groups(paths, opt):
            leaves = [plan[p] for p in group]
            views = [_to_matrix(value[p], leaf) for p, leaf in zip(group, leaves)]
            sides = {(_tp_side(leaf, value[p], opt.tp_size)
                      if opt.muon_tp_mode == "blockwise" else None)
                     for p, leaf in zip(group, leaves)}
            if len(sides) > 1:
                raise NotImplementedError(
                    f"muon_tp_mode blockwise with fused {[p[-1] for p in group]}: the members "
                    f"split differently across {opt.tp_size} tensor-parallel ranks (replicated KV "
                    f"heads); set muon_split_qkv true or use muon_tp_mode duplicated")
            side = sides.pop()
            mats = [_split_tp(m, side, opt.tp_size) for m, _ in views]
            fused = jnp.concatenate(mats, axis=-1) if len(mats) > 1 else mats[0]
            size_in, size_out = fused.shape[-2:]
            tall = size_in > size_out
            jobs.append(dict(group=group, views=views, side=side, tall=tall,
                             widths=[m.shape[-1] for m in mats], size=(size_out, size_in),
                             wide=jnp.swapaxes(fused, -1, -2) if tall else fused))
        # Same-shaped stacks are orthogonalised in one batched Newton-Schulz.
        buckets: dict[tuple[int, int], list[int]] = {}
        for j, job in enumerate(jobs):
            buckets.setdefault(job["wide"].shape[-2:], []).append(j)
        for members in buckets.values():
            stacked = jnp.concatenate([jobs[j]["wide"] for j in members], axis=0)
            ortho = newton_schulz(stacked, opt.muon_num_ns_steps, opt.muon_coefficients,
                                  opt.muon_fp32_matmul_prec)
            start = 0
            for j in members:
                n = jobs[j]["wide"].shape[0]
                jobs[j]["ortho"] = ortho[start:start + n]
                start += n
        out = {}
        for job in jobs:
            o = jnp.swapaxes(job["ortho"], -1, -2) if job["tall"] else job["ortho"]
            o = o * (muon_scale_factor(*job["size"], opt.muon_scale_mode)
                     * opt.muon_extra_scale_factor)
            start = 0
            for p, w, (m, back) in zip(job["group"], job["widths"], job["views"]):
                part = _unsplit(o[..., start:start + w], m.shape, job["side"], opt.tp_size)
                out[p] = back(part)
                start += w
        new = treedef.unflatten([out[p] for p in paths])
        new = jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates)
        return new, MuonState(mu)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- assembly

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


def _stored_codecs(opt: OptimConfig) -> tuple[q.Codec, q.Codec]:
    if opt.name in ("adamw8bit", "paged_adamw8bit"):
        return q.Codec("8bit", signed=True), q.Codec("8bit", signed=False)
    if opt.use_precision_aware_optimizer:
        return (q.Codec.for_dtype(_DTYPES[opt.exp_avg_dtype]),
                q.Codec.for_dtype(_DTYPES[opt.exp_avg_sq_dtype]))
    return q.FP32, q.FP32


def _base(opt: OptimConfig, plan, lr, wd, part: str) -> optax.GradientTransformation:
    """The element-wise optimizer for the leaves of one LR group."""
    mask = _by_path(plan, _decayed(opt, part))
    batch_axes = lambda path: plan[path].batch_axes  # noqa: E731
    if opt.name == "sgd":
        return optax.chain(optax.add_decayed_weights(wd, mask),
                           optax.trace(decay=opt.sgd_momentum),
                           optax.scale_by_learning_rate(lr))
    if opt.name == "lion8bit":
        direction = scale_by_lion_stored(*LION_BETAS, q.Codec("8bit", signed=True), batch_axes)
    else:  # adam / adamw / 8-bit adamw / Muon's Adam
        mu_codec, nu_codec = _stored_codecs(opt)
        direction = scale_by_adam_stored(opt.adam_beta1, opt.adam_beta2, opt.adam_eps,
                                         mu_codec, nu_codec, batch_axes, opt.adam_eps_root)
    return optax.chain(direction, optax.add_decayed_weights(wd, mask),
                       optax.scale_by_learning_rate(lr))


def _schedule_free(opt: OptimConfig, plan, wd) -> optax.GradientTransformation:
    """schedulefree's AdamWScheduleFree: the k-th update (0-based) uses
    ``lr * min(1, (k + 1) / warmup)``. optax's wrapper reads its schedule at a 1-based step and
    the inner ``scale_by_learning_rate`` at a 0-based one, so each gets its own view of it."""
    peak, warm = opt.lr, opt.schedule_free_warmup_steps

    def ramp(k):
        return peak * jnp.minimum(1.0, (k + 1.0) / warm) if warm > 0 else jnp.float32(peak)

    inner = optax.chain(
        optax.scale_by_rms(decay=opt.adam_beta2, eps=opt.adam_eps, eps_in_sqrt=False,
                           bias_correction=True),
        optax.add_decayed_weights(wd, _by_path(plan, _decayed(opt, "schedule_free"))),
        optax.scale_by_learning_rate(ramp))
    return optax.contrib.schedule_free(inner, learning_rate=lambda step: ramp(step - 1),
                                       b1=opt.adam_beta1)


class MasterState(NamedTuple):
    master: Any  # per leaf: the master weight in main_params_dtype storage
    inner: Any


def keep_master_copy(inner: optax.GradientTransformation, codec: q.Codec,
                     batch_axes: Callable[[Path], tuple] = lambda p: ()
                     ) -> optax.GradientTransformation:
    """Megatron's ``main_params_dtype`` (Transformer Engine FusedAdam's master weights): the
    optimizer keeps its own copy of the weights stored in ``codec`` (fp16 with an fp32 scale per
    tensor, amax -> fp16_max / 2), runs ``inner`` on that copy in float32 (weight decay
    included) and sets each parameter, held in its own (training) dtype, to the new copy
    rounded to that dtype."""
    def init(params):
        master = jax.tree_util.tree_map_with_path(
            lambda kp, p: q.encode(codec, p, batch_axes(_path(kp))), params)
        return MasterState(master, inner.init(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("keep_master_copy needs the parameters")
        leaf = lambda x: isinstance(x, (q.Scaled, jax.Array))  # noqa: E731
        main = jax.tree_util.tree_map_with_path(
            lambda kp, m: q.decode(codec, m, batch_axes(_path(kp))), state.master, is_leaf=leaf)
        u, inner_state = inner.update(updates, state.inner, main)
        new = jax.tree.map(lambda m, d: m + d.astype(jnp.float32), main, u)
        stored = jax.tree_util.tree_map_with_path(
            lambda kp, n: q.encode(codec, n, batch_axes(_path(kp))), new)
        # the step that lands each parameter on the new master copy in its own dtype
        out = jax.tree.map(lambda n, p: n.astype(p.dtype).astype(jnp.float32)
                           - p.astype(jnp.float32), new, params)
        return out, MasterState(stored, inner_state)

    return optax.GradientTransformation(init, update)


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
        pre.append(round_grads(_DTYPES[opt_cfg.main_grads_dtype]))
    if opt_cfg.clip_grad > 0:
        pre.append(clip_by_global_norm(opt_cfg.clip_grad))
    if opt_cfg.schedule_free:
        if opt_cfg.main_params_dtype != "fp32":
            raise ValueError("main_params_dtype fp16 keeps a master copy for Megatron's Adam/SGD/"
                             "Muon; the schedule-free optimizers keep their own weights: use fp32")
        return optax.chain(*pre, _schedule_free(opt_cfg, plan, wd))

    muon_member = _muon_member(opt_cfg) if opt_cfg.uses_muon else (lambda leaf: False)
    decoupled = opt_cfg.decoupled_lr is not None

    def label(leaf: Leaf) -> str:
        if muon_member(leaf):
            return "muon"
        if decoupled and leaf.kind in ("embedding", "output"):
            return "decoupled"
        return "main"

    used = {label(leaf) for leaf in plan.values()}
    part = "muon-adam" if opt_cfg.uses_muon else "main"
    transforms = {}
    if "main" in used:
        transforms["main"] = _base(opt_cfg, plan, lr_schedule, wd, part)
    if "decoupled" in used:
        dec = _decoupled_schedule(opt_cfg, lr_schedule, decoupled_lr_schedule)
        transforms["decoupled"] = _base(opt_cfg, plan, dec, wd, part)
    if "muon" in used:
        lr = lr_schedule
        if opt_cfg.muon_lr_mult != 1.0:
            lr = _scaled(lr_schedule, opt_cfg.muon_lr_mult)
        transforms["muon"] = optax.chain(scale_by_megatron_muon(plan, opt_cfg),
                                         optax.add_decayed_weights(wd),
                                         optax.scale_by_learning_rate(lr))
    core = optax.partition(transforms, _by_path(plan, label))
    if opt_cfg.use_precision_aware_optimizer and opt_cfg.main_params_dtype != "fp32":
        core = keep_master_copy(core, q.Codec.for_dtype(_DTYPES[opt_cfg.main_params_dtype]),
                                lambda path: plan[path].batch_axes)
    return optax.chain(*pre, core)


def _scaled(schedule, factor: float):
    if callable(schedule):
        return lambda count: schedule(count) * factor
    return schedule * factor


def param_labels(opt_cfg: OptimConfig, params_axes) -> dict[Path, str]:
    """path -> 'muon' / 'adam' (the Adam part) / '<name>' for inspection and logging."""
    plan = leaf_plan(params_axes)
    member = _muon_member(opt_cfg) if opt_cfg.uses_muon else (lambda leaf: False)
    other = "adam" if opt_cfg.uses_muon else opt_cfg.name
    return {p: ("muon" if member(leaf) else other) for p, leaf in plan.items()}


# ----------------------------------------------------------------------------- placement

def opt_state_memory_kind(opt_cfg: OptimConfig, device=None) -> str | None:
    """Memory kind for the optimizer state's shardings: ``'pinned_host'`` when the config asks
    for host-resident state (paged_adamw8bit, optimizer_memory_host_offload,
    optimizer_cpu_offload) and ``device`` (default: the first device) offers pinned host memory
    (``'unpinned_host'`` with Megatron's ``pin_cpu_params: false``); ``None`` means device
    memory.

    The train step reads such state with ``jax.device_put`` to device memory and writes the new
    state back with these shardings (MaxText's scheme). Paging on demand (bitsandbytes' CUDA
    unified memory) has no XLA equivalent, so paged_adamw8bit is *mapped* to this."""
    if not opt_cfg.host_offload:
        return None
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memory kinds keeps state on device
        return None
    wanted = HOST_MEMORY if opt_cfg.pin_host_memory else UNPINNED_HOST_MEMORY
    return wanted if wanted in kinds else None


def with_opt_state_memory_kind(shardings, opt_cfg: OptimConfig, device=None, abstract=None):
    """``shardings`` (a tree of Shardings for the optimizer state) placed per
    :func:`opt_state_memory_kind`. With ``optimizer_offload_fraction`` < 1 (and ``abstract``,
    the state's shapes), only the first leaves holding that share of the state's bytes go to
    the host, in tree order (Megatron offloads that share of the parameters' state)."""
    kind = opt_state_memory_kind(opt_cfg, device)
    if kind is None:
        return shardings
    if abstract is None or opt_cfg.offload_fraction >= 1.0:
        return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)]
    budget, placed, flat = opt_cfg.offload_fraction * sum(sizes), 0, []
    leaves, treedef = jax.tree.flatten(shardings)
    for s, size in zip(leaves, sizes):
        host = placed + size <= budget
        placed += size if host else 0
        flat.append(s.with_memory_kind(kind) if host else s)
    return jax.tree.unflatten(treedef, flat)


def schedule_free_eval_params(opt_state, params):
    """The averaged iterate (``x``) of a schedule-free optimizer state, for evaluation and
    export; ``params`` unchanged for other optimizers."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
            x, optax.contrib.ScheduleFreeState)):
        if isinstance(node, optax.contrib.ScheduleFreeState):
            return optax.contrib.schedule_free_eval_params(node, params)
    return params
