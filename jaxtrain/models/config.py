"""`ModelConfig`: the architecture of a dense decoder, named after the Megatron/MaxText knobs.

Research code builds one by hand; the trainer builds one from the resolved flat config with
:meth:`ModelConfig.from_config`. ``None`` sizes are derived in ``__post_init__`` the way Megatron
derives them, so the stored config is always complete.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxtrain.config.errors import ConfigError
from jaxtrain.models.attention import ATTENTION_IMPLS
from jaxtrain.models.moe.config import MoEConfig, moe_pattern, parse_layer_freq
from jaxtrain.models.remat import REMAT_POLICIES
from jaxtrain.quant.config import from_config as quant_config
from jaxtrain.quant.kvcache import KV_QUANT_AXES, KV_QUANT_DTYPES

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
ROPE_TYPES = ("rope", "yarn")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "quick_gelu", "squared_relu", "relu")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "mla_up_proj")
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
    """Architecture, numerics and layer-stack knobs of a dense decoder-only LM."""

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
    # Which layers sliding_window applies to (one bool per layer; None: all), e.g. gpt-oss's
    # windowed even layers. Scanned layers read it by layer index (see transformer.py).
    sliding_window_layers: tuple[bool, ...] | None = None
    # gpt-oss / Primus sink attention: a learned fp32 logit per query head, an extra softmax
    # column without a value, in every layer.
    attention_sinks: bool = False
    # Multi-latent attention (DeepSeek-V2/V3, Megatron MLA; see mla.py). q/k heads are
    # qk_head_dim + qk_pos_emb_head_dim wide, values v_head_dim; qk_layernorm puts a norm on the
    # q and kv latents (Megatron's spec; DeepSeek checkpoints have them).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None             # None: queries projected directly from hidden
    kv_lora_rank: int = 32
    qk_head_dim: int = 128                     # per-head q/k width without RoPE
    qk_pos_emb_head_dim: int = 64              # per-head q/k RoPE width (keys share one head)
    v_head_dim: int = 128
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # "xla" (plain jnp), "flash" (our Pallas kernel; interpreted on CPU), "cudnn"
    # (jax.nn cuDNN attention, NVIDIA only); "auto" resolves here: see `auto_attention_impl`.
    attention_impl: str = "xla"
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
        if self.multi_latent_attention:
            self._validate_mla(check)
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
            check(self.recompute_num_layers is not None and self.recompute_num_layers > 0,
                  "recompute_num_layers", "recompute_method needs a positive layer count")
            check(self.recompute_layer_ids is None, "recompute_layer_ids",
                  "exclusive with recompute_method")
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
        """Build from a resolved flat config (canonical knob keys); missing keys take defaults.

        Defaults are Megatron's (Primus) where Megatron has the knob. ``dtype`` wins over
        ``bf16``/``fp16`` when present. A Megatron ``recompute_granularity`` wins over
        ``remat_policy``. The attention implementation comes from the knobs of every dialect
        that name a kernel (see `_attention_choice`); those naming one must agree.
        Megatron's ``attention_softmax_in_fp32`` is read only when a Megatron knob picked the
        unfused (xla) path, as in Megatron, whose fused kernels always work in fp32.
        """
        g = cfg.get
        h = g("hidden_size", 1024)
        heads = g("num_attention_heads", 16)
        groups = g("num_query_groups") if g("group_query_attention", False) else None
        if g("mlp_activations") is not None:    # MaxText's spelling decides when it is set
            from jaxtrain.config.dialects.maxtext_model import mlp_from_activations
            try:
                activation, gated = mlp_from_activations(g("mlp_activations"))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        else:
            activation, gated = _megatron_activation(g)

        vocab = g("vocab_size")
        if vocab is None:
            raise ValueError("vocab_size is unset; set it or let the tokenizer supply it")
        multiple = g("make_vocab_size_divisible_by", 128) * g("tensor_model_parallel_size", 1)
        vocab = int(math.ceil(vocab / multiple) * multiple)

        pos = g("position_embedding_type", "learned_absolute")
        if g("use_rotary_position_embeddings"):
            pos = "rope"
        norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(
            str(g("normalization", "LayerNorm")).lower(), g("normalization"))

        if "dtype" in cfg:
            dtype = g("dtype")
        else:
            dtype = "float16" if g("fp16", False) else "bfloat16" if g("bf16", True) else "float32"

        attention_impl, chosen_by, megatron_unfused = _attention_choice(cfg)
        softmax_fp32 = (g("attention_softmax_in_fp32", False) or not megatron_unfused
                        or g("apply_query_key_layer_scaling", False))
        f32_product, f32_logits = g("float32_qk_product"), g("float32_logits")
        if g("attention") == "dot_product" and not megatron_unfused and (
                f32_product is not None or f32_logits is not None):
            # MaxText's dot_product attention (its knobs set, as in every MaxText file) keeps
            # scores and softmax in the compute dtype unless float32_qk_product (an fp32
            # product, hence fp32 scores) or float32_logits asks for float32.
            softmax_fp32 = bool(f32_product or f32_logits
                                or g("apply_query_key_layer_scaling", False))

        remat, method, nlayers, layer_ids, modules = _recompute(cfg)
        if g("moe_layer_recompute", False):   # Megatron: selective recompute of the MoE block
            if g("recompute_granularity") == "full":
                raise ConfigError("moe_layer_recompute recomputes the MoE block selectively; it "
                                  "cannot be combined with recompute_granularity full")
            modules = tuple(modules) + ("moe",)
        custom = tuple((name, g(name)) for name in _REMAT_TENSOR_NAMES if g(name) is not None)
        mla = bool(g("multi_latent_attention", False))
        rope_type = g("rope_type") or ("yarn" if mla else "rope")   # Megatron: MLA takes yarn
        rope = _rope_fields(g, rope_type)
        hidden_dropout, attention_dropout = (float(g("hidden_dropout", 0.1)),
                                             float(g("attention_dropout", 0.1)))
        if g("enable_dropout", True) is False:    # MaxText: no dropout anywhere
            hidden_dropout = attention_dropout = 0.0

        fields = dict(
            num_layers=g("num_layers", 24), hidden_size=h, num_attention_heads=heads,
            num_query_groups=groups, kv_channels=g("kv_channels"),
            ffn_hidden_size=g("ffn_hidden_size"), vocab_size=vocab,
            max_position_embeddings=g("max_position_embeddings") or g("seq_length", 4096),
            position_embedding_type=pos, rotary_percent=float(g("rotary_percent", 1.0)),
            rotary_interleaved=g("rotary_interleaved", False), **rope,
            yarn_scaling_factor=float(g("rotary_scaling_factor", 1.0)),
            yarn_mscale=float(g("mscale", 1.0)),
            yarn_mscale_all_dim=float(g("mscale_all_dim", 1.0)),
            **_yarn_range(g),
            normalization=norm, norm_epsilon=float(g("norm_epsilon", 1e-5)),
            apply_layernorm_1p=g("apply_layernorm_1p", False),
            qk_layernorm=g("qk_layernorm", False), qk_l2_norm=g("qk_l2_norm", False),
            activation=activation, gated_linear_unit=gated,
            add_bias_linear=g("add_bias_linear", False),
            add_qkv_bias=g("add_qkv_bias", False) or (g("add_bias_linear", False) and not mla),
            hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
            untie_embeddings_and_output_weights=g("untie_embeddings_and_output_weights", True),
            fp32_residual_connection=g("fp32_residual_connection", False),
            apply_residual_connection_post_layernorm=g(
                "apply_residual_connection_post_layernorm", False),
            init_method_std=float(g("init_method_std", 0.02)),
            init_method_xavier_uniform=g("init_method_xavier_uniform", False),
            apply_query_key_layer_scaling=g("apply_query_key_layer_scaling", False),
            attention_softmax_in_fp32=softmax_fp32,
            **_sink_fields(cfg), **_mla_fields(cfg),
            final_logit_softcapping=g("final_logit_softcapping") or None,
            attn_logit_softcapping=g("attn_logit_softcapping") or None,
            attention_impl=attention_impl,
            dtype=dtype, weight_dtype=_weight_dtype(cfg, dtype),
            quant=quant_config(cfg, accelerator()),
            quantize_kvcache=g("quantize_kvcache", False),
            kv_quant_axis=g("kv_quant_axis", "heads_and_dkv") or "",
            kv_quant_dtype=g("kv_quant_dtype", "int8"),
            logits_dot_in_fp32=g("logits_dot_in_fp32", False),
            use_iota_embed=g("use_iota_embed", False), scan_layers=g("scan_layers", True),
            param_scan_axis=g("param_scan_axis", 1), remat_policy=remat, remat_tensors=custom,
            recompute_method=method, recompute_num_layers=nlayers,
            recompute_layer_ids=layer_ids, recompute_modules=modules, moe=_moe_config(cfg),
        )
        _check_expert_activation(g, fields["moe"], fields["num_layers"])
        try:
            return cls(**fields)
        except ConfigError as e:
            raise ConfigError([f"{p} ({attention_impl!r} was chosen by {chosen_by}.)"
                               for p in e.problems]) from None
        except ValueError as e:
            raise ValueError(_knob_message(str(e))) from None


# ModelConfig fields read from a knob of another name: a config's problem names the knob.
_FIELD_KNOBS = {"sliding_window": "sliding_window_size",
                "sliding_window_layers": "window_attn_skip_freq",
                "yarn_scaling_factor": "rotary_scaling_factor", "yarn_mscale": "mscale",
                "yarn_mscale_all_dim": "mscale_all_dim"}


def _knob_message(text: str) -> str:
    """A ModelConfig validation message ("ModelConfig.field: ...") as the config's knob."""
    prefix, sep, rest = text.partition(": ")
    if not sep or not prefix.startswith("ModelConfig."):
        return text
    field = prefix.removeprefix("ModelConfig.")
    return f"{_FIELD_KNOBS.get(field, field)}: {rest}"


