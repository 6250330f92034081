"""Mixed precision except fp8/fp4: bf16/fp16, loss scaling, reduction and matmul precision."""
from jaxtrain.config.knob import Alias, HONORED, INERT, K, MAPPED

_M = "megatron"

_MATMUL_PRECISIONS = ("highest", "high", "medium")
# MaxText's matmul_precision (jax.lax.Precision names) -> the same JAX precision in this knob's names.
_MAXTEXT_PRECISION = {"default": "medium", "bfloat16": "medium", "high": "high",
                      "highest": "highest", "float32": "highest"}

_NO_RNG_TRACKER = ("JAX randomness comes from explicit PRNG keys split per use; there is no global "
                   "device RNG state for a tracker to manage, so this cannot change a run")


def _maxtext_precision(value):
    """MaxText matmul_precision -> memory.float32_matmul_precision (others left to the check)."""
    return _MAXTEXT_PRECISION.get(value, value) if isinstance(value, str) else value

KNOBS = [
    # Training dtype
    K("bf16", "bool", True, "Train in bfloat16 mixed precision: bf16 compute with fp32 master "
      "weights and optimizer state.", _M,
      aliases=(Alias("train.bf16", "pgs-train"),), doc_defaults={"pgs-train": True}, status=HONORED),
    K("fp16", "bool", False, "Train in float16 mixed precision with loss scaling; exclusive with "
      "bf16.", _M, status=HONORED),

    # Loss scaling (fp16)
    K("loss_scale", "float", None, "Fixed fp16 loss scale; null scales dynamically.", _M, status=HONORED),
    K("initial_loss_scale", "float", 4294967296.0, "Starting value of the dynamic fp16 loss "
      "scale (2^32).", _M, status=HONORED),
    K("min_loss_scale", "float", 1.0, "Lowest value the dynamic loss scale may fall to.", _M, status=HONORED),
    K("loss_scale_window", "int", 1000, "Overflow-free steps after which the dynamic loss scale "
      "doubles.", _M, status=HONORED),
    K("hysteresis", "int", 2, "Overflowing steps tolerated before the dynamic loss scale is "
      "halved.", _M, status=HONORED),

    # Gradient reduction and loss precision
    K("grad_reduce_in_bf16", "bool", False, "Reduce gradients across data-parallel ranks in bf16 "
      "to halve the traffic.", _M, status=HONORED),
    K("accumulate_allreduce_grads_in_fp32", "bool", False, "Accumulate and reduce gradients in "
      "fp32; bf16 training turns this on itself unless grad_reduce_in_bf16 is set.", _M, status=HONORED),
    K("fp16_lm_cross_entropy", "bool", False, "Run the output-layer loss in half precision (fp16) "
      "instead of fp32.", _M, status=HONORED),
    K("calculate_per_token_loss", "bool", False, "Average the loss over all non-padding tokens of "
      "the global batch instead of per micro-batch.", _M, status=HONORED),

    # Matmul precision for fp32 operands
    K("memory.float32_matmul_precision", "str", "high", "Precision of fp32 matmuls: highest = full "
      "fp32, high = TF32-class, medium = bf16-class.", "pgs-train", choices=_MATMUL_PRECISIONS, status=MAPPED, reason='sets jax_default_matmul_precision for the run: highest -> float32, high -> tensorfloat32, medium -> bfloat16',
      aliases=(Alias("matmul_precision", "maxtext", to_canonical=_maxtext_precision,
                     note="MaxText's jax.lax.Precision name: default and bfloat16 are medium "
                          "(JAX's DEFAULT), high is high, highest and float32 are highest"),)),

    # RNG trackers (PyTorch/Transformer Engine only)
    K("te_rng_tracker", "bool", False, "Use Transformer Engine's CUDA RNG state tracker for "
      "model-parallel randomness.", _M, INERT, _NO_RNG_TRACKER),
    K("inference_rng_tracker", "bool", False, "Use a separate lightweight RNG tracker during "
      "inference.", _M, INERT, _NO_RNG_TRACKER),
]
