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

Token-weighting objectives (pgs ``plugins.dft``/``deft``/``cadft``/``info_sft``, see
:class:`TokenObjective`) multiply each token's cross-entropy by a factor computed from the
model's own distribution and held constant under differentiation (stop_gradient). CADFT and
InfoSFT also need a statistic of the whole microbatch (per-row mean NLL, the mean factor).
Each of those is a per-row or whole-batch multiplier of per-row sums, so the same chunk pass
returns the sums it needs next to the weighted loss and the multiplier is applied to the row
sums afterwards: one pass, still no [B,T,V] tensor.

Legend: B batch, T length, C chunk length, n chunks, D hidden, V vocab.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxtrain.fused_ce import plain_loss, split_chunks
from jaxtrain.models.mtp import mtp_hidden_states, sequences, shift_left
from jaxtrain.models.transformer import decoder, hidden_states, logits_head


OBJECTIVES = ("ce", "dft", "deft", "cadft", "info_sft", "pre_rl")
# pgs pre_rl: a token is not imitated (masked from the CE) above these (nats)
PRE_RL_ENTROPY_THRESHOLD = 2.0
PRE_RL_KL_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class TokenObjective:
    """Which training objective weights the token cross-entropies (pgs's plugins).

    ``kind``: ``ce`` plain cross-entropy; ``dft`` weight p_t; ``deft`` weight p_t^a with
    a = sum_v p_v^2; ``cadft`` DFT times a per-row factor exp(-beta max(0, z)), z the row's
    mean-NLL z-score within the microbatch; ``info_sft`` weight q max(0, logit(pbar) -
    logit(q)), q = p_t, divided by its mean over the microbatch's loss tokens. Every factor
    is a constant under differentiation. ``pre_rl``: not a weighting but pgs's Pre-RL loss
    (:func:`_pre_rl_sums`), against the frozen base model.
    """

    kind: str = "ce"
    cadft_beta: float = 1.0
    info_sft_pbar: float = 0.93
    entropy_coeff: float = 0.1   # pre_rl: weight of the entropy bonus
    kl_coeff: float = 0.5        # pre_rl: weight of the KL penalty to the base model

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise ValueError(f"unknown token objective {self.kind!r}; one of {OBJECTIVES}")
        if self.kind == "info_sft" and not 0.0 < self.info_sft_pbar < 1.0:
            raise ValueError(f"info_sft_pbar must lie in (0, 1), got {self.info_sft_pbar}")

    @property
    def weighted(self) -> bool:
        return self.kind != "ce"

    @property
    def needs_base(self) -> bool:
        """Whether the loss compares with the frozen base model's distribution (pre_rl)."""
        return self.kind == "pre_rl"


CE = TokenObjective()

# pgs's clamps: DEFT's and InfoSFT's target probability floor, InfoSFT's ceiling and its
# smallest mean, CADFT's smallest spread
_P_FLOOR = 1e-8
_MEAN_FLOOR = 1e-8
_SIGMA_FLOOR = 1e-6


def model_hidden(params, micro: dict, model_cfg, *, quant_state=None, moe_state=None,
                 train: bool = False, rng=None, embed_noise: float = 0.0):
    """(final hidden states [B,T,D], MoE stats or None) of a microbatch (``tokens`` and
    optionally ``positions``/``segment_ids`` [B,T]); see :func:`model_loss` for the states.
    ``embed_noise``: pgs sym_noise's alpha, used only when ``train``."""
    return hidden_states(params, micro["tokens"], model_cfg, positions=micro.get("positions"),
                         segment_ids=micro.get("segment_ids"), deterministic=not train,
                         rng=rng, quant_state=quant_state, moe_state=moe_state,
                         with_moe_stats=True, embed_noise=embed_noise if train else 0.0)


