"""The output layer and token cross-entropy with their gradient computed in the forward pass.

``head_loss(head, hidden, targets, weights)`` = sum of weights x (-log p(target)) over
[B,T]. Its forward runs the output layer chunk by chunk along T and, while each chunk's
logits [B,C,V] exist, also their backward: the cotangents of the hidden states and of the
head's weights for a unit output cotangent. The backward pass then only scales them. Against
differentiating the plain (or ``jax.checkpoint``-chunked) loss this saves the logits'
recomputation (one of four V-sized matmuls) and the scatter that the gather of the target
logit transposes to, and never holds more than one chunk's logits. The same idea as the
"fused linear cross-entropy" of Liger-Kernel and Megatron's chunked output layer.

Only for a loss whose gradient is taken (the train step, the health monitor's gradients):
a forward alone (evaluation) would do the backward's work for nothing.

Legend: B batch, T length, n chunks, C chunk length, D hidden, V vocab.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.models.transformer import logits_head


def _token_nll(logits_BCV, targets_BC, half: bool):
    """-log p(target) [B,C] in float32; the target logit read with a compare-and-sum (its
    transpose is a select that fuses into the softmax gradient, not a scatter)."""
    logits = logits_BCV.astype(jnp.float16) if half else logits_BCV
    log_z_BC = jax.nn.logsumexp(logits, axis=-1)
    vocab_V = jnp.arange(logits.shape[-1], dtype=targets_BC.dtype)
    picked_BC = jnp.sum(jnp.where(vocab_V == targets_BC[..., None], logits, 0), axis=-1)
    return (log_z_BC - picked_BC).astype(jnp.float32)


def _chunk_loss(head, hidden_BCD, targets_BC, weights_BC, cfg, half):
    nll_BC = _token_nll(logits_head(head, hidden_BCD, cfg), targets_BC, half)
    return jnp.sum(weights_BC * nll_BC), nll_BC


def split_chunks(x_BT, n: int):
    """[B,T,...] -> [n,B,T/n,...]."""
    B, T = x_BT.shape[:2]
    return jnp.moveaxis(x_BT.reshape(B, n, T // n, *x_BT.shape[2:]), 1, 0)


def _merge(x_nBC):
    n, B, C = x_nBC.shape[:3]
    return jnp.moveaxis(x_nBC, 0, 1).reshape(B, n * C, *x_nBC.shape[3:])


def _forward(head, hidden_BTD, targets_BT, weights_BT, cfg, num_chunks, half):
    """(loss, (d loss/d head, d loss/d hidden [B,T,D], nll [B,T]))."""
    def one(hidden_BCD, targets_BC, weights_BC):
        """(loss, d loss/d head in float32, d loss/d hidden, nll) of one chunk."""
        loss_c, pull, nll_BC = jax.vjp(
            lambda h, x: _chunk_loss(h, x, targets_BC, weights_BC, cfg, half),
            head, hidden_BCD, has_aux=True)
        g_head, g_hidden_BCD = pull(jnp.ones_like(loss_c))
        return loss_c, jax.tree.map(lambda g: g.astype(jnp.float32), g_head), g_hidden_BCD, nll_BC

    if num_chunks <= 1:
        loss, grad_head, g_hidden, nll = one(hidden_BTD, targets_BT, weights_BT)
        return loss, (grad_head, g_hidden, nll)

    def chunk(carry, xs):
        loss_c, g_head, g_hidden_BCD, nll_BC = one(*xs)
        loss, grad_head = carry
        return ((loss + loss_c, jax.tree.map(jnp.add, grad_head, g_head)),
                (g_hidden_BCD, nll_BC))

    chunks = [split_chunks(x, num_chunks) for x in (hidden_BTD, targets_BT, weights_BT)]
    # the first chunk starts the sums: no zero-filled V x D accumulator to add to
    loss0, grad0, g_hidden0, nll0 = one(*(x[0] for x in chunks))
    (loss, grad_head), (g_hidden_nBCD, nll_nBC) = jax.lax.scan(
        chunk, (loss0, grad0), [x[1:] for x in chunks])
    return loss, (grad_head, _merge(jnp.concatenate([g_hidden0[None], g_hidden_nBCD])),
                  _merge(jnp.concatenate([nll0[None], nll_nBC])))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def head_loss(head, hidden_BTD, targets_BT, weights_BT, cfg, num_chunks: int = 1,
              half: bool = False):
    """Σ weights · token NLL for final hidden states [B,T,D] (float32 scalar).

    ``head``: the parameters :func:`~jaxtrain.models.transformer.logits_head` reads
    (``output``, or ``embedding`` when tied); ``num_chunks`` must divide T; ``half``:
    Megatron's fp16_lm_cross_entropy."""
    return _forward(head, hidden_BTD, targets_BT, weights_BT, cfg, num_chunks, half)[0]


def _fwd(head, hidden_BTD, targets_BT, weights_BT, cfg, num_chunks, half):
    loss, (grad_head, g_hidden, nll) = _forward(head, hidden_BTD, targets_BT, weights_BT, cfg,
                                                num_chunks, half)
    grad_head = jax.tree.map(lambda a, w: a.astype(w.dtype), grad_head, head)
    return loss, (grad_head, g_hidden, nll, targets_BT)


def _bwd(cfg, num_chunks, half, res, g):
    grad_head, g_hidden, nll, targets_BT = res
    head = jax.tree.map(lambda a: (a * g).astype(a.dtype), grad_head)
    targets_cot = jnp.zeros(targets_BT.shape, jax.dtypes.float0)
    return head, (g_hidden * g).astype(g_hidden.dtype), targets_cot, (nll * g)


head_loss.defvjp(_fwd, _bwd)


def plain_loss(params: dict, hidden_BTD, targets_BT, weights_BT, cfg, num_chunks: int = 0,
               half: bool = False):
    """:func:`head_loss` through the output layer of ``params``, in the most chunks up to
    ``num_chunks`` that divide T (one when 0)."""
    T = hidden_BTD.shape[1]
    chunks = max(d for d in range(1, min(T, max(num_chunks, 1)) + 1) if T % d == 0)
    with jax.named_scope("loss"):
        return head_loss(head_params(params, cfg), hidden_BTD, targets_BT,
                         weights_BT.astype(jnp.float32), cfg, chunks, half)


def head_params(params: dict, cfg) -> dict:
    """The parameters the output layer reads."""
    key = "output" if cfg.untie_embeddings_and_output_weights else "embedding"
    return {key: params[key]}
