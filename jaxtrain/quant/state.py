"""Which weights are quantized, their delayed-scaling state, and the hook ``dense`` calls.

The state is a tree beside the parameters (``TrainState.fp8``), not inside them:

    {"layers": {"attn": {"wq": {"x": {"amax_history": [L, H], "scale": [L, 1]},
                                "w": {...}, "g": {...}}, ...},
                "mlp":  {"wi_0": {...}, ...}}}

(layer axis first, H = history length). :func:`attach` puts each projection's slice of it next
to its weight as a :class:`QWeight` before the layer stack runs, so it rides through the layer
scan and remat with the weight; ``dense`` unwraps it. The quantized projections are the ``w*``
weights under ``layers`` without an experts axis (attention and MLP projections, MLA's too).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.errors import ConfigError
from jaxtrain.quant import numerics as nx
from jaxtrain.quant.matmul import qeinsum


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QWeight:
    """A projection weight with its delayed-scaling state (``meta``) and a per-layer switch
    ``on`` (bool [1]; False runs the layer unquantized: first_last_layers_bf16)."""

    w: Any
    meta: Any = None
    on: Any = None

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self):
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype


def quantized_paths(cfg) -> list[tuple[str, ...]]:
    """Paths (under ``layers``) of the weights the quantized matmuls take."""
    # imported here: the models import this module
    from jaxtrain.models.params import MOE_STACK, ParamSpec, layer_kinds, param_specs

    if MOE_STACK in layer_kinds(cfg):
        raise ConfigError("quantization covers dense models: the MoE expert GEMMs have no "
                          "quantized path yet (and MoE layers no scaling state)")
    found = []
    leaves = jax.tree_util.tree_flatten_with_path(
        param_specs(cfg)["layers"], is_leaf=lambda s: isinstance(s, ParamSpec))[0]
    for path, spec in leaves:
        keys = tuple(k.key for k in path)
        if keys[-1].startswith("w") and len(spec.shape) >= 3 and "exp" not in spec.axes:
            found.append(keys)
    return found


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
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (cfg.num_layers, *a.shape)), one)
    tree: dict = {}
    for path in quantized_paths(cfg):
        tree = _put(tree, path, stacked)
    return {"layers": tree}


def _check_layout():
    from jaxtrain.parallel import sharding

    layout = sharding.active_layout()
    if layout is not None and layout.mcfg.stage >= 3 and not layout.mcfg.reshard_after_forward:
        raise ConfigError("quantization with per-layer state or layer switches (delayed "
                          "scaling, first_last_layers_bf16) does not run with FSDP weights "
                          "kept gathered (parallel.reshard_after_forward false); keep the "
                          "default reshard_after_forward true")


def attach(params: dict, cfg, state: dict | None = None) -> dict:
    """``params`` with each quantized weight under ``layers`` wrapped as a :class:`QWeight`
    holding its slice of ``state`` (layer axis moved to ``cfg.param_scan_axis`` like the
    weights') and its layers' switches. Unchanged when nothing needs attaching."""
    qc = getattr(cfg, "quant", None)
    switches = qc is not None and (qc.bf16_start or qc.bf16_end)
    stateful = qc is not None and qc.stateful and state is not None
    if not (switches or stateful):
        return params
    _check_layout()
    ax = cfg.param_scan_axis
    on = None
    if switches:
        on = jnp.moveaxis(jnp.asarray(qc.layer_quantized(cfg.num_layers)).reshape(-1, 1), 0, ax)
    layers = params["layers"]
    for path in quantized_paths(cfg):
        meta = None
        if stateful:
            meta = jax.tree.map(lambda a: jnp.moveaxis(a, 0, ax), _get(state["layers"], path))
        layers = _put(layers, path, QWeight(_get(layers, path), meta, on))
    return {**params, "layers": layers}


def project(eq: str, x, w, cfg):
    """The quantized form of ``einsum(eq, x, w)`` in the compute dtype (``dense``'s hook)."""
    dt = cfg.compute_dtype
    meta = on = None
    if isinstance(w, QWeight):
        w, meta, on = w.w, w.meta, w.on
    x, w = x.astype(dt), w.astype(dt)
    if on is None:
        return qeinsum(eq, x, w, cfg.quant, meta)
    return jax.lax.cond(jnp.reshape(on, ()), lambda a, b: qeinsum(eq, a, b, cfg.quant),
                        lambda a, b: jnp.einsum(eq, a, b), x, w)
