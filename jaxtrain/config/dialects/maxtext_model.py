"""MaxText's model-architecture keys: the cross-key rules behind their aliases.

Most MaxText model keys are aliases of Megatron knobs (``base_emb_dim`` is ``hidden_size``,
``head_dim`` is ``kv_channels`` ...; see config/areas/model.py). What an alias cannot say is
done here, before the shape rules run: ``global_parameter_scale`` grows the base sizes, a
``decoder_block`` fixes the norm and position encoding of its family, ``mlp_activations`` and
the Megatron activation switches must not contradict each other, and a few MaxText values
(``num_experts: 1``, tied logits divided by sqrt(emb_dim)) mean something of their own.
"""
from __future__ import annotations

import math

# MaxText block -> the Megatron knob values the block implies (pre-norm RMSNorm, RoPE, no biases).
_BLOCK_SETTINGS = {
    block: {"normalization": "RMSNorm", "position_embedding_type": "rope",
            "add_bias_linear": False, "add_qkv_bias": False}
    for block in ("llama2", "mistral", "mixtral")
}
_MOE_BLOCKS = ("mixtral",)
_MEGATRON_ACTIVATIONS = ("swiglu", "quick_geglu", "openai_gelu", "squared_relu")
# MaxText activation names (flax.linen functions) -> jaxtrain activation. flax's gelu is the
# tanh approximation.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu_tanh", "relu": "relu"}
# Scaled size knobs: (canonical key, which of MaxText's four scales applies).
_SCALED = (("hidden_size", 0), ("num_attention_heads", 1), ("num_query_groups", 1),
           ("ffn_hidden_size", 2), ("moe_ffn_hidden_size", 2), ("num_layers", 3))


def individual_scales(scale: int) -> tuple[int, int, int, int]:
    """log2 multipliers (width, heads, MLP width, layers) for a power-of-two global scale:
    every factor of 8 doubles all four; the rest goes to heads and MLP width first, then width."""
    log2 = int(math.log2(scale))
    base, rem = divmod(log2, 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def mlp_from_activations(acts) -> tuple[str, bool]:
    """(activation, gated) for MaxText's mlp_activations; ValueError names what is unsupported.

    MaxText multiplies one projection per entry; 'linear' is the identity. So [act, linear]
    (either order) is a gated MLP with act on the gate, [act] a plain MLP."""
    acts = list(acts)
    known = [a for a in acts if a != "linear"]
    if len(acts) not in (1, 2) or len(known) != 1 or known[0] not in _ACTIVATIONS:
        raise ValueError(
            f"mlp_activations {acts!r} is not supported: jaxtrain builds [act] (plain MLP) or "
            f"[act, 'linear'] (gated MLP) with act one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[known[0]], len(acts) == 2


def maxtext_model(c) -> None:
    """MaxText model keys that span several knobs (runs before the shape rules)."""
    _scale(c)
    _llama31_rope(c)
    _decoder_block(c)
    _activations(c)
    if c.dialect == "maxtext" and c.values.get("num_experts") is not None \
            and c.values["num_experts"] <= 1:
        c.set("num_experts", None)          # MaxText: one expert means a dense MLP
    if c.dialect == "maxtext" and c.get("rope_type") == "yarn":
        c.error("rope_type yarn in a MaxText file: MaxText's YaRN keys (rope_factor, beta_fast, "
                "beta_slow, rope_interleave, ...) are not mapped yet; write YaRN with Megatron's "
                "knobs (rotary_scaling_factor, mscale, ...) in a Megatron file")
    if c.get("enable_dropout", True) is False:
        for key in ("hidden_dropout", "attention_dropout"):
            if c.get(key):
                c.set(key, 0.0)
    tied = c.values.get("untie_embeddings_and_output_weights") is False
    if tied and c.get("normalize_embedding_logits", True) and (
            c.dialect == "maxtext" or c.explicit("normalize_embedding_logits")):
        c.error("logits_via_embedding: true with normalize_embedding_logits: true (MaxText's "
                "default) divides the tied logits by sqrt(emb_dim), which jaxtrain's output head "
                "does not do; set normalize_embedding_logits: false for plain tied logits")
    if c.get("multi_latent_attention") and c.get("group_query_attention") and \
            not c.explicit("group_query_attention"):
        c.set("group_query_attention", False)   # MaxText's default GQA does not apply to MLA


def _llama31_rope(c) -> None:
    """MaxText applies Llama-3.1 RoPE scaling to every model_name starting with llama3.1,
    whatever rope_type says (its attention layer checks the name)."""
    name = c.get("model_name") or ""
    if c.dialect == "maxtext" and str(name).startswith("llama3.1") and \
            c.get("rope_type") in (None, "rope"):
        c.set("rope_type", "llama3.1")


def _scale(c) -> None:
    scale = c.get("global_parameter_scale", 1)
    if scale == 1:
        return
    if scale <= 0 or scale & (scale - 1):
        c.error(f"global_parameter_scale must be a power of two (MaxText's rule), got {scale}; "
                f"for other sizes set base_emb_dim, base_num_query_heads, base_num_kv_heads, "
                f"base_mlp_dim and base_num_decoder_layers")
        return
    factors = individual_scales(scale)
    for key, which in _SCALED:
        value = c.values.get(key)
        if value is not None and value > 0 and factors[which]:
            c.set(key, value * 2 ** factors[which])
    c.set("global_parameter_scale", 1)   # applied: the sizes above are final (a dump reloads)


def _decoder_block(c) -> None:
    block = c.get("decoder_block")
    if block is None or block not in _BLOCK_SETTINGS:
        return   # rejected blocks are reported by the status check
    for key, wanted in _BLOCK_SETTINGS[block].items():
        if c.values.get(key) == wanted:
            continue
        if c.explicit(key):
            c.error(f"decoder_block {block} is a pre-norm RMSNorm + RoPE block without biases, "
                    f"but {c.where(key)} asks otherwise; drop {key} or the decoder_block")
        else:
            c.set(key, wanted)
    experts = c.values.get("num_experts")
    if block not in _MOE_BLOCKS and experts is not None and experts > 1:
        c.error(f"num_experts = {experts} with decoder_block {block}: MaxText's {block} block has "
                f"no MoE layer (it ignores num_experts); use decoder_block mixtral for an MoE model")


def _activations(c) -> None:
    acts = c.values.get("mlp_activations")
    flags = [k for k in _MEGATRON_ACTIVATIONS if c.explicit(k)]
    if acts is None:
        return
    try:
        chosen = mlp_from_activations(acts)
    except ValueError as e:
        c.error(str(e))
        return
    if flags:
        from jaxtrain.models.config import _megatron_activation
        try:
            same = _megatron_activation(c.values.get) == chosen
        except ValueError:
            return   # exclusive Megatron switches: reported where the model is built
        if same:
            return
        if c.explicit("mlp_activations"):
            c.error(f"mlp_activations and {', '.join(flags)} both choose the MLP activation: "
                    f"{c.where('mlp_activations')}, {', '.join(c.where(k) for k in flags)}; "
                    f"keep one")
        else:
            c.set("mlp_activations", None)   # MaxText's default yields to an explicit switch
