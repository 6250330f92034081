"""OptimConfig: the optimizer knobs of a resolved config, in the optimizer's own terms.

Two dialects choose the optimizer: Megatron's ``optimizer`` (also MaxText configs; flavour
``megatron``) and pgs's ``train.optimizer`` (flavour ``pgs``). The flavour decides the
semantics where the two differ: which leaves decay (:func:`jaxtrain.optim.leaves.decayed`),
which leaves Muon takes and its coefficients, scale, Nesterov and LR multiplier.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxtrain.config import complete
from jaxtrain.config.areas import optim as _knob_areas
from jaxtrain.models.moe.config import parse_layer_freq
from jaxtrain.models.spec import freq_pattern, linear_pattern, stack_kinds, window_pattern

MEGATRON = "megatron"
PGS = "pgs"

# The accepted values are the registry's (jaxtrain/config/areas/optim.py).
MEGATRON_OPTIMIZERS = _knob_areas._MEGATRON_OPTIMIZERS
PGS_OPTIMIZERS = _knob_areas._PGS_OPTIMIZERS
SCALE_MODES = _knob_areas._MUON_SCALE_MODES
MATMUL_PRECS = _knob_areas._MUON_MATMUL_PRECS
TP_MODES = _knob_areas._MUON_TP_MODES

PGS_MUON_LR_MULT = 10.0  # pgs: "Muon LR is typically 10x AdamW LR"

# The Newton-Schulz coefficient sets (a, b, c) a config's muon_coefficients names (the
# iteration is jaxtrain.optim.muon.newton_schulz): X <- a X + (b A + c A^2) X, A = X X^T.
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))  # Emerging-Optimizers "quintic"
JORDAN = ((3.4445, -4.7750, 2.0315),)  # torch.optim.Muon / Keller Jordan's original
NS_COEFFICIENTS = {"quintic": QUINTIC, "jordan": JORDAN}

# The optimizer dtype knobs (main_grads_dtype, main_params_dtype, exp_avg_dtype,
# exp_avg_sq_dtype) by value.
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16,
          "fp8": jnp.float8_e4m3fn}


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
    wd_qk_norm: bool = False  # Megatron apply_wd_to_qk_layernorm: q/k norm scales decayed
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
    # pgs's optimisation extras (jaxtrain.optim.pgs_extras)
    adagc: bool = False
    adagc_lambda: float = 1.5
    adagc_beta: float = 0.95
    adagc_warmup_steps: int | None = None  # None: the LR schedule's warm-up (pgs's)
    adamc: bool = False
    llrd_decay: float = 1.0
    layer_stacks: tuple[str, ...] | None = None  # the stack of each layer, dense and MoE mixed
    hyperball: bool = False
    hyperball_lr: float = 0.0
    mona: bool = False
    mona_beta_a: float = 0.975
    mona_lite: bool = True
    freeze_linear: bool = False   # pgs freeze_non_attention: Gated DeltaNet layers fixed
    # DeepSeek-V4 without the indexer loss (v4_indexer_distill_loss_coeff 0): the indexers
    # stay as initialised (Primus sets them requires_grad False), no weight decay either
    freeze_indexer: bool = False

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
            _check(value in DTYPES, f"{key} {value!r} is not one of {tuple(DTYPES)}")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ValueError(f"{key} {value} needs use_precision_aware_optimizer (Megatron "
                                 f"keeps optimizer dtypes at fp32 otherwise)")
        _check(self.adagc_lambda > 0, f"train.adagc_lambda must be positive, got "
               f"{self.adagc_lambda}")
        for key in ("adagc_beta", "mona_beta_a"):
            # mona_beta_a = 1 would make MONA's alpha = -1 / (2 (1 - beta)) infinite
            _check(0 <= getattr(self, key) < 1,
                   f"train.{key} must be in [0, 1), got {getattr(self, key)}")
        _check(0 < self.llrd_decay <= 1, f"train.llrd_decay must be in (0, 1] (1 is off), got "
               f"{self.llrd_decay}")
        _check(self.hyperball_lr >= 0, f"train.hyperball_lr must be >= 0 (0 calibrates each "
               f"matrix), got {self.hyperball_lr}")
        _check(self.adagc_warmup_steps is None or self.adagc_warmup_steps >= 0,
               f"adagc_warmup_steps must be >= 0, got {self.adagc_warmup_steps}")

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
        return jnp.dtype(DTYPES[self.main_params_dtype])

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
        llrd = _float_or(get("train.llrd_decay"), 1.0)
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
            wd_qk_norm=bool(get("apply_wd_to_qk_layernorm")) or get(
                "no_weight_decay_cond_type") == "apply_wd_to_qk_layernorm",
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
            adagc=bool(get("train.adagc")),
            adagc_lambda=_float_or(get("train.adagc_lambda"), 1.5),
            adagc_beta=_float_or(get("train.adagc_beta"), 0.95),
            adamc=bool(get("train.adamc")), llrd_decay=llrd,
            layer_stacks=_layer_stacks(get) if llrd < 1 else None,
            hyperball=bool(get("train.hyperball")),
            hyperball_lr=_float_or(get("train.hyperball_lr"), 0.0),
            mona=bool(get("train.mona")), mona_beta_a=_float_or(get("train.mona_beta_a"), 0.975),
            mona_lite=get("train.mona_lite") is not False,
            freeze_linear=bool(get("train.freeze_non_attention")),
            freeze_indexer=(get("model_type") == "deepseek_v4"
                            and not get("v4_indexer_distill_loss_coeff")),
        )


def _check(ok: bool, message: str):
    if not ok:
        raise ValueError(message)


def _opt_float(value):
    return None if value is None else float(value)


def _float_or(value, default):
    return default if value is None else float(value)


def _layer_stacks(get) -> tuple[str, ...] | None:
    """The stack of each layer when a model mixes stacks (dense and MoE layers, softmax and
    Gated DeltaNet ones, Gemma 4's global ones), for layer-wise LR decay; None for one stack."""
    layers = get("num_layers")
    if not layers:
        return None
    moe = (False,) * int(layers)
    if get("num_experts"):
        freq = get("moe_layer_freq")
        moe = freq_pattern(parse_layer_freq(freq if freq is not None else 1), int(layers))
    linear = None
    if get("experimental_attention_variant") in ("gdn", "gated_delta_net") and \
            get("linear_attention_freq") is not None:
        linear = linear_pattern(parse_layer_freq(get("linear_attention_freq")), int(layers))
    kinds = stack_kinds(moe, linear, _global_layers(get, int(layers)))
    return None if len(set(kinds)) == 1 else kinds


_GLOBAL_SHAPE = ("global_kv_channels", "global_num_query_groups", "attention_k_eq_v",
                 "global_rotary_percent")


def _global_layers(get, n: int) -> tuple[bool, ...] | None:
    """Gemma 4's global layers (the ones without a sliding window) when the model gives them
    a shape of their own; the window knobs as ModelConfig.from_config reads them."""
    if not any(get(k) for k in _GLOBAL_SHAPE):
        return None
    size, freq = get("window_size"), get("window_attn_skip_freq")
    if isinstance(size, str):
        size = [int(v) for v in size.strip("()[] ").split(",") if v.strip()]
    if size is None or size[0] == -1:
        return (not get("sliding_window_size"),) * n
    if freq is None:
        return (False,) * n
    return tuple(not w for w in window_pattern(parse_layer_freq(freq), n))