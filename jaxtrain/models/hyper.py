"""Manifold-constrained hyper-connections (mHC): n residual streams in place of one.

The residual stream is x [B,T,n,D] between layers (``cfg.hc_streams`` = n > 1). Each half of a
layer (token mixer, FFN) reads one mix of the streams and writes its output back into all of
them, while the streams themselves are mixed by a doubly stochastic matrix:

    z      = rms(flatten(x)) @ W + (alpha_pre, alpha_post, alpha_res) * ... + b   [B,T,2n+R]
    pre    = sigmoid(z_pre)  (+ eps)                    [B,T,n]    what the sublayer reads
    post   = 2 sigmoid(z_post)                          [B,T,n]    how its output is spread
    res    = sinkhorn(z_res)                            [B,T,n,n]  rows and columns sum to 1
    x'     = mix(res, x) + post (x) f(sum_k pre_k x_k)

Two conventions, ``cfg.hc_style``:
- "deepseek" (MaxText's mhc.py, Hugging Face's DeepSeek-V4): a learned-scale RMS norm of
  epsilon ``norm_epsilon``; pre = sigmoid + eps; Sinkhorn starts from softmax(z) + eps and
  normalises columns, then (iters - 1) row/column rounds, each adding eps to the sums; the
  streams mix as res^T x. ``hc_lite`` (MaxText's mHC-lite) makes res a softmax-weighted sum of
  the n! permutation matrices instead. The streams are summed after the last layer.
- "megatron" (Megatron-LM's hyper_connection.py): no norm weight, x / (|x|/sqrt(nD) + eps);
  pre = sigmoid; Sinkhorn starts from exp(z - max z) and runs ``iters`` row/column rounds,
  dividing by the sums clamped at eps; the streams mix as res x. They are averaged after the
  last layer.
eps is ``hc_eps`` (1e-6). With ``hc_head`` (DeepSeek-V4) a learned mapping weighs the streams
at the end instead (`contract`).

Parameters of one half (``attn_hc``, ``mlp_hc``): ``w`` [nD, 2n+R], ``b`` [2n+R] (zeros),
``alpha`` [3] (pre, post, res gates, ``hc_init_gate``), and with "deepseek" ``norm`` {scale
[nD]}. R is n*n (n! with hc_lite). Legend: B batch, T length, n streams, D hidden.
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.spec import ParamSpec, _ones, _zeros

STREAMS = ("act_batch", "act_res_seq", None, "act_embed")   # logical axes of x [B,T,n,D]


def res_width(cfg) -> int:
    """R: the residual mixing logits per token."""
    n = cfg.hc_streams
    return math.factorial(n) if cfg.hc_lite else n * n


def specs(cfg) -> dict:
    """One half's :class:`ParamSpec` tree (module doc)."""
    n, D, dt = cfg.hc_streams, cfg.hidden_size, cfg.param_dtype
    width = 2 * n + res_width(cfg)
    if cfg.hc_style == "megatron":
        init = jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", 0, 1)
    else:
        init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", 0, 1)
    gate = cfg.hc_init_gate
    tree = {"w": ParamSpec((n * D, width), dt, (None, None), init),
            "b": ParamSpec((width,), dt, (None,), _zeros),
            "alpha": ParamSpec((3,), dt, (None,), lambda k, s, d: jnp.full(s, gate, d))}
    if cfg.hc_style == "deepseek":
        tree["norm"] = {"scale": ParamSpec((n * D,), dt, ("norm",), _ones)}
    return tree


def expand(x, cfg):
    """[B,T,D] -> [B,T,n,D], every stream a copy (identity with one stream)."""
    if cfg.hc_streams == 1:
        return x
    return jnp.broadcast_to(x[:, :, None], (*x.shape[:2], cfg.hc_streams, x.shape[-1]))


def head_specs(cfg) -> dict:
    """DeepSeek-V4's learned final collapse (``hc_head``): ``w`` [nD, n], ``b`` [n], ``alpha``
    [1] (initialised at ``hc_init_gate`` as the layers' gates)."""
    n, D, dt = cfg.hc_streams, cfg.hidden_size, cfg.param_dtype
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", 0, 1)
    return {"w": ParamSpec((n * D, n), dt, (None, None), init),
            "b": ParamSpec((n,), dt, (None,), _zeros),
            "alpha": ParamSpec((1,), dt, (None,),
                               lambda k, s, d: jnp.full(s, cfg.hc_init_gate, d))}


