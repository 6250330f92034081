"""Which weights are quantized, their delayed-scaling state, and the hooks the layers call.

The state is a tree beside the parameters (``TrainState.fp8``), not inside them, one subtree
per layer stack (dense ``layers``, ``moe_layers``):

    {"layers": {"attn": {"wq": {"x": {"amax_history": [L, H], "scale": [L, 1]},
                                "w": {...}, "g": {...}}, ...},
                "mlp":  {"wi_0": {...}, ...}},
     "moe_layers": {"attn": {...}, "moe": {"experts": {"wi_0": {...}, ...}, "shared": {...}}}}

(layer axis first, H = history length). :func:`attach` puts each projection's slice of it next
to its weight as a :class:`QWeight` before the layer stacks run, so it rides through the layer
scan and remat with the weight; ``dense`` and the MoE experts unwrap it. The quantized
projections are the ``w*`` weights of the layer stacks: attention (MLA's too), MLP, the
experts and the shared expert; the router, embedding and output layer stay in the compute
dtype (as in Megatron and MaxText).
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
    """Paths (the layer stack first) of the weights the quantized matmuls take."""
    # imported here: the models import this module
    from jaxtrain.models.params import STACKS, ParamSpec, param_specs

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
    from jaxtrain.models.params import layer_slots

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
    from jaxtrain.parallel import sharding

    layout = sharding.active_layout()
    if layout is not None and layout.mcfg.stage >= 3 and not layout.mcfg.reshard_after_forward:
        raise ConfigError("quantization with per-layer state or layer switches (delayed "
                          "scaling, first_last_layers_bf16) does not run with FSDP weights "
                          "kept gathered (parallel.reshard_after_forward false); keep the "
                          "default reshard_after_forward true")


def attach(params: dict, cfg, state: dict | None = None) -> dict:
    """``params`` with each quantized weight wrapped as a :class:`QWeight` holding its slice
    of ``state`` (layer axis moved to ``cfg.param_scan_axis`` like the weights') and its
    layers' switches. Unchanged when nothing needs attaching."""
    qc = getattr(cfg, "quant", None)
    switches = qc is not None and (qc.bf16_start or qc.bf16_end)
    stateful = qc is not None and qc.stateful and state is not None
    if not (switches or stateful):
        return params
    _check_layout()
    ax = cfg.param_scan_axis
    on = {}
    if switches:
        quantized = qc.layer_quantized(cfg.num_layers)
        on = {stack: jnp.moveaxis(jnp.asarray([quantized[i] for i in layers]).reshape(-1, 1),
                                  0, ax)
              for stack, layers in _stack_layers(cfg).items()}
    out = dict(params)
    for path in quantized_paths(cfg):
        meta = None
        if stateful:
            meta = jax.tree.map(lambda a: jnp.moveaxis(a, 0, ax), _get(state, path))
        out = _put(out, path, QWeight(_get(params, path), meta, on.get(path[0])))
    return out


def _switched(x, w, cfg, quantized, plain):
    """``quantized(x, w, meta)`` in the compute dtype, or ``plain(x, w)`` in the layers that
    first_last_layers_bf16 keeps unquantized (w a :class:`QWeight` with a switch)."""
    dt = cfg.compute_dtype
    meta = on = None
    if isinstance(w, QWeight):
        w, meta, on = w.w, w.meta, w.on
    x, w = x.astype(dt), w.astype(dt)
    if on is None:
        return quantized(x, w, meta)
    return jax.lax.cond(jnp.reshape(on, ()), lambda a, b: quantized(a, b, None), plain, x, w)


def project(eq: str, x, w, cfg):
    """The quantized form of ``einsum(eq, x, w)`` in the compute dtype (``dense``'s hook)."""
    return _switched(x, w, cfg, lambda a, b, meta: qeinsum(eq, a, b, cfg.quant, meta),
                     lambda a, b: jnp.einsum(eq, a, b))


def grouped_project(x, w, sizes, cfg, *, kernel: bool = False):
    """The quantized grouped matmul of the MoE experts (rows x [M, K] sorted by expert, w
    [G, K, N] or its :class:`QWeight`) in the compute dtype; see jaxtrain.quant.grouped."""
    from jaxtrain.models.moe import grouped_matmul
    from jaxtrain.quant.grouped import qgrouped

    return _switched(x, w, cfg,
                     lambda a, b, meta: qgrouped(a, b, sizes, cfg.quant, meta, kernel=kernel),
                     lambda a, b: grouped_matmul(a, b, sizes, kernel=kernel))
