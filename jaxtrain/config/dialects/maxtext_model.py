"""MaxText's model-architecture keys: the cross-key rules behind their aliases.

Most MaxText model keys are aliases of Megatron knobs (``base_emb_dim`` is ``hidden_size``,
``head_dim`` is ``kv_channels`` ...; see config/areas/model.py). What an alias cannot say is
done here, before the shape rules run: ``global_parameter_scale`` grows the base sizes, a
``decoder_block`` fixes its family's norms, biases, positions, attention and MoE router (a value
the block implies replaces a default; an explicit different value is an error), MaxText's YaRN
keys become jaxtrain's YaRN, ``mlp_activations`` becomes the Megatron activation switches where
one names the same MLP (and must not contradict an explicit one), and a few MaxText values
(``num_experts: 1``, tied logits divided by sqrt(emb_dim)) mean something of their own. Where
MaxText's block computes something jaxtrain's model cannot, the configuration is refused by
naming the key and the reason.

What each block is (MaxText's models/*.py, layers/attentions.py, attention_mla.py, moe.py):

- llama2, mistral, mixtral: pre-norm RMSNorm, RoPE on the two halves (interleaved pairs for
  llama3.1 scaling), no biases, global attention; mixtral: every layer MoE, softmax over the
  chosen experts' logits, experts as wide as base_mlp_dim.
- qwen2: as llama2 with q/k/v biases (attention_bias; no output bias) and optional q/k norms.
- qwen3 / qwen3_moe: as llama2 with per-head q/k RMSNorms (use_qk_norm); qwen3_moe: every layer
  MoE, experts base_moe_mlp_dim wide.
- deepseek: multi-latent attention (RMSNorms on the q/kv latents, YaRN on interleaved pairs,
  softmax scale times mscale^2), first_num_dense_layers dense layers then MoE layers with
  shared experts; routing by routed_score_func, scaled by routed_scaling_factor, with
  group-limited routing and a selection-only bias for model names deepseek3*/deepseek4*.
- gpt_oss: every layer MoE with GPT-OSS's clamped GLU, biases on every projection and the
  router, a sink logit per head, and a sliding window on every other layer.
- gpt3: pre-norm LayerNorm with zero-centred scales and biases, learned positions
  (trainable_position_size), biases on every projection, multi-head attention.
- olmo3: RMSNorms on the attention and MLP outputs only, q/k norms (across heads for olmo3*
  model names), three sliding-window layers to one global, one (YaRN) RoPE for all layers.
- qwen3_next, qwen3_5: Gated DeltaNet layers (gdn_* sizes) with full attention every
  inhomogeneous_layer_cycle_interval layers (sigmoid output gate, q/k norms, RoPE on
  partial_rotary_factor of each head), RMSNorms scaling by 1 + w, every layer MoE with a
  softmax router and one gated shared expert as wide as the routed ones; qwen3_5's
  multimodal RoPE (use_mrope) is plain RoPE on text, where all three positions are equal.
- llama4: pre-norm RMSNorm, Llama-3.1 RoPE on interleaved pairs except every
  nope_layer_interval-th layer (NoPE, with temperature_tuning's query scale), chunked attention
  (chunk_attn_window_size) on the RoPE layers, L2 q/k norms there (use_qk_norm); every
  interleave_moe_layer_step-th layer MoE: top-1 of the logits, its sigmoid scaling the token
  before the expert, plus shared_experts always-on experts.
- gemma, gemma2, gemma3: pre-norm RMSNorm (plain scales: MaxText's converted checkpoints hold
  1 + w), a tanh-GELU gated MLP, tied logits divided by sqrt(emb_dim) (the embedding scale is in
  the weights); gemma2: local/global layer pairs, sandwich norms, soft-caps; gemma3: q/k norms,
  five local layers per global one, a local RoPE base, a query scale by model name.
"""
from __future__ import annotations

import math

from jaxtrain.config.activations import (SWITCHES, megatron_activation, mlp_from_activations,
                                         switches_for)
from jaxtrain.config.areas.maxtext_model import BUILT_BLOCKS, MOE_BLOCKS
from jaxtrain.config.dialects.maxtext import pinned_base

# Scaled size knobs: (canonical key, which of MaxText's four scales applies).
_SCALED = (("hidden_size", 0), ("num_attention_heads", 1), ("num_query_groups", 1),
           ("ffn_hidden_size", 2), ("moe_ffn_hidden_size", 2), ("num_layers", 3))
_QWEN = ("qwen2", "qwen3", "qwen3_moe", "olmo3", "qwen3_custom_moe")
_LLAMA = ("llama2", "mistral", "mixtral")
_HYBRID = ("qwen3_next", "qwen3_5")
_LLAMA4_KEYS = ("nope_layer_interval", "interleave_moe_layer_step", "temperature_tuning",
                "chunk_attn_window_size")
_GEMMA4_KEYS = ("global_head_dim", "global_num_kv_heads", "v_norm_with_scale",
                "global_rope_max_timescale", "global_rope_proportion", "local_rope_proportion")
_GEMMA4 = ("gemma4", "gemma4_small")
_SMALL_KEYS = ("hidden_size_per_layer_input", "vocab_size_per_layer_input",
               "num_kv_shared_layers", "use_double_wide_mlp")
_RMS = "a pre-norm RMSNorm + RoPE block"
# MaxText's deepseek4 keys -> DeepSeek-V4's knobs (Primus's names, what from_knobs reads)
_V4_KNOBS = {"compressed_rope_max_timescale": "compress_rope_theta",
             "indexer_n_heads": "index_n_heads", "indexer_head_dim": "index_head_dim",
             "indexer_topk": "index_topk", "first_num_hash_layers": "num_hash_layers",
             "mhc_expansion_rate": "hc_mult", "sinkhorn_iterations": "hc_sinkhorn_iters",
             "sliding_window_size": "attn_sliding_window"}
_V4_KEYS = ("compressed_rope_max_timescale", "first_num_hash_layers", "compress_ratios",
            "o_groups", "o_lora_rank")
