"""`ModelConfig`: the architecture of a decoder-only LM (dense, or with mixture-of-experts
layers: ``moe``), named after the Megatron/MaxText knobs.

Research code builds one by hand; the trainer builds one from the resolved flat config with
:meth:`ModelConfig.from_config`, whose knob translation is :mod:`jaxtrain.models.from_knobs`.
``None`` sizes are derived in ``__post_init__`` the way Megatron derives them, so the stored
config is always complete. ``__post_init__`` also checks the fields against each other; those
checks are the only copy of each rule (config/rules.py keeps the rules on knobs that do not
reach the model as they are): a config meets them in ``from_config`` (the dry run builds the
model, jaxtrain/preflight.py), whose messages name the knobs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxtrain.config.errors import ConfigError
from jaxtrain.models import from_knobs
from jaxtrain.models.attention import ATTENTION_IMPLS
from jaxtrain.models.moe.config import moe_pattern
from jaxtrain.models.remat import REMAT_POLICIES
from jaxtrain.models.spec import HYBRID_STACKS, MOE_STACKS, layer_kinds
from jaxtrain.quant.kvcache import KV_QUANT_AXES, KV_QUANT_DTYPES

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
ROPE_TYPES = ("rope", "yarn")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "squared_relu", "relu")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "mla_up_proj", "mhc")
MOE_RECOMPUTE_MODULES = ("moe", "moe_act", "shared_experts")
REMAT_TENSOR_MODES = ("remat", "device", "offload")

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def dtype_name(value: Any) -> str:
    """A canonical dtype name ('float32', 'bfloat16', 'float16') for a name or a numpy dtype."""
    name = jnp.dtype(value).name if not isinstance(value, str) else value.lower()
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {sorted(set(_DTYPES.values()))}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture, numerics and layer-stack knobs of a decoder-only LM (``moe``: its
    mixture-of-experts layers, None for a dense model)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None        # None: multi-head attention (= heads)
    kv_channels: int | None = None             # head dim; None: hidden_size // heads
    ffn_hidden_size: int | None = None         # None: 4h, or Megatron's swiglu 8h/3 rounded to 64
    vocab_size: int = 128
    max_position_embeddings: int = 2048

    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rotary_seq_len_interpolation_factor: float | None = None
    use_rope_scaling: bool = False             # Llama-3.1 frequency scaling
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None   # None: 8192 (llama3) / 4096 (yarn)
    rope_type: str = "rope"
    yarn_scaling_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_truncate: bool = True

    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    qk_layernorm: bool = False
    qk_l2_norm: bool = False

    activation: str = "silu"
    gated_linear_unit: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False

    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    untie_embeddings_and_output_weights: bool = True
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    init_method_std: float = 0.02
    init_method_xavier_uniform: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    sliding_window: int | None = None
    # Gemma: the token embeddings times this (sqrt(hidden_size)); None: 1
    embedding_multiplier: float | None = None
    # MaxText normalize_embedding_logits: tied logits divided by sqrt(hidden_size) (before the
    # final soft-cap); MaxText's Gemma keeps the sqrt(hidden_size) in the embedding weights
    normalize_embedding_logits: bool = False
    # Gemma 2/3 sandwich norms: the attention and MLP outputs normalised before the residual add
    post_attention_norm: bool = False
    post_mlp_norm: bool = False
    # False: no norm before the sublayers (OLMo 2/3 normalise only their outputs)
    pre_norm: bool = True
    # Granite: each sublayer's output times residual_multiplier before its residual add, and
    # the logits divided by logits_scaling
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # GPT-NeoX's parallel residual: the MLP reads the layer's input (through its own norm) as
    # the attention does, and both outputs add to it: x + attn(n1(x)) + mlp(n2(x))
    parallel_residual: bool = False
    # with parallel_residual: the MLP reads the attention's normed input (one norm per layer:
    # GPT-J, PaLM, MaxText's default block) instead of its own norm of the input (GPT-NeoX)
    parallel_shared_norm: bool = False
    # With qk_layernorm: one norm over all heads' queries (keys) together, its scale [N*H]
    # ([K*H]), as OLMo 2/3; False normalises each head on its own
    qk_norm_across_heads: bool = False
    # Attention scores scaled by query_pre_attn_scalar**-0.5 (Gemma); None: head_dim**-0.5
    query_pre_attn_scalar: float | None = None
    # RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq; plain RoPE, no
    # scaling); None: every layer uses rotary_base and its scaling
    local_rotary_base: float | None = None
    # Which layers sliding_window applies to (one bool per layer; None: all), e.g. gpt-oss's
    # windowed even layers. Scanned layers read it by layer index (see transformer.py).
    sliding_window_layers: tuple[bool, ...] | None = None
    # gpt-oss / Primus sink attention: a learned fp32 logit per query head, an extra softmax
    # column without a value, in every layer.
    attention_sinks: bool = False
    # Llama 4: the layers that skip RoPE (NoPE; one bool per layer, True = no RoPE; None: none)
    no_rope_layers: tuple[bool, ...] | None = None
    # Llama 4: the q/k norm (qk_layernorm / qk_l2_norm) only on the RoPE layers
    qk_norm_rope_layers_only: bool = False
    # Llama 4 chunked local attention: on the RoPE layers a query sees only keys whose position
    # lies in its own block of this many positions (position // chunk equal); None: off
    attention_chunk_size: int | None = None
    # Llama 4 attention temperature tuning on the NoPE layers: queries times
    # 1 + scale * log(1 + floor((position + 1) / floor_scale))
    attn_temperature_tuning: bool = False
    attn_temperature_scale: float = 0.1
    attn_temperature_floor_scale: float = 8192.0
    # Qwen3-Next gated attention: the attention output times sigmoid(x @ wg), per head channel
    attention_output_gate: bool = False
    # Gemma 4's global layers (those sliding_window_layers leaves without a window): their own
    # head width and key/value-head count (None: kv_channels / num_query_groups), keys and
    # values from the one key projection (attention_k_eq_v: v is k before its norm and RoPE)
    # and proportional RoPE (global_rotary_percent: rotary_base, the first percent·H/2 channel
    # pairs rotated at base^(-2i/H) of the whole head, the rest left as they are). Any of these
    # puts the global layers in stacks of their own ('global_layers'; see `global_layers`).
    global_kv_channels: int | None = None
    global_num_query_groups: int | None = None
    attention_k_eq_v: bool = False
    global_rotary_percent: float | None = None
    # Gemma 4: values RMS-normalised per head, "plain" (no scale) or "scaled"; None: none
    v_norm: str | None = None
    # Gemma 4: each layer's output times its own scalar (a checkpoint constant, not trained)
    layer_scalar: bool = False
    # Gemma 4 small (E2B/E4B) per-layer embeddings (models/per_layer.py): each layer adds a gated
    # projection of its own slice of a per-token input of this width (0: off), made from a
    # second embedding table (per_layer_vocab_size rows; None: vocab_size) and the embeddings
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    # Gemma 4 small KV sharing: the last kv_shared_layers layers have no key/value projections
    # and attend over the keys and values of the last earlier layer of their kind (sliding or
    # global); with double_wide_shared_mlp their MLP is twice ffn_hidden_size wide
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    # Gated DeltaNet linear attention (Qwen3-Next / Qwen3.5; models/linear_attention.py): the
    # layers that mix tokens with it instead of softmax attention (one bool per layer; None:
    # none), its head counts and widths, the causal convolution's width, the chunk length of
    # the chunked form and whether q and k are L2-normalised inside the rule.
    linear_attention_layers: tuple[bool, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_chunk_size: int = 64
    linear_qk_l2_norm: bool = True
    # the walk across chunks: "xla" (lax.scan) or "pallas" (kernels/gated_delta/scan.py)
    linear_attention_impl: str = "xla"
    # "gdn" (Gated DeltaNet: a decay per head) or "kda" (Kimi Delta Attention: a decay per key
    # channel and low-rank gate projections; linear_attention.py)
    linear_attention_kind: str = "gdn"
    # the short causal convolution of q/k/v (False: SiLU only and no convolution; Primus's
    # use_short_conv)
    linear_short_conv: bool = True
    # Kimi K3's KDA: the decay bounded as lb * sigmoid(exp(A_log) * (a + dt_bias)) (None:
    # -exp(A_log) * softplus(a + dt_bias)) and a full-rank output gate [D,H,Dv] instead of the
    # low-rank pair
    kda_gate_lower_bound: float | None = None
    kda_full_rank_gate: bool = False
    # KDA's decay bottleneck width (None: the key head width, Kimi Linear; Primus's hybrid KDA
    # and FLA: the value head width) and a bias on the output gate's up projection (FLA's)
    kda_decay_rank: int | None = None
    kda_gate_bias: bool = False
    # LFM2's gated short convolutions (models/short_conv.py): the layers that mix tokens with
    # them instead of attention (one bool per layer; None: none), the convolution's width and
    # whether its projections and convolution have biases
    short_conv_layers: tuple[bool, ...] | None = None
    short_conv_kernel: int = 3
    short_conv_bias: bool = False
    # Hybrid models (Megatron's hybrid_layer_pattern, NemotronH, Mamba-2): one symbol per layer
    # and each layer one sublayer with its own pre-norm and residual add: 'M' Mamba-2 (mamba.py),
    # '*' attention, 'G' Gated DeltaNet, '-' MLP, 'E' MoE. None: attention + FFN layers.
    hybrid_layers: str | None = None
    # Mamba-2 mixers: state width, head width, groups sharing B/C, heads (None: 2·hidden_size /
    # head width, Megatron's expand 2), convolution width and bias, the chunk length of the
    # chunked scan, the gated norm's epsilon (Megatron fixes 1e-5) and a floor on the step size
    # (Hugging Face's time_step_min; Megatron has none)
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    mamba_conv_kernel_dim: int = 4
    mamba_conv_bias: bool = True
    mamba_chunk_size: int = 128
    mamba_norm_epsilon: float = 1e-5
    mamba_dt_floor: float = 0.0
    # the dtype the states entering each chunk are stored in during training (Megatron's
    # mamba_training_ssm_states_dtype); None: the compute dtype, as Megatron's params dtype
    mamba_state_dtype: str | None = None
    # Multi-token prediction (DeepSeek-V3, Megatron's mtp_num_layers; see mtp.py): the extra
    # prediction depths (0: none), the weight of their mean loss, and one module for every
    # depth instead of one each (mtp_use_repeated_layer)
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    mtp_repeated_layer: bool = False
    # a hybrid model's MTP module: the sublayers of each depth as hybrid_layers' symbols
    # (Megatron's pattern after '/'); None: one layer of the last layer's kind
    mtp_hybrid_layers: str | None = None
    # Kimi K3's MTP layer mixer (Primus mtp_layer_type): "linear" (KDA) or "attention" (MLA)
    # with the last layer's FFN; None: the last layer's kind. MTP layers never take attention
    # residuals (they read the decoder's collapsed output)
    mtp_mixer: str | None = None
    # Multi-latent attention (DeepSeek-V2/V3, Megatron MLA; see mla.py). q/k heads are
    # qk_head_dim + qk_pos_emb_head_dim wide, values v_head_dim; qk_layernorm puts a norm on the
    # q and kv latents (Megatron's spec; DeepSeek checkpoints have them).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None             # None: queries projected directly from hidden
    kv_lora_rank: int = 32
    qk_head_dim: int = 128                     # per-head q/k width without RoPE
    qk_pos_emb_head_dim: int = 64              # per-head q/k RoPE width (keys share one head)
    v_head_dim: int = 128
    # MLA without rotation (Kimi Linear, Primus's mla_use_nope): the qk_pos_emb_head_dim part
    # of queries and the shared key stays as projected
    mla_nope: bool = False
    # epsilon of the q/kv latent norms (Hugging Face's DeepSeek-V3 and Kimi Linear fix 1e-6);
    # None: norm_epsilon (Megatron)
    mla_latent_norm_epsilon: float | None = None
    # DeepSeek sparse attention (DeepSeek-V3.2; models/dsa.py) on every MLA layer: indexer heads
    # (0: off) and width, keys kept per query, RoPE on interleaved pairs instead of halves,
    # ReLU on the head scores, the key LayerNorm's epsilon (None: norm_epsilon), exact top-k
    # (ties to the earlier key) or every key scoring at least the k-th, XLA's approximate top-k
    # with this recall (None: exact); the indexer's KL loss weight (0: not trained), over the
    # selected keys only, and averaged over layers instead of summed (MaxText)
    dsa_index_heads: int = 0
    dsa_index_head_dim: int = 128
    dsa_index_topk: int = 2048
    dsa_rope_interleaved: bool = False
    dsa_scoring_relu: bool = True
    dsa_k_norm_epsilon: float | None = None
    dsa_exact_topk: bool = True
    dsa_approx_topk_recall: float | None = None
    dsa_loss_coeff: float = 0.0
    dsa_sparse_loss: bool = False
    dsa_loss_layer_mean: bool = False
    # heads per chunk when summing the indexer's scores and the indexer loss's attention target
    # (MaxText's mla_qk_head_chunk_size): less memory, the same values; 0: all heads at once
    dsa_head_chunk: int = 0
    # per layer, True: the layer has no indexer and attends to the keys the last computing layer
    # before it selected (GLM-5's index sharing, Megatron's dsa_indexer_topk_freq); None: none
    dsa_shared_layers: tuple[bool, ...] | None = None
    # Manifold-constrained hyper-connections (models/hyper.py): residual streams (1: the plain
    # residual), Sinkhorn rounds, MaxText's mHC-lite (permutation mixtures), the convention
    # ("deepseek": MaxText / DeepSeek-V4, "megatron": Megatron-LM) and the gates' initial value
    hc_streams: int = 1
    hc_sinkhorn_iters: int = 20
    hc_lite: bool = False
    hc_style: str = "deepseek"
    hc_init_gate: float = 0.01
    # the epsilon the mappings add (or clamp with); DeepSeek-V4's learned final collapse of the
    # streams (its HyperHead) instead of their sum or mean
    hc_eps: float = 1e-6
    hc_head: bool = False
    # DeepSeek-V4 attention (models/compressed.py): per layer a KV compression ratio (0: the
    # sliding window only; None: off), the ratio whose layers overlap their windows and pick
    # entries with an indexer (CSA; the other nonzero ratio: HCA), the compressing layers' RoPE
    # base, the grouped output projection (o_groups head groups, each to o_lora_rank), the
    # indexer's heads, width and entries kept per query, and its KL loss weight (0: untrained)
    compress_ratios: tuple[int, ...] | None = None
    compress_sparse_ratio: int = 4
    compress_rotary_base: float = 160000.0
    o_groups: int = 8
    o_lora_rank: int = 1024
    compress_index_heads: int = 64
    compress_index_head_dim: int = 128
    compress_index_topk: int = 512
    compress_index_loss_coeff: float = 0.0
    # the indexer's queries and keys fake-quantized to FP8 E4M3 (Primus's use_v4_fp8_indexer)
    compress_index_fp8: bool = False
    # Clamped gated units (Megatron's activation_func_clamp_value with a plain GLU, DeepSeek-V4's
    # swiglu_limit): act(min(gate, c)) * clip(up, -c, c) in every gated MLP and expert; None: off
    glu_clamp: float | None = None
    # Kimi K3's SiTU gated unit (Primus activation_situ_beta / _linear_beta): the gate's linear
    # factor and the up branch soft-clamped, b tanh(g/b) sigmoid(g) * c tanh(u/c) in float32;
    # None: the model's activation (c None: the up branch as is)
    situ_beta: float | None = None
    situ_linear_beta: float | None = None
    # Kimi K3's attention residuals (Primus attn_res_block_size, models/attn_res.py): each
    # sublayer reads a learned softmax mix of the block summaries kept every N layers and the
    # running sum; 0: the plain residual stream
    attn_res_block_size: int = 0
    # MaxText's qwen3_custom_moe layer: attention projects to this width A, its output (no
    # residual add) is normed and runs through the MoE layer at width A, then up to D and onto
    # the residual stream: x + up(moe(norm(attn(norm(x))))); None: the usual two halves
    attention_output_dim: int | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # "xla" (plain jnp), "flash" (our Pallas kernel; interpreted on CPU), "cudnn"
    # (jax.nn cuDNN attention, NVIDIA only); "auto" resolves here: see `auto_attention_impl`.
    attention_impl: str = "xla"
    # Context parallelism's K/V exchange (jaxtrain.parallel.context: p2p, allgather, a2a,
    # a2a+p2p), or one per layer, when the mesh has a context axis; None leaves the
    # sequence-sharded attention to XLA. cp_a2a_size: the all-to-all group size of a2a+p2p.
    # cp_reorder: the token order attention runs on, "dual_chunk_swap" (Megatron's causal load
    # balancing), "striped" or None (natural; see jaxtrain.parallel.context.REORDERS).
    cp_comm_type: str | tuple[str, ...] | None = None
    cp_a2a_size: int | None = None
    cp_reorder: str | None = "dual_chunk_swap"
    flash_block_sizes: Any = None              # kernels.flash_attention.BlockSizes; None: tuned

    dtype: str = "float32"
    weight_dtype: str = "float32"
    # Quantized projections (fp8 / fp4 / MaxText quantization / pgs float8): a
    # jaxtrain.quant.QuantConfig, or None for none.
    quant: Any = None
    # Quantized KV cache of decoding (models/decode.py, quant/kvcache.py; training has no cache):
    # kv_quant_axis "dkv" (a scale per token and kv head) or "heads_and_dkv" (per token; "" only
    # with the cache unquantized), kv_quant_dtype "int8" or "int4".
    quantize_kvcache: bool = False
    kv_quant_axis: str = "heads_and_dkv"
    kv_quant_dtype: str = "int8"
    logits_dot_in_fp32: bool = False
    use_iota_embed: bool = False

    scan_layers: bool = True
    param_scan_axis: int = 1
    remat_policy: str = "none"
    remat_tensors: tuple[tuple[str, str], ...] = ()   # remat_policy='custom': (name, mode) pairs
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_layer_ids: tuple[int, ...] | None = None
    recompute_modules: tuple[str, ...] = ()
    # Mixture of experts (models/moe/config.py MoEConfig); None: a dense model.
    moe: Any = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        h, n = self.hidden_size, self.num_attention_heads
        if self.num_query_groups is None:
            put("num_query_groups", n)
        if self.kv_channels is None:
            if h % n:
                raise ValueError(f"hidden_size {h} is not divisible by num_attention_heads {n}; "
                                 "set kv_channels")
            put("kv_channels", h // n)
        if self.ffn_hidden_size is None:
            ffn = int(4 * h * 2 / 3 / 64) * 64 if self.gated_linear_unit else 4 * h
            put("ffn_hidden_size", ffn)
        if self.original_max_position_embeddings is None:
            put("original_max_position_embeddings", 4096 if self.rope_type == "yarn" else 8192)
        put("dtype", dtype_name(self.dtype))
        put("weight_dtype", dtype_name(self.weight_dtype))
        put("remat_tensors", tuple(tuple(t) for t in self.remat_tensors))
        put("recompute_modules", tuple(self.recompute_modules))
        if self.moe is not None and self.moe.ffn_hidden_size is None:
            put("moe", dataclasses.replace(self.moe, ffn_hidden_size=self.ffn_hidden_size))
        if self.sliding_window_layers is not None:
            layers = tuple(bool(b) for b in self.sliding_window_layers)
            every = len(layers) == self.num_layers and all(layers)
            put("sliding_window_layers", None if every else layers)
        if self.no_rope_layers is not None:
            layers = tuple(bool(b) for b in self.no_rope_layers)
            put("no_rope_layers", layers if any(layers) else None)
        if self.linear_attention_layers is not None:
            layers = tuple(bool(b) for b in self.linear_attention_layers)
            put("linear_attention_layers", layers if any(layers) else None)
        if self.compress_ratios is not None:
            put("compress_ratios", tuple(int(r) for r in self.compress_ratios))
        if self.dsa_shared_layers is not None:
            layers = tuple(bool(b) for b in self.dsa_shared_layers)
            put("dsa_shared_layers", layers if any(layers) else None)
        if self.short_conv_layers is not None:
            layers = tuple(bool(b) for b in self.short_conv_layers)
            put("short_conv_layers", layers if any(layers) else None)
        if self.mamba_num_heads is None and self.mamba_head_dim > 0:   # Megatron's expand 2
            put("mamba_num_heads", 2 * self.hidden_size // self.mamba_head_dim)
        if self.recompute_layer_ids is not None:
            put("recompute_layer_ids", tuple(int(i) for i in self.recompute_layer_ids))
        if self.attention_impl == "auto":
            put("attention_impl", auto_attention_impl(self))
        self._validate()
        problems = attention_problems(self)
        if problems:
            raise ConfigError(problems)

    def _validate(self):
        def check(ok, field, msg):
            if not ok:
                raise ValueError(f"ModelConfig.{field}: {msg}")

        def choice(field, allowed):
            check(getattr(self, field) in allowed, field,
                  f"{getattr(self, field)!r} is not one of {allowed}")

        choice("position_embedding_type", POSITION_EMBEDDINGS)
        choice("attention_impl", ATTENTION_IMPLS)
        if self.flash_block_sizes is not None:
            from kernels.flash_attention import BlockSizes
            check(isinstance(self.flash_block_sizes, BlockSizes), "flash_block_sizes",
                  "must be a kernels.flash_attention.BlockSizes or None")
        choice("rope_type", ROPE_TYPES)
        choice("normalization", NORMALIZATIONS)
        choice("activation", ACTIVATIONS)
        check(self.num_attention_heads % self.num_query_groups == 0, "num_query_groups",
              f"{self.num_query_groups} does not divide num_attention_heads "
              f"{self.num_attention_heads}")
        check(self.rotary_dim % 2 == 0, "rotary_percent",
              f"kv_channels*rotary_percent = {self.rotary_dim} must be even")
        check(0 < self.rotary_percent <= 1, "rotary_percent", "must be in (0, 1]")
        for field in ("hidden_dropout", "attention_dropout"):
            check(0 <= getattr(self, field) < 1, field, f"{getattr(self, field)} must be in "
                  "[0, 1): dropping every activation leaves nothing to rescale")
        check(not (self.qk_layernorm and self.qk_l2_norm), "qk_l2_norm",
              "qk_layernorm and qk_l2_norm are exclusive")
        check(not (self.use_rope_scaling and self.rope_type == "yarn"), "use_rope_scaling",
              "Llama-3 rope scaling and rope_type='yarn' are exclusive")
        check(self.sliding_window is None or self.sliding_window > 0, "sliding_window",
              "must be a positive number of tokens or None")
        if self.sliding_window_layers is not None:
            check(len(self.sliding_window_layers) == self.num_layers, "sliding_window_layers",
                  f"has {len(self.sliding_window_layers)} entries for {self.num_layers} layers")
            check(self.sliding_window is not None, "sliding_window_layers",
                  "picks the layers that use sliding_window, which is None")
        if self.no_rope_layers is not None:
            check(len(self.no_rope_layers) == self.num_layers, "no_rope_layers",
                  f"has {len(self.no_rope_layers)} entries for {self.num_layers} layers")
            check(self.position_embedding_type == "rope", "no_rope_layers",
                  "picks layers that skip RoPE, and the model has no RoPE")
        check(self.attention_chunk_size is None or self.attention_chunk_size > 0,
              "attention_chunk_size", "must be a positive number of positions or None")
        check(self.attn_temperature_floor_scale > 0, "attn_temperature_floor_scale",
              "must be positive")
        check(self.query_pre_attn_scalar is None or self.query_pre_attn_scalar >= 0,
              "query_pre_attn_scalar", "must be positive (scores are scaled by its inverse "
              "square root; 0 or null: head_dim)")
        if self.multi_latent_attention:
            self._validate_mla(check)
        check(self.dsa_shared_layers is None or self.dsa_index_heads, "dsa_indexer_topk_freq",
              "index sharing needs DeepSeek sparse attention (experimental_attention_variant "
              "dsa)")
        check(not self.dsa_index_heads or self.multi_latent_attention,
              "experimental_attention_variant",
              "dsa (DeepSeek sparse attention) needs multi_latent_attention")
        for name in ("kda_gate_lower_bound", "kda_full_rank_gate", "kda_decay_rank",
                     "kda_gate_bias"):
            check(getattr(self, name) in (None, False) or (
                (self.linear_attention_layers is not None or "G" in (self.hybrid_layers or ""))
                and self.linear_attention_kind == "kda"),
                name, "shapes Kimi Delta Attention layers, and the model has none")
        check(not self.mla_nope or self.multi_latent_attention, "mla_nope",
              "leaves multi-latent attention unrotated, and the model has none")
        if self.has_global_shape:
            self._validate_global(check)
        if self.hc_streams != 1:
            self._validate_hyper(check, choice)
        check(not self.hc_head or self.hc_streams > 1, "hc_head", "collapses hyper-connection "
              "streams, and the model has one stream (hc_mult / mhc_expansion_rate 1)")
        check(self.hc_eps > 0, "hc_eps", "must be positive")
        if self.situ_beta is not None:
            check(self.situ_beta > 0 and self.gated_linear_unit and self.glu_clamp is None,
                  "situ_beta", "SiTU soft-clamps a gated unit: give a positive beta with a "
                  "gated MLP (swiglu) and no hard clamp")
        check(self.situ_linear_beta is None or (self.situ_beta and self.situ_linear_beta > 0),
              "situ_linear_beta", "soft-clamps SiTU's up branch: give situ_beta too and a "
              "positive bound")
        if self.attn_res_block_size:
            self._validate_attn_res(check)
        check(self.mtp_mixer in (None, "linear", "attention") and (
            self.mtp_mixer != "linear" or self.linear_attention_layers is not None),
            "mtp_mixer", f"{self.mtp_mixer!r}: 'linear' (needs linear-attention layers), "
            "'attention' or None (the last layer's kind)")
        check(self.glu_clamp is None or (self.glu_clamp > 0 and self.gated_linear_unit),
              "glu_clamp", "clamps gated units: give a positive limit with a gated MLP "
              "(swiglu)")
        if self.compress_ratios is not None:
            self._validate_compressed(check)
        check(not self.compress_index_fp8 or self.compress_ratios is not None,
              "compress_index_fp8", "fake-quantizes DeepSeek-V4's indexer, and the model has "
              "no compressed attention (compress_ratios)")
        if self.attention_output_dim is not None:
            self._validate_serial(check)
        check(self.logits_scaling > 0, "logits_scaling", "must be positive (logits are "
              "divided by it)")
        check(not self.parallel_shared_norm or self.parallel_residual, "parallel_shared_norm",
              "shares the attention's norm with the parallel MLP: it needs parallel_residual")
        check(not self.parallel_residual or (
            self.pre_norm and not self.apply_residual_connection_post_layernorm),
            "parallel_residual", "the parallel layer adds both sublayers to its normed-from "
            "input: it needs pre_norm and no apply_residual_connection_post_layernorm")
        check(self.v_norm in (None, "plain", "scaled"), "v_norm",
              f"{self.v_norm!r} is not one of (None, 'plain', 'scaled')")
        if self.linear_attention_layers is not None or "G" in (self.hybrid_layers or ""):
            self._validate_linear(check, choice)
        else:
            check(self.linear_short_conv, "linear_short_conv", "turns off the short "
                  "convolution of Gated DeltaNet layers, and the model has none")
        if self.hybrid_layers is not None:
            self._validate_hybrid(check)
        if self.kv_shared_layers or self.per_layer_input_size:
            self._validate_small_gemma4(check)
        if self.short_conv_layers is not None:
            check(len(self.short_conv_layers) == self.num_layers, "lfm_layer_types",
                  f"names {len(self.short_conv_layers)} layers of {self.num_layers}")
            check(self.short_conv_kernel > 0, "conv_L_cache", "must be positive")
            for name, on in (("linear_attention_freq", self.linear_attention_layers is not None),
                             ("hybrid_layer_pattern", self.hybrid_layers is not None),
                             ("global_kv_channels", self.has_global_shape)):
                check(not on, name, "is not built together with LFM2's short-convolution "
                      "layers (lfm_layer_types)")
        check(self.mtp_num_layers >= 0, "mtp_num_layers", "must be 0 (off) or positive")
        if self.hybrid_layers is not None and self.mtp_num_layers:
            mtp = self.mtp_hybrid_layers
            check(bool(mtp) and set(mtp) <= set(HYBRID_STACKS), "hybrid_layer_pattern",
                  f"a hybrid model's MTP layers are the pattern after '/' (got {mtp!r}; "
                  f"symbols {''.join(HYBRID_STACKS)})")
            check(not self.mtp_repeated_layer, "mtp_use_repeated_layer",
                  "not implemented yet with a hybrid model's MTP layers")
        check(self.mtp_hybrid_layers is None or (self.hybrid_layers is not None
                                                 and self.mtp_num_layers > 0),
              "hybrid_layer_pattern", "MTP layers after '/' need a hybrid model and "
              "mtp_num_layers")
        if self.mtp_num_layers and self.mtp_repeated_layer and self.moe is not None:
            check(layer_kinds(self)[-1] not in MOE_STACKS, "mtp_use_repeated_layer",
                  "not implemented yet with an MoE layer last (the repeated MTP module would be "
                  "an MoE layer, whose router statistics Megatron rescales)")
        check(self.mtp_loss_scaling_factor >= 0, "mtp_loss_scaling_factor", "must not be "
              "negative")
        choice("kv_quant_axis", ("",) + KV_QUANT_AXES)
        choice("kv_quant_dtype", tuple(KV_QUANT_DTYPES))
        check(not (self.quantize_kvcache and not self.kv_quant_axis), "kv_quant_axis",
              "cannot be empty when quantize_kvcache is on (use 'dkv' or 'heads_and_dkv')")
        check(self.param_scan_axis in (0, 1), "param_scan_axis", "must be 0 or 1")
        choice("remat_policy", REMAT_POLICIES)
        for name, mode in self.remat_tensors:
            check(mode in REMAT_TENSOR_MODES, "remat_tensors",
                  f"{name}={mode!r} is not one of {REMAT_TENSOR_MODES}")
        check(self.remat_policy != "custom" or self.remat_tensors, "remat_tensors",
              "remat_policy='custom' needs per-tensor remat/device/offload entries")
        check(self.recompute_method in (None,) + RECOMPUTE_METHODS, "recompute_method",
              f"{self.recompute_method!r} is not one of {RECOMPUTE_METHODS}")
        if self.recompute_method is not None:
            check(self.recompute_layer_ids is None, "recompute_layer_ids",
                  "exclusive with recompute_method")
            check(self.recompute_num_layers is not None and self.recompute_num_layers > 0,
                  "recompute_num_layers", "recompute_method needs a positive layer count")
        if self.recompute_method is not None or self.recompute_layer_ids is not None:
            check(self.remat_policy != "none", "remat_policy",
                  "recompute_method/recompute_layer_ids pick layers to remat; the policy is 'none'")
        for i in self.recompute_layer_ids or ():
            check(0 <= i < self.num_layers, "recompute_layer_ids", f"layer {i} out of range")
        if self.moe is not None:
            moe_pattern(self.moe, self.num_layers)   # raises on a pattern of the wrong length
        for m in self.recompute_modules:
            if m in MOE_RECOMPUTE_MODULES:
                check(self.moe is not None, "recompute_modules", f"{m!r} needs an MoE model")
                continue
            check(m in RECOMPUTE_MODULES, "recompute_modules",
                  f"{m!r} is not a dense-model module {RECOMPUTE_MODULES} (MoE/MLA modules "
                  "need the MoE/MLA model)")
        check("mla_up_proj" not in self.recompute_modules or self.multi_latent_attention,
              "recompute_modules", "'mla_up_proj' needs multi_latent_attention")
        check("mhc" not in self.recompute_modules or self.hc_streams > 1, "recompute_modules",
              "'mhc' needs hyper-connections (enable_mhc_connections)")

    def _validate_mla(self, check):
        """Megatron's MLA rules: no GQA, RoPE only on the pos-emb slice, no q/k/v biases."""
        check(self.num_query_groups == self.num_attention_heads, "num_query_groups",
              "multi-latent attention has no grouped-query attention (keys and values come "
              "per head from the shared latent)")
        check(not self.rotary_interleaved, "rotary_interleaved",
              "multi-latent attention already rotates interleaved pairs of its RoPE slice")
        check(self.rotary_percent == 1.0, "rotary_percent",
              "multi-latent attention rotates its whole qk_pos_emb_head_dim slice")
        check(not self.qk_l2_norm, "qk_l2_norm", "not defined for multi-latent attention")
        check(not self.add_qkv_bias, "add_qkv_bias",
              "multi-latent attention projections have no biases (add_bias_linear gives the "
              "output projection one)")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            check(getattr(self, name) > 0, name, "must be positive")
        check(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank",
              "must be positive or None (queries projected directly)")
        if self.dsa_index_heads:
            self._validate_dsa(check)

    def _validate_dsa(self, check):
        """DeepSeek sparse attention: indexer shapes, and what it is not built with."""
        for name, knob in (("dsa_index_heads", "dsa_indexer_n_heads"),
                           ("dsa_index_head_dim", "dsa_indexer_head_dim"),
                           ("dsa_index_topk", "dsa_indexer_topk")):
            check(getattr(self, name) > 0, knob, "must be positive (MaxText: indexer_n_heads, "
                  "indexer_head_dim, indexer_topk)")
        check(self.dsa_index_head_dim >= self.qk_pos_emb_head_dim, "dsa_indexer_head_dim",
              f"{self.dsa_index_head_dim} is narrower than its RoPE part qk_pos_emb_head_dim "
              f"{self.qk_pos_emb_head_dim}")
        check(self.dsa_loss_coeff >= 0, "dsa_indexer_loss_coeff", "must not be negative")
        check(self.sliding_window is None, "sliding_window",
              "not built with DeepSeek sparse attention")
        C = self.dsa_head_chunk
        check(C >= 0 and (not C or self.dsa_index_heads % C == 0
                          and self.num_attention_heads % C == 0), "mla_qk_head_chunk_size",
              f"{C} must divide the indexer's heads ({self.dsa_index_heads}) and the attention "
              f"heads ({self.num_attention_heads})")
        shared = self.dsa_shared_layers
        if shared is not None:
            check(len(shared) == self.num_layers and not shared[0], "dsa_indexer_topk_freq",
                  f"index sharing needs one entry per layer ({self.num_layers}) and a first "
                  "layer that computes its own selection")

    def _validate_serial(self, check):
        """MaxText's qwen3_custom_moe layer: softmax attention then MoE on every layer, the
        plain residual stream and pre-norms, and none of the extras its block lacks."""
        check(self.attention_output_dim > 0, "attention_output_dim", "must be positive")
        check(self.moe is not None and all(k in MOE_STACKS for k in layer_kinds(self)),
              "attention_output_dim", "MaxText's qwen3_custom_moe layer ends in an MoE layer: "
              "every layer must be one (num_experts, moe_layer_freq 1)")
        m = self.moe
        for name, on in (("moe.shared_expert_size", m is not None and m.shared_expert_size),
                         ("moe.latent_size", m is not None and m.latent_size),
                         ("multi_latent_attention", self.multi_latent_attention),
                         ("compress_ratios", self.compress_ratios is not None),
                         ("hc_streams", self.hc_streams > 1),
                         ("parallel_residual", self.parallel_residual),
                         ("post_attention_norm", self.post_attention_norm),
                         ("post_mlp_norm", self.post_mlp_norm),
                         ("add_bias_linear", self.add_bias_linear),
                         ("attention_output_gate", self.attention_output_gate),
                         ("apply_residual_connection_post_layernorm",
                          self.apply_residual_connection_post_layernorm),
                         ("mtp_num_layers", self.mtp_num_layers),
                         ("hidden_dropout", self.hidden_dropout > 0),
                         ("pre_norm", not self.pre_norm)):
            check(not on, name, "is not built with attention_output_dim (MaxText's "
                  "qwen3_custom_moe layer has none)")

    @property
    def moe_width(self) -> int:
        """The width of the tokens the MoE layers route: attention_output_dim or hidden_size."""
        return self.attention_output_dim or self.hidden_size

    def _validate_attn_res(self, check):
        """Attention residuals: a positive block size on the pre-norm residual stream of
        attention/linear-attention + FFN layers, and none of the other residual schemes."""
        check(self.attn_res_block_size > 0, "attn_res_block_size", "must be positive (0: off)")
        for name, on in (("hc_streams", self.hc_streams > 1),
                         ("hybrid_layer_pattern", self.hybrid_layers is not None),
                         ("parallel_residual", self.parallel_residual),
                         ("attention_output_dim", bool(self.attention_output_dim)),
                         ("apply_residual_connection_post_layernorm",
                          self.apply_residual_connection_post_layernorm),
                         ("pre_norm", not self.pre_norm),
                         ("post_attention_norm", self.post_attention_norm),
                         ("post_mlp_norm", self.post_mlp_norm),
                         ("residual_multiplier", self.residual_multiplier != 1.0),
                         ("per_layer_input_size", self.per_layer_input_size > 0),
                         ("layer_scalar", self.layer_scalar),
                         ("kv_shared_layers", self.kv_shared_layers > 0),
                         ("mtp_hybrid_layers", self.mtp_hybrid_layers is not None)):
            check(not on, name, "is not built with attention residuals (attn_res_block_size)")

    def _validate_hyper(self, check, choice):
        check(self.hc_streams > 1, "hc_streams", "must be 1 (the plain residual) or more "
              "streams (MaxText mhc_expansion_rate, Megatron mhc_num_residual_streams)")
        choice("hc_style", ("deepseek", "megatron"))
        check(self.hc_sinkhorn_iters > 0, "hc_sinkhorn_iters", "must be positive (MaxText "
              "sinkhorn_iterations, Megatron mhc_sinkhorn_iterations)")
        check(not self.hc_lite or self.hc_style == "deepseek", "hc_lite",
              "mHC-lite (enable_mhc_lite) is MaxText's; Megatron's mHC has no such mode")
        check(not self.hc_lite or self.hc_streams <= 6, "hc_lite",
              f"mixes all {self.hc_streams}! permutations; keep mhc_expansion_rate at 6 or less")
        for name, on, why in (
                ("parallel_residual", self.parallel_residual, "adds both sublayers at once"),
                ("apply_residual_connection_post_layernorm",
                 self.apply_residual_connection_post_layernorm, "adds the normed input"),
                ("per_layer_input_size", self.per_layer_input_size,
                 "adds Gemma 4's per-layer inputs to one stream"),
                ("layer_scalar", self.layer_scalar, "scales Gemma 4's one stream"),
                ("mtp_num_layers", self.mtp_num_layers and not self.hc_head,
                 "multi-token prediction modules read one stream (DeepSeek-V4's, with the "
                 "learned head hc_head, lift and collapse their own)")):
            check(not on, name, f"is not built with hyper-connections (mHC): its layer {why}")

    def _validate_compressed(self, check):
        """DeepSeek-V4 attention: one ratio per layer, at most one besides the sparse one, the
        query latent and groups it needs, and none of the other attention variants."""
        ratios, sparse = self.compress_ratios, self.compress_sparse_ratio
        check(len(ratios) == self.num_layers, "compress_ratios",
              f"has {len(ratios)} entries for {self.num_layers} layers")
        check(all(r >= 0 for r in ratios), "compress_ratios", "ratios are 0 (no compression) "
              "or positive")
        check(sparse > 0, "compress_sparse_ratio", "must be positive")
        heavy = sorted({r for r in ratios if r and r != sparse})
        check(len(heavy) <= 1, "compress_ratios", f"has the heavy ratios {heavy}: one "
              f"besides the sparse (indexed) ratio {sparse} is built")
        N, H, P = self.num_attention_heads, self.kv_channels, self.qk_pos_emb_head_dim
        check(self.q_lora_rank is not None and self.q_lora_rank > 0, "q_lora_rank",
              "DeepSeek-V4 attention projects queries through a latent: give its rank")
        check(self.num_query_groups == 1, "num_query_groups", "DeepSeek-V4 attention has one "
              "shared key/value head (num_query_groups 1)")
        check(0 < P <= H and P % 2 == 0, "qk_pos_emb_head_dim", f"{P}: the RoPE part of the "
              f"{H}-wide heads must be even and fit in them")
        check(self.o_groups > 0 and N % self.o_groups == 0, "o_groups",
              f"{self.o_groups} must divide the {N} heads into whole groups")
        check(self.o_lora_rank > 0, "o_lora_rank", "must be positive")
        if sparse in ratios:
            check(self.compress_index_heads > 0 and self.compress_index_topk > 0,
                  "index_n_heads", "the indexer of the sparse layers needs heads and a positive "
                  "top-k (index_n_heads, index_topk)")
            check(self.compress_index_head_dim >= P, "index_head_dim",
                  f"{self.compress_index_head_dim} is narrower than its RoPE part {P}")
        check(self.compress_index_loss_coeff >= 0, "v4_indexer_distill_loss_coeff",
              "must not be negative")
        check(not (self.mtp_num_layers and self.compress_index_loss_coeff), "mtp_num_layers",
              "the indexer loss (v4_indexer_distill_loss_coeff) of the MTP layers is not built")
        check(self.position_embedding_type == "rope" and self.normalization == "RMSNorm",
              "position_embedding_type", "DeepSeek-V4 attention takes RoPE and RMSNorm")
        check(not self.use_rope_scaling, "use_rope_scaling",
              "DeepSeek-V4's compressed layers take plain or YaRN RoPE")
        check(self.attention_dropout == 0, "attention_dropout", "not built with DeepSeek-V4 "
              "attention")
        for name, on in (("multi_latent_attention", self.multi_latent_attention),
                         ("qk_layernorm", self.qk_layernorm or self.qk_l2_norm),
                         ("hybrid_layer_pattern", self.hybrid_layers is not None),
                         ("linear_attention_freq", self.linear_attention_layers is not None),
                         ("lfm_layer_types", self.short_conv_layers is not None),
                         ("global_kv_channels", self.has_global_shape),
                         ("window_attn_skip_freq", self.sliding_window_layers is not None),
                         ("no_rope_freq", self.no_rope_layers is not None),
                         ("attention_chunk_size", self.attention_chunk_size is not None),
                         ("local_rotary_base", self.local_rotary_base is not None),
                         ("attention_output_gate", self.attention_output_gate),
                         ("attn_logit_softcapping", bool(self.attn_logit_softcapping)),
                         ("apply_query_key_layer_scaling", self.apply_query_key_layer_scaling),
                         ("kv_shared_layers", self.kv_shared_layers > 0),
                         ("per_layer_input_size", self.per_layer_input_size > 0),
                         ("quantize_kvcache", self.quantize_kvcache)):
            check(not on, name, "is not built with DeepSeek-V4's compressed attention "
                  "(compress_ratios)")

    @property
    def compress_dense_ratio(self) -> int:
        """The ratio of DeepSeek-V4's heavily compressed layers (0: none)."""
        heavy = [r for r in self.compress_ratios or () if r and r != self.compress_sparse_ratio]
        return heavy[0] if heavy else 0

    def _validate_global(self, check):
        """Gemma 4's global layers: a RoPE model of softmax layers, the query heads in whole
        groups, plain RoPE scaling."""
        for name in ("global_kv_channels", "global_num_query_groups"):
            check(getattr(self, name) is None or getattr(self, name) > 0, name,
                  "must be positive (or None: the ordinary layers' value)")
        K, H = self.attention_shape(wide=True)
        check(self.num_attention_heads % K == 0, "global_num_query_groups",
              f"{K} does not divide num_attention_heads {self.num_attention_heads}")
        check(H % 2 == 0, "global_kv_channels", f"{H} must be even (RoPE pairs channels)")
        p = self.global_rotary_percent
        check(p is None or 0 < p <= 1, "global_rotary_percent", "must be in (0, 1]")
        for name, bad in (("multi_latent_attention", self.multi_latent_attention),
                          ("linear_attention_freq", self.linear_attention_layers is not None),
                          ("no_rope_freq", self.no_rope_layers is not None),
                          ("use_rope_scaling", self.use_rope_scaling),
                          ("rotary_interleaved", self.rotary_interleaved),
                          ("rotary_seq_len_interpolation_factor",
                           bool(self.rotary_seq_len_interpolation_factor))):
            check(not bad, name, "is not built together with Gemma 4's global layers "
                  "(global_kv_channels, global_num_query_groups, attention_k_eq_v, "
                  "global_rotary_percent)")
        check(self.rope_type == "rope", "rope_type", "Gemma 4's global layers (global_kv_channels, "
              "global_num_query_groups, attention_k_eq_v, global_rotary_percent) take plain RoPE")
        check(self.position_embedding_type == "rope", "position_embedding_type",
              "Gemma 4's global layers (global_kv_channels, global_num_query_groups, "
              "attention_k_eq_v, global_rotary_percent) take RoPE")

    def _validate_linear(self, check, choice):
        """Gated DeltaNet's shapes: whole value heads per key head, a causal convolution."""
        layers = self.linear_attention_layers
        check(layers is None or len(layers) == self.num_layers, "linear_attention_freq",
              f"names {len(layers or ())} layers of {self.num_layers}")
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_chunk_size"):
            check(getattr(self, name) > 0, name, "must be positive")
        check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
              "linear_num_value_heads", f"{self.linear_num_value_heads} is not a multiple of "
              f"linear_num_key_heads {self.linear_num_key_heads} (each key head serves whole "
              "value heads)")
        check(self.linear_attention_impl in ("xla", "pallas"), "linear_attention_impl",
              f"{self.linear_attention_impl!r} is not one of ('xla', 'pallas')")
        choice("linear_attention_kind", ("gdn", "kda"))
        if self.linear_attention_kind == "kda":
            check(self.kda_decay_rank is None or self.kda_decay_rank > 0, "kda_decay_rank",
                  "must be positive")
            check(not (self.kda_gate_bias and self.kda_full_rank_gate), "kda_gate_bias",
                  "biases the low-rank gate's up projection; the full-rank gate has none")
            check(self.kda_gate_lower_bound is None or self.kda_gate_lower_bound < 0,
                  "kda_gate_lower_bound", "bounds a log-decay: give a negative bound")
        if self.linear_attention_impl == "pallas":
            C = self.linear_chunk_size
            check(C >= 16 and not C & (C - 1), "linear_chunk_size", f"{C}: the Pallas kernel "
                  "takes powers of two of at least 16 (Triton tiles); use 16, 32, 64 or 128, "
                  "or linear_attention_impl xla")
        check(not self.multi_latent_attention or self.hybrid_layers is not None
              or self.linear_attention_kind == "kda", "experimental_attention_variant",
              "Gated DeltaNet layers beside multi-latent attention are built in hybrid models "
              "only (hybrid_layer_pattern); Kimi Delta Attention takes them anywhere")

    def _validate_hybrid(self, check):
        """A hybrid pattern: one known symbol per layer, whole Mamba heads per group, and none
        of the layer variations that pair a mixer with an FFN."""
        pattern = self.hybrid_layers
        bad = sorted(set(pattern) - set("M*G-E"))
        check(not bad, "hybrid_layers", f"{''.join(bad)!r}: the symbols are M (Mamba), * "
              "(attention), G (Gated DeltaNet), - (MLP) and E (MoE)")
        check(len(pattern) == self.num_layers, "hybrid_layers",
              f"names {len(pattern)} layers of {self.num_layers}")
        check("E" not in pattern or self.moe is not None, "hybrid_layers",
              "has MoE layers (E) and the model has no MoE settings")
        check("E" in pattern or self.moe is None, "hybrid_layers",
              "has no MoE layers (E) but the model has MoE settings")
        if "M" in pattern:   # the Mamba sizes matter only with Mamba layers
            for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                         "mamba_conv_kernel_dim", "mamba_chunk_size"):
                check(getattr(self, name) > 0, name, "must be positive")
            check(self.mamba_heads % self.mamba_num_groups == 0, "mamba_num_groups",
                  f"{self.mamba_num_groups} does not divide the {self.mamba_heads} Mamba heads")
        for name, on in (("linear_attention_freq", self.linear_attention_layers is not None),
                         ("parallel_residual", self.parallel_residual),
                         ("apply_residual_connection_post_layernorm",
                          self.apply_residual_connection_post_layernorm),
                         ("global_kv_channels", self.has_global_shape),
                         ("layer_scalar", self.layer_scalar)):
            check(not on, name, "is not built for hybrid models (hybrid_layers)")
        check(self.pre_norm, "pre_norm", "hybrid models' layers are pre-norm")

    def _validate_small_gemma4(self, check):
        """Per-layer inputs and KV sharing: dense softmax-attention layers, every kind of
        sharing layer with an earlier layer of its kind to read."""
        n = self.kv_shared_layers
        check(0 <= n < self.num_layers, "kv_shared_layers", f"{n}: must leave at least one "
              f"of the {self.num_layers} layers computing its own keys and values")
        check(self.per_layer_input_size >= 0, "per_layer_input_size", "must be 0 (off) or "
              "positive")
        check(self.per_layer_vocab_size is None or self.per_layer_vocab_size > 0,
              "per_layer_vocab_size", "must be positive (or None: vocab_size)")
        check(not self.double_wide_shared_mlp or n, "double_wide_shared_mlp",
              "widens the MLP of the KV-sharing layers, and kv_shared_layers is 0")
        for name, on in (("num_moe_experts", self.moe is not None),
                         ("hybrid_layer_pattern", self.hybrid_layers is not None),
                         ("linear_attention_freq", self.linear_attention_layers is not None),
                         ("lfm_layer_types", self.short_conv_layers is not None),
                         ("multi_latent_attention", self.multi_latent_attention),
                         ("mtp_num_layers", self.mtp_num_layers > 0)):
            check(not on, name, "is not built together with Gemma 4 small's per-layer inputs "
                  "or KV sharing (hidden_size_per_layer_input, num_kv_shared_layers)")
        if not n:
            return
        for name, on in (("qk_norm_across_heads", self.qk_norm_across_heads),
                         ("qk_l2_norm", self.qk_l2_norm),
                         ("qk_norm_rope_layers_only", self.qk_norm_rope_layers_only),
                         ("attn_temperature_tuning", self.attn_temperature_tuning),
                         ("apply_query_key_layer_scaling", self.apply_query_key_layer_scaling)):
            check(not on, name, "is not built together with KV sharing "
                  "(num_kv_shared_layers)")
        first = self.num_layers - n
        own = {self.kv_kind(i) for i in range(first)}
        missing = {self.kv_kind(i) for i in range(first, self.num_layers)} - own
        check(not missing, "kv_shared_layers", f"the last {n} layers include "
              f"{' and '.join(sorted(missing))} layers, and no earlier layer of that kind "
              "computes keys and values for them")

    def kv_kind(self, i: int) -> str:
        """'sliding' or 'global': the kind of 0-based layer i whose keys and values a
        KV-sharing layer of the same kind reads."""
        return "global" if self.window_of_layer(i) is None else "sliding"

    @property
    def kv_roles(self) -> tuple[str | None, ...]:
        """Each layer's part in KV sharing: 'reuse' (reads an earlier layer's keys and values),
        'store' (the last layer of its kind before the sharing ones: they read its keys and
        values) or None."""
        n, L = self.kv_shared_layers, self.num_layers
        roles = [None] * (L - n) + ["reuse"] * n
        if n:
            for kind in {self.kv_kind(i) for i in range(L - n, L)}:
                roles[max(i for i in range(L - n) if self.kv_kind(i) == kind)] = "store"
        return tuple(roles)

    @property
    def mamba_heads(self) -> int:
        """Mamba heads per layer (Megatron: mamba_num_heads, else 2·hidden / head width)."""
        return self.mamba_num_heads

    @property
    def has_global_shape(self) -> bool:
        """Whether the global layers differ from the sliding-window ones (Gemma 4)."""
        return (self.global_kv_channels is not None or self.global_num_query_groups is not None
                or self.attention_k_eq_v or self.global_rotary_percent is not None)

    @property
    def global_layers(self) -> tuple[bool, ...] | None:
        """Which layers live in the global stacks (Gemma 4; None: no such layers)."""
        if not self.has_global_shape:
            return None
        return tuple(self.window_of_layer(i) is None for i in range(self.num_layers))

    def attention_shape(self, wide: bool = False) -> tuple[int, int]:
        """(key/value heads, head width) of the ordinary layers, or of the global ones."""
        if not wide:
            return self.num_kv_heads, self.head_dim
        return (self.global_num_query_groups or self.num_kv_heads,
                self.global_kv_channels or self.head_dim)

    def is_linear(self, i: int) -> bool:
        """Whether 0-based layer ``i`` is a Gated DeltaNet (linear-attention) layer."""
        return bool(self.linear_attention_layers and self.linear_attention_layers[i])

    @property
    def head_dim(self) -> int:
        """Width of a q/k head as attention sees it (MLA: the no-RoPE plus the RoPE part)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    @property
    def mla_softmax_scale(self) -> float:
        """MLA's softmax scale mscale^2/sqrt(head_dim), mscale = 0.1*mscale_all_dim*ln(f) + 1
        for the rotary scaling factor f > 1 (1 otherwise), whatever the rope_type (Megatron)."""
        f, a = self.yarn_scaling_factor, self.yarn_mscale_all_dim
        m = 1.0 if f <= 1 else 0.1 * a * math.log(f) + 1.0
        return m * m / math.sqrt(self.head_dim)

    def is_nope(self, i: int) -> bool:
        """Whether 0-based layer ``i`` skips RoPE (a Llama 4 NoPE layer)."""
        return bool(self.no_rope_layers and self.no_rope_layers[i])

    def window_of_layer(self, i: int) -> int | None:
        """The sliding window of 0-based layer ``i`` (None: it attends to the whole prefix)."""
        if self.sliding_window_layers is None or self.sliding_window_layers[i]:
            return self.sliding_window
        return None

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def param_dtype(self):
        return jnp.dtype(self.weight_dtype)

    @property
    def residual_dtype(self):
        return jnp.dtype("float32") if self.fp32_residual_connection else self.compute_dtype

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a flat config of canonical knobs: a resolved Config, or a partial mapping
        that :func:`jaxtrain.config.complete` fills with the registry's defaults. The
        translation is :func:`jaxtrain.models.from_knobs.build`."""
        return from_knobs.build(cls, cfg, accelerator)


