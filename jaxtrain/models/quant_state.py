"""Which of the model's weights are quantized, their delayed-scaling state, and attaching it.

The state is a tree beside the parameters (``TrainState.quant_state``), not inside them, one
subtree per layer stack (dense ``layers``, ``moe_layers``):

    {"layers": {"attn": {"wq": {"x": {"amax_history": [L, H], "scale": [L, 1]},
                                "w": {...}, "g": {...}}, ...},
                "mlp":  {"wi_0": {...}, ...}},
     "moe_layers": {"attn": {...}, "moe": {"experts": {"wi_0": {...}, ...}, "shared": {...}}}}

(layer axis first, H = history length). :func:`attach` puts each projection's slice of it next
to its weight as a :class:`jaxtrain.quant.QWeight` before the layer stacks run, so it rides
through the layer scan and remat with the weight; ``dense`` and the MoE experts unwrap it
(:mod:`jaxtrain.quant.hooks`). The quantized projections are the ``w*`` weights of the layer
stacks: attention (MLA's too), MLP, the experts and the shared expert; the router, embedding
and output layer stay in the compute dtype (as in Megatron and MaxText).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.config.errors import ConfigError
from jaxtrain.models.params import param_specs
from jaxtrain.models.spec import STACKS, ParamSpec, layer_slots
from jaxtrain.parallel import sharding
from jaxtrain.quant import numerics as nx
from jaxtrain.quant.hooks import QWeight


def quantized_paths(cfg) -> list[tuple[str, ...]]:
    """Paths (the layer stack first) of the weights the quantized matmuls take."""
    specs = param_specs(cfg)
    found = []
    for stack in STACKS:
        if stack not in specs:
            continue
        leaves = jax.tree_util.tree_flatten_with_path(
            specs[stack], is_leaf=lambda s: isinstance(s, ParamSpec))[0]
        for path, spec in leaves:
            keys = (stack, *(k.key for k in path))
            if keys[-1].startswith("w") and len(spec.shape) >= 3 and "router" not in keys:
                found.append(keys)
    return found


def _stack_layers(cfg) -> dict[str, list[int]]:
    """Each layer stack's layers (0-based model layer numbers, in stack order)."""
    out: dict[str, list[int]] = {}
    for i, (stack, _) in enumerate(layer_slots(cfg)):
        out.setdefault(stack, []).append(i)
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put(tree: dict, path, value) -> dict:
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _put(tree.get(path[0], {}), path[1:], value)}


def init_state(cfg) -> dict | None:
    """The delayed-scaling state for ``cfg`` (None when its recipe keeps none)."""
    qc = getattr(cfg, "quant", None)
    if qc is None or not qc.stateful:
        return None
    one = {role: nx.delayed_init(qc.history_len) for role in ("x", "w", "g")}
    count = {k: len(v) for k, v in _stack_layers(cfg).items()}
    tree: dict = {}
    for path in quantized_paths(cfg):
        n = count[path[0]]
        tree = _put(tree, path, jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), one))
    return tree


def _check_layout():
    layout = sharding.active_layout()
    if layout is not None and layout.mcfg.stage >= 3 and not layout.mcfg.reshard_after_forward:
        raise ConfigError("quantization with per-layer state or layer switches (delayed "
                          "scaling, first_last_layers_bf16) does not run with FSDP weights "
                          "kept gathered (parallel.reshard_after_forward false); keep the "
                          "default reshard_after_forward true")


def switches(cfg) -> dict | None:
    """Per layer stack: bool [L_stack, 1], whether each of its layers' projections are
    quantized (first_last_layers_bf16), or None when every layer is."""
    qc = getattr(cfg, "quant", None)
    if qc is None or not (qc.bf16_start or qc.bf16_end):
        return None
    quantized = qc.layer_quantized(cfg.num_layers)
    return {stack: jnp.asarray([quantized[i] for i in layers]).reshape(-1, 1)
            for stack, layers in _stack_layers(cfg).items()}


def attach_stacks(stacks: dict, cfg, state: dict | None, on: dict | None) -> dict:
    """Layer stacks (the model's, or a pipeline stage's slices) with each quantized weight
    wrapped as a :class:`QWeight` holding the matching slices of ``state`` and of the ``on``
    switches, whose layer axis sits where the weights' does (either may be None)."""
    if state is None and on is None:
        return stacks
    _check_layout()
    out = dict(stacks)
    for path in quantized_paths(cfg):
        if path[0] in stacks:
            meta = None if state is None else _get(state, path)
            out = _put(out, path, QWeight(_get(stacks, path), meta,
                                          None if on is None else on.get(path[0])))
    return out


def attach(params: dict, cfg, state: dict | None = None) -> dict:
    """``params`` with each quantized weight wrapped as a :class:`QWeight` holding its slice
    of ``state`` (layer axis moved to ``cfg.param_scan_axis`` like the weights') and its
    layers' switches. Unchanged when nothing needs attaching."""
    qc = getattr(cfg, "quant", None)
    stateful = qc is not None and qc.stateful and state is not None

    def at_scan_axis(tree):
        return None if tree is None else jax.tree.map(
            lambda a: jnp.moveaxis(a, 0, cfg.param_scan_axis), tree)

    stacks = {k: params[k] for k in STACKS if k in params}
    return {**params, **attach_stacks(stacks, cfg, at_scan_axis(state if stateful else None),
                                      at_scan_axis(switches(cfg)))}
