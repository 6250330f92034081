"""pgs preference optimisation (``dpo.enabled``): DPO and its variants as the train step's loss.

Data (:mod:`jaxtrain.data.preference`): each pair is two consecutive sample rows, chosen at
``2i`` and rejected at ``2i + 1``; a microbatch holds whole pairs. Here, per microbatch:

1. per-token log-probs ``log pi(y_t | y_<t)`` of the policy (with gradient) and of the frozen
   reference (``frozen["ref"]``, no gradient), chunked over the sequence like
   :func:`jaxtrain.loss.row_losses` (``memory.chunked_loss``): only one chunk's logits
   [B,C,V] exist at a time, never [B,T,V];
2. per-row scores ``s_b = sum_t a[b,t] log pi(y_t)``, ``a`` the scored-token mask (loss
   weight > 0), LD-DPO-weighted when ``ld_alpha`` != 1: 1 on the first ``min(len_c, len_r)``
   scored tokens of each side, ``ld_alpha`` on the longer answer's tail (pgs
   ``score_weights``);
3. with ``delta = (s_c - ref_c) - (s_r - ref_r)`` and ``delta_avg = (s_c - ref_c)/L_c -
   (s_r - ref_r)/L_r`` (``L`` = sum of ``a`` over the row, at least 1), per pair:
   sigmoid ``-log sig(beta delta)``; hinge ``relu(1 - beta delta)``; robust
   ``[-(1-e) log sig(beta delta) + e log sig(-beta delta)] / (1 - 2e)``, e = label_smoothing;
   cdpo (MaxText's use_dpo, conservative DPO) ``-(1-e) log sig(beta delta) - e log sig(-beta
   delta)``;
   ipo ``(delta_avg - 1/(2 beta))^2``; sigmoid_norm ``-log sig(beta delta_avg)``;
4. the microbatch loss is the mean over its pairs, plus (RPO) ``sft_weight`` times the mean
   NLL over the microbatch's chosen answer tokens (unweighted by LD-DPO), and the step
   averages microbatches (pgs: pair_denom = pairs x accumulation steps).

Metrics (means over the step's pairs): rewards/chosen and rewards/rejected
(``beta (s - ref)``), rewards/margins, rewards/accuracies (share with chosen reward >
rejected), logps/chosen, logps/rejected (the scores ``s``), dpo/loss (the preference term),
dpo/sft_nll.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.config.dialects import hf as hf_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.loss import token_nll
from jaxtrain.models.transformer import hidden_states, logits_head

REFERENCE_ITEM = "dpo_reference"   # the checkpoint item of a reference no directory names
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "cdpo")
METRICS = ("dpo/loss", "dpo/sft_nll", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "rewards/accuracies", "logps/chosen", "logps/rejected")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    ld_alpha: float = 1.0
    sft_weight: float = 0.0
    disable_dropout: bool = True
    precompute_reference: bool = False   # reference scores ride in the batch (ref_scores)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"dpo.loss_type {self.loss_type!r}: one of {', '.join(LOSS_TYPES)}")
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta {self.beta}: give a positive inverse temperature")
        top, open_top = (1.0, False) if self.loss_type == "cdpo" else (0.5, True)
        if not 0.0 <= self.label_smoothing <= top or (open_top and self.label_smoothing == top):
            raise ConfigError(f"dpo.label_smoothing ({self.label_smoothing}) must lie in "
                              f"[0, {top}{')' if open_top else ']'} for {self.loss_type}")
        if self.ld_alpha < 0:
            raise ConfigError(f"dpo.ld_alpha {self.ld_alpha}: give a weight >= 0 (1.0 = off)")
        if self.sft_weight < 0:
            raise ConfigError(f"dpo.sft_weight {self.sft_weight}: give a weight >= 0")

    @classmethod
    def from_config(cls, cfg) -> "DPOConfig | None":
        if not cfg.get("dpo.enabled"):
            return None
        return cls(loss_type=cfg["dpo.loss_type"], beta=float(cfg["dpo.beta"]),
                   label_smoothing=float(cfg["dpo.label_smoothing"]),
                   ld_alpha=float(cfg["dpo.ld_alpha"]), sft_weight=float(cfg["dpo.sft_weight"]),
                   disable_dropout=bool(cfg["dpo.disable_dropout"]),
                   precompute_reference=bool(cfg["dpo.precompute_reference"]))


def enabled(cfg) -> bool:
    return bool(cfg.get("dpo.enabled"))


def reference_name(cfg) -> str:
    """dpo.reference_model, or model.name_or_path when it is empty ("": no directory names the
    reference; it is then the weights the run starts from)."""
    return str(cfg.get("dpo.reference_model") or cfg.get("model.name_or_path") or "")


def reference_dir(cfg):
    """The Hugging Face directory of the frozen reference policy (a path or a cache name)."""
    name = reference_name(cfg)
    if not name:
        raise ConfigError("dpo.enabled compares the policy with a frozen reference: set "
                          "dpo.reference_model or model.name_or_path")
    try:
        return hf_config.locate(name)
    except ConfigError as e:
        raise ConfigError(f"dpo.reference_model {name!r}: {e}") from None


def frozen_key(tcfg) -> str | None:
    """The name of the frozen parameter tree the step takes beside the state, or None: pgs
    pre_rl's "base", DPO's "ref"."""
    if tcfg.objective.needs_base:
        return "base"
    d = getattr(tcfg, "dpo", None)
    if d is not None and not d.precompute_reference:
        return "ref"
    return None


def token_logps(params, hidden_BTD, targets_BT, model_cfg, num_chunks: int = 0,
                half_precision: bool = False):
    """log p(target) [B,T] (float32), the output layer run one chunk of the sequence at a time
    under jax.checkpoint when ``num_chunks`` > 1 (as :func:`jaxtrain.loss.row_losses`)."""
    def one(args):
        h_BCD, t_BC = args
        return -token_nll(logits_head(params, h_BCD, model_cfg), t_BC, half_precision)

    B, T, _ = hidden_BTD.shape
    if num_chunks <= 1:
        return one((hidden_BTD, targets_BT))
    if T % num_chunks:
        raise ValueError(f"sequence length {T} is not divisible by memory.loss_num_chunks "
                         f"{num_chunks}")
    C = T // num_chunks

    def split(x):   # [B,T,...] -> [n,B,C,...]
        return jnp.moveaxis(x.reshape(B, num_chunks, C, *x.shape[2:]), 1, 0)

    out_nBC = jax.lax.map(jax.checkpoint(one), (split(hidden_BTD), split(targets_BT)))
    return jnp.moveaxis(out_nBC, 0, 1).reshape(B, T)


def score_weights(mask_BT, ld_alpha: float):
    """a [B,T]: the scored-token mask, with LD-DPO's ``ld_alpha`` on the tokens of each row
    past the number of scored tokens both answers of its pair share (rows 2i, 2i+1)."""
    mask_BT = mask_BT.astype(jnp.float32)
    if ld_alpha == 1.0:
        return mask_BT
    position_BT = jnp.cumsum(mask_BT, axis=1)        # 1-based index among scored tokens
    lengths_P2 = jnp.sum(mask_BT, axis=1).reshape(-1, 2)
    shared_B = jnp.repeat(jnp.min(lengths_P2, axis=1), 2)
    return jnp.where(position_BT <= shared_B[:, None], mask_BT, ld_alpha * mask_BT)


def pair_losses(policy_B, reference_B, lengths_B, cfg: DPOConfig):
    """The per-pair loss [P] from per-row scores [B] (chosen rows even, rejected odd)."""
    pc, pr = policy_B[0::2], policy_B[1::2]
    rc, rr = reference_B[0::2], reference_B[1::2]
    beta, eps = cfg.beta, cfg.label_smoothing
    delta = (pc - rc) - (pr - rr)
    if cfg.loss_type == "sigmoid":
        return -jax.nn.log_sigmoid(beta * delta)
    if cfg.loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * delta)
    if cfg.loss_type == "cdpo":
        return (-(1.0 - eps) * jax.nn.log_sigmoid(beta * delta)
                - eps * jax.nn.log_sigmoid(-beta * delta))
    if cfg.loss_type == "robust":
        return ((-(1.0 - eps) * jax.nn.log_sigmoid(beta * delta)
                 + eps * jax.nn.log_sigmoid(-beta * delta)) / (1.0 - 2.0 * eps))
    lc, lr = jnp.maximum(lengths_B[0::2], 1.0), jnp.maximum(lengths_B[1::2], 1.0)
    delta_avg = (pc - rc) / lc - (pr - rr) / lr
    if cfg.loss_type == "ipo":
        return (delta_avg - 1.0 / (2.0 * beta)) ** 2
    return -jax.nn.log_sigmoid(beta * delta_avg)


def zero_metrics() -> dict:
    return {k: jnp.float32(0.0) for k in METRICS}


def micro_loss(params, ref_params, micro: dict, model_cfg, cfg: DPOConfig, *, quant_state=None,
               moe_state=None, rng=None, num_chunks: int = 0, half_precision: bool = False,
               embed_noise: float = 0.0):
    """(loss of the microbatch's pairs, MoE stats or None, metrics {METRICS: scalar}).

    ``micro``: tokens/targets/loss_mask (segment_ids, positions) [B,T], B even, rows 2i/2i+1
    a pair. The policy forward is deterministic with ``disable_dropout``; the reference's
    always is, and carries no gradient."""
    if ref_params is None and "ref_scores" not in micro:
        raise ValueError("DPO needs the frozen reference parameters (frozen['ref']) or the "
                         "batch's precomputed ref_scores")
    kw = dict(positions=micro.get("positions"), segment_ids=micro.get("segment_ids"))
    hidden_BTD, stats = hidden_states(
        params, micro["tokens"], model_cfg, deterministic=cfg.disable_dropout, rng=rng,
        quant_state=quant_state, moe_state=moe_state, with_moe_stats=True,
        embed_noise=0.0 if cfg.disable_dropout else embed_noise, **kw)
    targets = micro["targets"]
    logp_BT = token_logps(params, hidden_BTD, targets, model_cfg, num_chunks, half_precision)
    mask_BT = (micro["loss_mask"] > 0).astype(jnp.float32)
    a_BT = score_weights(mask_BT, cfg.ld_alpha)
    lengths_B = jnp.sum(a_BT, axis=1)
    scores_B = jnp.sum(logp_BT * a_BT, axis=1)
    if "ref_scores" in micro:
        ref_B = micro["ref_scores"][:, 0]
    else:
        ref_hidden_BTD = hidden_states(ref_params, micro["tokens"], model_cfg,
                                       deterministic=True, quant_state=quant_state, **kw)
        ref_logp_BT = token_logps(ref_params, ref_hidden_BTD, targets, model_cfg, num_chunks,
                                  half_precision)
        ref_B = jax.lax.stop_gradient(jnp.sum(ref_logp_BT * a_BT, axis=1))
    pref = jnp.mean(pair_losses(scores_B, ref_B, lengths_B, cfg))
    chosen_BT = mask_BT.at[1::2].set(0.0)
    sft_nll = -jnp.sum(logp_BT * chosen_BT) / jnp.maximum(jnp.sum(chosen_BT), 1.0)
    loss = pref + cfg.sft_weight * sft_nll if cfg.sft_weight else pref
    s = jax.lax.stop_gradient(scores_B)
    rewards = cfg.beta * (s - ref_B)
    rc, rr = rewards[0::2], rewards[1::2]
    metrics = {"dpo/loss": jax.lax.stop_gradient(pref),
               "dpo/sft_nll": jax.lax.stop_gradient(sft_nll),
               "rewards/chosen": jnp.mean(rc), "rewards/rejected": jnp.mean(rr),
               "rewards/margins": jnp.mean(rc - rr),
               "rewards/accuracies": jnp.mean((rc > rr).astype(jnp.float32)),
               "logps/chosen": jnp.mean(s[0::2]), "logps/rejected": jnp.mean(s[1::2])}
    return loss, stats, metrics
