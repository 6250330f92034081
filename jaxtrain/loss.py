"""Token cross-entropy from the model's final hidden states, whole or chunked.

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

from jaxtrain.models.transformer import logits_head


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
