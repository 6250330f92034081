"""Parameter-declaration primitives and the layer stacks, below every other model module.

:class:`ParamSpec` declares one parameter (shape, dtype, logical axes, initializer); the
initializers here are Megatron's. The layer stacks say where each layer's parameters live:
``layers`` holds the dense layers and ``moe_layers`` the MoE ones (``linear_layers`` and
``linear_moe_layers`` the same with Gated DeltaNet mixers), each in layer order, and
:func:`moe_pattern` (Megatron's ``moe_layer_freq``) decides which layers are MoE. A hybrid
model's layers are single sublayers, in stacks by kind (``HYBRID_STACKS``).

:mod:`jaxtrain.models.params` builds the model's parameter tree from these; the MoE package,
multi-latent attention and the quantization state read the stacks from here, so none of them
imports the others to find out where a layer lives.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

Init = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter. ``init`` makes one layer's value; ``layer_axis`` is where L sits, if any."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: Init
    layer_axis: int | None = None

    def stacked(self, num_layers: int, axis: int) -> "ParamSpec":
        shape = self.shape[:axis] + (num_layers,) + self.shape[axis:]
        axes = self.axes[:axis] + ("layers",) + self.axes[axis:]
        return dataclasses.replace(self, shape=shape, axes=axes, layer_axis=axis)

    def make(self, key: jax.Array) -> jax.Array:
        if self.layer_axis is None:
            return self.init(key, self.shape, self.dtype)
        a = self.layer_axis
        one = self.shape[:a] + self.shape[a + 1:]
        keys = jax.random.split(key, self.shape[a])
        return jnp.moveaxis(jax.vmap(lambda k: self.init(k, one, self.dtype))(keys), 0, a)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _leaf_key(key, path) -> jax.Array:
    """The initialization key of the leaf at ``path``: adding a parameter leaves the others'
    keys unchanged."""
    return jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def _linear_init(cfg, in_axis, out_axis, output_layer=False) -> Init:
    """Megatron's init: N(0, std), output layers N(0, std/sqrt(2L)); or Xavier uniform."""
    if cfg.init_method_xavier_uniform:
        return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis, out_axis)
    std = cfg.init_method_std / (2 * cfg.num_layers) ** 0.5 if output_layer else cfg.init_method_std
    return jax.nn.initializers.normal(std)


def _norm(cfg, size: int) -> dict:
    dt = cfg.param_dtype
    spec = {"scale": ParamSpec((size,), dt, ("norm",), _zeros if cfg.apply_layernorm_1p else _ones)}
    if cfg.normalization == "LayerNorm":
        spec["bias"] = ParamSpec((size,), dt, ("norm",), _zeros)
    return spec


# ----------------------------------------------------------------------------- layer stacks

DENSE_STACK, MOE_STACK = "layers", "moe_layers"
# Gated DeltaNet (linear-attention) layers of hybrid models, with a dense or an MoE FFN
LINEAR_STACK, LINEAR_MOE_STACK = "linear_layers", "linear_moe_layers"
# Gemma 4's global (full-attention) layers, whose heads differ from the sliding-window ones'
GLOBAL_STACK, GLOBAL_MOE_STACK = "global_layers", "global_moe_layers"
# Gemma 4 small's KV-sharing layers (no key/value projections), sliding-window or global
SHARED_STACK, GLOBAL_SHARED_STACK = "kv_shared_layers", "global_kv_shared_layers"
# DeepSeek sparse attention layers that reuse an earlier layer's key selection (GLM-5's index
# sharing; no indexer of their own), with a dense or an MoE FFN
DSA_SHARED_STACK, DSA_SHARED_MOE_STACK = "dsa_shared_layers", "dsa_shared_moe_layers"
# LFM2's gated short-convolution layers, with a dense or an MoE FFN
CONV_STACK, CONV_MOE_STACK = "conv_layers", "conv_moe_layers"
# DeepSeek-V4's compressed-attention layers (models/compressed.py): compressed sparse attention
# (overlapping windows and an indexer) and heavily compressed attention, dense or MoE FFN
CSA_STACK, CSA_MOE_STACK = "csa_layers", "csa_moe_layers"
HCA_STACK, HCA_MOE_STACK = "hca_layers", "hca_moe_layers"
# Hybrid models (ModelConfig.hybrid_layers, Megatron's hybrid_layer_pattern): a layer is one
# sublayer, a token mixer or an FFN, each with its own pre-norm and residual add
MAMBA_STACK, ATTENTION_STACK, GDN_STACK = "mamba_layers", "attention_layers", "gdn_layers"
MLP_STACK, MOE_MLP_STACK = "mlp_layers", "moe_mlp_layers"
HYBRID_STACKS = {"M": MAMBA_STACK, "*": ATTENTION_STACK, "G": GDN_STACK, "-": MLP_STACK,
                 "E": MOE_MLP_STACK}