# MoEConfig fields (in its messages) -> the Megatron knobs they are read from.
_MOE_KNOBS = {"topk": "moe_router_topk", "num_groups": "moe_router_num_groups",
              "group_topk": "moe_router_group_topk",
              "group_score_topk": "moe_router_group_score_topk",
              "score_function": "moe_router_score_function",
              "drop_policy": "moe_token_drop_policy", "dispatcher": "moe_token_dispatcher_type",
              "force_balancing": "moe_router_force_load_balancing_type",
              "router_dtype": "moe_router_dtype", "aux_loss_coeff": "moe_aux_loss_coeff",
              "pad_to_capacity": "moe_pad_expert_input_to_capacity",
              "load balancing type": "moe_router_load_balancing_type",
              "load balancing types": "moe_router_load_balancing_type",
              "expert bias": "moe_router_enable_expert_bias",
              "capacity factor": "moe_expert_capacity_factor"}
_MOE_WORDS = re.compile(r"(?<![\w.])(" + "|".join(
    re.escape(k) for k in sorted(_MOE_KNOBS, key=len, reverse=True)) + r")(?![\w])")


def _moe_knob_message(text: str) -> str:
    """An MoEConfig problem with its fields named as the knobs they come from."""
    return _MOE_WORDS.sub(lambda m: _MOE_KNOBS[m.group(1)], text.removeprefix("MoEConfig: "))


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
    if accelerator() == "cpu" or cfg.attention_dropout > 0:
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

    if cfg.attention_dropout > 0:
        no(f"dropout on the attention probabilities (attention_dropout = "
           f"{cfg.attention_dropout})", "set attention_dropout to 0")
    if impl == "flash":
        if cfg.flash_block_sizes is None and cfg.head_dim > _FLASH_MAX_HEAD_DIM:
            no(f"tuned tiles for head dim {cfg.head_dim} (kv_channels; at most "
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
    if cfg.head_dim % 8 or cfg.head_dim > 256:
        no(f"support for head dim {cfg.head_dim} (kv_channels; a multiple of 8, at most 256)",
           "change kv_channels")
    return problems


# Per knob: value -> implementation ("auto": the knob leaves the choice open).
_ATTENTION_SPELLINGS = {
    "attention": {"dot_product": "xla", "flash": "flash", "cudnn_flash_jax": "cudnn",
                  "cudnn_flash_te": "auto", "autoselected": "auto"},
    "attention_backend": {"flash": "flash", "fused": "flash", "unfused": "xla", "local": "xla",
                          "auto": "auto"},
    "use_flash_attn": {True: "auto", False: "xla"},
    "transformer_impl": {"local": "xla", "transformer_engine": "auto",
                         "inference_optimized": "auto"},
    "model.attn_implementation": {"eager": "xla", "sdpa": "auto", "flash_attention_2": "flash"},
}
_MEGATRON_ATTENTION_KNOBS = ("attention_backend", "use_flash_attn", "transformer_impl")


def _attention_choice(cfg: Mapping[str, Any]) -> tuple[str, str, bool]:
    """(attention_impl, the knobs that chose it, whether a Megatron knob asked for unfused).

    Every knob that names a kernel must name the same implementation, whatever its dialect; a
    conflict is a ConfigError naming them. Values meaning "a fused kernel where it fits" name
    none and leave the choice to auto (`auto_attention_impl`: the flash kernel on a GPU): MaxText
    autoselected and cudnn_flash_te (TransformerEngine; the Primus default), Megatron auto,
    use_flash_attn true and transformer_impl transformer_engine, HF sdpa. So every knob's
    default leaves it open. Primus ``use_turbo_attention`` names flash only with
    ``enable_primus_turbo`` on, as in Primus.
    """
    asks = []
    for key, spellings in _ATTENTION_SPELLINGS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if value not in spellings:
            raise ConfigError(f"{key} = {value!r} is not an attention kernel jaxtrain trains "
                              f"with; use one of {sorted(spellings, key=str)}.")
        asks.append((key, value, spellings[value]))
    if cfg.get("use_turbo_attention") and cfg.get("enable_primus_turbo"):
        asks.append(("use_turbo_attention", True, "flash"))
    named = [(k, v, impl) for k, v, impl in asks if impl != "auto"]
    impls = {impl for _, _, impl in named}
    if len(impls) > 1:
        raise ConfigError("attention knobs disagree: " + ", ".join(
            f"{k} = {v!r} selects {impl!r}" for k, v, impl in named)
            + ". Set one of them, or make them name the same implementation.")
    if not impls:
        return "auto", "no attention knob naming a kernel (auto)", False
    impl = impls.pop()
    unfused = impl == "xla" and any(k in _MEGATRON_ATTENTION_KNOBS for k, _, _ in named)
    return impl, ", ".join(f"{k} = {v!r}" for k, v, _ in named), unfused


def _megatron_activation(g) -> tuple[str, bool]:
    """(activation, gated) from Megatron's exclusive activation switches."""
    flags = [k for k in ("swiglu", "quick_geglu", "openai_gelu", "squared_relu")
             if g(k, k == "swiglu")]
    if len(flags) > 1:
        raise ValueError(f"activation knobs {flags} are exclusive; set only one")
    activation, gated = {
        "swiglu": ("silu", True), "quick_geglu": ("quick_gelu", True),
        "openai_gelu": ("gelu_tanh", False), "squared_relu": ("squared_relu", False),
    }.get(flags[0] if flags else None, ("gelu", False))
    if activation == "gelu" and g("add_bias_linear", False) and g("bias_gelu_fusion", True):
        activation = "gelu_tanh"  # Megatron's fused bias-GeLU is the tanh approximation
    return activation, gated


def _rope_fields(g, rope_type: str) -> dict:
    """RoPE fields from Megatron's knobs and MaxText's timescales.

    MaxText's timescales run geometrically from rope_min_timescale m to rope_max_timescale M
    (the rotary_base alias) and rope_linear_scaling_factor s multiplies them: the angle of
    channel pair i is pos / (s m (M/m)^(2i/R)), which is RoPE with base M/m on positions
    divided by s*m. MaxText's llama3.1 rope_type is Llama-3.1 scaling with fixed constants."""
    low, factor = float(g("rope_min_timescale", 1.0)), float(g("rope_linear_scaling_factor", 1.0))
    if low <= 0 or factor <= 0:
        raise ConfigError(f"rope_min_timescale ({low}) and rope_linear_scaling_factor ({factor}) "
                          "must be positive")
    interpolation = (g("rotary_seq_len_interpolation_factor") or 1.0) * low * factor
    fields = dict(rotary_base=float(g("rotary_base", 10000)) / low,
                  rotary_seq_len_interpolation_factor=(None if interpolation == 1.0
                                                       else interpolation),
                  use_rope_scaling=g("use_rope_scaling", False),
                  rope_scaling_factor=float(g("rope_scaling_factor", 8.0)),
                  rope_low_freq_factor=float(g("rope_low_freq_factor", 1.0)),
                  rope_high_freq_factor=float(g("rope_high_freq_factor", 4.0)),
                  original_max_position_embeddings=g("original_max_position_embeddings"),
                  rope_type=rope_type)
    if rope_type == "llama3.1":
        fields.update(rope_type="rope")
        if g("rope_use_scale", True):   # MaxText's constants: factor 8, 1/4, 8192 tokens
            fields.update(use_rope_scaling=True, rope_scaling_factor=8.0,
                          original_max_position_embeddings=8192)
    return fields


def _yarn_range(g) -> dict:
    """YaRN's correction range (Megatron-LM's yarn_* names; unset: its 32, 1 and rounding)."""
    fast, slow, rounded = (g("yarn_beta_fast"), g("yarn_beta_slow"),
                           g("yarn_correction_range_round_to_int"))
    return dict(yarn_beta_fast=32.0 if fast is None else float(fast),
                yarn_beta_slow=1.0 if slow is None else float(slow),
                yarn_truncate=True if rounded is None else bool(rounded))


def _expert_activation(g) -> tuple[str | None, float | None]:
    """(MoEConfig.activation, glu_limit): GPT-OSS's clamped GLU is Megatron's quick_geglu with
    glu_linear_offset 1 and activation_func_clamp_value; other offsets or clamps are not built."""
    clamp, offset = g("activation_func_clamp_value"), float(g("glu_linear_offset") or 0.0)
    if clamp is None and not offset:
        return None, None
    if not (g("quick_geglu", False) and offset == 1.0 and clamp is not None and clamp > 0):
        raise ConfigError(f"activation_func_clamp_value = {clamp!r} with glu_linear_offset = "
                          f"{offset!r}: jaxtrain builds only GPT-OSS's clamped GLU (quick_geglu, "
                          f"offset 1, a positive clamp), in MoE experts")
    return "swiglu_oai", float(clamp)


def _check_expert_activation(g, moe, num_layers: int) -> None:
    """The clamped GLU exists in the experts only: every layer must be an MoE layer."""
    if _expert_activation(g)[0] is None:
        return
    if moe is None or not all(moe_pattern(moe, num_layers)):
        raise ConfigError("GPT-OSS's clamped GLU (activation_func_clamp_value, "
                          "glu_linear_offset) is built in MoE experts only, and this model has "
                          "dense layers (moe_layer_freq)")


def _weight_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    """The parameters' storage dtype: MaxText's ``weight_dtype``, or the training dtype when
    the optimizer keeps the master weights itself (Megatron ``main_params_dtype`` fp16)."""
    if cfg.get("use_precision_aware_optimizer") and cfg.get("main_params_dtype",
                                                            "fp32") != "fp32":
        return dtype
    return cfg.get("weight_dtype", "float32")


def _sink_fields(cfg: Mapping[str, Any]) -> dict:
    """Window and sink fields from ``sliding_window_size`` and Primus's sink-attention knobs.

    ``use_sink_attention`` gives every layer a learned sink logit per head. Primus hands
    ``sink_sliding_window`` W to flash-attn as the window (W, 0): W keys back plus the query's
    own, so W + 1 keys here; on the even (0-based) layers with ``sink_window_even_layers_only``,
    else on all. As in Primus both window knobs act only with sinks on, and a model-wide window
    beside them is refused.
    """
    g = cfg.get
    fields = {"sliding_window": g("sliding_window_size") or None,
              "attention_sinks": bool(g("use_sink_attention", False))}
    sink_window = g("sink_sliding_window") or 0
    if fields["attention_sinks"] and sink_window:
        if fields["sliding_window"]:
            raise ConfigError(f"sliding_window_size = {fields['sliding_window']} and "
                              f"sink_sliding_window = {sink_window} both set a window; sink "
                              "attention takes only sink_sliding_window (as in Primus): set one.")
        fields["sliding_window"] = sink_window + 1
        if g("sink_window_even_layers_only", True):
            fields["sliding_window_layers"] = tuple(i % 2 == 0
                                                    for i in range(g("num_layers", 24)))
    megatron = _megatron_window(g)
    if megatron:
        if fields["sliding_window"]:
            raise ConfigError(f"window_size = {g('window_size')!r} and a window of "
                              f"{fields['sliding_window']} tokens (sliding_window_size or "
                              "sink_sliding_window) both set the sliding window: set one.")
        fields.update(megatron)
    return fields


def _megatron_window(g) -> dict:
    """Megatron-LM's ``window_size`` (left, right): each token sees ``left`` tokens back and
    itself (left + 1 keys; -1: unbounded), none ahead (a causal model; right 0 or -1), on the
    layers ``window_attn_skip_freq`` picks (1-based layer l is windowed unless N divides l, or
    as a 0/1 per-layer list says; unset: every layer), as ``is_layer_window_attention`` does."""
    size = g("window_size")
    if size is None:
        return {}
    if isinstance(size, str):
        size = [int(v) for v in size.strip("()[] ").split(",") if v.strip()]
    if len(size) != 2 or size[1] not in (0, -1) or size[0] < -1:
        raise ConfigError(f"window_size = {g('window_size')!r}: give (left, 0), left tokens "
                          "back (-1: unbounded) and none ahead, as a causal model attends")
    if size[0] == -1:
        return {}
    layers, freq = g("num_layers", 24), g("window_attn_skip_freq")
    if freq is None:
        return {"sliding_window": size[0] + 1}
    try:
        freq = parse_layer_freq(freq)   # the same int / 0-1 list forms as moe_layer_freq
    except ValueError as e:
        raise ConfigError(str(e).replace("moe_layer_freq", "window_attn_skip_freq")) from None
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"window_attn_skip_freq = {freq}: give a positive N (every Nth "
                              "layer attends fully) or a 0/1 list per layer")
        pattern = tuple((i + 1) % freq != 0 for i in range(layers))
    else:
        pattern = tuple(bool(v) for v in freq)
        if len(pattern) != layers:
            raise ConfigError(f"window_attn_skip_freq has {len(pattern)} entries for "
                              f"{layers} layers (num_layers)")
    return {"sliding_window": size[0] + 1, "sliding_window_layers": pattern} if any(
        pattern) else {}