_ASSUMED_ACCELERATOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxtrain_assumed_accelerator", default=None)


@contextlib.contextmanager
def assumed_accelerator(kind: str):
    """Inside, :func:`accelerator` answers ``kind`` without asking JAX: for building a
    ModelConfig before the backend may start (start-up reads the model's size to set XLA
    flags, and XLA reads its flags once, when the backend starts)."""
    token = _ASSUMED_ACCELERATOR.set(kind)
    try:
        yield
    finally:
        _ASSUMED_ACCELERATOR.reset(token)


def accelerator() -> str:
    """'cuda', 'rocm' or 'cpu' (anything else) for JAX's default backend (which this starts),
    or the kind :func:`assumed_accelerator` holds."""
    assumed = _ASSUMED_ACCELERATOR.get()
    if assumed is not None:
        return assumed
    if jax.default_backend() != "gpu":
        return "cpu"
    client = jax.devices()[0].client
    name = f"{client.platform} {client.platform_version}".lower()
    return "rocm" if "rocm" in name or "hip" in name else "cuda"


# The flash kernel's tuning table stops at this head dim (kernels/flash_attention/tuning.py).
_FLASH_MAX_HEAD_DIM = 256


def auto_attention_impl(cfg: ModelConfig) -> str:
    """What attention_impl='auto' becomes: the flash kernel on a GPU when it can run the
    model's attention (no attention dropout, a tuned head dim), else xla (always on CPU, where
    the kernel only runs interpreted)."""
    if accelerator() == "cpu" or cfg.attention_dropout > 0 or cfg.compress_ratios is not None:
        return "xla"
    if cfg.flash_block_sizes is None and cfg.head_dim > _FLASH_MAX_HEAD_DIM:
        return "xla"
    return "flash"


