"""Megatron's fused-kernel switches and Primus's build step."""
from jaxtrain.config.knob import HONORED, INERT, K

_XLA_FUSES = ("XLA fuses these elementwise ops in every jitted step; the flag only picks a CUDA "
              "kernel of the same math")

KNOBS = [
    # Fusions that change the numbers or name a kernel jaxtrain builds
    K("bias_gelu_fusion", "bool", True, "Fused bias + GELU; Megatron's fused path uses the tanh "
      "approximation of GELU (only with add_bias_linear).", "megatron", status=HONORED),
    K("cross_entropy_loss_fusion", "bool", False, "Compute the vocabulary softmax and "
      "cross-entropy in one fused pass without keeping float32 probabilities.", "megatron", status=INERT, reason='XLA fuses the log-softmax and cross-entropy of the loss on its own, and with memory.chunked_loss no float32 probabilities of the whole batch are kept either'),
    K("cross_entropy_fusion_impl", "str", "native", "Which fused cross-entropy to use: Megatron's "
      "native one or TransformerEngine's.", "megatron", choices=("native", "te"), status=INERT, reason='selects between two CUDA cross-entropy kernels with the same result; XLA compiles the loss itself'),
    K("apply_rope_fusion", "bool", True, "Apply rotary embeddings with a fused kernel.",
      "megatron", status=INERT, reason='XLA fuses the rotary-embedding multiply-adds into neighbouring ops; the result is the same'),

    # Pure kernel choices with the same math
    K("bias_swiglu_fusion", "bool", True, "Fold the bias add into the SwiGLU activation as a "
      "single kernel.", "megatron", INERT,
      _XLA_FUSES),
    K("bias_dropout_fusion", "bool", True, "Fused bias + dropout + residual-add kernel.",
      "megatron", INERT, _XLA_FUSES),
    K("masked_softmax_fusion", "bool", True, "Fused scale + mask + softmax kernel for unfused "
      "attention.", "megatron", INERT,
      "XLA fuses scale, mask and softmax itself; softmax precision is set by "
      "attention_softmax_in_fp32"),
    K("no_persist_layer_norm", "bool", False, "Avoid the persistent (hidden-size-specialised) "
      "LayerNorm CUDA kernel.", "megatron", INERT,
      "picks between two CUDA LayerNorm kernels of the same math; XLA generates its own norm "
      "kernels"),

    # Build step
    K("disable_compile_dependencies", "bool", True, "Skip compiling Megatron's C++/CUDA helper "
      "extensions when the trainer starts.", "megatron", INERT,
      "jaxtrain compiles nothing ahead of the run; XLA compiles the step itself"),
]
