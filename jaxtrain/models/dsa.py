"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): the lightning indexer and its KL loss.

Each MLA layer gets a small indexer that scores every visible key for every query; the
query then attends only to its ``dsa_index_topk`` best keys (all of them while a row has no
more). Scores: s[t, u] = sum_h w[t, h] * relu(q[t, h] . k[u]), with q from the query latent
(``wq_b``), one key head from the hidden state (``wk``, a LayerNorm with bias), RoPE on the
first qk_pos_emb_head_dim channels of both (half-split; interleaved pairs with
``dsa_rope_interleaved``) and per-head weights w = (x W_proj) / sqrt(H_i * D_i).

Training (Megatron's and MaxText's recipe): the indexer reads detached inputs, and the main
loss cannot reach it (the selection is discrete). Its own loss, KL(target || softmax(s)), with
the target the main attention's probabilities summed over heads and renormalised (detached),
averaged over the rows of the microbatch, is summed over layers times ``dsa_loss_coeff``
(MaxText averages over layers: ``dsa_loss_layer_mean``). ``dsa_sparse_loss`` restricts both
distributions to the selected keys.

Index sharing (GLM-5, Megatron's dsa_indexer_topk_freq; ``ModelConfig.dsa_shared_layers``):
some layers have no indexer and attend with the selection of the last layer before them that
computed one (transformer._run_layers carries it).

Megatron's Hadamard rotation of q and k is orthonormal (scores unchanged) and only serves its
FP8 scoring; it is not applied here.

indexer tree: wq_b [Rq,Hi,Di] (Rq = q_lora_rank, or D without one), wk [D,Di],
              k_norm {scale, bias} [Di], weights_proj [D,Hi].

Legend: B batch, T queries, S keys, D hidden, N attention heads, Hi/Di indexer heads/width,
P = qk_pos_emb_head_dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.mla import rope_pairs
from jaxtrain.models.spec import ParamSpec, _linear_init, _ones, _zeros

_EPS = 1e-10   # Megatron's clamp of the target before its log and of the L1 normaliser


def indexer_specs(cfg) -> dict:
    """ParamSpecs of one layer's indexer (the ``attn.indexer`` subtree)."""
    D, dt = cfg.hidden_size, cfg.param_dtype
    Hi, Di = cfg.dsa_index_heads, cfg.dsa_index_head_dim
    Rq = cfg.q_lora_rank or D
    return {
        "wq_b": ParamSpec((Rq, Hi, Di), dt, ("lora", None, "kv"), _linear_init(cfg, 0, (1, 2))),
        "wk": ParamSpec((D, Di), dt, ("embed", "kv"), _linear_init(cfg, 0, 1)),
        "k_norm": {"scale": ParamSpec((Di,), dt, ("norm",), _ones),
                   "bias": ParamSpec((Di,), dt, ("norm",), _zeros)},
        "weights_proj": ParamSpec((D, Hi), dt, ("embed", None), _linear_init(cfg, 0, 1)),
    }


def _rope(x, cos, sin, interleaved: bool):
    """RoPE on the first 2*cos.shape[-1] channels of x [B,T,n,Di] (the rest pass through):
    halves (x1, x2) rotated, or interleaved pairs as MLA rotates them (`mla.rope_pairs`)."""
    P = 2 * cos.shape[-1]
    r, rest = x[..., :P], x[..., P:]
    if interleaved:
        return jnp.concatenate([rope_pairs(r, cos, sin), rest], -1)
    r = r.astype(jnp.float32)
    x1, x2 = r[..., :P // 2], r[..., P // 2:]
    c, s = cos[:, :, None], sin[:, :, None]
    rot = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)
    return jnp.concatenate([rot, rest], -1)


def _layer_norm(p: dict, x, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def index_qkw(p: dict, x, q_in, rope, cfg):
    """The indexer's queries [B,T,Hi,Di], keys [B,T,Di] (normed, rotated) and head weights
    [B,T,Hi] (float32, scaled) of x [B,T,D] and the query latent q_in."""
    dt = cfg.compute_dtype
    Hi, Di = cfg.dsa_index_heads, cfg.dsa_index_head_dim
    q = jnp.einsum("btr,rhd->bthd", q_in.astype(dt), p["wq_b"].astype(dt))
    k = jnp.einsum("btd,de->bte", x.astype(dt), p["wk"].astype(dt))
    eps = cfg.norm_epsilon if cfg.dsa_k_norm_epsilon is None else cfg.dsa_k_norm_epsilon
    k = _layer_norm(p["k_norm"], k, eps)
    if rope is not None:
        q = _rope(q, *rope[:2], cfg.dsa_rope_interleaved)
        k = _rope(k[:, :, None], *rope[:2], cfg.dsa_rope_interleaved)[:, :, 0]
    w = jnp.einsum("btd,dh->bth", x.astype(jnp.float32), p["weights_proj"].astype(jnp.float32))
    return q, k, w * (Hi * Di) ** -0.5


def index_scores(q, k, w, cfg):
    """Scores [B,T,S] in float32 (no mask) of queries q [B,T,Hi,Di] with head weights w over
    keys k [B,S,Di]: the weighted sum over heads of (ReLU'd) q.k. With ``dsa_head_chunk`` the
    heads are summed a chunk at a time (recomputed in the backward), so no [B,T,Hi,S] tensor
    is made whole."""
    def chunk(q, w):
        logits = jnp.einsum("bthd,bsd->bths", q, k.astype(q.dtype),
                            preferred_element_type=jnp.float32)
        if cfg.dsa_scoring_relu:
            logits = jax.nn.relu(logits)
        return jnp.einsum("bths,bth->bts", logits, w)

    return _over_head_chunks(chunk, (q, w), q.shape[2], cfg.dsa_head_chunk)


def _over_head_chunks(fn, per_head, heads: int, size: int):
    """Σ over chunks of ``size`` heads of fn(*arrays sliced to the chunk's heads, axis 2);
    all heads at once when ``size`` is 0 or covers them."""
    if not size or size >= heads:
        return fn(*per_head)
    split = [jnp.moveaxis(a.reshape(*a.shape[:2], heads // size, size, *a.shape[3:]), 2, 0)
             for a in per_head]
    body = jax.checkpoint(lambda acc, xs: (acc + fn(*xs), None))
    first = jax.eval_shape(fn, *(a[0] for a in split))
    out, _ = jax.lax.scan(body, jnp.zeros(first.shape, first.dtype), tuple(split))
    return out


def select(scores, visible, cfg, k: int | None = None):
    """Boolean [B,T,S]: the keys each query keeps, the top k (``dsa_index_topk``) of its
    visible keys by score (ties to the earlier key; without ``dsa_exact_topk`` every key scoring
    at least the k-th is kept, as MaxText's threshold mask). All visible keys when S <= k. The
    k-th score per query is tagged ``indexer_cutoff_threshold`` (remat_policy custom)."""
    k = cfg.dsa_index_topk if k is None else k
    if scores.shape[-1] <= k:
        return visible
    masked = jnp.where(visible, scores, -jnp.inf)
    if cfg.dsa_approx_topk_recall is not None:
        top, _ = jax.lax.approx_max_k(masked, k, recall_target=cfg.dsa_approx_topk_recall)
    else:
        top, _ = jax.lax.top_k(masked, k)
    cut = checkpoint_name(top[..., -1:], "indexer_cutoff_threshold")
    if not cfg.dsa_exact_topk:
        return visible & (masked >= cut)
    above, tie = masked > cut, masked == cut
    room = k - jnp.sum(above, -1, keepdims=True)
    return visible & (above | (tie & (jnp.cumsum(tie, -1) <= room)))


def indexer_kl(scores, q, k, visible, selected, scale: float, sparse: bool,
               head_chunk: int = 0):
    """Mean over the B*T rows of KL(target || softmax(scores)): the target is the main
    attention's probabilities (q [B,T,N,H], k [B,S,N,H], detached) summed over heads (a chunk
    of ``head_chunk`` heads at a time) and renormalised; ``sparse``: both restricted to the
    ``selected`` keys."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    keep = selected if sparse else visible

    def head_probs(q, k):   # the heads' attention probabilities, summed
        att = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
        att = jnp.where(keep[:, None], att, -jnp.inf)
        return jnp.where(keep[:, None], jax.nn.softmax(att, -1), 0.0).sum(1)

    probs = _over_head_chunks(head_probs, (q, k), q.shape[2], head_chunk)
    target = probs / jnp.maximum(probs.sum(-1, keepdims=True), _EPS)
    logp = jax.nn.log_softmax(jnp.where(keep, scores, -jnp.inf), -1)
    terms = jnp.where(keep, target * (jnp.log(jnp.maximum(target, _EPS)) - logp), 0.0)
    return jnp.mean(terms.sum(-1))


def _coeff(cfg) -> float:
    """The indexer loss weight: DSA's, or DeepSeek-V4's (compressed.py; its layers' KL is the
    same ``dsa`` statistic)."""
    if cfg.compress_ratios is not None:
        return cfg.compress_index_loss_coeff
    return cfg.dsa_loss_coeff


def loss_weight(cfg) -> float:
    """What each layer's KL is multiplied by in the objective."""
    per_layer = _coeff(cfg)
    return per_layer / cfg.num_layers if cfg.dsa_loss_layer_mean else per_layer


def trains_indexer(cfg) -> bool:
    """Whether the forward in training computes the indexer's loss."""
    if cfg.compress_ratios is not None:
        return cfg.compress_sparse_ratio in cfg.compress_ratios and _coeff(cfg) > 0
    return bool(cfg.dsa_index_heads) and cfg.dsa_loss_coeff > 0


def pop(stats, key: str = "dsa"):
    """(the layers' statistics without ``key``, its value or None): the indexers' KL travels
    in the statistics under ``dsa`` (from `transformer._run_layers`, summed over layers), a
    layer's selection for index sharing under ``dsa_keep``."""
    if not stats or key not in stats:
        return stats, None
    rest = {k: v for k, v in stats.items() if k != key}
    return rest or None, stats[key]


def metrics(kl_sum, cfg) -> dict:
    """``indexer_loss``: the coefficient times the KL, averaged over layers (what Megatron and
    MaxText log)."""
    return {"indexer_loss": _coeff(cfg) * kl_sum / cfg.num_layers}
