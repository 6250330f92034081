"""XLA flags and JAX options from the communication knobs, set before the backend starts.

Megatron tunes communication through DDP buckets, NCCL options and Transformer Engine
userbuffers; under XLA the same intents are compiler flags. GPU flags are emitted only for a
GPU platform (XLA parses them on every platform, so the tests check all of them against the
installed jaxlib). A knob left off emits nothing and XLA's defaults stay.

- ``overlap_grad_reduce``: latency-hiding scheduler (LHS); pipelined all-reduce and
  reduce-scatter (the collective pipeliner moves a scanned layer's gradient reduction into the
  next loop iteration).
- ``overlap_param_gather``: LHS; pipelined all-gather (the next scanned layer's parameters are
  gathered during the current one).
- ``overlap_param_gather_with_optimizer_step``: LHS (gathers after the update overlap the rest
  of the update, which is the same compiled program).
- ``ddp_bucket_size`` (elements): all-reduce and reduce-scatter combine thresholds = elements x
  gradient bytes; all-gather threshold = elements x parameter bytes. ``ddp_num_buckets``: the
  same with ceil(parameters per tensor x pipeline shard / buckets) elements.
- ``suggested_communication_unit_size`` (with ``use_megatron_fsdp``): all-gather (parameter
  bytes) and reduce-scatter (gradient bytes) thresholds; wins over the bucket thresholds.
- ``tp_comm_overlap``: with any of ``tp_comm_overlap_ag/_rs/_rs_dgrad``, collective matmul
  (windowed einsum threshold 0 MiB, multi-streamed) plus LHS; with ``tp_comm_bulk_wgrad`` or
  ``_dgrad``, LHS. XLA has one collective-matmul switch for all directions.
- ``deterministic_mode``: ``--xla_gpu_deterministic_ops``; ``jax_threefry_partitionable``.
- ``shardy``: ``jax_use_shardy_partitioner`` (False: GSPMD).
- ``distributed_timeout_minutes``: on CPU ``--xla_cpu_collective_timeout_seconds`` (gloo);
  the start-up timeout is applied in :mod:`jaxtrain.parallel.distributed`.

Gradient bytes: 2 with ``grad_reduce_in_bf16`` (or ``fp16`` without
``accumulate_allreduce_grads_in_fp32``), else 4. Parameter bytes: the item size of
``weight_dtype``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.registry import registry

LHS = "xla_gpu_enable_latency_hiding_scheduler"
PIPELINED_AR = "xla_gpu_enable_pipelined_all_reduce"
PIPELINED_RS = "xla_gpu_enable_pipelined_reduce_scatter"
PIPELINED_AG = "xla_gpu_enable_pipelined_all_gather"
AR_THRESHOLD = "xla_gpu_all_reduce_combine_threshold_bytes"
RS_THRESHOLD = "xla_gpu_reduce_scatter_combine_threshold_bytes"
AG_THRESHOLD = "xla_gpu_all_gather_combine_threshold_bytes"
WINDOWED_EINSUM = "xla_gpu_threshold_for_windowed_einsum_mib"
MULTI_STREAM_EINSUM = "xla_gpu_multi_streamed_windowed_einsum"
DETERMINISTIC = "xla_gpu_deterministic_ops"
CPU_COLLECTIVE_TIMEOUT = "xla_cpu_collective_timeout_seconds"

# Every flag name this module can emit (a test checks each against the installed jaxlib).
FLAG_NAMES = (LHS, PIPELINED_AR, PIPELINED_RS, PIPELINED_AG, AR_THRESHOLD, RS_THRESHOLD,
              AG_THRESHOLD, WINDOWED_EINSUM, MULTI_STREAM_EINSUM, DETERMINISTIC,
              CPU_COLLECTIVE_TIMEOUT)

_KINDS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "gpu_multiprocess": "gpu"}

logger = logging.getLogger("jaxtrain")


def platform_kind(cfg: Mapping[str, Any] | None = None, platform: str | None = None) -> str:
    """``"cpu"`` or ``"gpu"`` (other platforms by name) without touching a device.

    The first of: ``platform``, the first entry of ``JAX_PLATFORMS``, the ``hardware`` knob;
    GPU when none says.
    """
    name = platform or os.environ.get("JAX_PLATFORMS") or (cfg or {}).get("hardware") or "gpu"
    first = name.split(",")[0].strip().lower()
    return _KINDS.get(first, first)


def _value(cfg: Mapping[str, Any], key: str):
    if key in cfg:
        return cfg[key]
    return registry().knobs[key].default


def _grad_bytes(cfg) -> int:
    half = _value(cfg, "grad_reduce_in_bf16") or (
        _value(cfg, "fp16") and not _value(cfg, "accumulate_allreduce_grads_in_fp32"))
    return 2 if half else 4


def _param_bytes(cfg) -> int:
    import jax.numpy as jnp

    return jnp.dtype(_value(cfg, "weight_dtype")).itemsize


def accelerator_of(platform: str | None) -> str:
    """The model's accelerator kind ('cpu', 'cuda', 'rocm') for a platform name, decided from
    the name alone (a generic 'gpu' counts as CUDA): nothing asks JAX, so no backend starts."""
    name = (platform or "").split(",")[0].strip().lower()
    if platform_kind(platform=name or None) == "cpu":
        return "cpu"
    return "rocm" if name == "rocm" else "cuda"


def _params_per_shard(cfg, platform: str | None = None) -> int:
    """Parameters one model-parallel shard holds (what one DP bucket set covers). Counted
    from the model knobs without starting the JAX backend (the flags are not written yet).
    JAX and the model package are imported here: this start-up module stays importable
    without them, and only ddp_num_buckets needs the count."""
    import jax

    from jaxtrain.models.config import ModelConfig, assumed_accelerator
    from jaxtrain.models.params import param_specs

    try:
        with assumed_accelerator(accelerator_of(platform or platform_kind(cfg))):
            specs = param_specs(ModelConfig.from_config(cfg))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"ddp_num_buckets needs the model's parameter count, which this "
                          f"config does not give ({e}); set ddp_bucket_size instead") from None
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(specs))
    split = _value(cfg, "tensor_model_parallel_size") * _value(cfg, "pipeline_model_parallel_size")
    return math.ceil(total / split)


def _check(cfg) -> None:
    """The value checks, whatever the platform."""
    size, count = _value(cfg, "ddp_bucket_size"), _value(cfg, "ddp_num_buckets")
    if size is not None and count is not None:
        raise ConfigError("set either ddp_bucket_size or ddp_num_buckets, not both")
    if size is not None and size < 1:
        raise ConfigError(f"ddp_bucket_size must be a positive number of elements, got {size}")
    if count is not None and count < 1:
        raise ConfigError(f"ddp_num_buckets must be at least 1, got {count}")
    unit = _value(cfg, "suggested_communication_unit_size")
    if unit is not None and unit < 1:
        raise ConfigError(f"suggested_communication_unit_size must be positive, got {unit}")
    minutes = _value(cfg, "distributed_timeout_minutes")
    if minutes is None or minutes < 1:
        raise ConfigError(f"distributed_timeout_minutes must be at least 1, got {minutes}")


def _bucket_elements(cfg, num_params: int | None, platform: str | None) -> int | None:
    size, count = _value(cfg, "ddp_bucket_size"), _value(cfg, "ddp_num_buckets")
    if count is None:
        return size
    params = num_params if num_params is not None else _params_per_shard(cfg, platform)
    return math.ceil(params / count)


def _gpu_flags(cfg, num_params: int | None, platform: str | None = None) -> dict[str, str]:
    flags: dict[str, str] = {}
    if _value(cfg, "overlap_grad_reduce"):
        flags.update({LHS: "true", PIPELINED_AR: "true", PIPELINED_RS: "true"})
    if _value(cfg, "overlap_param_gather"):
        flags.update({LHS: "true", PIPELINED_AG: "true"})
    if _value(cfg, "overlap_param_gather_with_optimizer_step"):
        flags[LHS] = "true"

    bucket = _bucket_elements(cfg, num_params, platform)
    if bucket is not None:
        grad, param = bucket * _grad_bytes(cfg), bucket * _param_bytes(cfg)
        flags.update({AR_THRESHOLD: str(grad), RS_THRESHOLD: str(grad), AG_THRESHOLD: str(param)})
    unit = _value(cfg, "suggested_communication_unit_size")
    if _value(cfg, "use_megatron_fsdp") and unit is not None:
        flags.update({AG_THRESHOLD: str(unit * _param_bytes(cfg)),
                      RS_THRESHOLD: str(unit * _grad_bytes(cfg))})

    if _value(cfg, "tp_comm_overlap"):
        if any(_value(cfg, k) for k in ("tp_comm_overlap_ag", "tp_comm_overlap_rs",
                                        "tp_comm_overlap_rs_dgrad")):
            flags.update({WINDOWED_EINSUM: "0", MULTI_STREAM_EINSUM: "true", LHS: "true"})
        if _value(cfg, "tp_comm_bulk_wgrad") or _value(cfg, "tp_comm_bulk_dgrad"):
            flags[LHS] = "true"

    if _value(cfg, "deterministic_mode"):
        flags[DETERMINISTIC] = "true"
    return flags


def _cpu_flags(cfg) -> dict[str, str]:
    return {CPU_COLLECTIVE_TIMEOUT: str(int(_value(cfg, "distributed_timeout_minutes")) * 60)}


def xla_flags(cfg: Mapping[str, Any], platform: str, *, num_params: int | None = None
              ) -> list[str]:
    """The ``--name=value`` XLA flags the knobs in ``cfg`` ask for on ``platform``.

    ``platform`` is ``cpu``, ``gpu``, ``cuda`` or ``rocm``; GPU flags are emitted only for a
    GPU. ``num_params`` (parameters per model-parallel shard) is needed only for
    ``ddp_num_buckets``; without it the count comes from the model knobs. Knobs missing from
    ``cfg`` take their registry defaults. Bad values raise ConfigError.
    """
    _check(cfg)
    kind = platform_kind(platform=platform)
    flags = _cpu_flags(cfg) if kind == "cpu" else _gpu_flags(cfg, num_params, platform) \
        if kind == "gpu" else {}
    return [f"--{name}={value}" for name, value in flags.items()]


def runtime_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``jax.config`` options the knobs set (any platform)."""
    options = {"jax_use_shardy_partitioner": bool(_value(cfg, "shardy"))}
    if _value(cfg, "deterministic_mode"):
        options["jax_threefry_partitionable"] = True
    return options