def _mla_fields(cfg: Mapping[str, Any]) -> dict:
    """Multi-latent attention fields (Megatron's CLI defaults) when it is switched on."""
    g = cfg.get
    if not g("multi_latent_attention", False):
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=g("q_lora_rank") or None,
                kv_lora_rank=g("kv_lora_rank", 32), qk_head_dim=g("qk_head_dim", 128),
                qk_pos_emb_head_dim=g("qk_pos_emb_head_dim", 64),
                v_head_dim=g("v_head_dim", 128))


_REMAT_TENSOR_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj",
                       "qkv_proj", "context", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")


def _recompute(cfg: Mapping[str, Any]):
    """(remat_policy, method, num_layers, layer_ids, modules) from MaxText or Megatron knobs."""
    g = cfg.get
    granularity = g("recompute_granularity")
    if granularity is None and g("recompute_activations"):
        granularity = "selective"
    if granularity is None and g("checkpoint_activations"):
        return "full", "uniform", g("recompute_num_layers") or 1, None, ()
    if granularity is None:
        policy = g("remat_policy", "none")
        return ("none" if policy in (None, "") else policy), None, None, None, ()
    if granularity == "selective":
        if g("recompute_method") is not None or g("recompute_num_layers") is not None:
            raise ValueError("recompute_granularity='selective' takes no recompute_method or "
                             "recompute_num_layers")
        modules = g("recompute_modules") or ["core_attn"]
        return "none", None, None, None, tuple(modules)
    if granularity != "full":
        raise ValueError(f"recompute_granularity={granularity!r} is not 'full' or 'selective'")
    ids = g("recompute_layer_ids")
    if ids is not None:
        if g("recompute_method") is not None:
            raise ValueError("recompute_layer_ids needs recompute_method null")
        return "full", None, None, tuple(ids), ()
    method = g("recompute_method")
    if method is None:
        raise ValueError("recompute_granularity='full' needs recompute_method "
                         "('uniform' or 'block') or recompute_layer_ids")
    return "full", method, g("recompute_num_layers"), None, ()


