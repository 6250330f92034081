"""Pipeline parallelism: one executor that runs any schedule table (jaxtrain.parallel.schedules).

A schedule is lowered (:func:`lower`) into a static program: at each tick every pipeline rank
runs at most one op (F, B or W of one microbatch on one of its model chunks), then the ranks
exchange what they produced (``ppermute`` over the ``pipeline`` mesh axis: activations to the
next stage, input gradients to the previous one). Ticks come from timing the table with unit
costs, so an op runs one tick after the op it waits for. What a rank receives goes into a
buffer slot chosen statically: a slot is reused once its last reader ran, so the buffers hold
exactly what the schedule keeps in flight (1F1B's p microbatches on the first rank, GPipe's m).

:func:`accumulate` runs the program as one ``lax.scan`` over ticks inside a ``shard_map`` that
is manual over ``pipeline`` only: the other mesh axes (data, tensor, ...) stay under the
compiler's partitioner, so a stage runs exactly as the unpipelined model does. Per op:

- F: the stage's forward from its input (the first stage embeds the tokens; the last stage
  computes the loss, kept for the step's metric);
- B: the stage's backward, recomputed from its saved input (stages keep only their inputs, as
  Megatron's full activation recompute): parameter gradients and the input gradient;
- split backward (zero-bubble schedules): B computes only the input gradient and W, later,
  only the parameter gradients (each recomputes the forward).

Parameter gradients are summed per rank; the shared parameters (embedding, final norm, output
layer) are summed over ranks at the end, which also joins a tied embedding's two uses (first
and last stage). The loss and its normalisation are the unpipelined step's: each microbatch's
loss is Σ weights · NLL with the step's token weights.

Under context parallelism the ranks run in lockstep: attention's ring exchange and the token
reordering around it are collective permutes, which XLA's CPU runtime only completes when every
device of the mesh enters them (and GPU runtimes only promise). Each tick, every op kind some
rank runs at that tick runs on every rank, which keeps only its own op's results; such a tick
costs the sum of its kinds (GPipe nothing more, 1F1B's steady state F + B, not max(F, B)).

Legend: p ranks, v chunks per rank, S = p·v stages, m microbatches, b rows per microbatch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.fused_ce import head_params
from jaxtrain.loss import hidden_loss, mtp_loss
from jaxtrain.models import attn_res, dsa, quant_state
from jaxtrain.models.params import STACKS
from jaxtrain.models.remat import NO_REMAT, layer_plan
from jaxtrain.models.spec import MOE_STACKS, layer_kinds
from jaxtrain.models.transformer import _run_layers, final_hidden, layer_inputs, layer_stacks
from jaxtrain.parallel import schedules as sched

AXIS = "pipeline"
IDLE = "idle"
FIXED = ("hash_routes",)   # untrained parameters every stage's layers read


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule lowered to ticks. ``rows`` [ticks, p, 8]: per rank, its op's branch,
    microbatch, chunk, input slot, gradient slot, layer shift, whether it is on the first
    stage (input: the embeddings) and the MoE-layer index of its stage's first layer;
    ``recv`` [ticks, p, channels, 2]: the input and gradient slot each channel's message is
    written to (the last slot of a buffer is a sink for no message); ``flags`` [ticks, 2]:
    whether the tick runs the output layer and loss (after a forward of the last stage) and
    the embedding's backward (after an input gradient of the first stage). ``branches``:
    (op kind, representative stage) per branch, 0 = idle."""

    schedule: sched.Schedule
    bounds: tuple[tuple[int, int], ...]   # per stage: its layers [lo, hi)
    rows: np.ndarray
    recv: np.ndarray
    flags: np.ndarray
    channels: tuple[int, ...]      # rank shift of each channel's ppermute
    branches: tuple[tuple[str, int], ...]
    x_slots: int
    g_slots: int
    head_rank: int
    embed_rank: int

    @property
    def ticks(self) -> int:
        return self.rows.shape[0]


