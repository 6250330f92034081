"""DeepSeek-V4 attention: a sliding window over one shared key=value head, plus compressed
entries that summarise the whole past (``cfg.compress_ratios``).

Per layer, with its compression ratio m (0: none):

    q     = rms(wq_b(norm(x wq_a)))   per head, no scale            [B,T,N,H]
    kv    = norm(x wkv)               one head: the keys are the values [B,T,H]
    RoPE rotates the last P channels of q and kv (interleaved pairs, the layout kept): the
    plain tables (``rotary_base``) where m = 0, the compressed ones (``compress_rotary_base``,
    YaRN with rope_type yarn, no attention factor) where m > 0.
    m = 0: each query attends over its sliding window and its head's sink.
    m > 0: it also attends to C = T // m compressed entries in the same softmax. Entry w pools
           window w (tokens w*m .. w*m+m-1): norm(sum_j softmax_j(x_j wgate + bias_j) (x_j wkv))
           per channel, RoPE'd at the position of its first token (w*m); query t sees it once
           the window closed, (w+1)*m <= t+1, and with packed documents only if the window
           lies in its own document (MaxText). With m = ``compress_sparse_ratio`` (CSA) the
           windows overlap: the projections are two wide, entry w pools the second half over
           window w and the first half over window w-1 (2m slots), and an indexer keeps each
           query's ``compress_index_topk`` best visible entries (HCA: every visible entry).
    out:  the RoPE of the values undone at the query's position (rotation by -angle), the heads
          in o_groups consecutive groups each projected to o_lora_rank (wo_a), then all groups
          to D (wo_b).

Indexer (CSA): its own overlapping compressor at width Di gives keys k_w; queries from the
query latent, q = wq_b(latent) [B,T,Hi,Di] with the compressed RoPE at the token positions;
score[t, w] = sum_h (x wweights)_h Hi^-0.5 * relu(q_h . k_w) Di^-0.5. The selection is discrete,
so the main loss never reaches the indexer; ``compress_index_loss_coeff`` trains it with
KL(target || softmax(scores over the visible entries)), the target being the main attention's
probabilities of the compressed entries summed over heads and renormalised (detached).

attn tree: wq_a [D,Rq], q_a_norm, wq_b [Rq,N,H], wkv [D,H], kv_norm, wo_a [N,H,Rg],
           wo_b [G,Rg,D], sinks [N] (attention_sinks, fp32);
           compressor {wkv [D,c,H], wgate [D,c,H], bias [m,c,H] (fp32), norm} (c = 2 on CSA);
           indexer {wq_b [Rq,Hi,Di], wweights [D,Hi], compressor (as above, width Di, c = 2)}.

Legend: B batch, T length, D hidden, N heads, H head width, P RoPE width, C entries, G groups,
Rq/Rg ranks, Hi/Di indexer heads/width.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import dsa
from jaxtrain.models import layers as L
from jaxtrain.models.attention import visible as attention_visible
from jaxtrain.models.spec import (CSA_STACKS, HCA_STACKS, ParamSpec, _linear_init, _norm,
                                  _zeros)
from jaxtrain.parallel.sharding import constrain


def layer_ratio(cfg, kind: str) -> int:
    """The compression ratio of the layers in stack ``kind``."""
    if kind in CSA_STACKS:
        return cfg.compress_sparse_ratio
    if kind in HCA_STACKS:
        return cfg.compress_dense_ratio
    return 0


def _pool_specs(cfg, width: int, ratio: int, halves: int) -> dict:
    D, dt = cfg.hidden_size, cfg.param_dtype
    proj = lambda: ParamSpec((D, halves, width), dt, ("embed", None, "kv"),  # noqa: E731
                             _linear_init(cfg, 0, (1, 2)))
    return {"wkv": proj(), "wgate": proj(),
            "bias": ParamSpec((ratio, halves, width), jnp.float32, (None, None, "kv"), _zeros),
            "norm": _norm(cfg, width)}


def specs(cfg, kind: str) -> dict:
    """ParamSpecs of one layer's attention (the ``attn`` subtree) in stack ``kind``."""
    D, N, H, dt = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels, cfg.param_dtype
    Rq, G, Rg = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    tree = {
        "wq_a": ParamSpec((D, Rq), dt, ("embed", "lora"), _linear_init(cfg, 0, 1)),
        "q_a_norm": _norm(cfg, Rq),
        "wq_b": ParamSpec((Rq, N, H), dt, ("lora", "q_heads", "kv"), _linear_init(cfg, 0, (1, 2))),
        "wkv": ParamSpec((D, H), dt, ("embed", "kv"), _linear_init(cfg, 0, 1)),
        "kv_norm": _norm(cfg, H),
        "wo_a": ParamSpec((N, H, Rg), dt, ("q_heads", "kv", "lora"),
                          _linear_init(cfg, (0, 1), 2)),
        "wo_b": ParamSpec((G, Rg, D), dt, (None, "lora", "embed"),
                          _linear_init(cfg, (0, 1), 2, output_layer=True)),
    }
    m = layer_ratio(cfg, kind)
    if m:
        sparse = kind in CSA_STACKS
        tree["compressor"] = _pool_specs(cfg, H, m, 2 if sparse else 1)
        if sparse:
            Hi, Di = cfg.compress_index_heads, cfg.compress_index_head_dim
            tree["indexer"] = {
                "wq_b": ParamSpec((Rq, Hi, Di), dt, ("lora", None, "kv"),
                                  _linear_init(cfg, 0, (1, 2))),
                "wweights": ParamSpec((D, Hi), dt, ("embed", None), _linear_init(cfg, 0, 1)),
                "compressor": _pool_specs(cfg, Di, m, 2)}
    return tree