STACKS = (DENSE_STACK, MOE_STACK, LINEAR_STACK, LINEAR_MOE_STACK, GLOBAL_STACK,
          GLOBAL_MOE_STACK, SHARED_STACK, GLOBAL_SHARED_STACK, CONV_STACK, CONV_MOE_STACK,
          DSA_SHARED_STACK, DSA_SHARED_MOE_STACK, CSA_STACK, CSA_MOE_STACK, HCA_STACK,
          HCA_MOE_STACK, *HYBRID_STACKS.values())
MOE_STACKS = (MOE_STACK, LINEAR_MOE_STACK, GLOBAL_MOE_STACK, CONV_MOE_STACK, MOE_MLP_STACK,
              DSA_SHARED_MOE_STACK, CSA_MOE_STACK, HCA_MOE_STACK)
CSA_STACKS = (CSA_STACK, CSA_MOE_STACK)
HCA_STACKS = (HCA_STACK, HCA_MOE_STACK)
DSA_SHARED_STACKS = (DSA_SHARED_STACK, DSA_SHARED_MOE_STACK)
CONV_STACKS = (CONV_STACK, CONV_MOE_STACK)
LINEAR_STACKS = (LINEAR_STACK, LINEAR_MOE_STACK, GDN_STACK)
GLOBAL_STACKS = (GLOBAL_STACK, GLOBAL_MOE_STACK, GLOBAL_SHARED_STACK)
KV_SHARED_STACKS = (SHARED_STACK, GLOBAL_SHARED_STACK)
MIXER_ONLY_STACKS = (MAMBA_STACK, ATTENTION_STACK, GDN_STACK)   # no FFN half
FFN_ONLY_STACKS = (MLP_STACK, MOE_MLP_STACK)                     # no token mixer


def moe_pattern(moe, num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE for ``moe`` (a ``MoEConfig`` or None) (Megatron: int N -> layer i
    is MoE when i % N == 0; a 0/1 tuple names each layer)."""
    if moe is None:
        return (False,) * num_layers
    return freq_pattern(moe.layer_freq, num_layers)


def freq_pattern(freq, num_layers: int) -> tuple[bool, ...]:
    """Which of ``num_layers`` layers are MoE for a parsed ``moe_layer_freq``."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq {freq} must be positive")
        return tuple(i % freq == 0 for i in range(num_layers))
    if len(freq) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(v) for v in freq)


