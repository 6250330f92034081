"""The model's loss: one function for training, evaluation and the health monitor, and the
token cross-entropy from the final hidden states, whole or chunked.

:func:`model_loss` runs the model over a microbatch and returns its weighted token-loss sum
(with the MoE router statistics). The train step, the validation/test step
(:mod:`jaxtrain.evaluation`) and the health monitor (:mod:`jaxtrain.observe.health`) all call
it, each passing the model's state explicitly: the quantization state
(``TrainState.quant_state``: the FP8 delayed-scaling amax histories and scales; evaluation and
health read the same scales the training forward uses, they do not update them) and the MoE
state (global_aux_loss's counts so far). ``train`` turns dropout and the router's training-only
statistics on.

``row_losses`` returns per-sequence sums of masked token losses and token counts; how they are
normalised (Megatron's ``calculate_per_token_loss``) is the train step's business.

Chunked mode (pgs ``memory.chunked_loss``) runs output layer + cross-entropy one sequence chunk
at a time under ``jax.checkpoint`` inside ``lax.map``: only one chunk's logits [B,C,V] exist at
a time, forward or backward, never the whole [B,T,V].

Legend: B batch, T length, C chunk length, n chunks, D hidden, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.transformer import hidden_states, logits_head


def model_hidden(params, micro: dict, model_cfg, *, quant_state=None, moe_state=None,
                 train: bool = False, rng=None):
    """(final hidden states [B,T,D], MoE stats or None) of a microbatch (``tokens`` and
    optionally ``positions``/``segment_ids`` [B,T]); see :func:`model_loss` for the states."""
    return hidden_states(params, micro["tokens"], model_cfg, positions=micro.get("positions"),
                         segment_ids=micro.get("segment_ids"), deterministic=not train,
                         rng=rng, quant_state=quant_state, moe_state=moe_state,
                         with_moe_stats=True)


def model_loss(params, micro: dict, weights, model_cfg, *, quant_state=None, moe_state=None,
               train: bool = False, rng=None, num_chunks: int = 0,
               half_precision: bool = False):
    """(Σ weights · token loss over the microbatch, MoE stats or None): the loss training,
    evaluation and the health monitor share.

    ``micro``: ``tokens``/``targets`` (and ``positions``/``segment_ids``) [B,T]; ``weights``
    [B,T]: the loss mask, or the train step's normalised token weights. ``quant_state``: the
    quantization state the forward takes its scales from (None: a recipe without state, or
    none kept); ``moe_state``: {aux_counts, steps} of global_aux_loss (training only).
    ``train``: dropout on (``rng`` a key) and the routers' training statistics (aux and z
    losses); off, the forward is deterministic. ``num_chunks``/``half_precision``: as
    :func:`row_losses`.
    """
    hidden_BTD, stats = model_hidden(params, micro, model_cfg, quant_state=quant_state,
                                     moe_state=moe_state, train=train, rng=rng)
    sums_B, _ = row_losses(params, hidden_BTD, micro["targets"], weights, model_cfg,
                           num_chunks=num_chunks, half_precision=half_precision)
    return jnp.sum(sums_B), stats


def token_nll(logits, targets, half_precision: bool = False):
    """-log p(target) per token [B,T] in float32; ``half_precision`` computes the softmax in the
    logits' half dtype first (Megatron's ``fp16_lm_cross_entropy``)."""
    logits_BTV = logits.astype(jnp.float16) if half_precision else logits
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, targets[..., None], axis=-1)[..., 0]
    return (log_z_BT - picked_BT).astype(jnp.float32)


def _chunk_sums(params, hidden_BTD, targets_BT, mask_BT, model_cfg, half):
    """Σ masked token losses [B] of hidden states [B,T,D] (or a chunk [B,C,D])."""
    nll_BT = token_nll(logits_head(params, hidden_BTD, model_cfg), targets_BT, half)
    return jnp.sum(nll_BT * mask_BT, axis=-1)


def row_losses(params, hidden, targets, loss_mask, model_cfg, *, num_chunks: int = 0,
               half_precision: bool = False):
    """(sum of masked token losses [B], masked token count [B]) for hidden [B,T,D]."""
    mask_BT = loss_mask.astype(jnp.float32)
    counts_B = jnp.sum(mask_BT, axis=-1)
    B, T, _ = hidden.shape
    if num_chunks <= 1:
        return _chunk_sums(params, hidden, targets, mask_BT, model_cfg, half_precision), counts_B
    if T % num_chunks:
        raise ValueError(f"sequence length {T} is not divisible by memory.loss_num_chunks "
                         f"{num_chunks}")
    C = T // num_chunks

    def split(x_BT):   # [B,T,...] -> [num_chunks,B,C,...]
        return jnp.moveaxis(x_BT.reshape(B, num_chunks, C, *x_BT.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(args):
        hidden_BCD, targets_BC, mask_BC = args
        return _chunk_sums(params, hidden_BCD, targets_BC, mask_BC, model_cfg, half_precision)

    sums_nB = jax.lax.map(one, (split(hidden), split(targets), split(mask_BT)))
    return jnp.sum(sums_nB, axis=0), counts_B