def rope_frequencies(cfg, compressed: bool) -> np.ndarray:
    """Inverse frequencies [P/2]: plain at ``rotary_base``, or the compressed layers' at
    ``compress_rotary_base`` (YaRN-scaled with rope_type yarn; its attention factor unused)."""
    P = cfg.qk_pos_emb_head_dim
    base = cfg.compress_rotary_base if compressed else cfg.rotary_base
    inv = 1.0 / base ** (np.arange(0, P, 2, dtype=np.float64) / P)
    if compressed and cfg.rope_type == "yarn":
        inv, _ = L.yarn(inv, cfg, P, base)
    return inv


def cos_sin(positions, cfg, compressed: bool):
    """(cos, sin) [..., P/2] float32 of integer positions (the plain or compressed tables)."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(
        rope_frequencies(cfg, compressed), jnp.float32)
    return jnp.cos(angle), jnp.sin(angle)


def rope_tables(positions, cfg):
    """(cos, sin, compressed cos, compressed sin) [B,T,P/2] float32 of positions [B,T]."""
    return (*cos_sin(positions, cfg, False), *cos_sin(positions, cfg, True))


def rope_tail(x, cos, sin):
    """x [B,T,(n,)W] with its last 2*cos.shape[-1] channels rotated as interleaved pairs
    (2i, 2i+1), the pairs staying where they are; cos/sin [B,T,P/2]."""
    P = 2 * cos.shape[-1]
    head = x.ndim == 4
    c, s = (cos[:, :, None], sin[:, :, None]) if head else (cos, sin)
    r = x[..., -P:].astype(jnp.float32)
    x1, x2 = r[..., 0::2], r[..., 1::2]
    rot = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(r.shape)
    return jnp.concatenate([x[..., :-P], rot.astype(x.dtype)], -1)


def pool_inputs(p: dict, x, cfg):
    """What a compressor pools, per token of x [B,T,D]: (kv, gate) [B,T,c,W] (a decoding
    cache keeps them)."""
    return (L.dense(x, p["wkv"], None, "btd,dcw->btcw", "compress_kv", cfg),
            L.dense(x, p["wgate"], None, "btd,dcw->btcw", "compress_gate", cfg))


def pool(p: dict, kv, gate, ratio: int, positions, cos_sin, cfg):
    """The compressed entries [B,C,W] of the tokens' :func:`pool_inputs` (module doc):
    C = T // ratio windows, overlapping when ``p``'s projections have two halves; RoPE'd by
    ``cos_sin`` of the positions of the windows' first tokens (w * ratio without packing)."""
    B, T, halves, W = kv.shape
    C = T // ratio
    if C == 0:
        return jnp.zeros((B, 0, W), cfg.compute_dtype)
    kv = kv[:, :C * ratio].astype(jnp.float32).reshape(B, C, ratio, halves, W)
    gate = gate[:, :C * ratio].astype(jnp.float32).reshape(B, C, ratio, halves, W) + p[
        "bias"].astype(jnp.float32)
    if halves == 2:   # slots: the first half over the previous window, the second over this one
        prev_kv = jnp.pad(kv[:, :-1, :, 0], ((0, 0), (1, 0), (0, 0), (0, 0)))
        prev_gate = jnp.concatenate([jnp.full((B, 1, ratio, W), -jnp.inf, jnp.float32),
                                     gate[:, :-1, :, 0]], 1)
        kv = jnp.concatenate([prev_kv, kv[:, :, :, 1]], 2)
        gate = jnp.concatenate([prev_gate, gate[:, :, :, 1]], 2)
    else:
        kv, gate = kv[:, :, :, 0], gate[:, :, :, 0]
    pooled = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)
    pooled = L.norm(p["norm"], pooled, cfg)
    cos, sin = cos_sin(positions[:, :C * ratio:ratio])
    return rope_tail(pooled, cos, sin)