_ABOUT = {
    **{b: f"{_RMS} without biases" for b in _LLAMA},
    "qwen2": f"{_RMS} with q/k/v biases as attention_bias says and q/k norms as use_qk_norm says",
    "qwen3": f"{_RMS} without biases, with q/k norms as use_qk_norm says",
    "qwen3_moe": f"{_RMS} without biases, with q/k norms as use_qk_norm says",
    "default": f"{_RMS} without biases whose attention and MLP read the same normed input in "
               "parallel, their sum added once",
    "qwen3_custom_moe": f"{_RMS} without biases, with q/k norms as use_qk_norm says, whose "
                        "attention projects to attention_output_dim and feeds, normed, the MoE "
                        "layer at that width, projected up to emb_dim (one residual add)",
    "deepseek": "a pre-norm RMSNorm block of multi-latent attention (RMSNorms on the q/kv "
                "latents) without biases",
    "gpt_oss": f"{_RMS} with biases on every projection as attention_bias says",
    "gpt3": "a pre-norm LayerNorm block (zero-centred scales, biases) with learned positions and "
            "biases on every projection",
    "gemma": f"{_RMS} without biases (its embedding scale lives in the weights)",
    "gemma2": f"{_RMS} without biases, local and global layers in pairs, sandwich norms as "
              "use_post_attn_norm / use_post_ffw_norm say",
    "gemma3": f"{_RMS} without biases, with q/k norms, five local layers to one global, "
              "sandwich norms as use_post_attn_norm / use_post_ffw_norm say",
    "olmo3": "a block that normalises only the outputs of attention and MLP (RMSNorm), with q/k "
             "norms as use_qk_norm says (across all heads for model names olmo3*) and three "
             "local layers to one global",
    "envy": f"{_RMS} without biases, with q/k norms as use_qk_norm says, an MoE layer every "
            "interleave_moe_layer_step layers (softmax router) and a norm after the MLP as "
            "use_post_ffw_norm says",
    "deepseek4": "DeepSeek-V4's block (a sliding window over one shared key=value head with "
                 "sinks, compressed entries per compress_ratios, grouped output projection, "
                 "mhc_expansion_rate hyper-connections with a learned head, MoE layers of "
                 "sqrtsoftplus routing, the first first_num_hash_layers hash-routed)",
    "gemma4": f"{_RMS} without biases, with q/k norms and a value norm, attention scale 1, "
              "five local layers to one global with the global_* head shape, keys as values "
              "(share_kv_projections) and proportional RoPE, sandwich norms, layer scalars, "
              "and MoE layers of a dense MLP beside the experts, each with its own norms",
    "gemma4_small": f"{_RMS} without biases, with q/k norms and a value norm, attention scale "
                    "1, four (gemma4-e2b) or five local layers to one global with the global_* "
                    "head shape and proportional RoPE, sandwich norms, layer scalars, per-layer "
                    "inputs and the last num_kv_shared_layers layers sharing earlier layers' "
                    "keys and values",
    "llama4": f"{_RMS} without biases, NoPE layers every nope_layer_interval, chunked "
              "attention on the RoPE layers, MoE layers every interleave_moe_layer_step with a "
              "sigmoid top-1 router scaling the expert input and shared experts",
    **{b: "a hybrid of Gated DeltaNet layers and gated full attention (RMSNorms scaling by "
          "1 + w, q/k norms, partial RoPE) with MoE layers and a gated shared expert"
       for b in _HYBRID},
}
_GEMMA = ("gemma", "gemma2", "gemma3")
# MaxText's gemma3 query scale by model name (its get_query_pre_attn_scalar): head_dim for 4b
# and 12b, emb_dim / heads for 27b; other names are refused, as MaxText raises for them.
_GEMMA3_QUERY_SCALE = {"gemma3-4b": "head_dim", "gemma3-12b": "head_dim", "gemma3-27b": "width"}
# MaxText keys a block does not read -> the blocks that do (a value away from the default in
# another block is refused: MaxText would ignore it, jaxtrain cannot honour it there).
_READ_BY = {
    "use_qk_norm": _QWEN + ("llama4", "envy"),
    **{k: ("llama4",) for k in _LLAMA4_KEYS},
    "interleave_moe_layer_step": ("llama4", "envy"),
    "mlp_activations_limit": ("gpt_oss", "deepseek4"),
    "sliding_window_size": ("gpt_oss", "gemma2", "gemma3", "olmo3", "deepseek4") + _GEMMA4,
    **{k: ("deepseek4",) for k in _V4_KEYS},
    "use_post_attn_norm": ("gemma2", "gemma3") + _GEMMA4,
    "use_post_ffw_norm": ("gemma2", "gemma3", "envy") + _GEMMA4,
    "local_rope_max_timescale": ("gemma3",) + _GEMMA4,
    **{k: _GEMMA4 for k in _GEMMA4_KEYS},
    "share_kv_projections": ("gemma4",),
    **{k: ("gemma4_small",) for k in _SMALL_KEYS},
    "inhomogeneous_layer_cycle_interval": ("gpt_oss", "olmo3", "llama4", "envy") + _HYBRID,
    "partial_rotary_factor": _HYBRID,
    "gdn_chunk_size": _HYBRID,
    "use_qk_norm_in_gdn": _HYBRID,
    "first_num_dense_layers": ("deepseek",),
    "shared_experts": ("deepseek", "llama4", "gemma4", "deepseek4") + _HYBRID,
    "routed_scaling_factor": ("deepseek", "deepseek4"),
    "n_routing_groups": ("deepseek",),
    "topk_routing_group": ("deepseek",),
    "trainable_position_size": ("gpt3",),
    "attention_output_dim": ("qwen3_custom_moe",),
    "moe_expert_input_dim": ("qwen3_custom_moe",),
}


