"""SeCO / SpaCO (pgs ``memory.seco``, ``seco_chunk_size``, ``seco_kv_offload``,
``spaco_budget``): one long sequence trained chunk by chunk, activation memory set by the chunk.

Semantics follow pgs's ``seco.py`` (Li et al. 2505.16710); the code is our own:

1. **Prefill** (no gradient): the chunks of the sequence run in order through the model, each
   attending over the keys and values of the chunks before it; every layer's K/V of every
   chunk is collected in one buffer ``{k: [L,1,T,K,H], v: [L,1,T,K,Hv]}``. No activation is
   kept.
2. **Reverse pass**: chunk c (last to first) is recomputed under ``jax.vjp`` as a function
   (params, K/V buffer) -> (chunk loss, chunk's own K/V). The cotangents are the loss
   cotangent (the loss scale; the token weights already hold the normaliser) and the K/V
   cotangent that the later chunks sent to chunk c's K/V. The parameter cotangent is added to
   the gradient; the buffer cotangent (non-zero only at positions < c·C: the chunk overwrites
   its own slot and the causal mask hides the later ones) is added to the relay accumulator
   for the earlier chunks. The sum is exactly ``jax.grad`` of the plain loss.

Both passes are ``lax.scan`` over chunks of one static shape: each chunk attends over the
whole T-long buffer with the causal mask at its absolute offset (``q_offset``), so one chunk
body is compiled whatever the number of chunks. The price is attention FLOPs: a chunk scores
its C queries against all T keys (masked beyond its own), about twice the triangular work of
growing prefixes; memory per chunk is O(C·T) scores + O(C) activations either way. Positions
are absolute (RoPE / learned), so chunking changes nothing numerically beyond summation order.

A length not divisible by the chunk (pgs allows a shorter last chunk) is padded at the end to
whole chunks with loss weight 0; causal attention keeps the padding invisible to real tokens.

**SpaCO** (``spaco_budget`` t, 0 < t < k chunks): only t chunks drawn without replacement
(seeded from the step's rng; no chunk is always included, as in pgs's ``random.sample``) are
recomputed and backpropagated; the K/V cotangent each selected chunk relays is scaled by
``min(k/t, 2)`` (per relay hop, so a path through h hops carries the factor h times), the
chunk's own loss gradient is not, exactly as pgs. The reported loss is the exact loss of the
whole sequence (from the prefill), where pgs reports only the selected chunks' sum. Note pgs's
estimator is not unbiased as documented: a chunk's own-loss term enters with probability t/k
and weight 1.

**K/V offload** (``seco_kv_offload``): the K/V buffer lives in host memory (the pinned host
memory space) through both passes and never comes to the device whole. Each layer copies its
own slice [1,T,K,H] to the device when it attends and drops it after (under differentiation
the layers are rematerialized, so the copies are not kept as residuals); a chunk's own K/V goes
straight to the host buffer. The device then holds one layer's keys and values at a time plus,
as in pgs, the K/V gradient accumulator (fp32) that relays to earlier chunks. pgs streams each
layer's keys in sequence blocks too (its attention runs block by block); jaxtrain's chunk
attends over the layer's whole slice at once. On the CPU backend host and device memory are
the same RAM.

Supported: dense decoders (no MoE: router statistics are per-sequence), no FP8 delayed-scaling
state, batch 1, no packing (``segment_ids`` are ignored: padding at the end needs no mask),
the xla attention (the chunked path always uses it), objectives with per-token factors (ce,
dft, deft); dropout is consistent across the two passes (chunk rng = fold_in(rng, c)).

Legend: L layers, T length (padded to n·C), C chunk, n chunks, K kv heads, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.config.errors import ConfigError
from jaxtrain.loss import row_losses
from jaxtrain.models import hyper
from jaxtrain.models import layers as L
from jaxtrain.models.decode import cached_layers
from jaxtrain.models.params import DENSE_STACK, layer_kinds
from jaxtrain.models.transformer import RESIDUAL, embed_inputs
from jaxtrain.parallel.sharding import constrain

KNOB = "memory.seco"
SPACO_CAP = 2.0   # pgs compensation_cap: the largest relay scale per hop
SECO_OBJECTIVES = ("ce", "dft", "deft")


def check_supported(model_cfg, objective=None, quant_state=None) -> list[str]:
    """Why SeCO cannot run this model/objective (empty when it can)."""
    problems = []
    other = sorted(set(layer_kinds(model_cfg)) - {DENSE_STACK})
    if other:
        problems.append(f"{KNOB} covers decoders of one dense layer stack; this model also has "
                        f"{', '.join(other)} (MoE, Gated DeltaNet or Gemma 4 global layers): "
                        "keep one")
    if getattr(model_cfg, "quant", None) is not None and model_cfg.quant.stateful:
        problems.append(f"{KNOB} does not carry the FP8 delayed-scaling state: keep one")
    if quant_state is not None:
        problems.append(f"{KNOB} does not carry a quantization state")
    if objective is not None and objective.kind not in SECO_OBJECTIVES:
        problems.append(f"{KNOB} supports per-token objectives {SECO_OBJECTIVES}; "
                        f"{objective.kind} needs statistics of the whole sequence or a base model")
    return problems


def spaco_scale(num_chunks: int, budget: int) -> float:
    """pgs's relay compensation: min(k/t, 2) when 0 < t < k, else 1 (exact SeCO)."""
    if budget <= 0 or budget >= num_chunks:
        return 1.0
    return min(num_chunks / budget, SPACO_CAP)


