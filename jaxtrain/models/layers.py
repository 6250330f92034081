"""Building blocks: norms, rotary embeddings (plain, Llama-3.1, YaRN), activations, MLP.

Legend: B batch, T length, D hidden, F ffn hidden, N heads, H head dim, R rotary dim.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxtrain import quant
from jaxtrain.parallel.sharding import constrain


def norm(p: dict, x, cfg, *, out_dtype=None, eps: float | None = None):
    """LayerNorm or RMSNorm over the last axis, computed in float32 (``eps``: in place of
    ``cfg.norm_epsilon``).

    ``apply_layernorm_1p`` stores the scale zero-centred and applies ``1 + scale``.
    """
    x32 = x.astype(jnp.float32)
    if cfg.normalization == "LayerNorm":
        x32 = x32 - x32.mean(-1, keepdims=True)
    eps = cfg.norm_epsilon if eps is None else eps
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)
    scale = p["scale"].astype(jnp.float32)
    y = y * (1.0 + scale if cfg.apply_layernorm_1p else scale)
    if "bias" in p:
        y = y + p["bias"].astype(jnp.float32)
    return y.astype(out_dtype or cfg.compute_dtype)


def l2_norm(x, eps: float):
    """Megatron/Llama-4 ``L2Norm``: x / sqrt(mean(x^2) + eps), no learned scale."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


def rope_inv_freq(cfg) -> tuple[np.ndarray, float]:
    """Inverse frequencies [R/2] and the attention factor that scales cos/sin."""
    R, base = cfg.rotary_dim, cfg.rotary_base
    inv = 1.0 / base ** (np.arange(0, R, 2, dtype=np.float64) / R)
    if cfg.use_rope_scaling:
        return _llama3_scaling(inv, cfg), 1.0
    if cfg.rope_type == "yarn":
        return yarn(inv, cfg)
    return inv, 1.0


def _llama3_scaling(inv, cfg):
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, scaled)