def window_pattern(freq, num_layers: int) -> tuple[bool, ...]:
    """Which layers keep the sliding window for a parsed window_attn_skip_freq (Megatron: int N
    makes every N-th layer attend fully, the rest windowed; a 0/1 tuple marks each layer, 1 =
    windowed)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"window_attn_skip_freq = {freq}: give a positive N (every Nth "
                             "layer attends fully) or a 0/1 list per layer")
        return tuple((i + 1) % freq != 0 for i in range(num_layers))
    if len(freq) != num_layers:
        raise ValueError(f"window_attn_skip_freq has {len(freq)} entries for {num_layers} "
                         "layers (num_layers)")
    return tuple(bool(v) for v in freq)


def linear_pattern(freq, num_layers: int) -> tuple[bool, ...]:
    """Which layers are Gated DeltaNet (linear attention) for a parsed linear_attention_freq
    (Megatron: int N makes every N-th layer softmax attention, the rest linear; a 0/1 tuple
    marks each layer, 1 = linear)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"linear_attention_freq {freq} must be positive")
        return tuple((i + 1) % freq != 0 for i in range(num_layers))
    if len(freq) != num_layers:
        raise ValueError(f"linear_attention_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(v) for v in freq)


def stack_kinds(moe: tuple[bool, ...], linear: tuple[bool, ...] | None,
                wide: tuple[bool, ...] | None = None,
                conv: tuple[bool, ...] | None = None) -> tuple[str, ...]:
    """The stack of each layer from which layers are MoE, which are linear attention, which
    are global layers of their own head shape (``wide``) and which gated short convolutions
    (``conv``)."""
    linear = linear or (False,) * len(moe)
    wide = wide or (False,) * len(moe)
    conv = conv or (False,) * len(moe)
    table = {(False, False, False): DENSE_STACK, (True, False, False): MOE_STACK,
             (False, True, False): LINEAR_STACK, (True, True, False): LINEAR_MOE_STACK,
             (False, False, True): GLOBAL_STACK, (True, False, True): GLOBAL_MOE_STACK}
    return tuple((CONV_MOE_STACK if m else CONV_STACK) if c else table[(bool(m), bool(lin),
                                                                         bool(g))]
                 for m, lin, g, c in zip(moe, linear, wide, conv))


def layer_kinds(cfg) -> tuple[str, ...]:
    """The stack each layer's parameters live in: 'layers' (dense), 'moe_layers', and for
    Gated DeltaNet layers 'linear_layers' / 'linear_moe_layers', for Gemma 4's global layers
    'global_layers' / 'global_moe_layers', for Gemma 4 small's KV-sharing layers
    'kv_shared_layers' / 'global_kv_shared_layers', for DeepSeek sparse attention layers that
    reuse an earlier layer's selection 'dsa_shared_layers' / 'dsa_shared_moe_layers', for
    DeepSeek-V4's compressing layers 'csa_layers' / 'hca_layers' (and their MoE stacks); a hybrid
    model's by its symbols (HYBRID_STACKS)."""
    pattern = getattr(cfg, "hybrid_layers", None)
    if pattern is not None:
        return tuple(HYBRID_STACKS[c] for c in pattern)
    kinds = stack_kinds(moe_pattern(getattr(cfg, "moe", None), cfg.num_layers),
                        getattr(cfg, "linear_attention_layers", None),
                        getattr(cfg, "global_layers", None),
                        getattr(cfg, "short_conv_layers", None))
    ratios = getattr(cfg, "compress_ratios", None)
    if ratios:   # DeepSeek-V4: the layers that compress, sparse (CSA) or heavily (HCA)
        sparse = cfg.compress_sparse_ratio
        kinds = tuple(k if not r else (CSA_MOE_STACK if k == MOE_STACK else CSA_STACK)
                      if r == sparse else (HCA_MOE_STACK if k == MOE_STACK else HCA_STACK)
                      for k, r in zip(kinds, ratios))
    dsa_shared = getattr(cfg, "dsa_shared_layers", None)
    if dsa_shared:   # DeepSeek sparse attention's index sharing: layers without an indexer
        kinds = tuple((DSA_SHARED_MOE_STACK if k == MOE_STACK else DSA_SHARED_STACK) if on else k
                      for k, on in zip(kinds, dsa_shared))
    shared = getattr(cfg, "kv_shared_layers", 0)
    first = len(kinds) - shared
    return kinds[:first] + tuple(GLOBAL_SHARED_STACK if k == GLOBAL_STACK else SHARED_STACK
                                 for k in kinds[first:])


def mtp_layer_kinds(cfg) -> tuple[str, ...]:
    """The stacks of the sublayers of one multi-token-prediction depth: a hybrid model's MTP
    pattern (``mtp_hybrid_layers``), else one layer of the last layer's kind."""
    pattern = getattr(cfg, "mtp_hybrid_layers", None)
    if pattern:
        return tuple(HYBRID_STACKS[c] for c in pattern)
    last = layer_kinds(cfg)[-1]
    mixer = getattr(cfg, "mtp_mixer", None)
    if mixer is None:
        return (last,)
    moe = last in MOE_STACKS   # Kimi K3: the chosen mixer with the last layer's FFN
    if mixer == "linear":
        return (LINEAR_MOE_STACK if moe else LINEAR_STACK,)
    return (MOE_STACK if moe else DENSE_STACK,)


def mtp_layer_count(cfg) -> int:
    """The layers (sublayers of a hybrid model) of all multi-token-prediction depths."""
    return getattr(cfg, "mtp_num_layers", 0) * len(mtp_layer_kinds(cfg))


def layer_slots(cfg) -> tuple[tuple[str, int], ...]:
    """(stack, index in that stack) of each layer."""
    seen = {k: 0 for k in STACKS}
    out = []
    for kind in layer_kinds(cfg):
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return tuple(out)
