"""The MoE layer (:func:`moe_block`): router and routed experts, plus the always-on shared expert.

Each device routes its own tokens: without a layout the routed part runs on the whole batch;
under a layout it runs in a ``shard_map`` over the whole mesh (:func:`_sharded`), which reads
from the logical-axis table how the tokens and the experts are split and hands the collectives
that split implies to the router and the dispatch as a :class:`~jaxtrain.models.moe.comm.Comm`.
Quantized expert weights (:class:`jaxtrain.quant.QWeight`) keep their scaling state and layer
switch replicated inside it.

Legend: B batch, T length, D hidden, E experts; b, t one device's share of B, T (under a
layout), N = b·t its tokens, k top-k.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.models import layers as L
from jaxtrain.models.moe.comm import LOCAL, Comm
from jaxtrain.models.moe.dispatch import experts_local
from jaxtrain.models.moe.router import _gate, route
from jaxtrain.parallel.sharding import active_layout, constrain, nested_mesh, spec_for
from jaxtrain.quant import QWeight


def _routed_local(p, x_btD, xr_btD, rand_btE, hash_btk, hashed, prev, steps, cfg, train,
                  comm: Comm):
    """Router + experts on one device's tokens x [b, t, D] (``xr``: the router's input, ``rand``:
    random logits or None, ``hash``: the experts hash routing fixes, or None) -> (y [b, t, D],
    stats)."""
    m = cfg.moe
    b, t, D = x_btD.shape
    logits_NE = _gate(p["router"], xr_btD.reshape(b * t, -1), m, cfg)
    probs_Nk, idx_Nk, keep_Nk, slots, stats = route(
        logits_NE, m, train=train,
        bias=p["router"].get("expert_bias") if m.expert_bias else None,
        rand_logits=None if rand_btE is None else rand_btE.reshape(b * t, -1),
        prev_aux_counts=prev, prev_steps=steps, comm=comm, seqs=b,
        forced=None if hash_btk is None else hash_btk.reshape(b * t, -1), hashed=hashed,
        score_bias=p["router"].get("score_bias"), qb_beta=p["router"].get("qb_beta"))
    x_ND = x_btD.reshape(b * t, D)
    if m.apply_probs_on_input:   # top-1: the token enters its expert scaled, leaves unweighted
        x_ND = (x_ND * probs_Nk.astype(x_ND.dtype)).astype(x_ND.dtype)
        probs_Nk = jnp.ones_like(probs_Nk)
        if slots is not None:   # capacity buffers: routed slots weigh 1, filler slots 0
            slots = (slots[0], (slots[1] > 0).astype(slots[1].dtype))
    if m.per_expert_scale:   # Gemma 4: each expert's learned scale on its routing weights
        scale_E = p["router"]["expert_scale"].astype(jnp.float32)
        probs_Nk = probs_Nk * scale_E[idx_Nk]
        if slots is not None:
            slots = (slots[0], slots[1] * scale_E[:, None].astype(slots[1].dtype))
    y_ND = experts_local(p["experts"], x_ND, probs_Nk, idx_Nk, keep_Nk, slots, cfg, comm)
    return y_ND.reshape(b, t, D), stats


def moe_block(p: dict, x, cfg, *, train: bool, rng=None, prev_aux_counts=None,
              prev_steps=None, router_input=None, hash_experts=None, hashed=None):
    """The MoE FFN on x [B, T, D] -> (y [B, T, D], stats); ``p`` holds router, experts and
    optionally shared (the always-on expert) and latent_in / latent_out (Megatron's latent MoE:
    the router and the shared expert read x, the routed experts its projection into
    ``moe.latent_size``, and their combined output is projected back). ``rng`` feeds input
    jitter and random-logit forced balancing; ``prev_*`` carry global_aux_loss's running
    counts; ``router_input`` [B, T, D]: what the router reads when it is not x (Gemma 4);
    ``hash_experts`` [B, T, k]: each token's experts when hash routing picks them (DeepSeek-V4's
    leading layers; -1: the router picks), the router still weighing them; ``hashed`` (bool
    scalar): whether they do in this layer."""
    m = cfg.moe
    x_BTD = constrain(x, "act_batch", "act_seq", "act_embed")
    B, T, D = x_BTD.shape
    key = rng if rng is not None else jax.random.key(0)
    xr_BTD = x_BTD if router_input is None else constrain(router_input, "act_batch", "act_seq",
                                                           "act_embed")
    if train and m.input_jitter_eps and rng is not None:
        eps = m.input_jitter_eps
        noise_BTD = jax.random.uniform(jax.random.fold_in(key, 0), x_BTD.shape, jnp.float32,
                                       1.0 - eps, 1.0 + eps)
        xr_BTD = (xr_BTD * noise_BTD).astype(xr_BTD.dtype)
    rand_BTE = (jax.random.normal(jax.random.fold_in(key, 1), (B, T, m.num_experts),
                                  jnp.float32) if m.force_balancing == "uniform" else None)
    routed = {"router": p["router"], "experts": p["experts"]}
    xe_BTD = x_BTD   # what the routed experts take: with a latent space, x projected into it
    if "latent_in" in p:
        xe_BTD = constrain(_latent(p["latent_in"], x_BTD, "latent_in", cfg), "act_batch",
                           "act_seq", "act_embed")
    layout = active_layout()
    if layout is None or layout.mesh.size == 1:
        y_BTD, stats = _routed_local(routed, xe_BTD, xr_BTD, rand_BTE, hash_experts, hashed,
                                     prev_aux_counts, prev_steps, cfg, train, LOCAL)
    else:
        y_BTD, stats = _sharded(layout, routed, xe_BTD, xr_BTD, rand_BTE, hash_experts, hashed,
                                prev_aux_counts, prev_steps, cfg, train, spec_for)
    if "latent_norm" in p:
        y_BTD = L.norm(p["latent_norm"], y_BTD, cfg)
    if "latent_out" in p:
        y_BTD = _latent(p["latent_out"], y_BTD, "latent_out", cfg)
    if "shared" in p:
        shared = L.mlp
        if "shared_experts" in cfg.recompute_modules:
            shared = jax.checkpoint(shared, static_argnums=(2,))
        s_BTD = shared(p["shared"], x_BTD, cfg)
        if "shared_gate" in p:
            gate_BT1 = jnp.einsum("btd,de->bte", x_BTD, p["shared_gate"].astype(x_BTD.dtype),
                                  preferred_element_type=jnp.float32)
            s_BTD = jax.nn.sigmoid(gate_BT1).astype(s_BTD.dtype) * s_BTD
        y_BTD = y_BTD + s_BTD.astype(y_BTD.dtype)
    return y_BTD, stats


def _latent(p: dict, x, name: str, cfg):
    """A latent projection (Megatron's fc1/fc2_latent_proj): x @ w (+ b)."""
    return L.dense(x, p["w"], p.get("b"), "btd,de->bte", name, cfg)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _sharded(layout, routed, x_BTD, xr_BTD, rand_BTE, hash_BTk, hashed, prev, steps, cfg, train,
             spec_for):
    """The routed part in a shard_map over the whole mesh (see the module docstring)."""
    m = cfg.moe
    rules, shape = layout.rules, layout.mesh_shape
    xs = spec_for(("act_batch", "act_seq", "act_embed"), x_BTD.shape, rules, shape)
    batch, seq = _axes(xs[0]), _axes(xs[1])
    wnames = {"wi": ("exp", "embed", "mlp"), "wi_0": ("exp", "embed", "mlp"),
              "wi_1": ("exp", "embed", "mlp"), "wo": ("exp", "mlp", "embed"),
              "bi": ("exp", "mlp"), "bi_0": ("exp", "mlp"), "bi_1": ("exp", "mlp"),
              "bo": ("exp", "embed")}

    def wspec(name, a):
        names = tuple(None if n == "mlp" and not m.expert_tensor_parallel else n
                      for n in wnames[name])
        spec = spec_for(names, a.shape, rules, shape)
        if isinstance(a, QWeight):   # quantized: its scaling state and switch are replicated
            return QWeight(spec, jax.tree.map(lambda _: P(), a.meta),
                           None if a.on is None else P())
        return spec

    espec = {n: wspec(n, a) for n, a in routed["experts"].items()}
    wo = getattr(espec["wo"], "w", espec["wo"])
    ep_axes, tensor = _axes(wo[0]), _axes(wo[1])
    if len(ep_axes) > 1:
        raise ValueError(f"experts split over several mesh axes {ep_axes}; expected one")
    expert = ep_axes[0] if ep_axes else None
    comm = Comm(seq=seq, batch=batch, expert=expert,
                ep=shape[expert] if expert else 1, tokens_split=expert in batch,
                tensor=tensor[0] if tensor else None)
    tok = P(*xs)
    rspec = jax.tree.map(lambda _: P(), routed["router"])
    in_specs = ({"router": rspec, "experts": espec}, tok, tok,
                None if rand_BTE is None else P(xs[0], xs[1], None),
                None if hash_BTk is None else P(xs[0], xs[1], None),
                None if hashed is None else P(),
                None if prev is None else P(), None if steps is None else P())

    def body(routed, x_btD, xr_btD, rand_btE, hash_btk, hashed, prev, steps):
        return _routed_local(routed, x_btD, xr_btD, rand_btE, hash_btk, hashed, prev, steps, cfg,
                             train, comm)

    args = (routed, x_BTD, xr_BTD, rand_BTE, hash_BTk, hashed, prev, steps)
    keep = [i for i, a in enumerate(args) if a is not None]
    fn = jax.shard_map(
        lambda *live: body(*_fill(live, keep, len(args))), **nested_mesh(layout),
        in_specs=tuple(in_specs[i] for i in keep), out_specs=(tok, P()))
    return fn(*(args[i] for i in keep))


def _fill(live, keep, n):
    out = [None] * n
    for i, a in zip(keep, live):
        out[i] = a
    return out
