"""Megatron's upcycling (``moe_use_upcycling``): an MoE model's parameters from its dense
counterpart's (Megatron-LM's megatron/core/transformer/moe/upcycling_utils.py; arXiv:2410.07524
for the scaling). The train loop calls :func:`upcycle` at the start of a run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.params import param_specs
from jaxtrain.models.spec import ParamSpec, _leaf_key, layer_slots


def upcycle(dense_params: dict, cfg, key) -> dict:
    """MoE parameters for ``cfg`` from those of its dense counterpart (``cfg.replace(moe=None)``):
    Megatron's upcycling (moe_use_upcycling; the train loop calls it at the start of a run).

    Granularity g = ffn_hidden_size / moe ffn_hidden_size: each dense FFN's hidden units are cut
    into g consecutive slices and expert e starts as slice e mod g. Expert weights (both
    up-projections, their biases, the down projection) are multiplied by s^(1/3) for gated or
    squared-ReLU units, s^(1/2) otherwise, with s = E·g/k under pre_softmax and s = g without
    (Megatron's compensation for the routing weights, arXiv:2410.07524); the down bias is
    copied. The router is freshly initialised from ``key`` with experts e and e' sharing a
    column when e // g = e' // g; router bias, expert bias and the shared expert keep their
    fresh initial values (Megatron copies nothing into them). Attention, norms, embeddings and
    the layers that stay dense are copied.

    With g = 1, no pre_softmax, no shared expert, no topk_scaling_factor and routing weights
    that sum to 1 (softmax over the top k; sigmoid/sqrtsoftplus renormalised, k > 1) every
    expert is the dense FFN and the MoE model computes exactly what the dense one did.
    """
    if getattr(cfg, "linear_attention_layers", None):
        raise ValueError("upcycling a hybrid (Gated DeltaNet) model is not built: it converts "
                         "the dense 'layers' stack only")
    m = cfg.moe
    F, Fe, E = cfg.ffn_hidden_size, m.ffn_hidden_size, m.num_experts
    if F % Fe or E % (F // Fe):
        raise ValueError(f"upcycling cuts the dense FFN ({F} hidden units) into experts of "
                         f"moe_ffn_hidden_size {Fe}: it must divide ffn_hidden_size, and "
                         f"num_experts ({E}) must be a multiple of the {F // max(Fe, 1)} slices")
    g = F // Fe
    act_scale = E * g / m.topk if m.pre_softmax else float(g)
    cube = cfg.gated_linear_unit or cfg.activation == "squared_relu"
    w_scale = act_scale ** (1 / 3 if cube else 1 / 2)
    slice_of = jnp.arange(E) % g                  # expert -> dense slice
    column_of = jnp.arange(E) // g                # expert -> router column

    specs = param_specs(cfg)["moe_layers"]["moe"]
    fresh = jax.tree_util.tree_map_with_path(
        lambda path, s: s.make(_leaf_key(key, path)),
        {k: specs[k] for k in ("router", "shared") if k in specs},
        is_leaf=lambda x: isinstance(x, ParamSpec))
    fresh["router"]["w"] = jnp.take(fresh["router"]["w"], column_of, axis=-1)

    def expert_leaf(name, a):   # a: one dense leaf, layers first -> [L, E, ...]
        if name == "bo":
            return jnp.broadcast_to(a[:, None], (a.shape[0], E, *a.shape[1:]))
        a = a * jnp.asarray(w_scale, a.dtype)
        if name == "wo":                                                    # [L, F, D]
            return jnp.take(a.reshape(a.shape[0], g, Fe, -1), slice_of, axis=1)
        if name.startswith("bi"):                                           # [L, F]
            return jnp.take(a.reshape(a.shape[0], g, Fe), slice_of, axis=1)
        a = a.reshape(*a.shape[:2], g, Fe)                                  # [L, D, g, Fe]
        return jnp.moveaxis(jnp.take(a, slice_of, axis=2), 2, 1)

    ax = cfg.param_scan_axis
    dense = dense_params["layers"]
    out = {k: v for k, v in dense_params.items() if k != "layers"}
    for kind in ("layers", "moe_layers"):
        ids = [i for i, (k, _) in enumerate(layer_slots(cfg)) if k == kind]
        if not ids:
            continue
        take = jax.tree.map(lambda a: jnp.take(a, jnp.asarray(ids), axis=ax), dense)
        if kind == "layers":
            out[kind] = take
            continue
        experts = {}
        for name, a in take["mlp"].items():
            a = expert_leaf(name, jnp.moveaxis(a, ax, 0))                   # [L, E, ...]
            experts[name] = a if ax == 0 else jnp.swapaxes(a, 0, 1)        # L at ax of [E, ...]
        rest = {k: v for k, v in take.items() if k != "mlp"}
        out[kind] = {**rest, "moe": {**fresh, "experts": experts}}
    return out