def _signature(cfg, bounds, s: int):
    """Stages with equal signatures run one traced body (their layer indices shifted)."""
    lo, hi = bounds[s]
    plan = tuple((g.start - lo, g.stop - lo, g.group, g.policy is NO_REMAT)
                 for g in layer_plan(cfg, lo, hi) if g.stop > g.start)
    res = lo if cfg.attn_res_block_size else None   # its summaries and block boundaries
    return (tuple(layer_kinds(cfg)[lo:hi]), plan, res)


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for values alive over [arrive, last use] ticks: a slot is free again from its
    value's last-use tick (the write of a tick follows its reads)."""
    free_at: list[int] = []
    slot = {}
    for start, end, key in sorted(intervals, key=lambda t: t[:2]):
        for i, t in enumerate(free_at):
            if t <= start:
                slot[key], free_at[i] = i, end
                break
        else:
            slot[key] = len(free_at)
            free_at.append(end)
    return slot, len(free_at)


def lower(s: sched.Schedule, cfg, bounds) -> Program:
    """The schedule ``s`` as a tick program for stages with layer ``bounds`` (per stage).

    The output layer and loss run in the tick of the last stage's forward (their gradient
    waits in a gradient slot for that stage's backward); the embedding's backward runs in the
    tick of the first stage's input gradient."""
    p, S = s.ranks, s.ranks * s.chunks
    starts = sched.timeline(s, {"F": 1.0, "B": 1.0, "W": 1.0})
    tick = {}                       # (kind, microbatch, stage) -> (tick, rank)
    for r, (order, st) in enumerate(zip(s.orders, starts)):
        for op, t in zip(order, st):
            tick[(op.kind, op.microbatch, s.stage(r, op.chunk))] = (int(t), r)
    n_ticks = 1 + max(t for t, _ in tick.values())
    home = {s.stage(r, c): r for r in range(p) for c in range(s.chunks)}
    last_use = "W" if s.split_backward else "B"

    x_live = [[] for _ in range(p)]     # per rank: (arrive, last use, (microbatch, stage))
    g_live = [[] for _ in range(p)]
    messages = []                       # (tick, from rank, to rank, buffer, key)
    flags = np.zeros((n_ticks, 2), np.int32)
    for (kind, mb, st), (t, r) in tick.items():
        if kind == "F" and st < S - 1:
            dest = home[st + 1]
            x_live[dest].append((t, tick[(last_use, mb, st + 1)][0], (mb, st + 1)))
            messages.append((t, r, dest, 0, (mb, st + 1)))
        if kind == "F" and st == S - 1:   # the loss's gradient, kept for this stage's B
            g_live[r].append((t, tick[(last_use, mb, st)][0], (mb, st)))
            flags[t, 0] = 1
        if kind == "B" and st > 0:
            dest = home[st - 1]
            g_live[dest].append((t, tick[(last_use, mb, st - 1)][0], (mb, st - 1)))
            messages.append((t, r, dest, 1, (mb, st - 1)))
        if kind == "B" and st == 0:
            flags[t, 1] = 1
    x_slot, g_slot = zip(*[(_allocate(x_live[r]), _allocate(g_live[r])) for r in range(p)])
    nx = max(1, max(n for _, n in x_slot))
    ng = max(1, max(n for _, n in g_slot))
    channels = tuple(sorted({(d - r) % p for _, r, d, _, _ in messages}))

    sigs, branches, branch_of = {}, [(IDLE, -1)], {}
    rows = np.zeros((n_ticks, p, 8), np.int32)
    kinds = layer_kinds(cfg)
    rows[:, :, 3], rows[:, :, 4] = nx, ng
    for (kind, mb, st), (t, r) in tick.items():
        if kind == "B":
            kind = "Bx" if s.split_backward else "BW"
        rep = sigs.setdefault(_signature(cfg, bounds, st), st)
        key = (kind, rep)
        if key not in branch_of:
            branch_of[key] = len(branches)
            branches.append(key)
        c = next(c for c in range(s.chunks) if s.stage(r, c) == st)
        rows[t, r] = (branch_of[key], mb, c,
                      x_slot[r][0].get((mb, st), nx), g_slot[r][0].get((mb, st), ng),
                      bounds[st][0] - bounds[rep][0], st == 0,
                      sum(k in MOE_STACKS for k in kinds[:bounds[st][0]]))
    recv = np.zeros((n_ticks, p, max(1, len(channels)), 2), np.int32)
    recv[..., 0], recv[..., 1] = nx, ng
    for t, r, dest, buf, key in messages:
        ch = channels.index((dest - r) % p)
        recv[t, dest, ch, buf] = (x_slot if buf == 0 else g_slot)[dest][0][key]
    return Program(s, tuple(bounds), rows, recv, flags, channels, tuple(branches), nx, ng,
                   home[S - 1], home[0])