def _moe_config(cfg: Mapping[str, Any]):
    """The MoEConfig of Megatron's MoE knobs; None without ``num_experts`` (a dense model)."""
    g = cfg.get
    if not g("num_experts"):
        return None
    tp, etp = g("tensor_model_parallel_size", 1), g("expert_tensor_parallel_size")
    if etp not in (None, 1, tp):
        raise ConfigError(f"expert_tensor_parallel_size {etp}: jaxtrain splits each expert over "
                          f"the whole tensor axis ({tp}) or not at all (1)")
    turbo = g("enable_primus_turbo", False)
    dispatcher = g("moe_token_dispatcher_type", "allgather")
    if dispatcher == "alltoall_seq" or (turbo and g("use_turbo_deepep", False)):
        dispatcher = "alltoall"   # Primus's older name; Turbo DeepEP is an all-to-all dispatch
    factor = g("moe_expert_capacity_factor")
    activation, glu_limit = _expert_activation(g)
    try:
        return _moe(g, etp, tp, turbo, dispatcher, factor, activation, glu_limit)
    except ValueError as e:
        raise ValueError(_moe_knob_message(str(e))) from None


def _moe(g, etp, tp, turbo, dispatcher, factor, activation, glu_limit):
    return MoEConfig(
        num_experts=g("num_experts"), topk=g("moe_router_topk", 2),
        layer_freq=parse_layer_freq(g("moe_layer_freq", 1)),
        ffn_hidden_size=g("moe_ffn_hidden_size"),
        shared_expert_size=g("moe_shared_expert_intermediate_size"),
        score_function=g("moe_router_score_function", "softmax"),
        pre_softmax=g("moe_router_pre_softmax", False), router_dtype=g("moe_router_dtype"),
        topk_scaling_factor=g("moe_router_topk_scaling_factor"),
        num_groups=g("moe_router_num_groups"), group_topk=g("moe_router_group_topk"),
        group_score_topk=g("moe_router_group_score_topk"),
        expert_bias=g("moe_router_enable_expert_bias", False),
        bias_update_rate=float(g("moe_router_bias_update_rate", 1e-3)),
        load_balancing=g("moe_router_load_balancing_type", "aux_loss"),
        aux_loss_coeff=g("moe_aux_loss_coeff", 0.0), z_loss_coeff=g("moe_z_loss_coeff"),
        input_jitter_eps=g("moe_input_jitter_eps"),
        router_softcap=g("router_logit_softcapping") or None,
        force_balancing=(g("moe_router_force_load_balancing_type", "even")
                         if g("moe_router_force_load_balancing", False) else None),
        capacity_factor=None if factor is None or factor < 0 else float(factor),
        capacity_per_sequence=bool(g("moe_capacity_per_sequence", False)),
        pad_to_capacity=g("moe_pad_expert_input_to_capacity", False),
        drop_policy=g("moe_token_drop_policy", "probs"),
        dispatcher=dispatcher,
        grouped_gemm=g("moe_grouped_gemm", False) or (turbo and g("use_turbo_grouped_gemm", False)),
        per_layer_logging=g("moe_per_layer_logging", False),
        expert_tensor_parallel=etp in (None, tp),
        router_bias=bool(g("add_bias_linear", False)),   # Megatron: the router is a linear layer
        activation=activation, glu_limit=glu_limit)