def model_loss(params, micro: dict, weights, model_cfg, *, quant_state=None, moe_state=None,
               train: bool = False, rng=None, num_chunks: int = 0,
               half_precision: bool = False, objective: TokenObjective | None = None,
               embed_noise: float = 0.0, base_params=None, grad_in_forward: bool = False,
               mtp_weights=None):
    """(Σ weights · token loss over the microbatch, MoE stats or None): the loss training,
    evaluation and the health monitor share (pre_rl: its loss, a mean over the microbatch's
    loss tokens, against ``base_params``, the frozen base model).

    ``micro``: ``tokens``/``targets`` (and ``positions``/``segment_ids``) [B,T]; ``weights``
    [B,T]: the loss mask, or the train step's normalised token weights. ``quant_state``: the
    quantization state the forward takes its scales from (None: a recipe without state, or
    none kept); ``moe_state``: {aux_counts, steps} of global_aux_loss (training only).
    ``train``: dropout on (``rng`` a key) and the routers' training statistics (aux and z
    losses); off, the forward is deterministic. ``num_chunks``/``half_precision``/
    ``objective``: as :func:`row_losses`. ``embed_noise``: pgs sym_noise's alpha (training
    only; see :func:`jaxtrain.models.transformer.hidden_states`). ``grad_in_forward``: the
    caller differentiates the loss; plain cross-entropy then computes the output layer's
    gradient during the forward (:mod:`jaxtrain.fused_ce`). ``mtp_weights`` [D][B,T]: the
    token weights of each multi-token-prediction depth (training a model with
    ``mtp_num_layers``); the stats then carry ``mtp`` [D], each depth's Σ weights · token loss
    (jaxtrain.models.mtp), and the MTP layers' router statistics after the decoder's.
    """
    if mtp_weights is not None:   # training a model with multi-token prediction
        hidden_BTD, stats, ctx = decoder(
            params, micro["tokens"], model_cfg, positions=micro.get("positions"),
            segment_ids=micro.get("segment_ids"), deterministic=not train, rng=rng,
            quant_state=quant_state, moe_state=moe_state,
            embed_noise=embed_noise if train else 0.0)
        mtp_losses, mtp_stats = mtp_loss(params, hidden_BTD, micro, ctx, mtp_weights,
                                         model_cfg, num_chunks=num_chunks,
                                         half_precision=half_precision,
                                         grad_in_forward=grad_in_forward)
        if mtp_stats is not None:   # the MTP layers' router statistics follow the decoder's
            stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
        lm = hidden_loss(params, hidden_BTD, micro["targets"], weights, model_cfg,
                         num_chunks=num_chunks, half_precision=half_precision,
                         objective=objective, grad_in_forward=grad_in_forward)
        return lm, {**(stats or {}), "mtp": mtp_losses}
    hidden_BTD, stats = model_hidden(params, micro, model_cfg, quant_state=quant_state,
                                     moe_state=moe_state, train=train, rng=rng,
                                     embed_noise=embed_noise)
    base = None
    if objective is not None and objective.needs_base:
        base_hidden_BTD, _ = model_hidden(base_params, micro, model_cfg)
        base = (base_params, jax.lax.stop_gradient(base_hidden_BTD))
    return hidden_loss(params, hidden_BTD, micro["targets"], weights, model_cfg,
                       num_chunks=num_chunks, half_precision=half_precision,
                       objective=objective, base=base, grad_in_forward=grad_in_forward), stats


def mtp_loss(params, hidden_BTD, micro: dict, ctx: dict, mtp_weights, model_cfg, *,
             num_chunks: int = 0, half_precision: bool = False, grad_in_forward: bool = False):
    """(each multi-token-prediction depth's Σ weights · token loss [D], the MTP layers' router
    statistics or None) after the decoder's final hidden states; ``ctx``: the decoder layers'
    context; ``mtp_weights`` [D][B,T] as :func:`model_loss` (the pipeline's last stage calls it
    too)."""
    outs, stats = mtp_hidden_states(params, hidden_BTD, micro["tokens"], ctx, model_cfg)
    seq = sequences(micro.get("segment_ids"), micro["tokens"])
    losses = jnp.stack([
        hidden_loss(params, h, shift_left(micro["targets"], k, seq), w, model_cfg,
                    num_chunks=num_chunks, half_precision=half_precision,
                    grad_in_forward=grad_in_forward)
        for k, (h, w) in enumerate(zip(outs, mtp_weights), 1)])
    return losses, stats