def events(prog: Program) -> dict:
    """The program as data (``dump_pp_data``): every op with its rank, tick, stage and
    microbatch, and the stages' layers."""
    ops = []
    for t in range(prog.ticks):
        for r in range(prog.schedule.ranks):
            branch, mb, chunk = (int(x) for x in prog.rows[t, r, :3])
            if branch:
                ops.append({"tick": t, "rank": r, "op": prog.branches[branch][0],
                            "microbatch": mb, "chunk": chunk,
                            "stage": prog.schedule.stage(r, chunk)})
    return {"schedule": prog.schedule.name, "ranks": prog.schedule.ranks,
            "chunks": prog.schedule.chunks, "microbatches": prog.schedule.microbatches,
            "stage_layers": [list(b) for b in prog.bounds], "ticks": prog.ticks,
            "input_slots": prog.x_slots, "ops": ops}


def stage_params(stacks: dict, cfg, s: sched.Schedule, bounds):
    """Per-rank copies of the layer stacks: {stack: [p, v, n_max, ...]}, chunk c of rank r
    holding its stage's layers of that stack in order (padded with layer 0)."""
    out = {}
    for k, tree in stacks.items():
        idx, _ = _stage_index(cfg, s, bounds, k)
        if np.array_equal(idx.reshape(-1), np.arange(layer_kinds(cfg).count(k))):
            # the stack in order, evenly split: a reshape (each rank's slice stays in place)
            out[k] = jax.tree.map(lambda a: a.reshape(*idx.shape, *a.shape[1:]), tree)
        else:
            out[k] = jax.tree.map(lambda a: a[idx], tree)
    return out


def _stage_index(cfg, s: sched.Schedule, bounds, k: str) -> tuple[np.ndarray, np.ndarray]:
    """(index [p, v, n_max] into stack k's layers, validity mask) of :func:`stage_params`."""
    kinds = layer_kinds(cfg)
    ordinal = np.cumsum([x == k for x in kinds]) - 1
    per = [[[int(ordinal[i]) for i in range(*bounds[s.stage(r, c)]) if kinds[i] == k]
            for c in range(s.chunks)] for r in range(s.ranks)]
    n = max(1, max(len(x) for row in per for x in row))
    idx = np.array([[x + [0] * (n - len(x)) for x in row] for row in per], np.int32)
    valid = np.array([[[j < len(x) for j in range(n)] for x in row] for row in per])
    return idx, valid


def unstage(staged: dict, like: dict, cfg, s: sched.Schedule, bounds) -> dict:
    """The inverse of :func:`stage_params` for values that are not summed (the quantization
    state): each layer's entry from the one stage slot holding it (padding slots dropped)."""
    out = {}
    for k, tree in staged.items():
        idx, valid = _stage_index(cfg, s, bounds, k)
        rows = idx[valid]
        out[k] = jax.tree.map(
            lambda a, base: base.at[rows].set(a.reshape(-1, *a.shape[3:])[valid.reshape(-1)]),
            tree, like[k])
    return out


def split_params(params: dict, cfg, s: sched.Schedule, bounds):
    """(per-rank layer stacks as :func:`stage_params`, the other parameters). It is linear:
    its transpose (``jax.linear_transpose``) brings the executor's gradients back to the
    parameters' shape."""
    shared = {k: v for k, v in params.items() if k not in STACKS}
    return stage_params(layer_stacks(params, cfg), cfg, s, bounds), shared


def _layer_counts(cfg, bounds, st: int) -> dict:
    kinds = layer_kinds(cfg)[slice(*bounds[st])]
    return {k: kinds.count(k) for k in STACKS if kinds.count(k)}


