"""The train state and the one jitted train step ``(state, batch) -> (state, metrics)``.

The step runs the global batch as ``M`` microbatches (the first, then the rest under
``lax.scan``), accumulating gradients (on a data-parallel-only mesh each device sums its own
rows' gradients and one psum per step reduces them: jaxtrain.parallel.accumulate);
normalises the loss as Megatron does (``calculate_per_token_loss``: over all tokens of the
global batch; otherwise the mean over microbatches and data-parallel shards of each shard's
token mean); unscales and checks fp16 gradients; skips pgs gradient spikes; and
applies the optax update. The per-token loss is plain cross-entropy or one of pgs's
token-weighting objectives (``TrainConfig.objective``), with pgs sym_noise's embedding noise
when set; evaluation keeps plain cross-entropy. A skipped step (fp16 overflow, spike) keeps
params and optimizer state, so neither the optimizer's count nor the LR schedule advances.
With pgs ``memory.gradient_release`` (``TrainConfig.gradient_release``) the step is instead
:func:`jaxtrain.release.fused_update`: one microbatch, a layer-wise backward that updates each
layer's parameters as soon as their gradient exists.

Batch layout: ``tokens``, ``targets``, ``loss_mask`` (and optionally ``positions``,
``segment_ids``) shaped [M, B, T], B = micro_batch_size x data-parallel size.

Legend: M microbatches, B batch, T length, P data-parallel shards, b = B/P rows per shard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtrain import dpo
from jaxtrain import loss_scale as ls
from jaxtrain import release
from jaxtrain import seco
from jaxtrain import spikes
from jaxtrain.loss import model_loss
from jaxtrain.models import dsa, moe, mtp
from jaxtrain.models import params as model_params
from jaxtrain.models import quant_state as model_quant_state
from jaxtrain.optim import freeze
from jaxtrain.parallel import accumulate as accumulate_mod
from jaxtrain.parallel import pipeline, stages


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array             # int32 iterations run (skipped ones included)
    opt_step: jax.Array         # int32 updates applied: what the LR schedule counts
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: ls.LossScale | None
    spike_stats: spikes.SpikeStats | None
    # The quantization state (delayed scaling's amax histories and scales;
    # jaxtrain.models.quant_state), or None. Updated by overwrite each step, never by the
    # optimizer. Checkpoints store it as the item "fp8" (jaxtrain.checkpoint).
    quant_state: Any = None


def init_state(params, optimizer, tcfg, rng, quant_state=None) -> TrainState:
    return TrainState(
        step=jnp.int32(0), opt_step=jnp.int32(0), params=params,
        opt_state=optimizer.init(moe.trainable(params)), rng=rng,   # no expert bias: not trained
        loss_scale=tcfg.loss_scale.init() if tcfg.loss_scale else None,
        spike_stats=spikes.init() if tcfg.spike_detection else None,
        quant_state=quant_state)


def _make_state(key, model_cfg, optimizer, tcfg) -> TrainState:
    params = model_params.init(model_cfg, jax.random.fold_in(key, 0))
    return init_state(params, optimizer, tcfg, jax.random.fold_in(key, 1),
                      quant_state=model_quant_state.init_state(model_cfg))


def abstract_state(model_cfg, optimizer, tcfg) -> TrainState:
    """The train state's shapes and dtypes, computed without allocating it."""
    return jax.eval_shape(lambda k: _make_state(k, model_cfg, optimizer, tcfg),
                          jax.random.key(0))


def state_shardings(layout, model_cfg, abstract: TrainState,
                    params_memory_kind=None) -> TrainState:
    """Where each part of the state lives: parameters and optimizer state per the layout's
    table (parameters in host memory with ``params_memory_kind``), counters and RNG
    replicated."""
    logical = model_params.logical_axes(model_cfg)
    repl = layout.replicated()
    return TrainState(
        step=repl, opt_step=repl,
        params=layout.params(logical, abstract.params, params_memory_kind),
        opt_state=layout.opt_state(abstract.opt_state, logical, abstract.params),
        rng=repl, loss_scale=jax.tree.map(lambda _: repl, abstract.loss_scale),
        spike_stats=jax.tree.map(lambda _: repl, abstract.spike_stats),
        quant_state=jax.tree.map(lambda _: repl, abstract.quant_state))