def yarn(inv, cfg, R: int | None = None, base: float | None = None):
    """(YaRN-scaled inverse frequencies, attention factor) of ``inv`` [R/2] at rotary width R
    and ``base`` (default: the model's rotary_dim and rotary_base)."""
    R = cfg.rotary_dim if R is None else R
    base = cfg.rotary_base if base is None else base
    factor = cfg.yarn_scaling_factor
    old = cfg.original_max_position_embeddings

    def dim_of(rotations):
        return R * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(cfg.yarn_beta_fast), dim_of(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    ramp = np.clip((np.arange(R // 2) - low) / ((high - low) or 0.001), 0, 1)
    extrapolate = 1 - ramp
    inv = inv / factor * (1 - extrapolate) + inv * extrapolate
    return inv, yarn_attention_factor(factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's cos/sin scale m(mscale) / m(mscale_all_dim), m(a) = 0.1 a ln(factor) + 1."""
    def m(a):
        return 1.0 if factor <= 1 else 0.1 * a * math.log(factor) + 1.0

    return m(mscale) / m(mscale_all_dim)


def rope_tables(positions, cfg):
    """(cos, sin) [B,T,R/2] in float32 for integer positions [B,T]."""
    inv, factor = rope_inv_freq(cfg)
    pos = positions.astype(jnp.float32)
    if cfg.rotary_seq_len_interpolation_factor:
        pos = pos / cfg.rotary_seq_len_interpolation_factor
    angle = pos[..., None] * jnp.asarray(inv, jnp.float32)
    return jnp.cos(angle) * factor, jnp.sin(angle) * factor


def local_rope_tables(positions, cfg):
    """(cos, sin) of the sliding-window layers when ``cfg.local_rotary_base`` is set: plain
    RoPE with that base (no scaling, no interpolation; Gemma 3's local layers)."""
    R = cfg.rotary_dim
    inv = 1.0 / cfg.local_rotary_base ** (np.arange(0, R, 2, dtype=np.float64) / R)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    return jnp.cos(angle), jnp.sin(angle)


def global_rope_tables(positions, cfg):
    """(cos, sin) [B,T,H/2] of Gemma 4's global layers (H their head width): proportional RoPE,
    channel pair i rotated at rotary_base^(-2i/H) for i < global_rotary_percent·H/2 and not
    rotated (angle 0) beyond."""
    H = cfg.attention_shape(wide=True)[1]
    turned = int((cfg.global_rotary_percent or 1.0) * H // 2)
    inv = np.zeros(H // 2)
    inv[:turned] = 1.0 / cfg.rotary_base ** (np.arange(0, 2 * turned, 2, dtype=np.float64) / H)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x, cos, sin, cfg):
    """Rotate the first R channels of x [B,T,N,H] (R = twice the tables' width); the rest pass
    through.

    Non-interleaved pairs channel i with i + R/2 (HF/NeoX layout); interleaved pairs 2i, 2i+1.
    """
    R = 2 * cos.shape[-1]
    xr, rest = x[..., :R].astype(jnp.float32), x[..., R:]
    cos, sin = cos[:, :, None], sin[:, :, None]
    if cfg.rotary_interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return jnp.concatenate([out.astype(x.dtype), rest], -1)


def activation(name: str, x):
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "squared_relu":
        return jnp.square(jax.nn.relu(x))
    if name == "relu":
        return jax.nn.relu(x)
    raise ValueError(f"unknown activation {name!r}")


def dense(x, w, b, eq: str, name: str, cfg):
    """einsum(eq, x, w) + b in the compute dtype, tagged ``name`` for remat policies; under
    ``cfg.quant`` the einsum is the quantized one (jaxtrain.quant; w may be a QWeight)."""
    dt = cfg.compute_dtype
    if getattr(cfg, "quant", None) is not None:
        y = quant.project(eq, x, w, cfg)
    else:
        y = jnp.einsum(eq, x.astype(dt), w.astype(dt))
    if b is not None:
        y = y + b.astype(dt)
    return checkpoint_name(y, name)


def glu(h0, h1, cfg, clamp=None):
    """The gated unit act(h0) * h1: clamped (act(min(h0, c)) * clip(h1, -c, c)) at
    ``cfg.glu_clamp`` (Megatron's activation_func_clamp_value, DeepSeek-V4's limit) or
    ``clamp``; or Kimi K3's SiTU (``cfg.situ_beta``), in float32 and back."""
    beta = getattr(cfg, "situ_beta", None)
    if beta is not None:
        g, u = h0.astype(jnp.float32), h1.astype(jnp.float32)
        if cfg.situ_linear_beta is not None:
            u = cfg.situ_linear_beta * jnp.tanh(u / cfg.situ_linear_beta)
        return (beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g) * u).astype(h0.dtype)
    clamp = cfg.glu_clamp if cfg.glu_clamp is not None else clamp
    if clamp is not None:
        h0, h1 = jnp.minimum(h0, clamp), jnp.clip(h1, -clamp, clamp)
    return activation(cfg.activation, h0) * h1


def mlp(p: dict, x, cfg):
    """Gated (act(x W0) * x W1) or plain act(x W) feed-forward, then W_o: [B,T,D] -> [B,T,D]."""
    if cfg.gated_linear_unit:
        h0 = dense(x, p["wi_0"], p.get("bi_0"), "btd,df->btf", "mlpwi_0", cfg)
        h1 = dense(x, p["wi_1"], p.get("bi_1"), "btd,df->btf", "mlpwi_1", cfg)
        h = glu(h0, h1, cfg)
    else:
        h = activation(cfg.activation, dense(x, p["wi"], p.get("bi"), "btd,df->btf", "mlpwi", cfg))
    h = constrain(h, "act_batch", "act_seq", "act_mlp")
    return dense(h, p["wo"], p.get("bo"), "btf,fd->btd", "mlpwo", cfg)


def dropout(x, rate: float, rng, deterministic: bool):
    if deterministic or rate == 0.0:
        return x
    if rng is None:
        raise ValueError("dropout is on (deterministic=False, rate > 0) but no rng was given")
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
