"""Low-precision compute: FP8/FP4 recipes, MaxText quantization modes, KV-cache quantization."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, K

_M = "megatron"

_FP8_FORMATS = ("e4m3", "hybrid")
_FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "custom")
_AMAX_ALGOS = ("max", "most_recent")
_FP4_FORMATS = ("e2m1",)
_FP4_RECIPES = ("nvfp4", "mxfp4", "custom")
# MaxText's QuantizationType enum ("" = off): AQT int8/intmp, Flax/qwix fp8 flavours, TE recipes.
_MAXTEXT_QUANT = ("", "int4", "int8", "int8w", "int4w", "intmp", "fp8", "fp8_e4m3", "fp8_e5m2",
                  "nanoo_fp8",
                  "fp8_nanoo", "fp8_gpu", "fp8_full", "te_fp8_delayedscaling",
                  "te_fp8_currentscaling", "te_mxfp8", "te_nvfp4", "te_nvfp4_no_rht")
_KV_AXES = ("", "dkv", "heads_and_dkv")
_KV_DTYPES = ("int8", "int4")

KNOBS = [
    # FP8 format and recipe (Megatron / Transformer Engine)
    K("fp8", "str", None, "FP8 matmul format: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
      "gradients); null trains without FP8.", _M, HONORED,
      "the transformer layers' projections (jaxtrain.quant); embedding and output layer stay in "
      "the compute dtype, as in Megatron; NVIDIA formats, AMD fnuz ones on ROCm "
      "(fp8_format_variant)", choices=_FP8_FORMATS),
    K("fp8_recipe", "str", "delayed", "How FP8 scales are chosen: delayed (amax history), "
      "tensorwise (current amax), blockwise, mxfp8, or a custom quantizer.", _M, MAPPED,
      "delayed and tensorwise: per-tensor scales; blockwise: 1x128 activation/gradient and "
      "128x128 weight blocks, power-of-two fp32 scales; mxfp8: 1x32 blocks, E8M0 scales. "
      "Blockwise always, and mxfp8 on CPU, Hopper and ROCm, run as an exact quantize-dequantize "
      "emulation; mxfp8 uses jax.nn.scaled_dot_general (cuDNN) on NVIDIA compute capability "
      "10+. Per-tensor FP8 GEMMs on GPUs come from XLA rewriting the quantize-dequantize-dot "
      "pattern (as Flax's fp8 ops)", choices=_FP8_RECIPES,
      rejected_values={"custom": "a custom recipe needs a Python quantizer factory "
                                 "(fp8_quantizer_factory), which a JAX trainer cannot load"}),
    K("fp8_margin", "int", 0, "Delayed scaling headroom: the scale maps amax to 2^-margin of the "
      "FP8 maximum.", _M, HONORED),
    K("fp8_amax_history_len", "int", 1024, "Steps of amax values kept per tensor for delayed "
      "scaling.", _M, HONORED),
    K("fp8_amax_compute_algo", "str", "max", "How delayed scaling reads the amax history: its "
      "maximum, or the latest value.", _M, HONORED, choices=_AMAX_ALGOS),
    K("fp8_format_variant", "str", "auto", "FP8 encodings: ocp (NVIDIA e4m3fn/e5m2), fnuz "
      "(AMD MI300 e4m3fnuz/e5m2fnuz), or auto (fnuz on ROCm, ocp elsewhere).", "jaxtrain",
      HONORED, choices=("auto", "ocp", "fnuz")),
    K("fp8_interval", "int", 1, "Old delayed-scaling update interval in steps.", _M, INERT,
      "deprecated in Megatron and ignored by Transformer Engine since 1.8: scales update every "
      "step regardless"),
    K("fp8_wgrad", "bool", True, "Run the weight-gradient GEMMs in FP8 too; false keeps them in "
      "higher precision.", _M, HONORED),
    K("fp8_param_gather", "bool", False, "Keep weights in FP8 and all-gather them in FP8 (needs "
      "the distributed optimizer or FSDP).", _M, INERT,
      "a TransformerEngine memory and bandwidth saving: jaxtrain keeps weights in weight_dtype "
      "and quantizes them inside each matmul with the same scales, after XLA gathers them, so "
      "the numbers do not change"),
    K("no_fp8_weight_transpose_cache", "bool", False, "Primus: do not keep the transposed FP8 "
      "weight from forward for the backward pass (saves memory).", _M, INERT,
      "XLA decides whether a transposed FP8 weight lives between forward and backward; there is "
      "no cache to turn off, and the numbers are the same either way"),

    # FP4
    K("fp4", "str", None, "FP4 matmul format (e2m1); null trains without FP4. Exclusive with "
      "fp8.", _M, MAPPED, "e2m1 activations, weights and gradients of the layers' projections "
      "by the fp4_recipe, emulated exactly (JAX has no FP4 GEMM on these backends)",
      choices=_FP4_FORMATS),
    K("fp4_recipe", "str", "nvfp4", "FP4 scaling recipe: NVFP4 block scaling or a custom "
      "quantizer.", _M, MAPPED, "nvfp4: 1x16 blocks with e4m3 scales times a per-tensor fp32 "
      "scale, round to nearest, emulated exactly by quantize-dequantize; Transformer Engine's "
      "16x16 weight blocks, random Hadamard transform and stochastic rounding of gradients are "
      "not reproduced", choices=_FP4_RECIPES, nullable=True,
      rejected_values={"custom": "a custom recipe needs a Python quantizer factory"},
      planned_values={"mxfp4": None}),
    K("fp4_param", "bool", False, "Keep weights in FP4 and all-gather them in FP4.", _M,
      REJECTED, "weights are stored in weight_dtype and quantized after XLA gathers them"),

    # Layers kept out of FP8/FP4
    K("first_last_layers_bf16", "bool", False, "Run the first and last transformer layers in bf16 "
      "during FP8/FP4 training; not allowed with the delayed recipe.", _M, HONORED),
    K("num_layers_at_start_in_bf16", "int", 1, "Leading layers kept in bf16 when "
      "first_last_layers_bf16 is on.", _M, HONORED),
    K("num_layers_at_end_in_bf16", "int", 1, "Trailing layers kept in bf16 when "
      "first_last_layers_bf16 is on.", _M, HONORED),

    # pgs float8
    K("memory.float8_training", "bool", False, "pgs: train linear layers in FP8 with per-row "
      "dynamic scales (torchao rowwise); embeddings stay in bf16.", "pgs-train", MAPPED,
      "qwix dot_general_qt with e4m3 activations, weights and gradients and one current scale "
      "per row/column; torchao's rounding of the scales to powers of two is not applied"),

    # MaxText quantization
    K("quantization", "str", "", "MaxText quantization mode for the transformer layers' matmuls "
      "(int8, fp8 flavours, te_* recipes); empty means none.", "maxtext", MAPPED,
      "int8/int4 (weights and activations), int8w/int4w (weights only), fp8_full, fp8_e4m3, "
      "fp8_e5m2: qwix dot_general_qt, per-channel current scales, straight-through gradients "
      "(AQT's int8 quantization of the activation gradient is not applied); fp8, fp8_gpu: "
      "Flax-style delayed scaling (history 1024, e4m3 forward, e5m2 gradients), nanoo_fp8 and "
      "fp8_nanoo the same in AMD fnuz formats; te_* take the Megatron recipe of the same "
      "scaling", choices=_MAXTEXT_QUANT, nullable=True,
      rejected_values={
          "intmp": "mixed precision reads a per-layer JSON (quant_cfg_path) jaxtrain does not "
                   "load; use int8, int4, int8w or int4w",
          "te_nvfp4": "its random Hadamard transform is not emulated; te_nvfp4_no_rht works"}),
    K("checkpoint_is_quantized", "bool", False, "The checkpoint being loaded holds AQT-quantized "
      "weights.", "maxtext", REJECTED, "AQT-serialized checkpoints (quantized weights with "
      "scales) are not read; jaxtrain checkpoints hold full-precision weights and quantize in "
      "the matmuls"),

    # KV-cache quantization (inference)
    K("quantize_kvcache", "bool", False, "Store the attention KV cache quantized while decoding "
      "(jaxtrain.models.generate); training has no KV cache and is unchanged.", "maxtext",
      HONORED),
    K("kv_quant_axis", "str", "heads_and_dkv", "Axes each KV-cache scale is taken over: the head "
      "dim only (dkv: a scale per token and kv head), or heads and head dim (one per token).",
      "maxtext", HONORED, choices=_KV_AXES),
    K("kv_quant_dtype", "str", "int8", "Integer type of the quantized KV cache (keys and values "
      "alike, symmetric absmax scales).", "maxtext", HONORED, choices=_KV_DTYPES),
]