def hidden_loss(params, hidden_BTD, targets_BT, weights, model_cfg, *, num_chunks: int = 0,
                half_precision: bool = False, objective: TokenObjective | None = None,
                base=None, grad_in_forward: bool = False):
    """Σ weights · token loss of final hidden states [B,T,D] (:func:`model_loss` after the
    layers; the pipeline's last stage calls it too). Arguments as :func:`model_loss` and
    :func:`row_losses`."""
    if grad_in_forward and (objective is None or not objective.weighted):
        return plain_loss(params, hidden_BTD, targets_BT, weights, model_cfg, num_chunks,
                          half_precision)
    sums_B, _ = row_losses(params, hidden_BTD, targets_BT, weights, model_cfg,
                           num_chunks=num_chunks, half_precision=half_precision,
                           objective=objective, base=base)
    return jnp.sum(sums_B)


def token_nll(logits, targets, half_precision: bool = False):
    """-log p(target) per token [B,T] in float32; ``half_precision`` computes the softmax in the
    logits' half dtype first (Megatron's ``fp16_lm_cross_entropy``)."""
    logits_BTV = logits.astype(jnp.float16) if half_precision else logits
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logits_BTV, targets[..., None], axis=-1)[..., 0]
    return (log_z_BT - picked_BT).astype(jnp.float32)


def token_factors(logits, targets, objective: TokenObjective):
    """The per-token factor [B,T] (float32, stop_gradient) an objective puts on each token's
    cross-entropy before any batch statistic: 1 (ce), p_t (dft, cadft), max(p_t, 1e-8)^a with
    a = sum_v p_v^2 (deft), q max(0, logit(pbar) - logit(q)) with q = p_t clipped to
    [1e-8, 1 - 1e-8] (info_sft, before its mean-1 rescaling)."""
    logits_BTV = jax.lax.stop_gradient(logits).astype(jnp.float32)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(logits_BTV, targets[..., None], axis=-1)[..., 0] - log_z_BT
    if objective.kind == "ce":
        return jnp.ones_like(logp_BT)
    if objective.kind in ("dft", "cadft"):
        return jnp.exp(logp_BT)
    if objective.kind == "deft":
        focus_BT = jnp.sum(jnp.exp(2.0 * (logits_BTV - log_z_BT[..., None])), axis=-1)
        return jnp.exp(focus_BT * jnp.maximum(logp_BT, math.log(_P_FLOOR)))
    q_BT = jnp.clip(jnp.exp(logp_BT), _P_FLOOR, 1.0 - _P_FLOOR)
    pbar = objective.info_sft_pbar
    gap_BT = math.log(pbar / (1.0 - pbar)) - (jnp.log(q_BT) - jnp.log1p(-q_BT))
    return q_BT * jnp.maximum(gap_BT, 0.0)


def _chunk_sums(params, hidden_BTD, targets_BT, mask_BT, model_cfg, half):
    """Σ masked token losses [B] of hidden states [B,T,D] (or a chunk [B,C,D])."""
    nll_BT = token_nll(logits_head(params, hidden_BTD, model_cfg), targets_BT, half)
    return jnp.sum(nll_BT * mask_BT, axis=-1)