def spaco_selected(rng, num_chunks: int, budget: int):
    """Bool [k]: the chunks SpaCO backpropagates (t drawn without replacement from ``rng``;
    all of them when budget is 0 or >= k)."""
    if budget <= 0 or budget >= num_chunks:
        return jnp.ones((num_chunks,), bool)
    pick = jax.random.choice(rng, num_chunks, (budget,), replace=False)
    return jnp.zeros((num_chunks,), bool).at[pick].set(True)


def _kv_shapes(cfg, length: int, dtype):
    K = cfg.num_kv_heads
    Hv = cfg.v_head_dim if cfg.multi_latent_attention else cfg.kv_channels
    return {"k": jnp.zeros((cfg.num_layers, 1, length, K, cfg.head_dim), dtype),
            "v": jnp.zeros((cfg.num_layers, 1, length, K, Hv), dtype)}


def _chunk(params, kv, tokens, positions, targets, weights, start, rng, cfg, *, train,
           with_loss, objective, half_precision, offload=False):
    """Chunk [1,C] at absolute offset ``start`` over the K/V buffer ``kv`` (earlier chunks'
    keys and values at their positions): (Σ weights · token loss of the chunk, or 0 without
    ``with_loss``; the chunk's own K/V {k: [L,1,C,K,H], v: [L,1,C,K,Hv]}). ``offload``: ``kv``
    is in host memory; each layer copies its own slice to the device when it attends (and
    is recomputed under differentiation rather than keeping that copy)."""
    x, rope = embed_inputs(params, tokens, positions, cfg)
    emb_rng = jax.random.fold_in(rng, cfg.num_layers) if rng is not None else None
    x = L.dropout(constrain(x, *RESIDUAL), cfg.hidden_dropout, emb_rng, not train
                  ).astype(cfg.residual_dtype)

    def kv_cache(c, k, v):
        c = _to_memory(c, "device" if offload else None)
        full_k = jax.lax.dynamic_update_slice_in_dim(c["k"], k.astype(c["k"].dtype), start, 1)
        full_v = jax.lax.dynamic_update_slice_in_dim(c["v"], v.astype(c["v"].dtype), start, 1)
        return full_k.astype(k.dtype), full_v.astype(v.dtype), {"k": k, "v": v}

    ctx = {"segment_ids": None, "deterministic": not train, "rng": rng, "rope": rope,
           "moe_state": None, "kv_cache": kv_cache, "q_offset": start, "positions": positions,
           "kv_positions": jnp.arange(kv["k"].shape[2], dtype=jnp.int32)[None]}
    x, own = cached_layers(params, hyper.expand(x, cfg), kv, ctx, cfg, None, remat=offload)
    own = jax.tree.map(lambda a, b: a.astype(b.dtype), own, kv)
    if not with_loss:
        return jnp.float32(0.0), own
    hidden = L.norm(params["final_norm"], hyper.contract(x, cfg, params.get("hc_head")), cfg)
    sums, _ = row_losses(params, hidden, targets, weights, cfg, half_precision=half_precision,
                         objective=objective)
    return jnp.sum(sums), own