def individual_scales(scale: int) -> tuple[int, int, int, int]:
    """log2 multipliers (width, heads, MLP width, layers) for a power-of-two global scale:
    every factor of 8 doubles all four; the rest goes to heads and MLP width first, then width."""
    log2 = int(math.log2(scale))
    base, rem = divmod(log2, 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def maxtext_model(c) -> None:
    """MaxText model keys that span several knobs (runs before the shape rules)."""
    if c.dialect == "maxtext" and c.values.get("num_experts") is not None \
            and c.values["num_experts"] <= 1:
        c.set("num_experts", None)          # MaxText: one expert means a dense MLP
    _expert_width(c)
    _scale(c)
    _llama31_rope(c)
    _decoder_block(c)
    _yarn(c)
    _activations(c)
    if c.get("enable_dropout", True) is False:
        for key in ("hidden_dropout", "attention_dropout"):
            if c.get(key):
                c.set(key, 0.0)
    if c.get("multi_latent_attention") and c.get("group_query_attention") and \
            not c.explicit("group_query_attention"):
        c.set("group_query_attention", False)   # MaxText's default GQA does not apply to MLA


def _imply(c, key, wanted, because: str) -> None:
    """``key`` takes ``wanted``: a default yields, an explicit different value is an error."""
    if c.values.get(key) == wanted:
        return
    if c.explicit(key):
        c.error(f"{because}, so {key} = {wanted!r}, but {c.where(key)} asks otherwise; drop "
                f"{key} or change what implies it")
    else:
        c.set(key, wanted)


def _set(c, key) -> bool:
    """``key`` is written, to a value away from MaxText's default (base.yml)."""
    default = pinned_base()[1].get(key, c.defaults.get(key))
    value = c.values.get(key)
    return c.explicit(key) and value is not None and value != default


def _refuse(c, key, why: str) -> None:
    c.error(f"{c.where(key)}: {why}")


def _cycle_divides(c, layers, interval) -> None:
    """With scan_layers MaxText builds num_layers // interval blocks of the layer cycle: an
    interval that does not divide the layers leaves some out, which jaxtrain refuses."""
    if c.get("scan_layers", True) and layers and interval > 1 and layers % interval:
        _refuse(c, "inhomogeneous_layer_cycle_interval", f"with scan_layers MaxText builds "
                f"num_layers // interval blocks, which leaves out {layers % interval} of the "
                f"{layers} layers; choose an interval that divides num_layers")


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


def _expert_width(c) -> None:
    """base_moe_mlp_dim as the expert width of the blocks that read it, before the sizes are
    scaled; MaxText's own checks of the expert width."""
    block = c.get("decoder_block")
    if block not in MOE_BLOCKS or not c.values.get("num_experts"):
        return
    width, dense = c.get("base_moe_mlp_dim", -1), c.get("ffn_hidden_size")
    if c.dialect == "maxtext" and width <= 0:
        c.error(f"num_experts = {c.get('num_experts')} needs a positive base_moe_mlp_dim "
                f"(MaxText's rule), got {c.where('base_moe_mlp_dim')}")
        return
    fully_moe = (c.get("first_num_dense_layers", 0) == 0
                 and c.get("inhomogeneous_layer_cycle_interval", 1) == 1)
    if c.dialect == "maxtext" and fully_moe and block not in ("qwen3_moe", "qwen3_custom_moe",
                                                             "gemma4") and \
            dense != width:   # Gemma 4 keeps its dense MLP beside the experts
        c.error(f"a model of MoE layers only needs base_mlp_dim = base_moe_mlp_dim (MaxText's "
                f"rule): {c.where('ffn_hidden_size')}, {c.where('base_moe_mlp_dim')}")
    if block in ("qwen3_moe", "qwen3_custom_moe", "deepseek", "llama4", "gemma4",
                 "envy") + _HYBRID and width > 0:
        _imply(c, "moe_ffn_hidden_size", width, f"decoder_block {block} sizes its experts by "
               f"base_moe_mlp_dim = {width}")


def _mrope(c, block) -> None:
    """use_mrope: plain RoPE in the qwen3_5 block (the three positions of a text token are all
    its position, so every channel section rotates by it); refused elsewhere."""
    if not c.get("use_mrope"):
        return
    if block != "qwen3_5":
        _refuse(c, "use_mrope", "multi-dimensional RoPE belongs to multimodal models, outside "
                "jaxtrain, which trains text-only decoders (the qwen3_5 block takes it: on text "
                "it is plain RoPE)")
        return
    c.set("use_mrope", False)
    c.set("mrope_section", pinned_base()[1].get("mrope_section",
                                                c.defaults.get("mrope_section")))


def _decoder_block(c) -> None:
    block = c.get("decoder_block")
    if c.dialect == "maxtext":
        _mrope(c, block)
    if block not in BUILT_BLOCKS:
        return   # planned and rejected blocks are reported by the status check
    because = f"decoder_block {block} is {_ABOUT[block]}"
    for key, blocks in _READ_BY.items():
        if block not in blocks and _set(c, key):
            _refuse(c, key, f"MaxText's {block} block does not read {key} (only "
                            f"{', '.join(blocks)} do); drop it")
    mla = bool(c.get("multi_latent_attention"))
    if (block == "deepseek") != mla:
        c.error(f"decoder_block {block} with {c.where('multi_latent_attention')}: MaxText's "
                f"deepseek block is built of multi-latent attention (attention_type mla) and the "
                f"other blocks of ordinary attention")
        return
    settings = _norms_and_biases(c, block)
    for key, wanted in settings.items():
        _imply(c, key, wanted, because)
    if block == "gpt3":
        _gpt3(c, because)
    if block == "gpt_oss":
        _gpt_oss(c, because)
    if block in _GEMMA:
        _gemma(c, block, because)
    if block == "olmo3":
        _olmo3(c, because)
    if block in _HYBRID:
        _hybrid(c, block, because)
    if block == "llama4":
        _llama4(c, because)
    if block == "envy":
        _envy(c, because)
    if block in _GEMMA4:
        _gemma4(c, block, because)
    if block == "deepseek4":
        _deepseek4(c, because)
    if block == "qwen3_custom_moe":
        _qwen3_custom(c)
    if block == "default":
        _parallel_block(c, because)
    _experts(c, block, because)


def _parallel_block(c, because) -> None:
    """MaxText's default block: x + attention(norm(x)) + mlp(norm(x)), one norm (its
    dropout_rate, a mask shared over the sequence, is refused with every block)."""
    _imply(c, "parallel_residual", True, because)
    _imply(c, "parallel_residual_shared_norm", True, because)


def _qwen3_custom(c) -> None:
    """qwen3_custom_moe: MaxText's rules on its two widths (attention_output_dim, read by
    from_knobs, and moe_expert_input_dim, which must equal it)."""
    width, experts = c.get("attention_output_dim", -1), c.get("moe_expert_input_dim", -1)
    if width <= 0 or experts != width:
        c.error(f"decoder_block qwen3_custom_moe needs a positive "
                f"{c.where('attention_output_dim')} equal to "
                f"{c.where('moe_expert_input_dim')} (MaxText's rule)")


def _deepseek4(c, because) -> None:
    """MaxText's deepseek4 block onto DeepSeek-V4's knobs: model_type deepseek_v4, its indexer,
    window, hash layers and hyper-connections under Primus's names, sinks in every layer.
    from_knobs reads the rest as MaxText means it (mhc_expansion_rate stays set): the
    hyper-connection gates start at 0.01 (MaxText's mhc.py), mlp_activations_limit clamps the
    routed experts only, load_balance_loss_weight's probabilities are softmax(score + bias)."""
    if not c.get("compress_ratios"):
        _refuse(c, "compress_ratios", "decoder_block deepseek4 needs a compression ratio per "
                "layer (0 none, 4 compressed sparse attention, 128 heavily compressed)")
        return
    _imply(c, "model_type", "deepseek_v4", because)
    _imply(c, "attn_sink", True, because)
    for theirs, ours in _V4_KNOBS.items():
        c.set(ours, c.get(theirs))
    c.set("sliding_window_size", 0)   # read as attn_sliding_window


def _norms_and_biases(c, block) -> dict:
    attention_bias = bool(c.get("attention_bias", False))
    if attention_bias and block not in ("qwen2", "gpt_oss", "gpt3"):
        _refuse(c, "attention_bias", f"MaxText's {block} block has no attention biases (only "
                                     f"qwen2 and gpt_oss read attention_bias); drop it")
    qk_norm = bool(c.get("use_qk_norm", False)) and block in _QWEN + ("envy",)
    scaled = bool(c.get("qk_norm_with_scale", True))
    if block == "llama4":   # Llama 4's L2 norm (no scale), on the RoPE layers only
        l2 = bool(c.get("use_qk_norm", False))
        return dict(normalization="RMSNorm", apply_layernorm_1p=False,
                    position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False,
                    qk_layernorm=False, qk_l2_norm=l2, qk_norm_rope_layers_only=l2)
    if block == "gpt3":
        return dict(normalization="LayerNorm", apply_layernorm_1p=True, add_bias_linear=True,
                    add_qkv_bias=True, qk_layernorm=False, qk_l2_norm=False)
    if block in _HYBRID:
        return dict(normalization="RMSNorm", apply_layernorm_1p=True,
                    position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False,
                    qk_layernorm=True, qk_l2_norm=False)
    if block in _GEMMA + _GEMMA4:   # gemma3/4's q/k norms are built in (use_qk_norm unread)
        return dict(normalization="RMSNorm", apply_layernorm_1p=False,
                    position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False,
                    qk_layernorm=block != "gemma", qk_l2_norm=False)
    settings = dict(normalization="RMSNorm", apply_layernorm_1p=False,
                    position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False,
                    qk_layernorm=qk_norm and scaled, qk_l2_norm=qk_norm and not scaled)
    if block == "qwen2":
        settings["add_qkv_bias"] = attention_bias
    elif block == "gpt_oss":
        settings["add_bias_linear"] = settings["add_qkv_bias"] = attention_bias
    elif block == "deepseek":
        settings.update(qk_layernorm=True, qk_l2_norm=False)   # the q/kv latent norms
    return settings


def _gpt3(c, because) -> None:
    """Learned positions of trainable_position_size (none without), multi-head attention."""
    size = c.get("trainable_position_size", -1)
    _imply(c, "position_embedding_type", "learned_absolute" if size > 0 else "none", because)
    if size > 0:
        c.set("max_position_embeddings", size)   # MaxText's max_position_embeddings is YaRN's
    groups, heads = c.get("num_query_groups"), c.get("num_attention_heads")
    if c.get("group_query_attention") and groups not in (None, heads):
        _refuse(c, "num_query_groups", f"MaxText's gpt3 block is multi-head attention "
                                       f"(base_num_kv_heads = base_num_query_heads = {heads})")
    if c.get("use_sink_attention"):
        _refuse(c, "use_sink_attention", "MaxText's gpt3 attention has no sink logits")


def _gpt_oss(c, because) -> None:
    """Biases everywhere, the sliding-window layer pattern, the clamped GLU."""
    biases = {k: bool(c.get(k, False)) for k in ("attention_bias", "mlp_bias", "routed_bias")}
    if len(set(biases.values())) > 1:
        c.error(f"decoder_block gpt_oss with {', '.join(c.where(k) for k in biases)}: jaxtrain "
                f"gives the attention, the experts and the router biases together "
                f"(add_bias_linear), as GPT-OSS has them; set all three alike")
    interval = c.get("inhomogeneous_layer_cycle_interval", 1)
    layers, scan = c.get("num_layers"), c.get("scan_layers", True)
    _cycle_divides(c, layers, interval)
    window = c.get("sliding_window_size") or 0
    if window:
        if not c.get("use_sink_attention"):
            _refuse(c, "sliding_window_size", "jaxtrain builds gpt_oss's alternating window "
                    "with its sink attention (use_sink_attention / attention_sink: true), as "
                    "GPT-OSS has it; set attention_sink: true")
        elif window < 2:
            _refuse(c, "sliding_window_size", "a window of one token (the token itself) is not "
                                              "built; use 2 or more")
        elif scan and interval % 2 and interval != 1:
            _refuse(c, "inhomogeneous_layer_cycle_interval", f"with scan_layers MaxText windows "
                    f"layer i when (i mod {interval}) is even, a pattern jaxtrain does not "
                    f"build; use an even interval (GPT-OSS: 2)")
        else:
            # MaxText windows W keys (the token and W - 1 before it); Primus's sink window W'
            # is W' + 1 keys. Scanned with interval 1, every layer is the windowed one.
            _imply(c, "sink_sliding_window", window - 1, because + " and a window of "
                   f"{window} tokens (sliding_window_size)")
            _imply(c, "sink_window_even_layers_only", not (scan and interval == 1), because)
            c.set("sliding_window_size", None)
    acts = c.values.get("mlp_activations")
    limit = c.get("mlp_activations_limit", -1.0)
    if c.values.get("num_experts"):
        if acts is not None and list(acts) != ["sigmoid", "linear"]:
            _refuse(c, "mlp_activations", "gpt_oss experts compute w0 * act(1.702 w0) * (w1 + 1) "
                    "with act = mlp_activations[0]; jaxtrain builds it with sigmoid (GPT-OSS's "
                    "clamped GLU): use [sigmoid, linear]")
        elif limit <= 0:
            _refuse(c, "mlp_activations_limit", "gpt_oss clamps its GLU at this limit; jaxtrain "
                    "builds the clamp with a positive limit (GPT-OSS: 7.0)")
        else:
            c.set("mlp_activations", None)
            for key, wanted in (("swiglu", False), ("quick_geglu", True),
                                ("glu_linear_offset", 1.0),
                                ("activation_func_clamp_value", float(limit))):
                _imply(c, key, wanted, because + ", its experts GPT-OSS's clamped GLU")


def _gemma(c, block, because) -> None:
    """MaxText's Gemma blocks: gemma2 counts a local and a global layer as one decoder layer
    (num_decoder_layers is half the depth), gemma3 repeats five local layers and a global one;
    the local layers' window is sliding_window_size (none when 0), their RoPE base
    local_rope_max_timescale (gemma3, when positive, without rope_linear_scaling_factor)."""
    if block != "gemma":
        _imply(c, "post_attention_norm", bool(c.get("use_post_attn_norm")), because)
        _imply(c, "post_mlp_norm", bool(c.get("use_post_ffw_norm")), because)
    if block == "gemma2" and c.get("num_layers"):
        c.set("num_layers", 2 * c.get("num_layers"))
    window = c.get("sliding_window_size") or 0
    if block != "gemma" and window > 0:
        c.set("window_size", [window - 1, 0])
        c.set("window_attn_skip_freq", 2 if block == "gemma2" else 6)
        c.set("sliding_window_size", None)
    if block != "gemma3":
        return
    local = c.get("local_rope_max_timescale", -1)
    if local and local > 0:
        _imply(c, "local_rotary_base", float(local), because)
    name = c.get("model_name") or ""
    scale = _GEMMA3_QUERY_SCALE.get(name)
    if scale is None:
        c.error(f"decoder_block gemma3 with model_name = {name!r}: MaxText's gemma3 block takes "
                f"its query scale from the model name and knows "
                f"{', '.join(_GEMMA3_QUERY_SCALE)} only; use one of them")
    elif scale == "width":
        _imply(c, "query_pre_attn_scalar",
               float(c.get("hidden_size") // c.get("num_attention_heads")), because)


def _gemma4(c, block, because) -> None:
    """MaxText's gemma4 block: layer i is global when 6 divides i + 1 (gemma4_small with
    model_name gemma4-e2b: 5), the others slide over sliding_window_size keys; the global
    layers take global_head_dim / global_num_kv_heads (0: the local values), keys as values
    with share_kv_projections (gemma4 only), RoPE of base
    global_rope_max_timescale (else rope_max_timescale) on global_rope_proportion of their
    channel pairs (proportional for gemma4* model names, as MaxText's Gemma4 RoPE); the local
    layers plain RoPE of base local_rope_max_timescale. Values are RMS-normed (with a scale as
    v_norm_with_scale says), the query scale is 1 and each layer's output is multiplied by its
    layer scalar (jaxtrain keeps it fixed, as transformers does; MaxText trains it).
    gemma4_small adds per-layer inputs when hidden_size_per_layer_input and
    vocab_size_per_layer_input are both positive (with only the width, MaxText builds the
    gates and never feeds them: refused) and KV sharing (num_kv_shared_layers,
    use_double_wide_mlp)."""
    _imply(c, "post_attention_norm", bool(c.get("use_post_attn_norm")), because)
    _imply(c, "post_mlp_norm", bool(c.get("use_post_ffw_norm")), because)
    window = c.get("sliding_window_size") or 0
    if window <= 0:
        _refuse(c, "sliding_window_size", f"MaxText's {block} block slides its local layers "
                "over this many keys; give a positive window")
        return
    c.set("window_size", [window - 1, 0])
    name = str(c.get("model_name") or "")
    c.set("window_attn_skip_freq", 5 if block == "gemma4_small" and name == "gemma4-e2b" else 6)
    if (block == "gemma4_small" and c.get("hidden_size_per_layer_input", 0) > 0
            and c.get("vocab_size_per_layer_input", 0) <= 0):
        _refuse(c, "vocab_size_per_layer_input", "MaxText's gemma4_small block feeds the "
                "per-layer gates only with a positive per-layer vocabulary (with 0 it builds "
                "them and skips them); give the vocabulary, or hidden_size_per_layer_input 0")
        return
    c.set("sliding_window_size", None)
    if c.get("local_rope_proportion", 1.0) != 1.0:
        _refuse(c, "local_rope_proportion", "jaxtrain's gemma4 local layers rotate whole heads "
                "(1.0), as every Gemma 4 model does")
        return
    share = c.get("global_rope_proportion", 0.25)
    if share < 1.0 and not name.startswith("gemma4"):
        _refuse(c, "global_rope_proportion", f"MaxText's gemma4 block rotates {share} of the "
                f"global channels the Gemma 4 way (proportional) only for gemma4* model names, "
                f"and model_name is {name!r}; name the gemma4 model or use 1.0")
        return
    local = c.get("local_rope_max_timescale", -1)
    global_ = c.get("global_rope_max_timescale", -1)
    if global_ and global_ > 0:
        c.set("rotary_base", float(global_))
    if local and local > 0:
        _imply(c, "local_rotary_base", float(local), because)
    width, groups = c.get("global_head_dim", 0), c.get("global_num_kv_heads", 0)
    _imply(c, "global_kv_channels", int(width) if width and width > 0 else None, because)
    _imply(c, "global_num_query_groups", int(groups) if groups and groups > 0 else None,
           because)
    for key, wanted in (("attention_k_eq_v", bool(c.get("share_kv_projections", False))),
                        ("global_rotary_percent", float(share) if share < 1.0 else None),
                        ("v_norm", "scaled" if c.get("v_norm_with_scale", True) else "plain"),
                        ("query_pre_attn_scalar", 1.0), ("layer_scalar", True)):
        _imply(c, key, wanted, because)


def _gemma4_router(c) -> dict | None:
    """Gemma 4's MoE layer: the dense MLP (shared_experts × mlp_dim wide) beside the experts,
    each with its own norms; the router reads an unscaled RMS norm of the residual stream times
    a learned scale and emb_dim^-0.5, softmax over all experts, top-k (renormalised with
    norm_topk_prob), times a learned scale per expert."""
    if c.get("shared_experts", 0) != 1:
        _refuse(c, "shared_experts", "MaxText's gemma4 MoE layer runs one dense MLP of mlp_dim "
                "beside the experts; use 1")
        return None
    router = _softmax_router(c, "gemma4")
    if router is None:
        return None
    return {**router, "moe_router_pre_softmax": not c.get("norm_topk_prob", False),
            "moe_shared_expert_intermediate_size": c.get("ffn_hidden_size"),
            "moe_branch_norms": True, "moe_router_input_norm": True,
            "moe_per_expert_scale": True}


def _olmo3(c, because) -> None:
    """MaxText's olmo3 block: no input norms, RMSNorms on the attention and MLP outputs, q/k
    norms over all heads together for model names olmo3* (per head otherwise), a window of
    sliding_window_size on three layers of every four, one RoPE (with its YaRN) for all."""
    _imply(c, "pre_norm", False, because)
    _imply(c, "post_attention_norm", True, because)
    _imply(c, "post_mlp_norm", True, because)
    across = bool(c.get("qk_layernorm")) and str(c.get("model_name") or "").startswith("olmo3")
    _imply(c, "qk_norm_across_heads", across, because)
    layers, interval = c.get("num_layers"), c.get("inhomogeneous_layer_cycle_interval", 1)
    _cycle_divides(c, layers, interval)
    window = c.get("sliding_window_size") or 0
    if window > 0:
        c.set("window_size", [window - 1, 0])
        c.set("window_attn_skip_freq", 4)
        c.set("sliding_window_size", None)


def _hybrid(c, block, because) -> None:
    """MaxText's qwen3_next / qwen3_5 blocks: layer i is full attention when (i + 1) is a
    multiple of inhomogeneous_layer_cycle_interval, else Gated DeltaNet (gdn_* sizes); the full
    attention gates its output and rotates partial_rotary_factor of each head; every layer is
    MoE with one shared expert as wide as the routed ones behind a sigmoid gate."""
    interval = c.get("inhomogeneous_layer_cycle_interval", 1)
    layers = c.get("num_layers")
    if interval < 1:
        _refuse(c, "inhomogeneous_layer_cycle_interval", "must be positive (every this-many-th "
                "layer is full attention)")
        return
    _cycle_divides(c, layers, interval)
    if not c.values.get("num_experts"):
        c.error(f"decoder_block {block}: MaxText builds every layer of this block with MoE "
                f"(Qwen3NextSparseMoeBlock); set num_experts and base_moe_mlp_dim")
        return
    _imply(c, "experimental_attention_variant", "gdn", because)
    _imply(c, "linear_attention_freq", interval, because + " with full attention every "
           f"{interval} layers (inhomogeneous_layer_cycle_interval)")
    _imply(c, "attention_output_gate", True, because)
    _imply(c, "rotary_percent", float(c.get("partial_rotary_factor", 1.0)),
           because + " rotating partial_rotary_factor of each head")
    width = c.get("moe_ffn_hidden_size") or c.get("ffn_hidden_size")
    _imply(c, "moe_shared_expert_intermediate_size", width, because + ", its shared expert as "
           "wide as the routed ones")
    _imply(c, "moe_shared_expert_gate", True, because)


def _llama4(c, because) -> None:
    """MaxText's llama4 block: layer i is NoPE when nope_layer_interval divides i + 1 and MoE
    when interleave_moe_layer_step does. Scanned, MaxText repeats one cycle of
    inhomogeneous_layer_cycle_interval layers and places NoPE/MoE layers by their index in the
    cycle, the same pattern only when both intervals divide the cycle."""
    layers = c.get("num_layers")
    interval = c.get("inhomogeneous_layer_cycle_interval", 1)
    _cycle_divides(c, layers, interval)
    nope, step = c.get("nope_layer_interval", -1), c.get("interleave_moe_layer_step", 1)
    scan = c.get("scan_layers", True)
    for key, every in (("nope_layer_interval", nope), ("interleave_moe_layer_step", step)):
        if scan and every > 0 and interval % every:
            _refuse(c, key, f"with scan_layers MaxText places these layers by their index in "
                    f"the cycle of inhomogeneous_layer_cycle_interval = {interval} layers, which "
                    f"{every} does not divide; make the interval a multiple of it")
            return
    if not layers:
        return
    if nope > 0:
        _imply(c, "no_rope_freq", [int((i + 1) % nope == 0) for i in range(layers)],
               because + f" (nope_layer_interval {nope})")
    elif c.get("temperature_tuning"):
        c.warnings.append("temperature_tuning scales the queries of NoPE layers, and "
                          "nope_layer_interval gives none: it changes nothing")
    if c.values.get("num_experts") and step > 1:
        _imply(c, "moe_layer_freq", [int((i + 1) % step == 0) for i in range(layers)],
               because + f" (interleave_moe_layer_step {step})")


def _envy(c, because) -> None:
    """MaxText's envy block: layer i is MoE when interleave_moe_layer_step divides i + 1 (with
    scan_layers, by its index in the cycle of inhomogeneous_layer_cycle_interval layers, the
    same pattern only when the step divides the cycle); use_post_ffw_norm norms the MLP's
    output."""
    _imply(c, "post_mlp_norm", bool(c.get("use_post_ffw_norm")), because)
    layers = c.get("num_layers")
    interval = c.get("inhomogeneous_layer_cycle_interval", 1)
    _cycle_divides(c, layers, interval)
    step = c.get("interleave_moe_layer_step", 1)
    if c.get("scan_layers", True) and step > 0 and interval % step:
        _refuse(c, "interleave_moe_layer_step", f"with scan_layers MaxText places the MoE "
                f"layers by their index in the cycle of inhomogeneous_layer_cycle_interval = "
                f"{interval} layers, which {step} does not divide; make the interval a multiple "
                "of it")
        return
    if layers and c.values.get("num_experts") and step > 1:
        _imply(c, "moe_layer_freq", [int((i + 1) % step == 0) for i in range(layers)],
               because + f" (interleave_moe_layer_step {step})")


def _llama4_router(c) -> dict | None:
    """Llama 4's router: the top-1 logit's sigmoid, multiplied into the token before its
    expert (Megatron's moe_apply_probs_on_input), plus shared_experts always-on experts."""
    if c.get("moe_router_topk", 1) != 1:
        _refuse(c, "num_experts_per_tok", "MaxText's llama4 block scales each token by its one "
                "routing weight before the expert (it reshapes the weights to one per token); "
                "use 1")
        return None
    for key in ("routed_score_func", "routed_bias"):
        if _set(c, key):
            _refuse(c, key, "MaxText's llama4 router is a sigmoid of the top logit; drop it")
            return None
    if c.get("load_balance_loss_weight", 0.0) > 0:
        _refuse(c, "load_balance_loss_weight", "MaxText's llama4 balance loss takes a softmax "
                "of all logits while its router weighs by a sigmoid; jaxtrain's balance losses "
                "score with the router's own function (Megatron), so this loss is not built")
        return None
    shared = c.get("shared_experts", 0)
    width = c.get("moe_ffn_hidden_size") or c.get("ffn_hidden_size")
    return {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
            "moe_apply_probs_on_input": True, "moe_router_topk_scaling_factor": None,
            "moe_router_num_groups": None, "moe_router_group_topk": None,
            "moe_router_enable_expert_bias": False,
            "moe_shared_expert_intermediate_size": shared * width if shared > 0 else None}


def _experts(c, block, because) -> None:
    experts = c.values.get("num_experts")
    moe_only = ("load_balance_loss_weight", "routed_bias", "routed_bias_update_rate",
                "routed_score_func", "mlp_bias")
    if not experts:
        for key in moe_only:
            if _set(c, key):
                _refuse(c, key, f"a setting of MoE layers, and this model has none "
                                f"(num_experts {c.values.get('num_experts')})")
        return
    if block not in MOE_BLOCKS:
        c.error(f"num_experts = {experts} with decoder_block {block}: MaxText's {block} block "
                f"has no MoE layer (it ignores num_experts); use decoder_block "
                f"{', '.join(MOE_BLOCKS)} for an MoE model")
        return
    if c.get("mlp_bias") and block != "gpt_oss":
        _refuse(c, "mlp_bias", "jaxtrain's experts get biases only with biases on every "
                               "projection (add_bias_linear), as in gpt_oss")
    if block not in ("gpt_oss", "deepseek4") and c.get("mlp_activations_limit", -1.0) > 0:
        _refuse(c, "mlp_activations_limit", f"MaxText's {block} experts do not clamp (deepseek: "
                "DeepSeek V4's clamped SwiGLU, which jaxtrain does not build)")
    k = c.get("moe_router_topk", 1)
    router = (_deepseek_router(c, k) if block in ("deepseek", "deepseek4") else
              _llama4_router(c) if block == "llama4" else
              _gemma4_router(c) if block == "gemma4" else _softmax_router(c, block))
    if router is None:
        return
    first = c.get("first_num_dense_layers", 0)
    layers = c.get("num_layers")
    if block in ("deepseek", "deepseek4"):
        shared = c.get("shared_experts", 0)
        width = c.get("moe_ffn_hidden_size") or c.get("ffn_hidden_size")
        router["moe_shared_expert_intermediate_size"] = (
            shared * width if shared > 0 and width else None)
        if first > 0 and layers:
            if first >= layers:
                _refuse(c, "first_num_dense_layers", f"leaves no MoE layer of the {layers}")
                return
            router["moe_layer_freq"] = [0] * first + [1] * (layers - first)
    weight = c.get("load_balance_loss_weight", 0.0)
    if weight > 0:
        if block == "deepseek":
            _refuse(c, "load_balance_loss_weight", "the DeepSeek block's balance loss takes a "
                    "softmax of its routing scores, which jaxtrain's balancing losses do not")
        elif block == "deepseek4":   # the same loss on softmax(score + bias), per sequence
            router["moe_router_load_balancing_type"] = "seq_aux_loss"
            router["moe_aux_loss_coeff"] = weight * k / layers
        elif layers:   # MaxText averages the loss over its MoE layers
            pattern = c.values.get("moe_layer_freq")
            moe_layers = (sum(pattern) if isinstance(pattern, (list, tuple))
                          else layers - first)
            router["moe_router_load_balancing_type"] = "seq_aux_loss"
            router["moe_aux_loss_coeff"] = weight * k / moe_layers
    factor = c.get("capacity_factor", -1.0)
    if factor > 0 and c.get("sparse_matmul", True):
        c.warnings.append(f"capacity_factor {factor} drops nothing with sparse_matmul true (as in "
                          f"MaxText, whose grouped-matmul path is dropless); set sparse_matmul: "
                          f"false for per-sequence expert capacity")
    elif factor > 0:
        # MaxText drops tokens only on its dense (einsum) path: per sequence, in token order
        router.update(moe_expert_capacity_factor=float(factor), moe_capacity_per_sequence=True,
                      moe_token_drop_policy="position")
    for key, wanted in router.items():
        _imply(c, key, wanted, because + " with its MoE router")


def _softmax_router(c, block) -> dict | None:
    """mixtral, qwen3_moe, gpt_oss: top-k of the logits, softmax over the chosen ones (then
    norm_topk_prob, a no-op); gpt_oss's routed_bias is a learned logit bias."""
    if c.get("routed_score_func"):
        _refuse(c, "routed_score_func", f"MaxText's {block} block takes a softmax over the "
                "chosen experts' scores after this function, which jaxtrain's router does not "
                "build (the DeepSeek block uses it as the routing scores)")
        return None
    if c.get("routed_bias") and block != "gpt_oss":
        _refuse(c, "routed_bias", f"in MaxText's {block} block a learned bias on the router "
                "logits; jaxtrain's router has one only with biases on every projection "
                "(add_bias_linear), as in gpt_oss")
        return None
    if c.get("routed_bias_update_rate", 0.0) > 0:
        _refuse(c, "routed_bias_update_rate", "MaxText updates routing biases in the deepseek "
                "block only (its own rule)")
        return None
    return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
            "moe_router_group_topk": None, "moe_router_enable_expert_bias": False}


def _deepseek_router(c, k) -> dict | None:
    """DeepSeek routing as MaxText's moe.py does it. Scores = routed_score_func(logits) (+ the
    bias); model names deepseek3*/deepseek4* select on biased scores within the best groups and
    weight by the unbiased ones, other names (deepseek2, kimi) take the plain top-k of the
    (biased) scores, weight by them (moe_router_score_bias: the bias is learned) and ignore the
    groups. sigmoid/sqrtsoftplus weights are renormalised, all are multiplied by
    routed_scaling_factor."""
    name = str(c.get("model_name") or "")
    v3 = name.startswith(("deepseek3", "deepseek4"))
    score, bias = c.get("routed_score_func") or "", bool(c.get("routed_bias"))
    groups, group_topk = c.get("n_routing_groups", -1), c.get("topk_routing_group", -1)
    router: dict = {}
    if not score:
        _refuse(c, "routed_score_func", "with no score function MaxText's DeepSeek block weighs "
                "the experts by their raw router logits, which jaxtrain's router does not "
                "build; use softmax or sigmoid")
        return None
    if bias and score == "softmax":
        _refuse(c, "routed_bias", "with softmax scores MaxText adds the learned bias to the "
                "softmax probabilities that weigh the experts; jaxtrain adds a learned score "
                "bias to sigmoid or sqrtsoftplus scores only; set routed_bias: false or "
                "routed_score_func: sigmoid")
        return None
    if bias and not v3:   # the learned gate bias picks and weighs the experts
        if c.get("routed_bias_update_rate", 0.0) > 0:
            _refuse(c, "routed_bias_update_rate", f"with model_name {name!r} (not "
                    "deepseek3*/deepseek4*) MaxText both trains the routing bias and moves it "
                    "by this rate; jaxtrain builds one or the other: set it to 0 (the bias is "
                    "learned) or use a deepseek3* name (the aux-loss-free bias)")
            return None
        router["moe_router_score_bias"] = True
        bias = False
    if score == "softmax":
        router.update(moe_router_score_function="softmax", moe_router_pre_softmax=True)
    else:
        if k == 1:
            _refuse(c, "routed_score_func", f"{score} routing with one expert per token: MaxText "
                    "renormalises the single weight to 1, jaxtrain keeps the score (Megatron)")
            return None
        router.update(moe_router_score_function=score, moe_router_pre_softmax=False)
    router["moe_router_enable_expert_bias"] = bias
    if bias:
        router["moe_router_bias_update_rate"] = float(c.get("routed_bias_update_rate", 0.0))
    elif c.get("routed_bias_update_rate", 0.0) > 0:
        _refuse(c, "routed_bias_update_rate", "updates the routing bias, and routed_bias is off")
        return None
    if groups != -1 or group_topk != -1:
        if not v3:
            _refuse(c, "n_routing_groups", f"MaxText limits routing to expert groups only for "
                    f"model names deepseek3*/deepseek4* and ignores it for {name!r}")
            return None
        if groups <= 0 or group_topk <= 0:
            c.error(f"group-limited routing needs both {c.where('n_routing_groups')} and "
                    f"{c.where('topk_routing_group')} positive")
            return None
        if group_topk > k or k // group_topk != 2:
            _refuse(c, "topk_routing_group", f"MaxText scores a group by its top-2 experts; "
                    f"jaxtrain's group score sums top-k / groups kept = {k // group_topk} "
                    f"(Megatron's rule), the same only when num_experts_per_tok = 2 x "
                    f"topk_routing_group")
            return None
        router.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    else:
        router.update(moe_router_num_groups=None, moe_router_group_topk=None)
    scale = float(c.get("routed_scaling_factor", 1.0))
    router["moe_router_topk_scaling_factor"] = None if scale == 1.0 else scale
    return router


def _mscale(factor: float, coefficient: float) -> float:
    """YaRN's m = 0.1 coefficient ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def _yarn(c) -> None:
    """MaxText's rotary layout and YaRN keys onto jaxtrain's RoPE.

    MaxText rotates the two halves of each head (RotaryEmbedding), interleaved pairs with
    llama3.1 scaling (LLaMARotaryEmbedding) and as rope_interleave says with YaRN. Its YaRN takes
    rope_factor, beta_fast/slow and rope_truncate as jaxtrain's; rope_attention_scaling
    multiplies the rotated q/k by m = 0.1 ln(factor) + 1; MLA multiplies its softmax scale by
    m(mscale)^2 when max_position_embeddings > original_max_position_embeddings. jaxtrain scales
    the rotary cos/sin by m(mscale)/m(mscale_all_dim) and MLA's softmax by m(mscale_all_dim)^2,
    so mscale_all_dim carries the softmax part and mscale makes the ratio right."""
    rope_type, mla = c.get("rope_type"), bool(c.get("multi_latent_attention"))
    keys = ("rope_factor", "beta_fast", "beta_slow", "rope_interleave", "rope_truncate",
            "rope_attention_scaling", "yarn_softmax_mscale")
    if c.dialect != "maxtext":
        chosen = [k for k in keys if _set(c, k)]
        if chosen:
            c.error(f"{', '.join(c.where(k) for k in chosen)}: MaxText's YaRN keys are read in "
                    f"MaxText files; in this file write YaRN with Megatron's knobs "
                    f"(rotary_scaling_factor, mscale, mscale_all_dim, yarn_beta_fast, ...)")
        return
    if c.get("position_embedding_type") != "rope":
        return
    if rope_type != "yarn":
        if mla:
            c.error(f"multi-latent attention with {c.where('rope_type')}: MaxText then rotates "
                    f"the two halves of the RoPE slice, while jaxtrain's MLA rotates interleaved "
                    f"pairs, as MaxText's YaRN with rope_interleave does; use rope_type: yarn")
            return
        because = (f"{c.where('rope_type')} rotates "
                   + ("interleaved channel pairs in MaxText (LLaMARotaryEmbedding)"
                      if rope_type == "llama3.1" else "the two halves of each head in MaxText"))
        _imply(c, "rotary_interleaved", rope_type == "llama3.1", because)
        if rope_type == "llama3.1" and c.get("rope_linear_scaling_factor", 1.0) != 1.0:
            _refuse(c, "rope_linear_scaling_factor", "MaxText's llama3.1 rotary embedding does "
                                                     "not read it; drop it")
        return
    for key in ("rope_min_timescale", "rope_linear_scaling_factor"):
        if c.get(key, 1.0) != 1.0:
            _refuse(c, key, "MaxText's YaRN takes its frequencies from rope_max_timescale alone; "
                            "drop it")
    factor = float(c.get("rope_factor", 40.0))
    because = f"{c.where('rope_type')} in a MaxText file"
    _imply(c, "rotary_scaling_factor", factor, because + f" with rope_factor {factor}")
    _imply(c, "yarn_beta_fast", float(c.get("beta_fast", 32.0)), because)
    _imply(c, "yarn_beta_slow", float(c.get("beta_slow", 1.0)), because)
    _imply(c, "yarn_correction_range_round_to_int", bool(c.get("rope_truncate", True)), because)
    if mla:
        if not c.get("rope_interleave", True):
            _refuse(c, "rope_interleave", "jaxtrain's multi-latent attention rotates interleaved "
                                          "pairs of its RoPE slice only")
            return
        _imply(c, "rotary_interleaved", False, because + " (MLA interleaves on its own)")
    else:
        _imply(c, "rotary_interleaved", bool(c.get("rope_interleave", True)), because)
    longer = (c.get("max_position_embeddings") or 0) > (c.get("original_max_position_embeddings")
                                                         or 0)
    softmax = float(c.get("yarn_softmax_mscale", 1.0)) if mla and longer else 0.0
    if mla and longer and factor < 1:
        _refuse(c, "rope_factor", "MaxText's MLA softmax scale with a YaRN factor below 1 is not "
                                  "built")
        return
    if c.get("rope_attention_scaling") and factor > 1:
        rotary = (_mscale(factor, 1.0) * _mscale(factor, softmax) - 1) / (0.1 * math.log(factor))
    else:
        rotary = softmax
    _imply(c, "mscale_all_dim", softmax, because)
    _imply(c, "mscale", rotary, because)


def _activations(c) -> None:
    """``mlp_activations`` as Megatron's activation switches (the canonical knobs) where a switch
    names the same MLP; what none names stays (see config/activations.py). Beside an explicit
    switch the two must agree: a MaxText default yields to the switch, an explicit value is an
    error."""
    acts = c.values.get("mlp_activations")
    if acts is None:
        return
    try:
        chosen = mlp_from_activations(acts)
    except ValueError as e:
        c.error(str(e))
        return
    flags = [k for k in SWITCHES if c.explicit(k)]
    if flags:
        try:
            same = megatron_activation(c.values) == chosen
        except ValueError:
            return   # exclusive Megatron switches: reported where the model is built
        if not same and c.explicit("mlp_activations"):
            c.error(f"mlp_activations and {', '.join(flags)} both choose the MLP activation: "
                    f"{c.where('mlp_activations')}, {', '.join(c.where(k) for k in flags)}; "
                    f"keep one")
        else:   # the switches say it already, or MaxText's default yields to them
            c.set("mlp_activations", None)
        return
    switches = switches_for(*chosen)
    if switches is None:
        return
    for key, on in switches.items():
        if c.values.get(key) != on:
            c.set(key, on)
    c.set("mlp_activations", None)