def entry_visible(T: int, entries: int, ratio: int, segment_ids=None):
    """Boolean [1|B,T,C]: the token at index t sees entry w once its window closed,
    w < (t + 1) // ratio; with packed documents (``segment_ids`` [B,T]) only entries whose
    window lies in its own document (MaxText's rule: a window spanning documents is nobody's)."""
    seen = (jnp.arange(entries)[None, :] < ((jnp.arange(T) + 1) // ratio)[:, None])[None]
    if segment_ids is None:
        return seen
    windows = segment_ids[:, :entries * ratio].reshape(-1, entries, ratio)
    low, high = windows.min(-1), windows.max(-1)
    own = jnp.where(low == high, low, -1)
    return seen & (segment_ids[:, :, None] == own[:, None, :])


def index_scores(p: dict, x, q_latent, rot, keys, cfg):
    """The indexer's scores [B,T,C] (float32, unmasked) of x [B,T,D] and the query latent
    against its entries ``keys`` [B,C,Di]; ``rot``: the compressed (cos, sin) of the tokens."""
    Hi, Di = cfg.compress_index_heads, cfg.compress_index_head_dim
    q = L.dense(q_latent, p["wq_b"], None, "btr,rhd->bthd", "indexer_query", cfg)
    q = rope_tail(q, *rot)
    if cfg.compress_index_fp8:
        q, keys = fake_fp8(q), fake_fp8(keys)
    logits = jnp.einsum("bthd,bcd->bthc", q, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    logits = jax.nn.relu(logits) * Di ** -0.5
    w = jnp.einsum("btd,dh->bth", x.astype(jnp.float32), p["wweights"].astype(jnp.float32))
    return jnp.einsum("bthc,bth->btc", logits, w * Hi ** -0.5)


def fake_fp8(x):
    """x rounded through FP8 E4M3 with one scale for the whole tensor (448 / max |x| in x's
    dtype; x as it is when that is 0), computed in x's dtype as Primus's use_v4_fp8_indexer
    does; the gradient passes straight through."""
    amax = jnp.max(jnp.abs(jax.lax.stop_gradient(x)))
    scale = (448.0 / jnp.where(amax > 0, amax, 1).astype(jnp.float32)).astype(x.dtype)
    q = jnp.clip(x * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(x.dtype) / scale
    return x + jax.lax.stop_gradient(jnp.where(amax > 0, q, x) - x)


def _indexer_kl(scores, logits, keep):
    """Primus's distillation loss, the mean over the B*T rows of KL(target || softmax of the
    indexer's scores over the kept entries): the target is each head's softmax of its attention
    logits [B,N,T,C] over the kept entries, summed over heads and renormalised (detached).
    Rows without a kept entry add 0."""
    logits = jax.lax.stop_gradient(logits)
    kept = keep[:, None]
    probs = jax.nn.softmax(jnp.where(kept, logits, -jnp.inf), -1)
    target = jnp.where(kept, probs, 0.0).sum(1)
    target = target / jnp.maximum(target.sum(-1, keepdims=True), dsa._EPS)
    logp = jax.nn.log_softmax(jnp.where(keep, scores, -jnp.inf), -1)
    terms = jnp.where(keep, target * (jnp.log(jnp.maximum(target, dsa._EPS)) - logp), 0.0)
    return jnp.mean(terms.sum(-1))


def _band(kv, W: int):
    """Keys [B,T,H] laid out per block of W queries: [B, nb, 2W, H], block c holding the keys of
    blocks c-1 and c (T padded to nb*W; zeros before the first)."""
    B, T, H = kv.shape
    nb = -(-T // W)
    blocks = jnp.pad(kv, ((0, 0), (W, nb * W - T), (0, 0))).reshape(B, nb + 1, W, H)
    return jnp.concatenate([blocks[:, :-1], blocks[:, 1:]], 2)


def _band_keep(T: int, W: int, segment_ids):
    """Boolean [B|1,1,T,2W]: which of its band's keys (_band) query t sees: causal, within the
    window (t - s < W) and its document."""
    nb = -(-T // W)
    t = jnp.arange(nb * W)[:, None]
    s = (t // W - 1) * W + jnp.arange(2 * W)[None, :]
    keep = (s >= 0) & (s <= t) & (t - s < W)
    keep = keep[None, None, :T]
    if segment_ids is None:
        return keep
    seg = jnp.pad(segment_ids, ((0, 0), (W, nb * W - T)), constant_values=-1)
    keys = jnp.concatenate([seg[:, :-W].reshape(-1, nb, W), seg[:, W:].reshape(-1, nb, W)], -1)
    same = segment_ids[:, :, None] == jnp.repeat(keys, W, axis=1)[:, :T]
    return keep & same[:, None]


def _attend(q, kv, entries, entry_keep, sinks, segment_ids, cfg, local_keep=None):
    """One softmax over the local keys, the compressed entries (``entry_keep`` [B,T,C]) and the
    sinks: (out [B,T,N,H], the entries' scaled logits [B,N,T,C] float32). With a window W the
    local keys are taken per block of W queries (the keys of that block and the one before:
    O(T W) scores), else over the whole prefix. ``local_keep`` [B,1,T,S]: which of the S keys
    kv [B,S,H] each query sees (decoding), instead of the causal window over q's own tokens."""
    B, T, N, H = q.shape
    acc = jnp.float32
    scale = H ** -0.5
    W = cfg.sliding_window
    banded = local_keep is None and W is not None and T > 2 * W
    if banded:
        nb = -(-T // W)
        qb = jnp.pad(q, ((0, 0), (0, nb * W - T), (0, 0), (0, 0))).reshape(B, nb, W, N, H)
        keys = _band(kv, W)
        s_loc = jnp.einsum("bcinh,bcjh->bncij", qb, keys, preferred_element_type=acc)
        s_loc = s_loc.reshape(B, N, nb * W, 2 * W)[:, :, :T] * scale
        local_keep = _band_keep(T, W, segment_ids)
    else:
        s_loc = jnp.einsum("btnh,bsh->bnts", q, kv, preferred_element_type=acc) * scale
        if local_keep is None:
            local_keep = attention_visible(T, T, segment_ids, sliding_window=W)[:, None]
    S = s_loc.shape[-1]
    s_cmp = jnp.einsum("btnh,bch->bntc", q, entries.astype(q.dtype),
                       preferred_element_type=acc) * scale
    low = jnp.finfo(acc).min
    scores = jnp.concatenate([jnp.where(local_keep, s_loc, low),
                              jnp.where(entry_keep[:, None], s_cmp, low)], -1)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(acc)[None, :, None, None], (B, N, T, 1))
        scores = jnp.concatenate([scores, sink], -1)
    probs = jax.nn.softmax(scores, axis=-1)
    p_loc, p_cmp = probs[..., :S].astype(kv.dtype), probs[..., S:S + entries.shape[1]]
    if banded:
        p_loc = jnp.pad(p_loc, ((0, 0), (0, 0), (0, nb * W - T), (0, 0)))
        out = jnp.einsum("bncij,bcjh->bcinh", p_loc.reshape(B, N, nb, W, 2 * W), keys,
                         preferred_element_type=acc).reshape(B, nb * W, N, H)[:, :T]
    else:
        out = jnp.einsum("bnts,bsh->btnh", p_loc, kv, preferred_element_type=acc)
    out = out + jnp.einsum("bntc,bch->btnh", p_cmp.astype(kv.dtype), entries.astype(kv.dtype),
                           preferred_element_type=acc)
    return out.astype(q.dtype), s_cmp


def attention_block(p: dict, x, ctx: dict, cfg, cache=None):
    """DeepSeek-V4 attention over x [B,T,D] -> (out [B,T,D], extras, cache): the extras carry
    the indexer's KL under ``dsa`` when ``compress_index_loss_coeff`` trains it.

    Decoding (decode.py) passes the layer's ``cache``: kv [B,S,H] and, compressing, the
    compressors' :func:`pool_inputs` (ckv, cgate; the indexer's ikv, igate) [B,S,c,W], a
    token's at the slot of its position (``ctx['cache_slots']`` [B,T]; a left-padded prompt's
    padding, slot < 0, is not stored), so the windows are each row's own. A prefill of whole
    rows attends as training does; a decode step (``ctx['q_offset']``) or a padded prefill
    attends over the cached window keys and the entries pooled from the cached projections
    (module doc), the queries at ``ctx['positions']``. Without a cache it comes back None."""
    B, T, _ = x.shape
    # the whole sequence (sequence parallelism gathers it here): the windows and the
    # compressor's overlapping pools read neighbouring tokens
    x = constrain(x, "act_batch", "act_seq", "act_embed")
    cos, sin, ccos, csin = ctx["rope"]
    positions = ctx["positions"]
    m = layer_ratio(cfg, ctx["stack"])
    rot = (ccos, csin) if m else (cos, sin)
    tables = functools.partial(cos_sin, cfg=cfg, compressed=True)   # the entries' RoPE

    latent = L.norm(p["q_a_norm"], L.dense(x, p["wq_a"], None, "btd,dr->btr", "mla_q", cfg),
                    cfg)
    q = L.dense(latent, p["wq_b"], None, "btr,rnh->btnh", "query_proj", cfg)
    q = rope_tail(L.l2_norm(q, cfg.norm_epsilon), *rot)
    q = constrain(q, "act_batch", "act_seq", "act_heads", "act_kv")
    kv = L.norm(p["kv_norm"], L.dense(x, p["wkv"], None, "btd,dh->bth", "key_proj", cfg), cfg)
    kv = rope_tail(kv, *rot)
    extras = {}
    seen = {"kv": kv}   # what a cache keeps of these tokens, and what they attend over
    if m:
        seen["ckv"], seen["cgate"] = pool_inputs(p["compressor"], x, cfg)
        if "indexer" in p:
            seen["ikv"], seen["igate"] = pool_inputs(p["indexer"]["compressor"],
                                                     jax.lax.stop_gradient(x), cfg)
    decoding = cache is not None and ("q_offset" in ctx or ctx.get("padded", False))
    if cache is not None:
        rows = jnp.arange(B)[:, None]
        cache = {n: c.at[rows, ctx["cache_slots"]].set(seen[n].astype(c.dtype), mode="drop")
                 for n, c in cache.items()}
        if decoding:
            seen = {n: c.astype(seen[n].dtype) for n, c in cache.items()}
    # the positions of what is attended over (the cache's: 0..S-1)
    seen_at = (jnp.broadcast_to(jnp.arange(seen["kv"].shape[1]), (B, seen["kv"].shape[1]))
               if decoding else positions)
    if m:
        entries = pool(p["compressor"], seen["ckv"], seen["cgate"], m, seen_at, tables, cfg)
        C = entries.shape[1]
        if decoding:   # entry w is visible once its window closed: w < (position + 1) // m
            keep = jnp.arange(C)[None, None, :] < ((positions + 1) // m)[:, :, None]
        else:
            keep = jnp.broadcast_to(entry_visible(T, C, m, ctx.get("segment_ids")), (B, T, C))
        scores = None
        if "indexer" in p:
            keys = pool(p["indexer"]["compressor"], seen["ikv"], seen["igate"],
                        cfg.compress_sparse_ratio, seen_at, tables, cfg)
            scores = index_scores(p["indexer"], jax.lax.stop_gradient(x),
                                  jax.lax.stop_gradient(latent), (ccos, csin), keys, cfg)
            keep = keep & dsa.select(jax.lax.stop_gradient(scores), keep, cfg,
                                     k=cfg.compress_index_topk)
    else:
        entries = jnp.zeros((B, 0, kv.shape[-1]), kv.dtype)
        keep = jnp.zeros((B, T, 0), bool)
    local = None
    if decoding:   # the window of each query among the cached keys
        ahead = positions[:, :, None] - seen_at[:, None, :]
        W = cfg.sliding_window
        local = ((ahead >= 0) & (ahead < W if W is not None else True))[:, None]
    out, s_cmp = _attend(q, seen["kv"], entries, keep, p.get("sinks"),
                         ctx.get("segment_ids"), cfg, local_keep=local)
    if "indexer" in p and cfg.compress_index_loss_coeff > 0 and not ctx["deterministic"]:
        extras["dsa"] = _indexer_kl(scores, s_cmp, keep)
    out = checkpoint_name(rope_tail(out, rot[0], -rot[1]), "context")
    G = cfg.o_groups
    out = out.reshape(B, T, G, -1, out.shape[-1])
    wo_a = p["wo_a"].reshape(G, -1, *p["wo_a"].shape[1:])
    grouped = L.dense(out, wo_a, None, "btgnh,gnhr->btgr", "out_proj_a", cfg)
    return L.dense(grouped, p["wo_b"], None, "btgr,grd->btd", "out_proj", cfg), extras, cache
