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

Legend: B batch, T length, C chunk length, D hidden, V vocab.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.transformer import hidden_states, logits_head


def model_hidden(params, micro: dict, model_cfg, *, quant_state=None, moe_state=None,
                 train: bool = False, rngs=None):
    """(final hidden states [B,T,D], MoE stats or None) of a microbatch (``tokens`` and
    optionally ``positions``/``segment_ids`` [B,T]); see :func:`model_loss` for the states."""
    return hidden_states(params, micro["tokens"], model_cfg, positions=micro.get("positions"),
                         segment_ids=micro.get("segment_ids"), deterministic=not train,
                         rngs=rngs, quant_state=quant_state, moe_state=moe_state,
                         with_moe_stats=True)


def model_loss(params, micro: dict, weights, model_cfg, *, quant_state=None, moe_state=None,
               train: bool = False, rngs=None, num_chunks: int = 0,
               half_precision: bool = False):
    """(Σ weights · token loss over the microbatch, MoE stats or None): the loss training,
    evaluation and the health monitor share.

    ``micro``: ``tokens``/``targets`` (and ``positions``/``segment_ids``) [B,T]; ``weights``
    [B,T]: the loss mask, or the train step's normalised token weights. ``quant_state``: the
    quantization state the forward takes its scales from (None: a recipe without state, or
    none kept); ``moe_state``: {aux_counts, steps} of global_aux_loss (training only).
    ``train``: dropout on (``rngs`` a key) and the routers' training statistics (aux and z
    losses); off, the forward is deterministic. ``num_chunks``/``half_precision``: as
    :func:`row_losses`.
    """
    hidden, stats = model_hidden(params, micro, model_cfg, quant_state=quant_state,
                                 moe_state=moe_state, train=train, rngs=rngs)
    sums, _ = row_losses(params, hidden, micro["targets"], weights, model_cfg,
                         num_chunks=num_chunks, half_precision=half_precision)
    return jnp.sum(sums), stats


def token_nll(logits, targets, half_precision: bool = False):
    """-log p(target) per token [B,T] in float32; ``half_precision`` computes the softmax in the
    logits' half dtype first (Megatron's ``fp16_lm_cross_entropy``)."""
    if half_precision:
        logits = logits.astype(jnp.float16)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (log_z - picked).astype(jnp.float32)


def _chunk_sums(params, hidden, targets, mask, model_cfg, half):
    nll = token_nll(logits_head(params, hidden, model_cfg), targets, half)
    return jnp.sum(nll * mask, axis=-1)


def row_losses(params, hidden, targets, loss_mask, model_cfg, *, num_chunks: int = 0,
               half_precision: bool = False):
    """(sum of masked token losses [B], masked token count [B]) for hidden [B,T,D]."""
    mask = loss_mask.astype(jnp.float32)
    counts = jnp.sum(mask, axis=-1)
    B, T, _ = hidden.shape
    if num_chunks <= 1:
        return _chunk_sums(params, hidden, targets, mask, model_cfg, half_precision), counts
    if T % num_chunks:
        raise ValueError(f"sequence length {T} is not divisible by memory.loss_num_chunks "
                         f"{num_chunks}")
    C = T // num_chunks

    def split(x):
        return jnp.moveaxis(x.reshape(B, num_chunks, C, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(args):
        h, t, m = args
        return _chunk_sums(params, h, t, m, model_cfg, half_precision)

    sums = jax.lax.map(one, (split(hidden), split(targets), split(mask)))
    return jnp.sum(sums, axis=0), counts
