"""The train step's MoE side: the non-trainable expert bias, its update, the statistics'
accumulator and the metrics.

Expert bias (aux-loss-free balancing) is a float32 parameter leaf ``expert_bias`` that the
optimizer never sees (:data:`~jaxtrain.models.moe.config.NON_TRAINABLE`); the train step adds
``rate * sign(mean(c) - c)`` once per global batch from the loads ``c`` counted by the forward
(:func:`update_expert_bias`). Keeping it among the parameters makes checkpoints, evaluation
and HF export (DeepSeek's ``e_score_correction_bias``) see it without extra state.

The aux and z losses join the objective averaged over microbatches (also with
calculate_per_token_loss, where Megatron's scaling divides them by the token count instead) and
are reported without their coefficients as ``moe_aux_loss``, ``moe_seq_aux_loss``,
``moe_global_aux_loss``, ``moe_z_loss`` (:func:`metrics`).

Legend: L (L_moe) MoE layers, E experts.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxtrain.models.moe.config import LOSS_METRICS, NON_TRAINABLE
from jaxtrain.models.spec import MOE_STACKS, layer_kinds, mtp_layer_kinds


def trainable(tree):
    """``tree`` (params, grads or their logical axes) without the non-trainable leaves."""
    if isinstance(tree, dict):
        return {k: trainable(v) for k, v in tree.items() if k not in NON_TRAINABLE}
    return tree


def merge_trainable(full, part):
    """``full`` with the leaves of ``part`` (a :func:`trainable` subtree) put back in."""
    if isinstance(full, dict):
        return {k: (merge_trainable(v, part[k]) if k in part else v) for k, v in full.items()}
    return part


def update_expert_bias(params: dict, counts, cfg) -> dict:
    """Megatron's aux-free update, once per global batch: bias += rate·sign(mean(c) − c) per
    MoE layer, so under-loaded experts rise. counts [L_moe, E]: tokens kept per expert, in
    MoE-layer order (across the MoE stacks)."""
    m = cfg.moe
    if m is None or not m.expert_bias:
        return params
    counts_LE = counts.astype(jnp.float32)
    delta_LE = m.bias_update_rate * jnp.sign(counts_LE.mean(-1, keepdims=True) - counts_LE)
    return _update_routers(params, "expert_bias", lambda old, rows: old + delta_LE[rows], cfg)


def update_router_state(params: dict, sums: dict, num_micro: int, cfg, step=None) -> dict:
    """Once per global batch (Megatron's finalize step): the expert bias from the loads
    counted (:func:`update_expert_bias`) and quantile balancing's bias from its quantiles
    averaged over the microbatches: ema·beta + (1 − ema)·mean, less its mean over experts.
    ``sums``: the forward's statistics summed over the step's microbatches; ``step``: the
    1-based number of this global batch (Kimi K3's update interval)."""
    m = cfg.moe
    if m is not None and m.bias_rule == "quantile" and m.k3_interval > 1:
        params = _update_routers(params, ("expert_bias", "k3_hist"),
                                 _k3_pooled(sums["k3_hist"], step, m), cfg)
    elif m is not None and m.bias_rule == "quantile":
        params = _update_routers(params, "expert_bias", _k3_bias(sums["k3_hist"], m), cfg)
    else:
        params = update_expert_bias(params, sums["counts"], cfg)
    if m is None or not m.quantile_balancing:
        return params
    mean_LE = sums["qb"].astype(jnp.float32) / num_micro

    def blend(old_LE, rows):
        new_LE = m.qb_ema * old_LE + (1.0 - m.qb_ema) * mean_LE[rows]
        return new_LE - new_LE.mean(-1, keepdims=True)

    return _update_routers(params, "qb_beta", blend, cfg)


def _k3_bias(hist_LEB, m):
    """Kimi K3's rule (Primus's compute_quantile_bias): each expert's bias is minus the
    1 - k/E quantile of its margins, read from the pooled histogram [L, E, bins] by linear
    interpolation inside the straddling bin, centred; an EMA of the old bias with
    ``m.k3_ema``; layers whose histogram is empty keep theirs. Returns new(old, rows)."""
    lo, hi = m.k3_range
    bins = hist_LEB.shape[-1]
    count = hist_LEB.astype(jnp.float32)
    cum = jnp.cumsum(count, -1)
    total = cum[..., -1:]
    target = total * (1.0 - m.topk / m.num_experts)
    idx = jnp.minimum(jnp.sum(cum < target, -1, keepdims=True), bins - 1)
    prev = jnp.where(idx == 0, 0.0, jnp.take_along_axis(cum, jnp.maximum(idx - 1, 0), -1))
    here = jnp.take_along_axis(count, idx, -1)
    frac = jnp.clip((target - prev) / jnp.maximum(here, 1.0), 0.0, 1.0)
    value = jnp.where(total > 0, lo + (hi - lo) / bins * (idx + frac), 0.5 * (lo + hi))[..., 0]
    bias_LE = -value
    if m.k3_center:
        bias_LE = bias_LE - bias_LE.mean(-1, keepdims=True)
    empty_L = jnp.sum(count, (-1, -2)) == 0

    def new(old_LE, rows):
        target_LE = bias_LE[rows]
        if m.k3_ema is not None:
            target_LE = m.k3_ema * old_LE + (1.0 - m.k3_ema) * target_LE
        return jnp.where(empty_L[rows][:, None], old_LE, target_LE)

    return new


def _k3_pooled(hist_LEB, step, m):
    """Kimi K3's rule with an update interval n (Primus's): the histograms pool in the routers'
    ``k3_hist`` leaf over n global batches; at the batches numbered n, 2n, ... the bias is set
    from the pooled one (:func:`_k3_bias`) and the pool emptied. Returns
    new((old bias, old pool), rows)."""
    due = jnp.asarray(step) % m.k3_interval == 0

    def new(olds, rows):
        bias_LE, pool_LEB = olds
        pooled = pool_LEB + hist_LEB[rows].astype(jnp.float32)
        bias = _k3_bias(pooled, m)(bias_LE, jnp.arange(len(rows)))
        return jnp.where(due, bias, bias_LE), jnp.where(due, 0.0, pooled)

    return new


# Router leaves with more than the expert axis ([E] otherwise)
_LEAF_NDIM = {"k3_hist": 2}


def _update_routers(params: dict, leaf, new, cfg) -> dict:
    """``params`` with every MoE layer's router ``leaf`` [E] replaced by new(old [L, E],
    rows [L]): ``rows`` the layers' places in MoE-layer order (the decoder's stacks, then the
    multi-token-prediction layers depth-major). ``leaf`` a tuple of names: ``new`` takes and
    returns a tuple of their values."""
    moe_kinds = [k for k in layer_kinds(cfg) if k in MOE_STACKS]
    n_main = len(moe_kinds)
    out = dict(params)
    n_extra = len(moe_layer_ids(cfg)) - n_main
    if n_extra:   # depth-major rows of each depth's MoE (sub)layers
        mtp = params["mtp"]
        hybrid = "layers" in mtp
        inner = mtp["layers"] if hybrid else mtp
        subs = ([str(n) for n, k in enumerate(mtp_layer_kinds(cfg)) if k in MOE_STACKS]
                if hybrid else ["layer"])
        for r, n in enumerate(subs):
            rows = jnp.arange(n_main + r, n_main + n_extra, len(subs))
            inner = _set_router_leaf(inner, n, leaf, new, rows, cfg)
        out["mtp"] = {**mtp, "layers": inner} if hybrid else inner
    for stack in MOE_STACKS:
        if stack in params:
            rows = jnp.asarray([j for j, k in enumerate(moe_kinds) if k == stack])
            out = _set_router_leaf(out, stack, leaf, new, rows, cfg)
    return out


def _set_router_leaf(tree: dict, key: str, leaf, new, rows, cfg) -> dict:
    """``tree`` with the stacked router ``leaf`` (or leaves) of ``tree[key]``'s MoE set to
    new(old, rows)."""
    layers = tree[key]
    router = dict(layers["moe"]["router"])
    names = (leaf,) if isinstance(leaf, str) else leaf
    olds = [router[n] for n in names]
    # the layer axis: none in an unstacked module (one MTP layer), else the scan axis
    stacked = olds[0].ndim > _LEAF_NDIM.get(names[0], 1)
    axis = cfg.param_scan_axis if stacked else None
    rowed = [jnp.moveaxis(o, axis, 0) if stacked else o[None] for o in olds]
    rowed = [o.astype(jnp.float32) for o in rowed]
    values = new(rowed[0] if isinstance(leaf, str) else tuple(rowed), rows)
    values = (values,) if isinstance(leaf, str) else values
    for n, o, v in zip(names, olds, values):
        router[n] = (jnp.moveaxis(v, 0, axis) if stacked else v[0]).astype(o.dtype)
    return {**tree, key: {**layers, "moe": {**layers["moe"], "router": router}}}


def metrics(stats: dict, cfg, moe_layer_ids) -> dict:
    """Metrics rows from stats averaged over microbatches ([L_moe, ...] leaves): each balancing
    loss and the z-loss without their coefficients, averaged over MoE layers (and per layer,
    named by the global layer index, with per_layer_logging)."""
    m = cfg.moe
    out = {}
    named = [(LOSS_METRICS[t], stats["lb"][:, j]) for j, (t, c) in
             enumerate(zip(m.load_balancing, m.aux_loss_coeff)) if t in LOSS_METRICS and c > 0]
    if m.z_loss_coeff:
        named.append(("moe_z_loss", stats["z"]))
    for name, per_layer in named:
        out[name] = jnp.mean(per_layer)
        if m.per_layer_logging:
            for j, layer in enumerate(moe_layer_ids):
                out[f"{name}_layer_{layer}"] = per_layer[j]
    return out


def moe_layer_ids(cfg) -> tuple[int, ...]:
    """Global indices of the MoE layers, in the order their statistics are stacked."""
    kinds = layer_kinds(cfg)
    ids = tuple(i for i, kind in enumerate(kinds) if kind in MOE_STACKS)
    mtp = mtp_layer_kinds(cfg)   # MTP layers after: num_layers + (k-1)·P + n, depth-major
    for k in range(getattr(cfg, "mtp_num_layers", 0)):
        ids += tuple(cfg.num_layers + k * len(mtp) + n for n, kind in enumerate(mtp)
                     if kind in MOE_STACKS)
    return ids


def zero_stats(cfg):
    """Zeros shaped like the forward's stacked MoE statistics (None without MoE layers): the
    train step's accumulator over microbatches."""
    m = cfg.moe
    n = len(moe_layer_ids(cfg)) if m is not None else 0
    if not n:
        return None
    f32 = jnp.float32
    stats = {"lb": jnp.zeros((n, len(m.load_balancing)), f32), "z": jnp.zeros((n,), f32),
             "objective": jnp.zeros((n,), f32), "counts": jnp.zeros((n, m.num_experts), f32)}
    if "global_aux_loss" in m.load_balancing:
        stats["aux_counts"] = jnp.zeros((n, m.num_experts), f32)
    if m.quantile_balancing:
        stats["qb"] = jnp.zeros((n, m.num_experts), f32)
    if m.bias_rule == "quantile":
        stats["k3_hist"] = jnp.zeros((n, m.num_experts, m.k3_bins), jnp.int32)
    return stats