def contract(x, cfg, head: dict | None = None):
    """[B,T,n,D] -> [B,T,D] after the last layer: with ``head`` (``hc_head``) the weighted sum
    sum_k (sigmoid(rms(flatten(x)) w alpha + b)_k + eps) x_k, else the streams' sum
    ("deepseek", MaxText) or mean ("megatron")."""
    if cfg.hc_streams == 1:
        return x
    if head is not None:
        B, T, n, D = x.shape
        flat = x.reshape(B, T, n * D).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt((flat * flat).mean(-1, keepdims=True) + cfg.norm_epsilon)
        z = flat @ head["w"].astype(jnp.float32) * head["alpha"].astype(jnp.float32)
        pre = jax.nn.sigmoid(z + head["b"].astype(jnp.float32)) + cfg.hc_eps
        return jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
    out = x.astype(jnp.float32).sum(2)
    if cfg.hc_style == "megatron":
        out = out / cfg.hc_streams
    return out.astype(x.dtype)


def _sinkhorn(z, cfg):
    """Doubly stochastic [..., n, n] from logits z (module doc)."""
    if cfg.hc_style == "megatron":
        m = jnp.exp(z - jax.lax.stop_gradient(z.max(-1, keepdims=True)))   # rows rescale away
        for _ in range(cfg.hc_sinkhorn_iters):
            m = m / jnp.maximum(m.sum(-1, keepdims=True), cfg.hc_eps)
            m = m / jnp.maximum(m.sum(-2, keepdims=True), cfg.hc_eps)
        return m
    m = jax.nn.softmax(z, axis=-1) + cfg.hc_eps
    m = m / (m.sum(-2, keepdims=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        m = m / (m.sum(-1, keepdims=True) + cfg.hc_eps)
        m = m / (m.sum(-2, keepdims=True) + cfg.hc_eps)
    return m


def permutations(n: int) -> np.ndarray:
    """The n! permutation matrices [n!, n, n] (mHC-lite's basis), in itertools order."""
    return np.eye(n, dtype=np.float32)[np.array(list(itertools.permutations(range(n))))]


def maps(p: dict, x, cfg):
    """(pre [B,T,n], post [B,T,n], res [B,T,n,n]) in float32 for streams x [B,T,n,D], with res
    oriented so that the mixed streams are sum_j res[i, j] x_j."""
    B, T, n, D = x.shape
    flat = x.reshape(B, T, n * D).astype(jnp.float32)
    ms = (flat * flat).mean(-1, keepdims=True)
    if cfg.hc_style == "megatron":
        flat = flat / (jnp.sqrt(ms) + cfg.hc_eps)
    else:
        flat = flat * jax.lax.rsqrt(ms + cfg.norm_epsilon) * p["norm"]["scale"].astype(
            jnp.float32)
    z = flat @ p["w"].astype(jnp.float32)
    a = p["alpha"].astype(jnp.float32)
    width = z.shape[-1]
    gates = jnp.repeat(a, np.array([n, n, width - 2 * n]), total_repeat_length=width)
    z = z * gates + p["b"].astype(jnp.float32)
    pre = jax.nn.sigmoid(z[..., :n])
    post = 2.0 * jax.nn.sigmoid(z[..., n:2 * n])
    if cfg.hc_style == "megatron":
        return pre, post, _sinkhorn(z[..., 2 * n:].reshape(B, T, n, n), cfg)
    if cfg.hc_lite:
        weights = jax.nn.softmax(z[..., 2 * n:], axis=-1)
        res = jnp.einsum("btp,pkm->btkm", weights, jnp.asarray(permutations(n)))
    else:
        res = _sinkhorn(z[..., 2 * n:].reshape(B, T, n, n), cfg)
    return pre + cfg.hc_eps, post, jnp.swapaxes(res, -1, -2)


def collapse(p: dict, x, cfg):
    """(the sublayer's input [B,T,D], (post, res) for :func:`merge`) from streams x."""
    pre, post, res = maps(p, x, cfg)
    h = jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32))
    return h.astype(x.dtype), (post, res)


def merge(mix, x, out):
    """The streams after a sublayer: res-mixed x plus its output ``out`` [B,T,D] spread by post."""
    post, res = mix
    mixed = jnp.einsum("btij,btjd->btid", res, x.astype(jnp.float32))
    return (mixed + post[..., None] * out.astype(jnp.float32)[:, :, None]).astype(x.dtype)


def mixing_flops(cfg) -> float:
    """Forward FLOPs per token of one half's collapse, stream mixing and spread
    (2nD + 2n^2 D + 2nD); the mapping matmul is a weight (``w``) and counted with the others,
    Sinkhorn's O(iters n^2) is left out. 0 without hyper-connections."""
    n, D = cfg.hc_streams, cfg.hidden_size
    return 0.0 if n == 1 else float(4 * n * D + 2 * n * n * D)