def _to_memory(tree, kind):
    if kind is None:
        return tree
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host if kind == "host"
                                                 else jax.memory.Space.Device), tree)


def seco_loss_and_grads(params, tokens, targets, loss_mask, cfg, chunk: int, *,
                        spaco_budget: int = 0, rng=None, positions=None, train: bool = False,
                        loss_scale=1.0, objective=None, half_precision: bool = False,
                        kv_offload: bool = False):
    """(Σ loss_mask · token loss, its gradient w.r.t. params) for one sequence [1,T], computed
    chunk by chunk (module docstring). ``loss_mask`` [1,T]: the loss weights (the train step's
    normalised weights, or a 0/1 mask). ``rng``: the dropout key (``train``) and SpaCO's draw.
    ``loss_scale``: multiplies the gradient (fp16 loss scaling), not the returned loss.
    ``spaco_budget`` t: SpaCO (0: exact SeCO). ``kv_offload``: K/V buffer in host memory."""
    if tokens.ndim != 2 or tokens.shape[0] != 1:
        raise ValueError(f"{KNOB} trains one sequence at a time: tokens must be [1, T], got "
                         f"{tokens.shape}")
    if chunk < 1:
        raise ValueError(f"memory.seco_chunk_size must be at least 1, got {chunk}")
    problems = check_supported(cfg, objective)
    if problems:
        raise ValueError("; ".join(problems))
    if (spaco_budget > 0 or train) and rng is None:
        raise ValueError("SpaCO and dropout need an rng")
    T = tokens.shape[1]
    n = -(-T // chunk)
    Tp = n * chunk
    pad = Tp - T
    if positions is None:
        positions = jnp.arange(T, dtype=jnp.int32)[None]
    padded = lambda a, mode="constant": jnp.pad(a, ((0, 0), (0, pad)), mode=mode)  # noqa: E731
    tok_n1C = padded(tokens).reshape(n, 1, chunk)
    tgt_n1C = padded(targets).reshape(n, 1, chunk)
    w_n1C = padded(loss_mask.astype(jnp.float32)).reshape(n, 1, chunk)
    pos_n1C = padded(positions.astype(jnp.int32), "edge").reshape(n, 1, chunk)
    idx = jnp.arange(n)
    starts = idx * chunk
    drop_rng, pick_rng = jax.random.split(rng if rng is not None else jax.random.key(0))
    chunk_rng = lambda c: jax.random.fold_in(drop_rng, c) if train else None  # noqa: E731
    spaco = 0 < spaco_budget < n
    selected_n = spaco_selected(pick_rng, n, spaco_budget)
    relay = jnp.float32(spaco_scale(n, spaco_budget))
    dtype = jnp.dtype(cfg.compute_dtype)
    opts = dict(cfg=cfg, train=train, objective=objective, half_precision=half_precision,
                offload=kv_offload)
    host = "host" if kv_offload else None

    # 1. prefill: every chunk's K/V, no activations kept (SpaCO: also the exact loss); with
    # the offload the chunk's own K/V goes to the host buffer, which never comes back whole
    def fill(kv, xs):
        c, s, tok, pos, tgt, w = xs
        lc, own = _chunk(params, kv, tok, pos, tgt, w, s, chunk_rng(c), with_loss=spaco,
                         **opts)
        kv = jax.tree.map(lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o, s, 2),
                          kv, _to_memory(own, host))
        return kv, lc

    kv0 = _to_memory(_kv_shapes(cfg, Tp, dtype), host)
    kv, prefill_losses = jax.lax.scan(
        fill, kv0, (idx, starts, tok_n1C, pos_n1C, tgt_n1C, w_n1C))
    kv = jax.lax.stop_gradient(kv)

    # 2. reverse: recompute each chunk under vjp, relaying the K/V cotangent to earlier chunks
    ct_loss = jnp.asarray(loss_scale, jnp.float32)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def back(carry, xs):
        g_kv, grads, loss = carry
        c, s, tok, pos, tgt, w, sel = xs

        def run(g_kv, grads, loss):
            f = lambda p, b: _chunk(p, b, tok, pos, tgt, w, s, chunk_rng(c),  # noqa: E731
                                    with_loss=True, **opts)
            (lc, own), vjp = jax.vjp(f, params, kv)
            ct_own = jax.tree.map(
                lambda g, o: (jax.lax.dynamic_slice_in_dim(g, s, chunk, 2) * relay
                              ).astype(o.dtype), g_kv, own)
            g_p, g_b = vjp((ct_loss.astype(lc.dtype), ct_own))
            g_b = _to_memory(g_b, "device" if host else None)   # the K/V gradient: on device
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g_p)
            g_kv = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_kv, g_b)
            return g_kv, grads, loss + lc

        if spaco:
            out = jax.lax.cond(sel, run, lambda *a: a, g_kv, grads, loss)
        else:
            out = run(g_kv, grads, loss)
        return out, None

    g_kv0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), kv0)
    (_, grads, loss), _ = jax.lax.scan(
        back, (g_kv0, zero_grads, jnp.float32(0.0)),
        (idx, starts, tok_n1C, pos_n1C, tgt_n1C, w_n1C, selected_n), reverse=True)
    if spaco:
        loss = jnp.sum(prefill_losses)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, grads