def _flag_name(token: str) -> str:
    return token.lstrip("-").split("=", 1)[0]


def merge(existing: str, ours: list[str]) -> tuple[str, list[str], list[str]]:
    """``(XLA_FLAGS text, flags added, flags of ours the user's text already sets)``."""
    user = {_flag_name(t) for t in existing.split() if t.startswith("-")}
    added = [f for f in ours if _flag_name(f) not in user]
    kept = [f for f in ours if _flag_name(f) in user]
    return " ".join(existing.split() + added), added, kept


@dataclasses.dataclass(frozen=True)
class Applied:
    """What :func:`apply` did: flags added to XLA_FLAGS, flags of ours the user's XLA_FLAGS
    overrode, and the jax.config options set."""

    added: tuple[str, ...]
    overridden: tuple[str, ...]
    options: Mapping[str, Any]


def apply(cfg: Mapping[str, Any], platform: str, *, num_params: int | None = None) -> Applied:
    """Add :func:`xla_flags` to ``XLA_FLAGS`` and set :func:`runtime_options`.

    Call before anything starts the JAX backend: XLA reads ``XLA_FLAGS`` once, when the first
    backend starts. Flags already in ``XLA_FLAGS`` win: a flag we would emit whose name the
    user already set is left out (and reported in ``overridden``). If the backend has already
    started the flags are not applied (a GPU run logs a warning naming them); the jax.config
    options still are.
    """
    import jax
    from jax._src import xla_bridge

    ours = xla_flags(cfg, platform, num_params=num_params)
    options = runtime_options(cfg)
    added, kept = [], []
    if xla_bridge.backends_are_initialized():
        present = os.environ.get("XLA_FLAGS", "").split()
        late = [f for f in ours if f not in present]
        if late:
            # on CPU that is only the gloo timeout, which single-process runs never use
            level = logging.WARNING if platform_kind(platform=platform) == "gpu" else logging.DEBUG
            logger.log(level, "the JAX backend has already started, so these XLA flags cannot "
                       "take effect: %s", " ".join(late))
    else:
        text, added, kept = merge(os.environ.get("XLA_FLAGS", ""), ours)
        if text:
            os.environ["XLA_FLAGS"] = text
    for name, value in options.items():
        jax.config.update(name, value)
    return Applied(tuple(added), tuple(kept), options)
