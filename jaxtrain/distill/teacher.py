"""What a frozen JAX teacher (pgs ``backend: hf``) gives the distillation losses, from its final
hidden states at the completion positions: each completion token's log-prob, optionally its
top-k alternatives (``topk_kl``, xtok's dense term) and ``rs_kd``'s draws.

The output layer runs a slice of rows at a time (``lax.map``): one slice's [rows, V] logits
exist at once. ``full_rkl`` needs no scores here: it projects the teacher's hidden states slice
by slice inside the loss (:func:`jaxtrain.distill.losses.over_rows`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.distill.losses import row_logps, slices


def sample_draws(logp_RV, rounds: int, temperature: float, key):
    """Random Sampling KD's sparse targets from log-probs [R, V]: ``rounds`` ids per row drawn
    with replacement from the proposal ``r ∝ p^temperature``, each weighted by ``p / r``
    normalised over the row (so the weighted draws estimate p without bias; temperature 1: each
    weight 1 / rounds). Returns (ids [R, rounds], weights [R, rounds], log p of the ids)."""
    proposal = logp_RV if temperature == 1.0 else jax.nn.log_softmax(logp_RV * temperature, -1)
    cdf = jnp.cumsum(jnp.exp(proposal), -1)        # inverse-CDF draws: O(V + rounds log V)
    u = jax.random.uniform(key, (logp_RV.shape[0], rounds)) * cdf[:, -1:]
    ids = jnp.minimum(jax.vmap(jnp.searchsorted)(cdf, u), logp_RV.shape[1] - 1)
    lp = jnp.take_along_axis(logp_RV, ids, axis=1)
    ratio = lp - jnp.take_along_axis(proposal, ids, axis=1)
    return ids, jax.nn.softmax(ratio, axis=1), lp


def score(params, hidden_ND, targets_N, model_cfg, *, top_k: int = 0, rounds: int = 0,
          temperature: float = 1.0, key=None, num_slices: int = 1) -> dict:
    """{"token_lp" [N]; "topk_ids", "topk_lp" [N, top_k] with ``top_k``; "sample_ids",
    "sample_weights", "sample_lp" [N, rounds] with ``rounds`` (``key`` needed)} in float32."""
    if rounds and key is None:
        raise ValueError("rs_kd's draws need a PRNG key")
    keys = jax.random.split(key if key is not None else jax.random.key(0), num_slices)

    def one(args):
        h_RD, t_R, k = args
        logp = row_logps(params, h_RD, model_cfg)
        out = {"token_lp": jnp.take_along_axis(logp, t_R[:, None], axis=1)[:, 0]}
        if top_k:
            out["topk_lp"], out["topk_ids"] = jax.lax.top_k(logp, top_k)
        if rounds:
            out["sample_ids"], out["sample_weights"], out["sample_lp"] = sample_draws(
                logp, rounds, temperature, k)
        return out

    got = jax.lax.map(one, (*slices((hidden_ND, targets_N), num_slices), keys))
    return {k: v.reshape(hidden_ND.shape[0], *v.shape[2:]) for k, v in got.items()}