def check_step(model_cfg, tcfg) -> None:
    """Raise ConfigError for the step settings the SeCO step does not cover."""
    problems = check_supported(model_cfg, tcfg.objective)
    if tcfg.micro_batch_size != 1 or tcfg.data_parallel_size != 1:
        problems.append(f"{KNOB} trains one sequence per step on one device: it needs "
                        f"micro_batch_size 1 (got {tcfg.micro_batch_size}) and data-parallel "
                        f"size 1 (got {tcfg.data_parallel_size})")
    if tcfg.embed_noise:
        problems.append(f"{KNOB} cannot be combined with plugins.sym_noise (its noise scale "
                        "depends on the whole sequence)")
    if tcfg.gradient_release:
        problems.append(f"{KNOB} cannot be combined with memory.gradient_release")
    if tcfg.seco_chunk < 1:
        problems.append(f"memory.seco_chunk_size must be at least 1, got {tcfg.seco_chunk}")
    if problems:
        raise ConfigError(problems)


def micro_grads(params, micro: dict, weights_BT, rng, model_cfg, tcfg, scale):
    """The train step's microbatch (``micro`` leaves [1,T]) through SeCO/SpaCO: (Σ weights ·
    token loss, gradient × ``scale``)."""
    return seco_loss_and_grads(
        params, micro["tokens"], micro["targets"], weights_BT, model_cfg, tcfg.seco_chunk,
        spaco_budget=tcfg.spaco_budget, rng=rng, positions=micro.get("positions"),
        train=True, loss_scale=scale, objective=tcfg.objective,
        half_precision=tcfg.half_precision_loss, kv_offload=tcfg.seco_kv_offload)