def accumulate(prog: Program, layout, cfg, *, stacks, shared, batch, weights_MBT, step_rng,
               scale, num_chunks: int, half_precision: bool, accum_dtype,
               embed_noise: float = 0.0, moe0=None, qstate=None, qon=None, objective=None,
               mtp_weights_MDBT=None):
    """(stage gradients {stack: [p, v, n_max, ...]}, shared gradients, Σ loss, Σ MoE
    statistics, the stages' quantization state, Σ per-depth MTP losses [D] or None, Σ over
    microbatches and layers of the DSA indexers' KL or None) of the step's microbatches run by
    ``prog``; the indexers' objective joins each stage's loss as in the unpipelined step.
    ``mtp_weights_MDBT``: each microbatch's multi-token-prediction token weights
    (jaxtrain.step); the MTP modules run with the output layer after the last stage, adding
    mtp_loss_scaling_factor times the mean over depths (and an MoE MTP layer's router
    objective) to the loss they differentiate.
    ``qstate`` / ``qon``: the delayed-scaling state and first_last_layers_bf16 switches
    (:mod:`jaxtrain.models.quant_state`) split as :func:`stage_params`, or None; a stage's
    weight-gradient op (W, or the whole backward) moves its layers' state on, so each stage
    updates its own in the order its schedule runs the microbatches. ``objective``: a
    token-weighting objective (``TrainConfig.objective``; its factors come from each
    microbatch's own logits at the last stage). ``stacks``:
    :func:`stage_params`;
    ``shared``: the other parameters; ``batch`` leaves and ``weights_MBT`` [M, B, T]; the
    gradients are of the loss times ``scale`` (fp16 loss scaling), in ``accum_dtype``;
    ``embed_noise``: pgs sym_noise's alpha on the embeddings; ``moe0``: zeros shaped like the
    MoE layers' stacked router statistics (None without MoE layers), whose load-balancing
    objective joins the loss averaged over microbatches, as in the unpipelined step.

    A rank's op runs in a ``lax.switch`` on its branch; the embedding, output layer and loss
    run outside it, on every rank of a tick that needs them (a tick lasts as long as its
    slowest rank, so this costs no time), so that the collectives they contain under tensor
    parallelism are entered by every device; under context parallelism the ranks run their
    ops in lockstep (``run_op``)."""
    bounds = prog.bounds
    p = prog.schedule.ranks
    lockstep = layout.mesh_shape.get("context", 1) > 1
    if objective is not None and objective.needs_base:
        raise ValueError("the pipeline does not run an objective with a base model (pre_rl)")
    M, T = batch["tokens"].shape[0], batch["tokens"].shape[-1]
    emb_keys = [k for k in ("embedding", "position_embedding") if k in shared]
    head_keys = list(dict.fromkeys(["final_norm", *head_params(shared, cfg),
                                    *[k for k in ("hc_head", "attn_res_head") if k in shared]]))
    depths = cfg.mtp_num_layers if mtp_weights_MDBT is not None else 0
    if depths:   # the MTP modules read the embeddings too
        head_keys = list(dict.fromkeys([*head_keys, "mtp", *emb_keys]))
    main_moe = sum(k in MOE_STACKS for k in layer_kinds(cfg))   # MTP layers' rows after

    def earlier(hist, mb):
        """global_aux_loss's state for microbatch ``mb``: the counts of the earlier ones."""
        if hist is None:
            return None
        before = (jnp.arange(M) < mb)[:, None, None]
        return {"aux_counts": jnp.sum(jnp.where(before, hist, 0.0), 0),
                "steps": mb.astype(jnp.float32)}

    def context(micro, rng, sh=None, moe_state=None, fixed=None):
        """(embeddings or None, the layers' context) of a microbatch. ``fixed``: the untrained
        tables the layers read (DeepSeek-V4's hash routes), on every stage."""
        return layer_inputs({**(fixed or {}), **(sh or {})}, micro["tokens"], cfg,
                            positions=micro.get("positions"),
                            segment_ids=micro.get("segment_ids"), deterministic=False,
                            rng=rng, with_embedding=sh is not None, embed_noise=embed_noise,
                            moe_state=moe_state)

    def wire(x):
        """The embeddings as the first stage receives them (attention residuals: folded)."""
        return attn_res.fold(x, None, cfg) if cfg.attn_res_block_size else x

    def layers_fn(st: int, shift, on, moe_state, fixed, sp, q, x, micro, rng):
        """((stage output, its MoE and DSA indexer objectives / M), (router statistics or
        None, the stage's DSA indexer KL or None))."""
        _, ctx = context(micro, rng, moe_state=moe_state, fixed=fixed)
        y, stats = _run_layers(quant_state.attach_stacks(sp, cfg, q, on), x, ctx, cfg,
                               layers=bounds[st], shift=shift)
        stats, kl = dsa.pop(stats)
        aux = jnp.float32(0.0) if stats is None else jnp.sum(stats["objective"]) / M
        if kl is not None:
            aux = aux + dsa.loss_weight(cfg) * kl / M
        return (y, aux), (stats, kl)

    def make_branch(kind: str, st: int):
        n = _layer_counts(cfg, bounds, st)

        def branch(carry, row, x_in, micro, rng, sp_all, on_all, fixed, scale):
            xbuf, gbuf, gst, moe, qst, hist, ind = carry
            c, gs, shift = row[2], row[4], row[5]
            moe_state = earlier(hist, row[1])

            def mine(tree):   # this chunk's layers of a per-rank [v, n_max, ...] tree
                return None if tree is None else {
                    k: jax.tree.map(lambda a: a[c, :n[k]], tree[k]) for k in n if k in tree}

            sp, q = mine(sp_all), mine(qst)
            f = functools.partial(layers_fn, st, shift, mine(on_all), moe_state, fixed)
            if kind == "F":
                (y, _), (stats, kl) = f(sp, q, x_in, micro, rng)
                ind = ind if kl is None else ind + kl
                if stats is not None:
                    moe = jax.tree.map(lambda acc, s: jax.lax.dynamic_update_slice_in_dim(
                        acc, jax.lax.dynamic_slice_in_dim(acc, row[7], s.shape[0]) + s,
                        row[7], 0), moe, stats)
                if hist is not None and stats is not None:
                    hist = hist.at[row[1]].set(jax.lax.dynamic_update_slice_in_dim(
                        hist[row[1]], stats["aux_counts"], row[7], 0))
                return (xbuf, gbuf, gst, moe, qst, hist, ind), y.astype(x_in.dtype)
            cot = (gbuf[gs], scale)
            if kind == "Bx":
                _, vjp, _ = jax.vjp(lambda x: f(sp, q, x, micro, rng), x_in, has_aux=True)
                return carry, vjp(cot)[0].astype(x_in.dtype)
            # the quantization state's "gradient" is its next value (overwrite-with-gradient)
            if kind == "W":
                _, vjp, _ = jax.vjp(lambda a, s: f(a, s, x_in, micro, rng), sp, q,
                                    has_aux=True)
                (dsp, dq), dx = vjp(cot), jnp.zeros_like(x_in)
            else:
                _, vjp, _ = jax.vjp(lambda a, s, x: f(a, s, x, micro, rng), sp, q, x_in,
                                    has_aux=True)
                dsp, dq, dx = vjp(cot)
            gst = {k: jax.tree.map(lambda acc, g: acc.at[c, :n[k]].add(g.astype(acc.dtype)),
                                   gst[k], dsp[k]) if k in dsp else gst[k] for k in gst}
            if qst is not None:
                qst = {k: jax.tree.map(lambda acc, new: acc.at[c, :n[k]].set(new), qst[k],
                                       dq[k]) if k in dq else qst[k] for k in qst}
            return (xbuf, gbuf, gst, moe, qst, hist, ind), dx.astype(x_in.dtype)

        return branch

    def idle(carry, row, x_in, micro, rng, sp_all, on_all, fixed, scale):
        return carry, jnp.zeros_like(x_in)

    fns = [idle] + [make_branch(k, st) for k, st in prog.branches[1:]]

    def run_op(branches_t, mine, carry, args):
        """(carry, output) of this rank's op (branch ``mine``; ``branches_t``: every rank's at
        this tick). Without lockstep, a ``lax.switch``. In lockstep, every branch some rank
        runs at this tick runs on every rank, each rank keeping only its own op's results,
        so that every device enters the same collectives in the same order."""
        if not lockstep:
            return jax.lax.switch(mine, fns, carry, *args)
        out = jnp.zeros_like(args[1])
        for b in range(1, len(fns)):
            def use(carry, out, b=b):
                new, y = fns[b](carry, *args)
                keep = mine == b
                return (jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, carry),
                        jnp.where(keep, y, out))
            carry, out = jax.lax.cond(jnp.any(branches_t == b), use,
                                      lambda carry, out: (carry, out), carry, out)
        return carry, out

    def run(sp_all, sh_all, moe, qst, on_all, batch, weights_MBT, step_rng, scale, rows, recv,
            flags, mtp_w):
        rank = jax.lax.axis_index(AXIS)
        # this rank's [v, n_max, ...]
        sp_all, qst, on_all = jax.tree.map(lambda a: a[0], (sp_all, qst, on_all))
        B = batch["tokens"].shape[1]
        dt = jnp.dtype(cfg.residual_dtype)
        # what a stage sends: the residual stream [B,T,D], its n streams [B,T,n,D] with
        # hyper-connections, the folded running sum and summaries with attention residuals
        streams = (cfg.hc_streams if cfg.hc_streams > 1 else
                   attn_res.width(cfg) if cfg.attn_res_block_size else None)
        x_shape = (B, T, *([streams] if streams else []), cfg.hidden_size)
        xbuf = jnp.zeros((prog.x_slots + 1, *x_shape), dt)
        gbuf = jnp.zeros((prog.g_slots + 1, *x_shape), dt)
        gst = jax.tree.map(lambda a: jnp.zeros(a.shape, accum_dtype), sp_all)
        gsh = jax.tree.map(lambda a: jnp.zeros(a.shape, accum_dtype), sh_all)
        emb = {k: sh_all[k] for k in emb_keys}
        fixed = {k: sh_all[k] for k in FIXED if k in sh_all}
        head = {k: sh_all[k] for k in head_keys}
        on_head, on_embed = rank == prog.head_rank, rank == prog.embed_rank

        def head_loss_grads(x, micro, w, mb, rng, moe_state):
            """(loss, its gradient for x and the head's parameters, x scale, per-depth MTP
            losses, the MTP layers' router statistics) of the last stage's output x.
            ``moe_state``: global_aux_loss's counts before microbatch ``mb`` (MTP layers)."""
            _, ctx = context(micro, rng, moe_state=moe_state, fixed=fixed)   # MTP layers

            def loss_fn(x, h):
                hidden = final_hidden(h, x, ctx, cfg)
                loss = hidden_loss(h, hidden, micro["targets"], w, cfg, num_chunks=num_chunks,
                                   half_precision=half_precision, objective=objective,
                                   grad_in_forward=True)
                if not depths:
                    return loss, (loss, jnp.zeros((0,), jnp.float32), None)
                return mtp_objective(h, hidden, micro, ctx, loss, mtp_w[mb])
            (_, (loss, per_depth, stats)), (dx, dh) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True)(x, head)
            return loss, (dx * scale).astype(dt), jax.tree.map(
                lambda g: (g * scale).astype(accum_dtype), dh), per_depth, stats

        def mtp_objective(h, hidden, micro, ctx, loss, w_DBT):
            """The main loss plus the MTP modules' (jaxtrain.models.mtp) as the unpipelined
            step adds them, with (loss, per-depth losses, their router statistics)."""
            per_depth, stats = mtp_loss(h, hidden, micro, ctx, list(w_DBT), cfg,
                                        num_chunks=num_chunks, half_precision=half_precision,
                                        grad_in_forward=True)
            aux = 0.0 if stats is None else jnp.sum(stats["objective"]) / M
            total = loss + cfg.mtp_loss_scaling_factor * jnp.mean(per_depth) + aux
            return total, (loss, per_depth, stats)

        def tick(carry, xs):
            xbuf, gbuf, gst, gsh, loss, moe, qst, hist, mtp_sum, ind = carry
            rows_t, recv_t, flags_t = xs
            row, rcv = rows_t[rank], recv_t[rank]
            mb = row[1]
            micro = jax.tree.map(lambda a: a[mb], batch)
            rng = jax.random.fold_in(step_rng, mb)
            x_emb, embed_vjp = jax.vjp(
                lambda e: wire(context(micro, rng, e, fixed=fixed)[0]).astype(dt), emb)
            x_in = jnp.where(row[6] == 1, x_emb, xbuf[row[3]])
            args = (row, x_in, micro, rng, sp_all, on_all, fixed, scale)
            (xbuf, gbuf, gst, moe, qst, hist, ind), out = run_op(
                rows_t[:, 0], row[0], (xbuf, gbuf, gst, moe, qst, hist, ind), args)
            # the output layer and loss after the last stage's forward (its gradient kept in
            # the stage's gradient slot), the embedding's backward after the first stage's
            mtp_rows = None if moe is None or not depths else jax.tree.map(
                lambda a: jnp.zeros((depths, *a.shape[1:]), a.dtype), moe)
            zero_head = (jnp.float32(0.0), jnp.zeros_like(out),
                         jax.tree.map(lambda a: jnp.zeros(a.shape, accum_dtype), head),
                         jnp.zeros((depths,), jnp.float32), mtp_rows)
            lv, dx, dh, per_depth, mtp_stats = jax.lax.cond(
                flags_t[0] == 1, lambda: head_loss_grads(out, micro, weights_MBT[mb], mb, rng,
                                                         earlier(hist, mb)),
                lambda: zero_head)
            use_head = (flags_t[0] == 1) & on_head
            if hist is not None and mtp_rows is not None:   # the MTP layers' counts, kept
                hist = hist.at[mb, main_moe:].set(
                    jnp.where(use_head, mtp_stats["aux_counts"], hist[mb, main_moe:]))
            gbuf = gbuf.at[jnp.where(use_head, row[4], prog.g_slots)].set(dx)
            loss = loss + jnp.where(use_head, lv, 0.0)
            mtp_sum = mtp_sum + jnp.where(use_head, per_depth, 0.0)
            if mtp_rows is not None:   # an MoE MTP layer's statistics: the rows after the main
                moe = jax.tree.map(lambda acc, s: acc.at[main_moe:].add(
                    jnp.where(use_head, s, 0).astype(acc.dtype)), moe, mtp_stats)
            gsh = {**gsh, **{k: jax.tree.map(
                lambda acc, g: acc + jnp.where(use_head, g, 0).astype(acc.dtype), gsh[k], dh[k])
                for k in head}}
            use_emb = (flags_t[1] == 1) & on_embed
            demb = jax.lax.cond(
                flags_t[1] == 1,
                lambda: embed_vjp(jnp.where(use_emb, out, jnp.zeros_like(out)))[0],
                lambda: jax.tree.map(jnp.zeros_like, emb))
            gsh = {**gsh, **{k: jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype),
                                             gsh[k], demb[k]) for k in emb}}
            for ch, shift in enumerate(prog.channels):
                got = out if shift == 0 else jax.lax.ppermute(
                    out, AXIS, [(i, (i + shift) % p) for i in range(p)])
                xbuf = xbuf.at[rcv[ch, 0]].set(got)
                gbuf = gbuf.at[rcv[ch, 1]].set(got)
            return (xbuf, gbuf, gst, gsh, loss, moe, qst, hist, mtp_sum, ind), None

        # global_aux_loss: each microbatch's counts per MoE layer, written by the stages' F
        hist = (jnp.zeros((M, *moe["aux_counts"].shape), jnp.float32)
                if moe is not None and "aux_counts" in moe else None)
        carry = (xbuf, gbuf, gst, gsh, jnp.float32(0.0), moe, qst, hist,
                 jnp.zeros((depths,), jnp.float32), jnp.float32(0.0))
        (_, _, gst, gsh, loss, moe, qst, _, mtp_sum, ind), _ = jax.lax.scan(
            tick, carry, (rows, recv, flags))
        gsh, loss, moe, mtp_sum, ind = jax.lax.psum((gsh, loss, moe, mtp_sum, ind), AXIS)
        return jax.tree.map(lambda a: a[None], (gst, qst)) + (gsh, loss, moe, mtp_sum, ind)

    spec = P(AXIS)
    staged = lambda tree: jax.tree.map(lambda _: spec, tree)  # noqa: E731
    gst, qst, gsh, loss, moe, mtp_sum, ind = jax.shard_map(
        run, mesh=layout.mesh,
        in_specs=(staged(stacks), P(), P(), staged(qstate), staged(qon), P(), P(), P(), P(),
                  P(), P(), P(), P()),
        out_specs=(staged(stacks), staged(qstate), P(), P(), P(), P(), P()),
        axis_names={AXIS}, check_vma=False)(
            stacks, shared, moe0, qstate, qon, batch, weights_MBT, step_rng,
            jnp.asarray(scale, jnp.float32), jnp.asarray(prog.rows), jnp.asarray(prog.recv),
            jnp.asarray(prog.flags),
            mtp_weights_MDBT if depths else jnp.zeros((0,), jnp.float32))
    return (gst, gsh, loss, moe, qst, (mtp_sum if depths else None),
            ind if dsa.trains_indexer(cfg) else None)