def create_state(key, model_cfg, optimizer, tcfg, shardings: TrainState) -> TrainState:
    """The initial state, born sharded (jit with out_shardings: no device ever holds a full
    copy of a sharded tensor), then moved to host memory where ``shardings`` say so."""
    on_device = jax.tree.map(device_memory, shardings)
    state = jax.jit(lambda k: _make_state(k, model_cfg, optimizer, tcfg),
                    out_shardings=on_device)(key)
    if on_device == shardings:
        return state
    return jax.device_put(state, shardings)


def device_memory(sharding):
    """``sharding`` placed in device memory (host-memory shardings moved back to the device)."""
    kind = getattr(sharding, "memory_kind", None)
    return sharding if kind in (None, "device") else sharding.with_memory_kind("device")


def memory_movers(shardings):
    """(to_device, to_host) for a tree placed in host memory by ``shardings``, else None."""
    if all(getattr(s, "memory_kind", None) in (None, "device")
           for s in jax.tree.leaves(shardings)):
        return None
    on_device = jax.tree.map(device_memory, shardings)
    return (lambda tree: jax.device_put(tree, on_device),
            lambda tree: jax.device_put(tree, shardings))


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree.leaves(tree)))


def _loss_weights(loss_mask_MBT, tcfg):
    """Per-token weights [M,B,T] whose weighted sum is the step's loss (Megatron normalising)."""
    mask_MBT = loss_mask_MBT.astype(jnp.float32)
    if tcfg.per_token_loss:
        return mask_MBT / jnp.maximum(jnp.sum(mask_MBT), 1.0)
    M, B, T = mask_MBT.shape
    P = tcfg.data_parallel_size
    mask_MPbT = mask_MBT.reshape(M, P, B // P, T)
    tokens_MP11 = jnp.maximum(jnp.sum(mask_MPbT, axis=(2, 3), keepdims=True), 1.0)
    return (mask_MPbT / tokens_MP11 / (M * P)).reshape(M, B, T)


def _mtp_weights(micro: dict, weights_BT, tcfg, num_micro: int, depths: int) -> list:
    """Each multi-token-prediction depth's token weights [B,T] for a microbatch: its loss mask
    (shifted k places left, jaxtrain.models.mtp) normalised as Megatron normalises depth k's
    loss, over that depth's own tokens per microbatch and data-parallel shard; with
    calculate_per_token_loss over the step's tokens, as the main loss."""
    seq = mtp.sequences(micro.get("segment_ids"), micro["tokens"])
    out = []
    for k in range(1, depths + 1):
        if tcfg.per_token_loss:
            out.append(mtp.shift_left(weights_BT, k, seq))
        else:
            mask_BT = mtp.shift_left(micro["loss_mask"].astype(jnp.float32), k, seq)
            out.append(_loss_weights(mask_BT[None], tcfg)[0] / num_micro)
    return out


def make_train_step(model_cfg, tcfg, optimizer: optax.GradientTransformation, lr_schedule,
                    opt_state_memory=None, *, layout=None, grad_shardings=None,
                    params_memory=None):
    """The pure train step for these configs; jit it with donated state.

    ``opt_state_memory`` = (to_device, to_host) keeps the optimizer state in host memory
    between steps (paged_adamw8bit, optimizer_memory_host_offload): the step brings it to the
    device for the update and writes the new state back; ``params_memory`` does the same for
    the parameters (pgs ``parallel.cpu_offload``). ``layout`` (a
    :class:`~jaxtrain.parallel.sharding.Layout`) pins activation shardings while tracing;
    ``grad_shardings`` pins where the reduced gradients live (ZeRO-2/FSDP: sharded over data
    parallel, so XLA reduce-scatters instead of all-reducing).
    """
    accum_dtype = jnp.dtype(tcfg.accum_dtype)
    if tcfg.gradient_release:
        release.check_supported(model_cfg, tcfg)
    if tcfg.seco_chunk:
        seco.check_step(model_cfg, tcfg)
    frozen_key = dpo.frozen_key(tcfg) or "base"
    to_device, to_host = opt_state_memory or (lambda t: t, lambda t: t)
    params_in, params_out = params_memory or (lambda t: t, lambda t: t)
    pin = ((lambda t: jax.lax.with_sharding_constraint(t, grad_shardings))
           if grad_shardings is not None else (lambda t: t))
    programs = {}   # pipeline parallelism: the lowered schedule per microbatch count

    def pipelined(params, qstate, batch, weights_MBT, step_rng, scale, moe0):
        """(gradients in accum_dtype, Σ loss, Σ MoE statistics, the quantization state moved
        on) of the step's microbatches run through the pipeline schedule
        (jaxtrain.parallel.pipeline)."""
        M = weights_MBT.shape[0]
        if M not in programs:
            plan = tcfg.pipeline
            programs[M] = pipeline.lower(plan.build(M), model_cfg, stages.bounds(plan.counts))
        prog = programs[M]

        def split(q):
            return pipeline.split_params(q, model_cfg, prog.schedule, prog.bounds)

        stacks, shared = split(params)
        on = model_quant_state.switches(model_cfg)

        def staged(tree):
            return None if tree is None else pipeline.stage_params(
                tree, model_cfg, prog.schedule, prog.bounds)

        mtp_MDBT = None
        if model_cfg.mtp_num_layers:   # each microbatch's MTP depths' token weights
            mtp_MDBT = jax.vmap(lambda micro, w: jnp.stack(_mtp_weights(
                micro, w, tcfg, M, model_cfg.mtp_num_layers)))(batch, weights_MBT)
        gst, gsh, loss, moe_sum, qst, mtp_sum, kl_sum = pipeline.accumulate(
            prog, layout, model_cfg, stacks=stacks, shared=shared, batch=batch,
            weights_MBT=weights_MBT, step_rng=step_rng, scale=scale,
            num_chunks=tcfg.loss_chunks, half_precision=tcfg.half_precision_loss,
            accum_dtype=accum_dtype, embed_noise=tcfg.embed_noise, moe0=moe0,
            qstate=staged(qstate), qon=staged(on), objective=tcfg.objective,
            mtp_weights_MDBT=mtp_MDBT)
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, accum_dtype), params)
        (grads,) = jax.linear_transpose(split, like)((gst, gsh))
        if qstate is not None:
            qstate = pipeline.unstage(qst, qstate, model_cfg, prog.schedule, prog.bounds)
        extra = ({} if mtp_sum is None else   # the step divides extras by the microbatch count
                 {f"mtp_{k}_loss": v * M for k, v in enumerate(mtp_sum, 1)})
        if kl_sum is not None:
            extra.update(dsa.metrics(kl_sum, model_cfg))
        return grads, loss, moe_sum, qstate, extra

    def micro_loss(params, qstate, micro, weights_BT, rng, moe_state, scale, num_micro,
                   base_params):
        """(objective x scale, (LM loss, MoE stats)): the objective adds the MoE aux losses
        (summed over layers, weighted by their coefficients) averaged over microbatches. pgs
        pre_rl's loss is a mean over the microbatch's tokens, averaged over microbatches; so
        is DPO's (jaxtrain.dpo, a mean over the microbatch's pairs), whose metrics come third."""
        if tcfg.freeze_linear:
            params = freeze.stop_frozen(params)
        if tcfg.dpo is not None:
            lm, stats, extra = dpo.micro_loss(
                params, base_params, micro, model_cfg, tcfg.dpo, quant_state=qstate,
                moe_state=moe_state, rng=rng, num_chunks=tcfg.loss_chunks,
                half_precision=tcfg.half_precision_loss, embed_noise=tcfg.embed_noise)
            lm = lm / num_micro
            stats, indexer, extra = _indexer_terms(stats, num_micro, extra)
            aux = 0.0 if stats is None else jnp.sum(stats["objective"]) / num_micro
            return (lm + aux + indexer) * scale, (lm, stats, extra)
        mtp_weights = (_mtp_weights(micro, weights_BT, tcfg, num_micro,
                                    model_cfg.mtp_num_layers)
                       if model_cfg.mtp_num_layers else None)
        lm, stats = model_loss(params, micro, weights_BT, model_cfg, quant_state=qstate,
                               moe_state=moe_state, train=True, rng=rng,
                               num_chunks=tcfg.loss_chunks,
                               half_precision=tcfg.half_precision_loss,
                               objective=tcfg.objective, embed_noise=tcfg.embed_noise,
                               base_params=base_params, grad_in_forward=True,
                               mtp_weights=mtp_weights)
        if tcfg.objective.needs_base:
            lm = lm / num_micro
        extra = {}
        if mtp_weights is not None:   # Megatron: the scaled mean over depths joins the gradient
            stats = dict(stats)
            per_depth = stats.pop("mtp")
            mtp_objective = model_cfg.mtp_loss_scaling_factor * jnp.mean(per_depth)
            # reported per depth; the step divides extra metrics by the microbatch count
            extra = {f"mtp_{k}_loss": v * num_micro for k, v in enumerate(per_depth, 1)}
            stats = stats or None
        else:
            mtp_objective = 0.0
        stats, indexer, extra = _indexer_terms(stats, num_micro, extra)
        aux = 0.0 if stats is None else jnp.sum(stats["objective"]) / num_micro
        return (lm + aux + mtp_objective + indexer) * scale, (lm, stats, extra)

    def _indexer_terms(stats, num_micro, extra):
        """(stats without the DSA indexers' KL, their objective averaged over microbatches,
        ``extra`` with the microbatch's ``indexer_loss`` metric)."""
        stats, kl = dsa.pop(stats)
        if kl is None:
            return stats, 0.0, extra
        return stats, dsa.loss_weight(model_cfg) * kl / num_micro, {
            **extra, **dsa.metrics(kl, model_cfg)}

    def step(state: TrainState, batch: dict, frozen: dict | None = None):
        """``frozen``: parameter trees held beside the state, never trained ({"base": the
        starting weights} for pgs pre_rl, {"ref": the reference policy} for DPO)."""
        with layout.activations() if layout is not None else contextlib.nullcontext():
            return _step(dataclasses.replace(state, params=params_in(state.params)), batch,
                         frozen or {})

    def _released(state: TrainState, batch: dict):
        """pgs memory.gradient_release (jaxtrain.release): one microbatch, each parameter
        updated during the backward; nothing is skipped (no loss scale, no spike check)."""
        weights_MBT = _loss_weights(batch["loss_mask"], tcfg)
        rng, step_rng = jax.random.split(state.rng)
        micro = jax.tree.map(lambda a: a[0], batch)
        lr = lr_schedule(state.opt_step)
        loss, params, opt_state, grad_norm, zeros = release.fused_update(
            state.params, to_device(state.opt_state), micro, weights_MBT[0],
            jax.random.fold_in(step_rng, 0), model_cfg, tcfg, optimizer,
            log_zeros=tcfg.log_num_zeros_in_grad)
        new_state = dataclasses.replace(
            state, step=state.step + 1, opt_step=state.opt_step + 1,
            params=params_out(params), opt_state=to_host(opt_state), rng=rng)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
                   "skipped": jnp.bool_(False), "spike": jnp.bool_(False),
                   "tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}
        if tcfg.log_params_norm:
            metrics["params_norm"] = _global_norm(params)
        if zeros is not None:
            metrics["num_zeros_in_grad"] = zeros
        return new_state, metrics

    def _step(state: TrainState, batch: dict, frozen: dict):
        if tcfg.gradient_release:
            return _released(state, batch)
        weights_MBT = _loss_weights(batch["loss_mask"], tcfg)
        scale = state.loss_scale.scale if state.loss_scale is not None else jnp.float32(1.0)
        rng, step_rng = jax.random.split(state.rng)

        def accumulate(carry, xs, *, params, step_rng, pin):
            grads, loss, qstate, moe_sum, extra_sum = carry
            micro, weights_BT, i = xs   # one microbatch: [B,T] leaves
            moe_state = None if moe_sum is None or "aux_counts" not in moe_sum else {
                "aux_counts": moe_sum["aux_counts"], "steps": i.astype(jnp.float32)}
            # The quantization state's "gradient" is its updated value (overwrite-with-gradient,
            # see jaxtrain.quant.matmul): each microbatch's forward/backward moves it one call on.
            if tcfg.seco_chunk:   # pgs memory.seco: chunk by chunk (jaxtrain.seco)
                lm, g = seco.micro_grads(params, micro, weights_BT,
                                         jax.random.fold_in(step_rng, i), model_cfg, tcfg, scale)
                stats, extra = None, extra_sum
            else:
                (_, (lm, stats, extra)), (g, qstate) = jax.value_and_grad(
                    lambda p, q: micro_loss(p, q, micro, weights_BT,
                                            jax.random.fold_in(step_rng, i), moe_state, scale, M,
                                            frozen.get(frozen_key)),
                    argnums=(0, 1), has_aux=True)(params, qstate)
            g = jax.tree.map(lambda b: b.astype(accum_dtype), g)
            grads = pin(g if grads is None else jax.tree.map(jnp.add, grads, g))
            if moe_sum is not None:
                moe_sum = jax.tree.map(jnp.add, moe_sum, stats)
            extra_sum = jax.tree.map(jnp.add, extra_sum, extra)
            return (grads, loss + lm, qstate, moe_sum, extra_sum), None

        M = weights_MBT.shape[0]
        extra0 = (dpo.zero_metrics() if tcfg.dpo is not None else
                  {f"mtp_{k}_loss": jnp.float32(0.0)
                   for k in range(1, model_cfg.mtp_num_layers + 1)})
        if dsa.trains_indexer(model_cfg):
            extra0["indexer_loss"] = jnp.float32(0.0)
        micros = (batch, weights_MBT, jnp.arange(M))
        moe0 = moe.zero_stats(model_cfg)

        def accumulate_all(params, micros, step_rng, pin):
            """The first microbatch starts the gradient sum (no zero-filled accumulator to
            add to); the others, if any, run under lax.scan."""
            body = functools.partial(accumulate, params=params, step_rng=step_rng, pin=pin)
            carry, _ = body((None, jnp.float32(0.0), state.quant_state, moe0, extra0),
                            jax.tree.map(lambda a: a[0], micros))
            if M > 1:
                carry, _ = jax.lax.scan(body, carry, jax.tree.map(lambda a: a[1:], micros))
            return carry

        axes = () if M == 1 else accumulate_mod.local_axes(
            layout, model_cfg, tcfg, moe0 is not None, state.quant_state is not None)
        if tcfg.pipeline is not None:
            grads, loss, moe_sum, qstate, extra = pipelined(
                state.params, state.quant_state, batch, weights_MBT, step_rng, scale, moe0)
            carry = (pin(grads), loss, qstate, moe_sum, {**extra0, **extra})
        elif axes:   # one reduction per step (jaxtrain.parallel.accumulate)
            grads, loss = accumulate_mod.reduce_once(
                lambda p, m, r: accumulate_all(p, m, r, lambda t: t)[:2], layout, axes,
                state.params, micros, step_rng)
            carry = (pin(grads), loss, state.quant_state, moe0, extra0)
        else:
            carry = accumulate_all(state.params, micros, step_rng, pin)
        grads, loss, qstate, moe_sum, extra_sum = carry
        grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / scale).astype(p.dtype),
                             grads, state.params)
        grad_norm = _global_norm(grads)
        overflow = ~jnp.isfinite(grad_norm)
        skip = overflow if state.loss_scale is not None else jnp.bool_(False)

        spike_stats, spiked = state.spike_stats, jnp.bool_(False)
        if state.spike_stats is not None:
            checked, spiked = spikes.check(state.spike_stats, grad_norm, tcfg.spike_z_threshold)
            spike_stats = jax.tree.map(lambda new, old: jnp.where(overflow, old, new),
                                       checked, state.spike_stats)
            spiked = spiked & ~overflow
            skip = skip | spiked

        lr = lr_schedule(state.opt_step)
        opt_state = to_device(state.opt_state)
        trained = moe.trainable(state.params)   # without the expert bias (moe.NON_TRAINABLE)
        with jax.named_scope("optimizer"):
            updates, new_opt = optimizer.update(moe.trainable(grads), opt_state, trained)
            new_params = moe.merge_trainable(state.params, optax.apply_updates(trained, updates))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(skip, b, a), new, old)  # noqa: E731
        kept_params = keep(new_params, state.params)
        if moe_sum is not None:   # Megatron updates the routers' biases once per global batch
            kept_params = moe.update_router_state(kept_params, moe_sum, M, model_cfg,
                                                  step=state.step + 1)
        new_state = TrainState(
            step=state.step + 1, opt_step=state.opt_step + jnp.where(skip, 0, 1).astype(jnp.int32),
            params=params_out(kept_params),
            opt_state=to_host(keep(new_opt, opt_state)), rng=rng,
            loss_scale=(ls.update(state.loss_scale, overflow, tcfg.loss_scale)
                        if state.loss_scale is not None else None),
            spike_stats=spike_stats,
            quant_state=keep(qstate, state.quant_state))   # a skip keeps it, as the params
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32),
                   "skipped": skip, "spike": spiked,
                   "tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}
        metrics.update({k: v / M for k, v in extra_sum.items()})   # DPO: means over pairs
        if moe_sum is not None:
            metrics.update(moe.metrics(jax.tree.map(lambda a: a / M, moe_sum), model_cfg,
                                       moe.moe_layer_ids(model_cfg)))
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        if tcfg.log_params_norm:
            metrics["params_norm"] = _global_norm(kept_params)
        if tcfg.log_num_zeros_in_grad:
            metrics["num_zeros_in_grad"] = sum(jnp.sum(g == 0) for g in jax.tree.leaves(grads))
        return new_state, metrics

    return step
