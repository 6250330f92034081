"""Activation rematerialisation: MaxText ``remat_policy`` names and Megatron recompute layouts.

The layer tags its intermediates with ``checkpoint_name`` using MaxText's names:
``decoder_layer_input``, ``query_proj``, ``key_proj``, ``value_proj``, ``context`` (attention
output before the out projection), ``out_proj``, ``mlpwi_0``/``mlpwi_1`` (gated MLP) or
``mlpwi``, and ``mlpwo``; quantized matmuls name their quantized operands ``quantization``.
q, k and v are separate projections here, so MaxText's fused ``qkv_proj`` stands for the three
of them (in the custom policy too).

:func:`layer_plan` turns Megatron's ``recompute_method``/``recompute_num_layers``/
``recompute_layer_ids`` into contiguous layer segments, each with a group size and a policy.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

_QKV = ("query_proj", "value_proj", "key_proj")
_MINIMAL = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
_OFFLOAD = dict(offload_src="device", offload_dst="pinned_host")

NO_REMAT = "no-remat"

_SAVE = {
    "minimal": _MINIMAL,
    "minimal_with_context": _MINIMAL + ("context",),
    "minimal_flash": _MINIMAL + ("context",),
    "minimal_with_quantization": _MINIMAL + ("quantization",),
    "minimal_with_context_and_quantization": _MINIMAL + ("context", "quantization"),
    "save_dot_with_context_except_mlp": _QKV + ("context", "out_proj"),
    "save_dot_except_mlpwi": _QKV + ("out_proj", "mlpwo"),
    "save_dot_except_mlp": _QKV + ("out_proj",),
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
}
_OFFLOADED = {
    "qkv_proj_offloaded": ("query_proj", "value_proj", "key_proj"),
    "minimal_offloaded": _MINIMAL,
}
REMAT_POLICIES = ("none", "full", "custom", *_SAVE, *_OFFLOADED)


def checkpoint_policy(cfg):
    """The ``jax.checkpoint`` policy for ``cfg.remat_policy``; NO_REMAT for 'none'.

    'full' saves nothing (policy None); 'custom' saves the ``device`` tensors and offloads the
    ``offload`` tensors of ``cfg.remat_tensors`` to pinned host memory, recomputing the rest.
    """
    name = cfg.remat_policy
    if name == "none":
        return NO_REMAT
    if name == "full":
        return None
    if name in _SAVE:
        return jax.checkpoint_policies.save_only_these_names(*_SAVE[name])
    if name in _OFFLOADED:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(_OFFLOADED[name]),
            **_OFFLOAD)
    if name == "custom":
        device, offload = custom_names(cfg.remat_tensors)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=device, names_which_can_be_offloaded=offload, **_OFFLOAD)
    raise ValueError(f"remat_policy={name!r} is not one of {REMAT_POLICIES}")


def custom_names(remat_tensors) -> tuple[list[str], list[str]]:
    """(names kept on device, names offloaded) of MaxText's per-tensor remat modes; the fused
    ``qkv_proj``, when kept or offloaded, stands for query_proj, key_proj and value_proj."""
    modes = dict(remat_tensors)
    fused = modes.pop("qkv_proj", "remat")
    if fused != "remat":
        modes.update({part: fused for part in _QKV})
    device = [n for n, mode in modes.items() if mode == "device"]
    offload = [n for n, mode in modes.items() if mode == "offload"]
    return device, offload


class Segment(NamedTuple):
    """Layers [start, stop) run in groups of ``group`` layers, each group under ``policy``."""

    start: int
    stop: int
    group: int
    policy: object


def layer_plan(cfg, lo: int = 0, hi: int | None = None) -> list[Segment]:
    """Contiguous layer segments of layers [lo, hi) (default all) with their remat policy
    (NO_REMAT: plain).

    Default: every layer rematted on its own with ``cfg.remat_policy``. Megatron layouts:
    ``uniform`` N: groups of N consecutive layers, one checkpoint per group (the last group may
    be shorter); ``block`` N: the first N layers rematted, the rest plain;
    ``recompute_layer_ids``: exactly those layers rematted. As in Megatron, a pipeline stage
    (layers [lo, hi)) counts ``uniform`` groups and ``block``'s first N from its own first layer.
    """
    hi = cfg.num_layers if hi is None else hi
    n, policy = hi - lo, checkpoint_policy(cfg)
    if policy is NO_REMAT or (cfg.recompute_method is None and cfg.recompute_layer_ids is None):
        return [Segment(lo, hi, 1, policy)]
    if cfg.recompute_method == "uniform":
        k = min(cfg.recompute_num_layers, n)
        full = lo + n // k * k
        segs = [Segment(lo, full, k, policy)]
        return segs + ([Segment(full, hi, hi - full, policy)] if full < hi else [])
    if cfg.recompute_method == "block":
        k = lo + min(cfg.recompute_num_layers, n)
        return [Segment(lo, k, 1, policy)] + ([Segment(k, hi, 1, NO_REMAT)] if k < hi else [])
    chosen = set(cfg.recompute_layer_ids)
    segs: list[Segment] = []
    for i in range(lo, hi):
        p = policy if i in chosen else NO_REMAT
        if segs and segs[-1].policy is p:
            segs[-1] = segs[-1]._replace(stop=i + 1)
        else:
            segs.append(Segment(i, i + 1, 1, p))
    return segs
