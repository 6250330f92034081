"""Mixture-of-experts FFN: Megatron's top-k router in every mode, capacity and dropless token
dispatch with a grouped matmul, shared experts, and expert parallelism.

The formulas follow Megatron-LM's megatron/core/transformer/moe (router.py, moe_utils.py,
token_dispatcher.py, upcycling_utils.py), with Primus's and MaxText's additions where a knob
asks for them. One module per concern, each importing only the ones above it in this list:

    config     MoEConfig (the knobs and their validation), moe_layer_freq parsing, moe_pattern
    comm       the mesh axes seen inside the MoE's shard_map; per-rank sums and means
    router     gating, scores, top-k / group-limited / sinkhorn routing, capacity, aux/z losses
    experts    the experts' FFN on rows sorted by expert (grouped matmul) or capacity buffers
    dispatch   tokens to their experts and back: local, allgather, alltoall
    block      moe_block: router + routed experts (in a shard_map under a layout) + shared expert
    step       the train step's side: non-trainable expert bias and its update, stats, metrics
    upcycling  a dense model's parameters turned into the MoE model's (moe_use_upcycling)

Everything callers used from the single module this package replaces is importable from
``jaxtrain.models.moe`` itself.

Legend: B batch, T length, D hidden, E experts, k top-k, F expert FFN hidden, N tokens.
"""
from jaxtrain.models.moe.block import moe_block
from jaxtrain.models.moe.comm import LOCAL, Comm
from jaxtrain.models.moe.config import (BALANCING, DISPATCHERS, DROP_POLICIES,
                                        EXPERT_ACTIVATIONS, FORCE_BALANCING, LOSS_METRICS,
                                        NON_TRAINABLE, SCORE_FUNCTIONS, SINKHORN_MAX_ITERS,
                                        SINKHORN_TOL, MoEConfig, moe_pattern, parse_layer_freq)
from jaxtrain.models.moe.dispatch import experts_local
from jaxtrain.models.moe.experts import _glu
from jaxtrain.models.moe.router import (_gate, aux_scores, capacity, capacity_slots,
                                        group_score_topk, route, sequence_capacity, sinkhorn,
                                        sinkhorn_routing, switch_loss, topk_routing)
from jaxtrain.models.moe.step import (merge_trainable, metrics, moe_layer_ids, trainable,
                                      update_expert_bias, update_router_state, zero_stats)
from jaxtrain.models.moe.upcycling import upcycle
from jaxtrain.ops import grouped_matmul


__all__ = ["BALANCING", "Comm", "DISPATCHERS", "DROP_POLICIES", "EXPERT_ACTIVATIONS",
           "FORCE_BALANCING", "LOCAL", "LOSS_METRICS", "MoEConfig", "NON_TRAINABLE",
           "SCORE_FUNCTIONS", "SINKHORN_MAX_ITERS", "SINKHORN_TOL", "aux_scores", "capacity",
           "capacity_slots", "experts_local", "group_score_topk", "grouped_matmul",
           "merge_trainable", "metrics", "moe_block", "moe_layer_ids", "moe_pattern",
           "parse_layer_freq", "route", "sequence_capacity", "sinkhorn", "sinkhorn_routing",
           "switch_loss", "topk_routing", "trainable", "update_expert_bias",
           "update_router_state", "upcycle", "zero_stats"]
