"""Gradient accumulation that reduces over data parallel once per step, not per microbatch.

Under GSPMD the gradient sum carried through the microbatch loop has a sharding (replicated,
or split over data parallel from ZeRO-2), so XLA all-reduces (reduce-scatters) each
microbatch's gradient before adding it. Megatron reduces once, after the last microbatch.
When the mesh only splits the batch (no tensor, context, expert or pipeline split, parameters
whole on every device) and every term of the loss is a sum over tokens, the microbatch loop
here runs inside ``shard_map`` over the batch axes: each device sums its own rows' gradients
and loss, and one ``psum`` per step adds them up.

Not used where a microbatch's loss needs the whole microbatch at once: MoE routing statistics
(the load-balancing losses count tokens over the global batch), DPO and the token-weighting
objectives (means and statistics over the microbatch), FP8 delayed scaling (amax over the
global batch), pgs seco and gradient release (their own loops).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.mesh import BATCH_AXES
from jaxtrain.parallel.sharding import no_layout


def local_axes(layout, model_cfg, tcfg, has_moe: bool, has_quant_state: bool
               ) -> tuple[str, ...]:
    """The batch axes a local accumulation sums over; () where it does not apply."""
    if layout is None or has_moe or has_quant_state or layout.mcfg.stage >= 3:
        return ()
    if tcfg.dpo is not None or tcfg.objective.weighted or tcfg.seco_chunk or getattr(
            model_cfg, "mtp_num_layers", 0) or getattr(model_cfg, "dsa_loss_coeff", 0):
        # metrics beside the loss (DPO, MTP, the DSA indexer's): the general path
        return ()
    shape = layout.mesh_shape
    if any(n > 1 for a, n in shape.items() if a not in BATCH_AXES):
        return ()
    return tuple(a for a in BATCH_AXES if shape.get(a, 1) > 1)


def reduce_once(accumulate, layout, axes: tuple[str, ...], params, micros, rng):
    """``accumulate(params, micros, rng) -> (grads, loss)`` run by each device on its rows of
    ``micros`` (leaves [M, B, ...] split over ``axes`` on B; 1-D leaves whole), its dropout
    key folded with its index; returns the sums over devices (replicated)."""
    def spec(a):
        return P(None, axes) if a.ndim >= 2 else P()

    def local(params, micros, rng):
        with no_layout():
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
            return jax.lax.psum(accumulate(params, micros, rng), axes)

    return jax.shard_map(local, mesh=layout.mesh,
                         in_specs=(P(), jax.tree.map(spec, micros), P()),
                         out_specs=P(), check_vma=False)(params, micros, rng)
