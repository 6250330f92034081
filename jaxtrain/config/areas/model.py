"""Model architecture: shape, attention, positions, norms, init, dtypes and the HF model source."""
from jaxtrain.config.knob import Alias, HONORED, INERT, MAPPED, K, REJECTED

_DTYPES = ("bfloat16", "float32", "float16")
_DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_MEGATRON_ATTENTION = ("flash", "fused", "unfused", "local", "auto")
_MAXTEXT_ATTENTION = ("autoselected", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax",
                      "paged", "vllm_rpa", "vllm_batched_rpa")
_HF_ATTENTION = ("sdpa", "flash_attention_2", "eager")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "mrope", "relative", "none")
_PGS = ("pgs-train", "pgs-distill")

KNOBS = [
    # Model family and code path
    K("use_legacy_models", "bool", False, "Build Megatron's pre-Core (legacy) model classes.",
      "megatron", REJECTED, "selects Megatron's legacy PyTorch model code; jaxtrain has a single "
      "JAX model implementation, so leave it false"),
    K("deprecated_use_mcore_models", "bool", False, "Old switch that opted into Megatron-Core "
      "models, which are now the only kind.", "megatron", INERT,
      "Megatron-Core models are the default and this flag no longer selects anything; jaxtrain "
      "has a single model implementation"),
    K("model_type", "str", "gpt", "Model family to build; gpt is the decoder-only transformer "
      "(dense, MoE or MLA).", "megatron", REJECTED,
      "jaxtrain builds decoder-only GPT-style transformers only; Mamba/hybrid and the Primus "
      "deepseek_v4/kimi_k3 model builders are other families",
      choices=("gpt", "mamba", "deepseek_v4", "kimi_k3")),
    K("transformer_impl", "str", "transformer_engine", "Layer library Megatron builds from: "
      "TransformerEngine or its own local PyTorch modules.", "megatron", MAPPED,
      "jaxtrain has one JAX implementation of each layer, so only the attention kernel follows "
      "it: local selects the xla attention (Megatron's local spec runs its unfused "
      "DotProductAttention); transformer_engine and inference_optimized leave the kernel to "
      "attention_backend and the other attention knobs",
      choices=("transformer_engine", "local", "inference_optimized")),
    K("encoder_num_layers", "int", None, "Layer count of the encoder stack in an encoder-decoder "
      "model.", "megatron",
      REJECTED, "encoder-decoder (T5-style) models are not supported; set the depth of the "
      "decoder-only stack with num_layers"),
    K("decoder_num_layers", "int", None, "Decoder depth of an encoder-decoder model.", "megatron",
      INERT, "only encoder-decoder models read it; decoder-only models take their depth from "
      "num_layers, in Megatron as in jaxtrain"),

    # Transformer shape
    K("num_layers", "int", 24, "Number of transformer layers.", "megatron", status=HONORED),
    K("hidden_size", "int", 1024, "Model width: size of the residual stream.", "megatron", status=HONORED),
    K("ffn_hidden_size", "int", None, "Inner width of the MLP; null means 4 x hidden_size "
      "(8/3 x rounded down to 64 with SwiGLU).", "megatron", status=HONORED),
    K("num_attention_heads", "int", 16, "Number of query heads per attention layer.", "megatron", status=HONORED),
    K("kv_channels", "int", None, "Width of each attention head; null means hidden_size / "
      "num_attention_heads.", "megatron", status=HONORED),
    K("group_query_attention", "bool", False, "Share each key/value head among a group of query "
      "heads (GQA).", "megatron", status=HONORED),
    K("num_query_groups", "int", None, "Number of key/value heads under GQA; null means one per "
      "query head.", "megatron", status=HONORED),

    # Attention details
    K("qk_layernorm", "bool", False, "Normalise queries and keys per head before the dot product.",
      "megatron", status=HONORED),
    K("qk_l2_norm", "bool", False, "Scale queries and keys to unit L2 norm per head before the dot "
      "product.", "megatron", status=HONORED),
    K("add_qkv_bias", "bool", False, "Give the query/key/value projections a bias term.",
      "megatron", status=HONORED),
    K("attention_dropout", "float", 0.1, "Dropout probability on the attention weights.",
      "megatron", status=HONORED),
    K("attention_softmax_in_fp32", "bool", False, "Compute the attention mask and softmax in "
      "float32 whatever the compute dtype.", "megatron", status=HONORED),
    K("apply_query_key_layer_scaling", "bool", False, "Divide attention scores by the layer index "
      "before the softmax and undo it in fp32 (an fp16 guard).", "megatron", status=HONORED),

    # Attention kernel choice
    K("attention_backend", "str", "auto", "Attention kernel: flash, fused, unfused (plain XLA), "
      "local, or auto to pick per shape.", "megatron", MAPPED,
      "TransformerEngine's kernels are CUDA/ROCm PyTorch code: flash and fused (cuDNN) run "
      "jaxtrain's Pallas flash kernel, unfused and local the plain-XLA attention, auto the "
      "flash kernel on a GPU and XLA on the CPU (or with attention dropout, which the kernel "
      "lacks); other attention knobs set must agree", choices=_MEGATRON_ATTENTION),
    K("attention", "str", "cudnn_flash_te", "Attention kernel by MaxText name: autoselected, "
      "dot_product (plain XLA), flash, cudnn_flash_te, ...", "maxtext", MAPPED,
      "dot_product is the plain-XLA attention and flash jaxtrain's Pallas flash kernel; "
      "cudnn_flash_jax is jax.nn cuDNN attention with segment ids as a dense mask, refused off "
      "NVIDIA GPUs and with softcap or dropout; TransformerEngine is not used, so "
      "cudnn_flash_te (the default) is auto like autoselected: the flash kernel on a GPU, XLA "
      "on the CPU or with attention dropout, which the kernel lacks",
      choices=_MAXTEXT_ATTENTION, rejected_values={
          v: "an inference-only kernel over a paged KV cache; jaxtrain trains with "
          "full-sequence attention" for v in ("paged", "vllm_rpa", "vllm_batched_rpa")}),
    K("model.attn_implementation", "str", "sdpa", "Attention kernel by Hugging Face name: eager "
      "(plain), sdpa (fused, picked per shape) or flash_attention_2.", "pgs-train", MAPPED,
      "PyTorch kernels: eager runs the plain-XLA attention, flash_attention_2 jaxtrain's Pallas "
      "flash kernel, sdpa the auto choice (flash on a GPU, XLA on the CPU)",
      choices=_HF_ATTENTION),

    # Position embeddings
    K("add_position_embedding", "bool", False, "Add a learned absolute position embedding to the "
      "token embeddings.", "megatron", status=INERT, reason="read only by Megatron's legacy models (use_legacy_models is rejected); the core GPT model takes position_embedding_type"),
    K("position_embedding_type", "str", "learned_absolute", "How positions enter the model: "
      "learned table, RoPE, multimodal RoPE, relative bias or none.", "megatron",
      choices=_POSITION_EMBEDDINGS, status=HONORED, planned_values={"mrope": None, "relative": None}),
    K("max_position_embeddings", "int", None, "Longest sequence the position encoding is built "
      "for, in tokens.", "megatron", status=HONORED),
    K("original_max_position_embeddings", "int", None, "Context length the model was pretrained "
      "with, the base for RoPE scaling, in tokens.", "megatron", status=HONORED),
    K("use_rotary_position_embeddings", "bool", None, "Legacy switch: true forces "
      "position_embedding_type to rope.", "megatron", status=HONORED),
    K("rotary_base", "int", 10000, "RoPE base period theta.", "megatron", status=HONORED),
    K("rotary_percent", "float", 1.0, "Fraction of each head's channels that RoPE rotates.",
      "megatron", status=HONORED),
    K("rotary_interleaved", "bool", False, "Rotate interleaved channel pairs (GPT-J layout) "
      "instead of the two halves.", "megatron", status=HONORED),
    K("rotary_seq_len_interpolation_factor", "int", None, "Divide positions by this factor before "
      "RoPE (linear position interpolation).", "megatron", status=HONORED),
    K("use_rope_scaling", "bool", False, "Apply Llama-3.1-style frequency-dependent RoPE scaling.",
      "megatron", status=HONORED),
    K("rope_scaling_factor", "float", 8.0, "Stretch factor of the Llama-3.1 RoPE scaling.",
      "megatron", status=HONORED),
    K("rope_type", "str", None, "RoPE variant: plain rope or YaRN; null lets the attention type "
      "choose.", "megatron", choices=("rope", "yarn"), status=HONORED),

    # MLP and activations
    K("swiglu", "bool", True, "Gated SiLU MLP (SwiGLU) instead of a plain GELU MLP.", "megatron", status=HONORED),
    K("quick_geglu", "bool", False, "Gated MLP with the quick GELU x*sigmoid(1.702x) as gate.",
      "megatron", status=HONORED),
    K("openai_gelu", "bool", False, "Use the tanh approximation of GELU in the MLP.", "megatron", status=HONORED),
    K("squared_relu", "bool", False, "Use relu(x)^2 as the MLP activation.", "megatron", status=HONORED),
    K("add_bias_linear", "bool", False, "Give every linear layer a bias term (implies "
      "add_qkv_bias).", "megatron", status=HONORED),

    # Norms, residuals and dropout
    K("normalization", "str", "LayerNorm", "Norm layer used throughout the model.", "megatron",
      choices=("LayerNorm", "RMSNorm"), status=HONORED),
    K("norm_epsilon", "float", 1e-5, "Epsilon added to the variance inside every norm.",
      "megatron", status=HONORED),
    K("apply_layernorm_1p", "bool", False, "Store norm scales as offsets from 1 (zero-centred "
      "gamma).", "megatron", status=HONORED),
    K("apply_residual_connection_post_layernorm", "bool", False, "Take the residual from the "
      "normalised input rather than the raw input.", "megatron", status=HONORED),
    K("fp32_residual_connection", "bool", False, "Keep the residual stream in float32.",
      "megatron", status=HONORED),
    K("hidden_dropout", "float", 0.1, "Dropout probability on each block's output before the "
      "residual add.", "megatron", status=HONORED),

    # Embeddings and output head
    K("untie_embeddings_and_output_weights", "bool", True, "Give the output head its own weights "
      "instead of reusing the embedding table.", "megatron", status=HONORED),
    K("use_iota_embed", "bool", True, "Look up embeddings as a one-hot matmul built with iota "
      "instead of a gather.", "maxtext", status=HONORED),
    K("logits_dot_in_fp32", "bool", False, "Compute the output-head matmul in float32.",
      "maxtext", status=HONORED),
    K("final_logit_softcapping", "float", None, "Soft-cap the output logits to c*tanh(x/c); null "
      "disables.", "megatron", status=HONORED),
    K("clone_scatter_output_in_embedding", "bool", True, "Copy the embedding output after the "
      "sequence-parallel scatter (a PyTorch autograd workaround).", "megatron", INERT,
      "guards PyTorch autograd against an in-place view; JAX arrays are immutable"),

    # Softcapping inside attention and routing
    K("sliding_window_size", "int", None, "Mistral-style local attention: each token sees at "
      "most this many tokens back (itself included); null or 0 attends to the whole prefix.",
      "jaxtrain", HONORED),
    K("attn_logit_softcapping", "float", None, "Soft-cap attention scores to c*tanh(x/c) before "
      "the softmax; null disables.", "megatron", status=HONORED),
    K("router_logit_softcapping", "float", None, "Soft-cap MoE router logits to c*tanh(x/c); null "
      "disables.", "megatron", status=HONORED),

    # Initialisation
    K("init_method_std", "float", 0.02, "Sigma of the normal distribution that initial weights "
      "are drawn from.",
      "megatron", status=HONORED),
    K("perform_initialization", "bool", True, "Randomly initialise the weights; false leaves them "
      "to a checkpoint load.", "megatron", status=INERT, reason='parameters are always created by a jitted init (milliseconds of device work) and a checkpoint load replaces them'),
    K("use_cpu_initialization", "bool", None, "Initialise weights on the host and copy them to "
      "the accelerators.", "megatron", INERT,
      "JAX's counter-based PRNG gives the same weights on any device; jaxtrain initialises "
      "directly into the sharded layout"),

    # Dtypes
    K("dtype", "str", "bfloat16", "Dtype of activations and matmul inputs.", "maxtext",
      choices=_DTYPES, value_aliases=_DTYPE_SPELLINGS, status=HONORED),
    K("weight_dtype", "str", "float32", "Storage dtype of the model parameters (the master "
      "copy the optimizer updates).", "maxtext", choices=_DTYPES,
      value_aliases=_DTYPE_SPELLINGS,
      doc_defaults={"maxtext": "bfloat16", "pgs-train": "bfloat16"},
      aliases=(Alias("model.torch_dtype", "pgs-train",
                     note="the dtype the HF weights are loaded and trained in"),), status=HONORED),

    # Kernel and scheduling selectors of section 10.1
    K("use_te_activation_func", "bool", False, "Run MLP activations with TransformerEngine "
      "kernels.", "megatron", INERT,
      "a CUDA kernel choice for the same function; XLA fuses the activation into neighbouring ops"),
    K("gradient_accumulation_fusion", "bool", True, "Accumulate weight gradients straight into "
      "float32 buffers inside the backward matmul.", "megatron", status=INERT, reason='names a fused CUDA kernel that adds weight gradients into an fp32 buffer; under XLA the accumulation dtype follows grad_reduce_in_bf16 / accumulate_allreduce_grads_in_fp32'),
    K("delay_wgrad_compute", "bool", False, "Postpone weight-gradient matmuls so they overlap "
      "expert-parallel communication.", "megatron", INERT,
      "reorders PyTorch kernel launches without changing results; XLA's scheduler orders the "
      "backward pass itself"),

    # Hugging Face model source (pgs)
    K("model.name_or_path", "str", None, "Hugging Face model id or local directory whose "
      "config and weights start the model.", "pgs-train",
      doc_defaults={"pgs-train": "meta-llama/Llama-3.1-8B-Instruct", "pgs-distill": None},
      aliases=(Alias("model.student", "pgs-distill", note="the student model of distillation"),), issue=None),
    K("model.use_liger_kernel", "bool", True, "Swap in Liger's fused Triton kernels for norms, "
      "SwiGLU and RoPE.", _PGS, INERT,
      "Liger replaces PyTorch ops with fused CUDA kernels of the same math; XLA fuses these "
      "elementwise ops in every jitted step"),
    K("model.compile", "bool", True, "torch.compile each transformer layer.", "pgs-train", INERT,
      "jaxtrain always compiles the whole train step with jax.jit; there is no eager mode to "
      "switch to"),
    K("model.compile_backend", "str", "inductor", "torch.compile backend (inductor, aot_eager, "
      "...).", "pgs-train", INERT, "XLA is the only compiler behind jax.jit"),
    K("model.compile_mode", "str", "default", "torch.compile optimisation mode (default, "
      "reduce-overhead, max-autotune).", "pgs-train", INERT,
      "XLA has no such modes; its GPU autotuning and command buffers are configured by XLA flags"),

    # Distillation student extras (pgs-distill)
    K("model.stop_tokens", "list[str]", [], "Extra student tokens that end a sampled completion.",
      "pgs-distill"),
    K("model.chat_template_kwargs", "dict", {}, "Extra keyword arguments for every "
      "apply_chat_template call, e.g. enable_thinking.", "pgs-distill"),
]
