"""Low-precision compute: FP8/FP4 recipes, MaxText quantization modes, KV-cache quantization."""
from jaxtrain.config.knob import INERT, K

_M = "megatron"

_FP8_FORMATS = ("e4m3", "hybrid")
_FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "custom")
_AMAX_ALGOS = ("max", "most_recent")
_FP4_FORMATS = ("e2m1",)
_FP4_RECIPES = ("nvfp4", "custom")
# MaxText's QuantizationType enum ("" = off): AQT int8/intmp, Flax/qwix fp8 flavours, TE recipes.
_MAXTEXT_QUANT = ("", "int4", "int8", "intmp", "fp8", "fp8_e4m3", "fp8_e5m2", "nanoo_fp8",
                  "fp8_nanoo", "fp8_gpu", "fp8_full", "te_fp8_delayedscaling",
                  "te_fp8_currentscaling", "te_mxfp8", "te_nvfp4", "te_nvfp4_no_rht")
_KV_AXES = ("", "dkv", "heads_and_dkv")
_KV_DTYPES = ("int8", "int4")

KNOBS = [
    # FP8 format and recipe (Megatron / Transformer Engine)
    K("fp8", "str", None, "FP8 matmul format: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
      "gradients); null trains without FP8.", _M, choices=_FP8_FORMATS, issue=11),
    K("fp8_recipe", "str", "delayed", "How FP8 scales are chosen: delayed (amax history), "
      "tensorwise (current amax), blockwise, mxfp8, or a custom quantizer.", _M,
      choices=_FP8_RECIPES, issue=11),
    K("fp8_margin", "int", 0, "Delayed scaling headroom: the scale maps amax to 2^-margin of the "
      "FP8 maximum.", _M, issue=11),
    K("fp8_amax_history_len", "int", 1024, "Steps of amax values kept per tensor for delayed "
      "scaling.", _M, issue=11),
    K("fp8_amax_compute_algo", "str", "max", "How delayed scaling reads the amax history: its "
      "maximum, or the latest value.", _M, choices=_AMAX_ALGOS, issue=11),
    K("fp8_interval", "int", 1, "Old delayed-scaling update interval in steps.", _M, INERT,
      "deprecated in Megatron and ignored by Transformer Engine since 1.8: scales update every "
      "step regardless"),
    K("fp8_wgrad", "bool", True, "Run the weight-gradient GEMMs in FP8 too; false keeps them in "
      "higher precision.", _M, issue=11),
    K("fp8_param_gather", "bool", False, "Keep weights in FP8 and all-gather them in FP8 (needs "
      "the distributed optimizer or FSDP).", _M, issue=11),
    K("no_fp8_weight_transpose_cache", "bool", False, "Primus: do not keep the transposed FP8 "
      "weight from forward for the backward pass (saves memory).", _M, INERT,
      "XLA decides whether a transposed FP8 weight lives between forward and backward; there is "
      "no cache to turn off, and the numbers are the same either way"),

    # FP4
    K("fp4", "str", None, "FP4 matmul format (e2m1); null trains without FP4. Exclusive with "
      "fp8.", _M, choices=_FP4_FORMATS, issue=11),
    K("fp4_recipe", "str", "nvfp4", "FP4 scaling recipe: NVFP4 block scaling or a custom "
      "quantizer.", _M, choices=_FP4_RECIPES, nullable=True, issue=11),
    K("fp4_param", "bool", False, "Keep weights in FP4 and all-gather them in FP4.", _M, issue=11),

    # Layers kept out of FP8/FP4
    K("first_last_layers_bf16", "bool", False, "Run the first and last transformer layers in bf16 "
      "during FP8/FP4 training; not allowed with the delayed recipe.", _M, issue=11),
    K("num_layers_at_start_in_bf16", "int", 1, "Leading layers kept in bf16 when "
      "first_last_layers_bf16 is on.", _M, issue=11),
    K("num_layers_at_end_in_bf16", "int", 1, "Trailing layers kept in bf16 when "
      "first_last_layers_bf16 is on.", _M, issue=11),

    # pgs float8
    K("memory.float8_training", "bool", False, "pgs: train linear layers in FP8 with per-row "
      "dynamic scales (torchao rowwise); embeddings stay in bf16.", "pgs-train", issue=11),

    # MaxText quantization
    K("quantization", "str", "", "MaxText quantization mode for the transformer layers' matmuls "
      "(int8, fp8 flavours, te_* recipes); empty means none.", "maxtext",
      choices=_MAXTEXT_QUANT, nullable=True, issue=11),
    K("checkpoint_is_quantized", "bool", False, "The checkpoint being loaded holds AQT-quantized "
      "weights.", "maxtext", issue=11),

    # KV-cache quantization (inference)
    K("quantize_kvcache", "bool", False, "Store the attention KV cache quantized during "
      "decoding.", "maxtext", issue=11),
    K("kv_quant_axis", "str", "heads_and_dkv", "Axes each KV-cache scale is taken over: the head "
      "dim only (dkv), or heads and head dim together.", "maxtext", choices=_KV_AXES,
      issue=11),
    K("kv_quant_dtype", "str", "int8", "Integer type of the quantized KV cache.", "maxtext",
      choices=_KV_DTYPES, issue=11),
]