def _objective_sums(logits_BTV, targets_BT, weights_BT, half, objective):
    """Per-row sums [3,B] over these tokens: Σ weight·factor·nll (the loss, differentiable),
    Σ nll and Σ factor over the loss tokens (weight > 0; batch statistics, constant)."""
    nll_BT = token_nll(logits_BTV, targets_BT, half)
    factor_BT = token_factors(logits_BTV, targets_BT, objective)
    valid_BT = (weights_BT > 0).astype(jnp.float32)
    stat_nll_B = jax.lax.stop_gradient(jnp.sum(nll_BT * valid_BT, axis=-1))
    return jnp.stack([jnp.sum(weights_BT * factor_BT * nll_BT, axis=-1), stat_nll_B,
                      jnp.sum(factor_BT * valid_BT, axis=-1)])


def _pre_rl_sums(logits_BTV, base_logits_BTV, targets_BT, valid_BT):
    """pgs pre_rl's per-row sums [5,B]: Σ CE over imitated tokens, their count, Σ entropy and
    Σ KL(π || base) over the not-imitated loss tokens, their count. A loss token is not
    imitated when its entropy exceeds 2 nats or its KL 0.5; entropy and KL carry gradients,
    the choice and the base do not."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    base_BTV = jax.nn.log_softmax(jax.lax.stop_gradient(base_logits_BTV).astype(jnp.float32),
                                  axis=-1)
    p_BTV = jnp.exp(logp_BTV)
    entropy_BT = -jnp.sum(p_BTV * logp_BTV, axis=-1)
    kl_BT = jnp.sum(p_BTV * (logp_BTV - base_BTV), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    unsafe_BT = jax.lax.stop_gradient((entropy_BT > PRE_RL_ENTROPY_THRESHOLD)
                                      | (kl_BT > PRE_RL_KL_THRESHOLD))
    imitate_BT = (valid_BT & ~unsafe_BT).astype(jnp.float32)
    held_BT = (valid_BT & unsafe_BT).astype(jnp.float32)
    return jnp.stack([jnp.sum(nll_BT * imitate_BT, -1), jnp.sum(imitate_BT, -1),
                      jnp.sum(entropy_BT * held_BT, -1), jnp.sum(kl_BT * held_BT, -1),
                      jnp.sum(held_BT, -1)])


def _pre_rl_rows(objective, sums_5B):
    """Per-row shares [B] of pgs's pre_rl loss CE/imitated - c_H·H/held + c_KL·KL/held (the
    counts are those of the whole microbatch), so their sum is the loss."""
    imitated = jnp.maximum(jnp.sum(sums_5B[1]), 1.0)
    held = jnp.maximum(jnp.sum(sums_5B[4]), 1.0)
    return (sums_5B[0] / imitated - objective.entropy_coeff * sums_5B[2] / held
            + objective.kl_coeff * sums_5B[3] / held)


def _row_scale(objective, nll_sums_B, factor_sums_B, counts_B):
    """The per-row multiplier [B] an objective's batch statistic puts on the row sums (constant
    under differentiation): CADFT's exp(-beta·max(0, z)), InfoSFT's 1 / mean factor, else 1.

    CADFT: z-score of each row's mean NLL over the rows that have loss tokens (sample standard
    deviation, floored at 1e-6); with fewer than two such rows z is 0. InfoSFT: the factor's
    mean over all loss tokens of the microbatch, floored at 1e-8.
    """
    nll_sums_B, factor_sums_B = jax.lax.stop_gradient((nll_sums_B, factor_sums_B))
    if objective.kind == "cadft":
        has_B = counts_B > 0
        rows = jnp.sum(has_B)
        mean_nll_B = nll_sums_B / jnp.maximum(counts_B, 1.0)
        mu = jnp.sum(jnp.where(has_B, mean_nll_B, 0.0)) / jnp.maximum(rows, 1)
        var = jnp.sum(jnp.where(has_B, (mean_nll_B - mu) ** 2, 0.0)) / jnp.maximum(rows - 1, 1)
        z_B = (mean_nll_B - mu) / jnp.maximum(jnp.sqrt(var), _SIGMA_FLOOR)
        z_B = jnp.where(has_B & (rows > 1), z_B, 0.0)
        return jnp.exp(-objective.cadft_beta * jnp.maximum(z_B, 0.0))
    if objective.kind == "info_sft":
        mean = jnp.sum(factor_sums_B) / jnp.maximum(jnp.sum(counts_B), 1.0)
        return jnp.broadcast_to(1.0 / jnp.maximum(mean, _MEAN_FLOOR), counts_B.shape)
    return jnp.ones_like(counts_B)


def objective_weights(logits, targets, loss_weights, objective: TokenObjective):
    """The effective per-token weights [B,T] of an objective on whole logits [B,T,V] (no
    gradient): ``loss_weights`` × factor × row multiplier, so the objective's loss is
    Σ weights · nll. For tests and inspection; training goes through :func:`row_losses`."""
    w_BT = loss_weights.astype(jnp.float32)
    sums_3B = _objective_sums(logits, targets, w_BT, False, objective)
    scale_B = _row_scale(objective, sums_3B[1], sums_3B[2], jnp.sum(w_BT > 0, axis=-1,
                                                                     dtype=jnp.float32))
    return jax.lax.stop_gradient(w_BT * token_factors(logits, targets, objective)
                                 * scale_B[:, None])


def row_losses(params, hidden, targets, loss_mask, model_cfg, *, num_chunks: int = 0,
               half_precision: bool = False, objective: TokenObjective | None = None,
               base=None):
    """(sum of masked token losses [B], masked token count [B]) for hidden [B,T,D].

    ``objective`` (default plain CE): a token-weighting objective; the sums are then the
    objective's weighted row losses (``loss_mask`` the per-token weights it multiplies; its
    batch statistics span the B rows and count the tokens with weight > 0). pre_rl: ``base`` =
    (base params, base hidden states [B,T,D]); the sums are the rows' shares of its loss
    (:func:`_pre_rl_rows`), the loss tokens those with weight > 0."""
    mask_BT = loss_mask.astype(jnp.float32)
    counts_B = jnp.sum(mask_BT, axis=-1)
    B, T, _ = hidden.shape
    weighted = objective is not None and objective.weighted

    pre_rl = weighted and objective.needs_base
    base_hidden = base[1] if pre_rl else jnp.zeros((B, T, 0), hidden.dtype)

    def sums(hidden_BCD, targets_BC, mask_BC, base_BC0):
        if not weighted:
            return _chunk_sums(params, hidden_BCD, targets_BC, mask_BC, model_cfg,
                               half_precision)
        logits_BCV = logits_head(params, hidden_BCD, model_cfg)
        if pre_rl:
            return _pre_rl_sums(logits_BCV, logits_head(base[0], base_BC0, model_cfg),
                                targets_BC, mask_BC > 0)
        return _objective_sums(logits_BCV, targets_BC, mask_BC, half_precision, objective)

    if num_chunks <= 1:
        with jax.named_scope("loss"):
            out = sums(hidden, targets, mask_BT, base_hidden)
    else:
        # a batch cut to a shorter length bucket takes the largest chunk count dividing it
        num_chunks = max(d for d in range(1, min(T, num_chunks) + 1) if T % d == 0)
        one = jax.checkpoint(lambda args: sums(*args))
        chunks = [split_chunks(x, num_chunks) for x in (hidden, targets, mask_BT, base_hidden)]
        with jax.named_scope("loss"):
            out = jnp.sum(jax.lax.map(one, chunks), axis=0)
    if not weighted:
        return out, counts_B
    if pre_rl:
        return _pre_rl_rows(objective, out), counts_B
    valid_B = jnp.sum(mask_BT > 0, axis=-1, dtype=jnp.float32)
    return out[0] * _row_scale(objective, out[1], out[2], valid_B), counts_B