_XLA_KNOBS = ("attention: dot_product, attention_backend: unfused or "
              "model.attn_implementation: eager")


def attention_problems(cfg: ModelConfig) -> list[str]:
    """Why ``cfg.attention_impl`` cannot compute the attention ``cfg`` describes (empty: it can).

    Nothing is dropped silently: a feature a backend lacks is a problem to fix in the config.
    """
    impl, problems = cfg.attention_impl, []
    if impl == "xla":
        return problems
    name = {"flash": "the flash-attention kernel", "cudnn": "cuDNN attention"}[impl]

    def no(feature, fix):
        problems.append(f"attention_impl={impl!r}: {name} has no {feature}; {fix}, or use "
                        f"the xla implementation ({_XLA_KNOBS}).")

    if cfg.compress_ratios is not None:
        no("DeepSeek-V4 compressed attention (compress_ratios: local keys and compressed "
           "entries in one softmax)", "leave attention_impl at auto")
    if cfg.attention_dropout > 0:
        no(f"dropout on the attention probabilities (attention_dropout = "
           f"{cfg.attention_dropout})", "set attention_dropout to 0")
    widths = {cfg.head_dim: "kv_channels"}
    if cfg.has_global_shape:   # Gemma 4's global layers
        widths.setdefault(cfg.attention_shape(wide=True)[1], "global_kv_channels")
    if impl == "flash":
        for width, knob in widths.items():
            if cfg.flash_block_sizes is None and width > _FLASH_MAX_HEAD_DIM:
                no(f"tuned tiles for head dim {width} ({knob}; at most "
                   f"{_FLASH_MAX_HEAD_DIM})", "pass flash_block_sizes")
        return problems
    platform = accelerator()
    if platform != "cuda":
        problems.append(f"attention_impl='cudnn' (attention: cudnn_flash_jax) needs an NVIDIA GPU "
                        f"with cuDNN, and JAX's default backend here is {platform}; use the "
                        f"flash kernel (attention: flash) or {_XLA_KNOBS}.")
    if cfg.attn_logit_softcapping:
        no(f"logit soft-capping (attn_logit_softcapping = {cfg.attn_logit_softcapping})",
           "use the flash kernel (attention: flash)")
    if cfg.attention_sinks:
        no("attention sinks (use_sink_attention: the learned per-head softmax column)",
           "use the flash kernel (attention: flash)")
    if cfg.dtype not in ("bfloat16", "float16"):
        no(f"{cfg.dtype} inputs (dtype; it takes bfloat16 or float16)", "change dtype")
    for width, knob in widths.items():
        if width % 8 or width > 256:
            no(f"support for head dim {width} ({knob}; a multiple of 8, at most 256)",
               f"change {knob}")
    return problems
