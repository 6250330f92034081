"""pgs ``memory.gradient_release``: the optimizer fused into the backward pass.

The plain train step (:mod:`jaxtrain.step`) differentiates the whole model with
``jax.value_and_grad``, so the gradient of every parameter exists at once before
``optimizer.update`` reads it. Here the backward is written out layer by layer inside the
jitted step and each layer's parameters are updated as soon as their gradient exists:

1. forward the embedding (``jax.vjp``: its pullback is kept for the end);
2. run the layer stack with ``lax.scan``, keeping each layer's input [L,B,T,D] (what a
   fully rematerialised scan keeps anyway) and nothing else;
3. final norm, output layer and loss under ``jax.vjp``: the loss, the cotangent of the last
   layer's output, and the gradients of the non-layer parameters (final norm, output layer,
   tied embedding) that reach the head;
4. a reverse ``lax.scan`` over the layers: layer i's forward is recomputed under ``jax.vjp``
   at its saved input, giving layer i's parameter gradient and the cotangent of its input
   (carried on); the optimizer update of layer i's parameter slice and of its optimizer-state
   slice follows at once, written back in place (``dynamic_update_slice`` on the carried
   stacks), so only one layer's gradient is live at a time;
5. the embedding pullback, then one update of the non-layer parameters with their summed
   gradients (the tied embedding gets both its lookup and its output-layer gradient).

The optimizer is called as it is built (any optax chain), once per layer and once for the
rest, on a *view*: the parameter tree with the part being updated (one layer slice, its
stacked axis kept with size 1, or the non-layer leaves) and zero-sized stand-ins for every
other leaf. That is exact for element-wise optimizers, whose update of a leaf reads only that
leaf, its gradient and its own state. The optimizer state must then be made of leaves that
mirror a parameter (same path suffix and shape: Adam's moments, Lion's momentum), sliced with
it, and scalars (the step count), which every call advances alike from the same old value;
:func:`check_state` refuses anything else (block-quantized 8-bit states, Muon's, a
per-tensor statistic of a stacked tensor). Transforms that read all gradients together (global
clipping, Muon, gradient accumulation, spike detection, layer-wise LR decay, ...) are refused
by the config rules (:func:`jaxtrain.config.rules.pgs`) and by :func:`check_supported`.

The reported ``grad_norm`` is pgs's: the square root of the per-tensor squared norms summed
as the backward produces them (equal to the global norm of the plain step).

Scope: a dense decoder (no MoE), ``scan_layers`` true, one microbatch per step, no pipeline,
no fp16 loss scaling, no FP8 delayed-scaling state, any token objective but pre_rl.

Legend: L layers, B batch, T length, D hidden.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config.errors import ConfigError
from jaxtrain.loss import row_losses
from jaxtrain.models import layers as L
from jaxtrain.models.params import layer_axes
from jaxtrain.models.spec import DENSE_STACK, layer_kinds
from jaxtrain.models.transformer import RESIDUAL, decoder_layer, embed_inputs
from jaxtrain.parallel.sharding import constrain, gather_weights

KNOB = "memory.gradient_release"


def check_supported(model_cfg, tcfg) -> None:
    """Raise ConfigError for the model and step settings the fused step does not cover."""
    problems = []
    other = sorted(set(layer_kinds(model_cfg)) - {DENSE_STACK})
    if other:
        problems.append(f"{KNOB} covers decoders of one dense layer stack; this model also has "
                        f"{', '.join(other)} (MoE, Gated DeltaNet or Gemma 4 global layers): "
                        "keep one")
    if not model_cfg.scan_layers:
        problems.append(f"{KNOB} scans the layer stack backwards: it needs scan_layers true")
    if getattr(model_cfg, "quant", None) is not None and model_cfg.quant.stateful:
        problems.append(f"{KNOB} does not carry the FP8 delayed-scaling state: keep one")
    if tcfg.num_microbatches > 1:
        problems.append(f"{KNOB} updates during the backward, so nothing can accumulate: it "
                        f"needs train.gradient_accumulation_steps 1 (the batch gives "
                        f"{tcfg.num_microbatches} microbatches per step)")
    if tcfg.ga_ramp_start:
        problems.append(f"{KNOB} cannot be combined with train.ga_ramp_start (accumulation)")
    if tcfg.loss_scale is not None:
        problems.append(f"{KNOB} cannot be combined with fp16 loss scaling: an overflow skip "
                        "needs every gradient before the first update")
    if tcfg.spike_detection:
        problems.append(f"{KNOB} cannot be combined with train.spike_detection: the skip needs "
                        "the global gradient norm before the first update (pgs skips it)")
    if tcfg.objective.needs_base:
        problems.append(f"{KNOB} cannot be combined with plugins.pre_rl")
    if problems:
        raise ConfigError(problems)


def _suffix_match(path, param_paths):
    """Index of the longest parameter path that ends ``path``, else None."""
    best, best_len = None, 0
    for k, pp in enumerate(param_paths):
        n = len(pp)
        if n > best_len and len(path) >= n and tuple(path[-n:]) == tuple(pp):
            best, best_len = k, n
    return best


def check_state(params, opt_state):
    """For each optimizer-state leaf: the index of the parameter it mirrors, or None for a
    shared scalar. ConfigError for any other leaf (not an element-wise optimizer state)."""
    p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    p_paths = [path for path, _ in p_leaves]
    owners = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        k = _suffix_match(path, p_paths)
        if k is not None and leaf.shape == p_leaves[k][1].shape:
            owners.append(k)
        elif leaf.ndim == 0:
            owners.append(None)
        else:
            raise ConfigError(
                f"{KNOB} needs an element-wise optimizer whose state mirrors the parameters; "
                f"the optimizer state leaf {jax.tree_util.keystr(path)} {leaf.shape} does not "
                "(use adamw/adam, sgd or lion)")
    return owners


def fused_update(params, opt_state, micro: dict, weights_BT, rng, model_cfg, tcfg,
                 optimizer: optax.GradientTransformation, *, log_zeros: bool = False):
    """(loss, new params, new optimizer state, grad_norm, zeros in grad or None) for one
    microbatch ``micro`` ([B,T] leaves) weighted by ``weights_BT``: the layer-wise backward
    with each update applied as soon as its gradient exists (module docstring)."""
    cfg = model_cfg
    ax = cfg.param_scan_axis
    p_flat, p_def = jax.tree_util.tree_flatten_with_path(params)
    p_leaves = [leaf for _, leaf in p_flat]
    stacked = [path[0] == jax.tree_util.DictKey(DENSE_STACK) for path, _ in p_flat]
    s_leaves, s_def = jax.tree.flatten(opt_state)
    owners = check_state(params, opt_state)

    def empty(k):
        """A zero-sized stand-in for parameter k (its stack axis, or its first axis, 0)."""
        shape = list(p_leaves[k].shape)
        shape[ax if stacked[k] else 0] = 0
        return shape

    def call(part, grads, p_part, s_part, s_scalars):
        """optimizer.update on the view of ``part`` (a set of parameter indices); ``grads``,
        ``p_part``: {k: leaf}; ``s_part``: {state index: leaf} for the part's mirrors.
        Returns (new p_part, new s_part, new scalars)."""
        pview = [p_part[k] if k in part else jnp.zeros(empty(k), p_leaves[k].dtype)
                 for k in range(len(p_leaves))]
        gview = [grads[k] if k in part else jnp.zeros(empty(k), p_leaves[k].dtype)
                 for k in range(len(p_leaves))]
        sview = []
        for j, owner in enumerate(owners):
            if owner is None:
                sview.append(s_scalars[j])
            elif owner in part:
                sview.append(s_part[j])
            else:
                sview.append(jnp.zeros(empty(owner), s_leaves[j].dtype))
        pv, gv = p_def.unflatten(pview), p_def.unflatten(gview)
        updates, new_s = optimizer.update(gv, s_def.unflatten(sview), pv)
        new_p = jax.tree.leaves(optax.apply_updates(pv, updates))
        new_s = s_def.flatten_up_to(new_s)
        return ({k: new_p[k] for k in part},
                {j: new_s[j] for j, o in enumerate(owners) if o is not None and o in part},
                {j: new_s[j] for j, o in enumerate(owners) if o is None})

    def sumsq(leaves):
        return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)

    def zeros_in(leaves):
        return sum(jnp.sum(g == 0) for g in leaves)

    layer_ids = [k for k in range(len(p_leaves)) if stacked[k]]
    rest_ids = [k for k in range(len(p_leaves)) if not stacked[k]]
    scalars = {j: s_leaves[j] for j, o in enumerate(owners) if o is None}
    rest = {k: v for k, v in params.items() if k != DENSE_STACK}

    # 1. embedding (pgs sym_noise and the embedding dropout as in hidden_states)
    tokens = micro["tokens"]
    B, T = tokens.shape
    positions = micro.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def embed_fn(rest):
        x, rope = embed_inputs(rest, tokens, positions, cfg)
        if tcfg.embed_noise:
            signs = jax.random.rademacher(jax.random.fold_in(rng, cfg.num_layers + 1),
                                          x.shape, x.dtype)
            x = x + signs * jnp.asarray(tcfg.embed_noise / (T * cfg.hidden_size) ** 0.5,
                                        x.dtype)
        x = L.dropout(constrain(x, *RESIDUAL), cfg.hidden_dropout,
                      jax.random.fold_in(rng, cfg.num_layers), False)
        return x.astype(cfg.residual_dtype), rope

    x0, embed_pullback, rope = jax.vjp(embed_fn, rest, has_aux=True)
    ctx = {"segment_ids": micro.get("segment_ids"), "deterministic": False, "rng": rng,
           "rope": rope, "moe_state": None, "positions": positions}
    axes = layer_axes(cfg, DENSE_STACK)

    def layer(p, x, i):
        with jax.named_scope("decoder_layer"):
            return decoder_layer(gather_weights(p, axes), x, i, ctx, cfg)

    def unstack(leaves):
        return p_def.unflatten([leaves[k] if stacked[k] else None for k in range(len(stacked))]
                               )[DENSE_STACK]

    def slice_layer(leaves, i, keepdims):
        return {k: jax.lax.dynamic_index_in_dim(leaves[k], i, ax, keepdims=keepdims)
                for k in leaves}

    # 2. the layer stack forward, keeping each layer's input
    stack = {k: p_leaves[k] for k in layer_ids}

    def forward(x, i):
        p = unstack(slice_layer(stack, i, False))
        return layer(p, x, i), x

    x_L, inputs_LBTD = jax.lax.scan(forward, x0, jnp.arange(cfg.num_layers))

    # 3. final norm, output layer and loss
    def head(rest, x):
        hidden = L.norm(rest["final_norm"], x, cfg)
        sums_B, _ = row_losses(rest, hidden, micro["targets"], weights_BT, cfg,
                               num_chunks=tcfg.loss_chunks,
                               half_precision=tcfg.half_precision_loss,
                               objective=tcfg.objective)
        return jnp.sum(sums_B)

    loss, head_pullback = jax.vjp(head, rest, x_L)
    g_rest, dx = head_pullback(jnp.ones_like(loss))

    # 4. layers in reverse: recompute, pull back, update this layer at once
    mirrors = {j: s_leaves[j] for j, o in enumerate(owners) if o is not None and stacked[o]}

    def backward(carry, xs):
        stack, mirrors, dx, sq, nz = carry
        x_in, i = xs
        p_keep = slice_layer(stack, i, True)
        p_i = {k: jnp.squeeze(v, ax) for k, v in p_keep.items()}

        def f(p, x):
            return layer(unstack(p), x, i)

        _, pullback = jax.vjp(f, p_i, x_in)
        g_i, dx = pullback(dx)
        g_i = {k: jnp.expand_dims(g.astype(p_leaves[k].dtype), ax) for k, g in g_i.items()}
        sq = sq + sumsq(g_i.values())
        if log_zeros:
            nz = nz + zeros_in(g_i.values())
        new_p, new_m, _ = call(set(layer_ids), g_i, p_keep,
                               {j: jax.lax.dynamic_index_in_dim(m, i, ax) for j, m in
                                mirrors.items()}, scalars)
        stack = {k: jax.lax.dynamic_update_index_in_dim(stack[k], new_p[k], i, ax)
                 for k in stack}
        mirrors = {j: jax.lax.dynamic_update_index_in_dim(mirrors[j], new_m[j], i, ax)
                   for j in mirrors}
        return (stack, mirrors, dx, sq, nz), None

    nz0 = jnp.int32(0)
    (stack, mirrors, dx0, sq, nz), _ = jax.lax.scan(
        backward, (stack, mirrors, dx, jnp.float32(0.0), nz0),
        (inputs_LBTD, jnp.arange(cfg.num_layers)), reverse=True)

    # 5. the embedding's pullback, then the non-layer parameters' update
    (g_embed,) = embed_pullback(dx0)
    g_rest = jax.tree.map(jnp.add, g_rest, g_embed)
    index = {jax.tree_util.keystr(path): k for k, (path, _) in enumerate(p_flat)}
    g_rest_leaves = {index[jax.tree_util.keystr(path)]: g.astype(p_leaves[
        index[jax.tree_util.keystr(path)]].dtype)
        for path, g in jax.tree_util.tree_flatten_with_path(g_rest)[0]}
    sq = sq + sumsq(g_rest_leaves.values())
    if log_zeros:
        nz = nz + zeros_in(g_rest_leaves.values())
    rest_mirrors = {j: s_leaves[j] for j, o in enumerate(owners) if o is not None
                    and not stacked[o]}
    new_rest, new_rest_m, new_scalars = call(set(rest_ids), g_rest_leaves,
                                             {k: p_leaves[k] for k in rest_ids},
                                             rest_mirrors, scalars)
    new_p = [stack[k] if stacked[k] else new_rest[k] for k in range(len(p_leaves))]
    new_s = [new_scalars[j] if o is None else mirrors[j] if stacked[o] else new_rest_m[j]
             for j, o in enumerate(owners)]
    return (loss, p_def.unflatten(new_p), s_def.unflatten(new_s), jnp.sqrt(sq),
            nz if log_zeros else None)

