"""pgs ``train.freeze_non_attention``: the Gated DeltaNet (linear-attention) and Mamba-2
(recurrent) layers of a hybrid model stop training, all their parameters but the norms (the
layer norms and the mixer's gated output norm); full-attention layers, MLP sublayers of
Megatron's hybrid stack, embeddings, the final norm and the head train.

Frozen leaves are cut from the autodiff graph (:func:`stop_frozen`, so XLA drops their
weight-gradient matmuls and the activations only those need: what pgs's
``memory.selective_diff`` saves) and get neither optimizer state nor updates, weight decay
included (the optimizer's ``frozen`` part, :func:`is_frozen`).

pgs's own trainer picks the frozen tensors by name and keeps every name containing ``attn``
trainable, so on Qwen3.5 (``linear_attn.*``) it freezes the MLPs instead; jaxtrain follows the
documented meaning above.
"""
from __future__ import annotations

import jax

from jaxtrain.models.spec import LINEAR_STACKS, MAMBA_STACK

FROZEN_STACKS = (*LINEAR_STACKS, MAMBA_STACK)


def is_frozen(path: tuple[str, ...]) -> bool:
    """A parameter (by tree path) that freeze_non_attention holds fixed."""
    return path[0] in FROZEN_STACKS and not any("norm" in p for p in path)


def stop_frozen(params: dict) -> dict:
    """``params`` with the frozen leaves behind ``jax.lax.stop_gradient``."""
    def one(keypath, a):
        path = tuple(str(getattr(k, "key", k)) for k in keypath)
        return jax.lax.stop_gradient(a) if is_frozen(path) else a

    return jax.tree_util.tree_map_with_path(one, params)
