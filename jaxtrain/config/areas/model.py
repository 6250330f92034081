"""Model architecture: shape, attention, positions, norms, init, dtypes and the HF model source."""
from jaxtrain.config.areas.maxtext_model import DECODER_BLOCKS, PLANNED_BLOCKS, REJECTED_BLOCKS
from jaxtrain.config.knob import Alias, HONORED, INERT, MAPPED, K, REJECTED, _as_bool

_DTYPES = ("bfloat16", "float32", "float16")
_DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_MEGATRON_ATTENTION = ("flash", "fused", "unfused", "local", "auto")
_MAXTEXT_ATTENTION = ("autoselected", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax",
                      "paged", "vllm_rpa", "vllm_batched_rpa")
_HF_ATTENTION = ("sdpa", "flash_attention_2", "eager")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")
_PGS = ("pgs-train", "pgs-distill")
_MT = "maxtext"
_SCALED = "MaxText's base size; global_parameter_scale multiplies it"
_DERIVED_SIZES = (("emb_dim", "model width", "base_emb_dim"),
                  ("num_query_heads", "query-head count", "base_num_query_heads"),
                  ("num_kv_heads", "key/value-head count", "base_num_kv_heads"),
                  ("mlp_dim", "MLP width", "base_mlp_dim"),
                  ("moe_mlp_dim", "expert MLP width", "base_moe_mlp_dim"),
                  ("num_decoder_layers", "layer count", "base_num_decoder_layers"))


# MaxText-only model knobs (not aliases, which mark a MaxText file already): a file or command
# line using one is read with MaxText's defaults (see resolve._maxtext_spelling).
MAXTEXT_MODEL_KEYS = frozenset({
    "global_parameter_scale", "decoder_block", "mlp_activations", "emb_dim", "num_query_heads",
    "num_kv_heads", "mlp_dim", "moe_mlp_dim", "num_decoder_layers", "rope_min_timescale",
    "rope_linear_scaling_factor", "rope_use_scale", "enable_dropout", "dropout_rate", "fused_qkv",
    "fused_mlp", "use_qk_norm", "use_post_attn_norm", "use_post_ffw_norm", "float32_qk_product",
    "float32_logits", "cast_logits_to_fp32", "normalize_embedding_logits", "base_moe_mlp_dim",
    "capacity_factor", "load_balance_loss_weight", "shared_experts", "first_num_dense_layers",
    "routed_scaling_factor", "routed_score_func", "routed_bias", "routed_bias_update_rate",
    "n_routing_groups", "topk_routing_group"})


def _uncapped_if_zero(value):
    """MaxText writes 0.0 for "no soft cap"; 0 (or null) becomes None."""
    try:
        if value is not None and not isinstance(value, bool) and float(value) == 0:
            return None
    except (TypeError, ValueError):
        pass
    return value


def _negate(value):
    """MaxText logits_via_embedding (tied) is the inverse of untie_embeddings_and_output_weights."""
    return not _as_bool(value)


KNOBS = [
    # Model family and code path
    K("use_legacy_models", "bool", False, "Build Megatron's pre-Core (legacy) model classes.",
      "megatron", REJECTED, "selects Megatron's legacy PyTorch model code; jaxtrain has a single "
      "JAX model implementation, so leave it false"),
    K("deprecated_use_mcore_models", "bool", False, "Old switch that opted into Megatron-Core "
      "models, which are now the only kind.", "megatron", INERT,
      "Megatron-Core models are the default and this flag no longer selects anything; jaxtrain "
      "has a single model implementation"),
    K("model_type", "str", "gpt", "Model family: gpt the decoder-only transformer (dense, MoE "
      "or MLA), mamba/hybrid Megatron's hybrid stack, deepseek_v4 DeepSeek-V4, kimi_k3 Kimi "
      "K3's text backbone.",
      "megatron", HONORED,
      choices=("gpt", "mamba", "hybrid", "deepseek_v4", "kimi_k3", "flux_schnell",
               "diffusion_model"),
      rejected_values={v: "diffusion models (Flux) are image generators, not language models; "
                          "jaxtrain trains decoder-only language models"
                       for v in ("flux_schnell", "diffusion_model")}),
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
    K("num_layers", "int", 24, "Number of transformer layers.", "megatron", status=HONORED,
      aliases=(Alias("base_num_decoder_layers", _MT, note=_SCALED),),
      doc_defaults={_MT: 16}),
    K("hidden_size", "int", 1024, "Model width: size of the residual stream.", "megatron",
      status=HONORED, aliases=(Alias("base_emb_dim", _MT, note=_SCALED),),
      doc_defaults={_MT: 2048}),
    K("ffn_hidden_size", "int", None, "Inner width of the MLP; null means 4 x hidden_size "
      "(8/3 x rounded down to 64 with SwiGLU).", "megatron", status=HONORED,
      aliases=(Alias("base_mlp_dim", _MT, note=_SCALED),), doc_defaults={_MT: 7168}),
    K("num_attention_heads", "int", 16, "Number of query heads per attention layer.", "megatron",
      status=HONORED, aliases=(Alias("base_num_query_heads", _MT, note=_SCALED),),
      doc_defaults={_MT: 16}),
    K("kv_channels", "int", None, "Width of each attention head; null means hidden_size / "
      "num_attention_heads.", "megatron", status=HONORED,
      aliases=(Alias("head_dim", _MT, note="MaxText's width of one query/key/value head of "
                     "ordinary attention; its default 128 does not follow base_emb_dim"),),
      doc_defaults={_MT: 128}),
    K("group_query_attention", "bool", False, "Share each key/value head among a group of query "
      "heads (GQA).", "megatron", status=HONORED, doc_defaults={_MT: True}),
    K("num_query_groups", "int", None, "Number of key/value heads under GQA; null means one per "
      "query head.", "megatron", status=HONORED,
      aliases=(Alias("base_num_kv_heads", _MT, note=_SCALED + "; MaxText files always use "
                     "grouped-query attention (equal counts are plain multi-head)"),),
      doc_defaults={_MT: 16}),

    # MaxText's model size scaling and decoder block
    K("global_parameter_scale", "int", 1, "MaxText size multiplier (a power of two) that grows "
      "width, heads, MLP width and depth from their base_* values.", _MT, HONORED),
    K("decoder_block", "str", None, "MaxText layer family (the choices, less those not built "
      "yet or refused); null: the Megatron knobs decide.",
      _MT, HONORED, choices=DECODER_BLOCKS, doc_defaults={_MT: "llama2"},
      planned_values={b: 25 for b in PLANNED_BLOCKS}, rejected_values=REJECTED_BLOCKS),
    *[K(name, "int", None, f"MaxText's effective {what}: {base} x the global_parameter_scale "
        "factor.", _MT, INERT, f"MaxText computes it from {base} and global_parameter_scale and "
        f"overwrites any value written here; set {base} instead")
      for name, what, base in _DERIVED_SIZES],

    # Attention details
    K("embedding_multiplier", "float", None, "Multiply the token embeddings by this factor "
      "(Gemma: sqrt(hidden_size)); null leaves them as looked up.", "jaxtrain", status=HONORED),
    K("post_attention_norm", "bool", False, "Normalise the attention output before the residual "
      "add (Gemma 2/3 sandwich norm; its own scale per layer).", "jaxtrain", status=HONORED),
    K("post_mlp_norm", "bool", False, "Normalise the MLP output before the residual add (Gemma "
      "2/3 sandwich norm; its own scale per layer).", "jaxtrain", status=HONORED),
    K("pre_norm", "bool", True, "Normalise each sublayer's input (pre-norm); false feeds the "
      "residual stream in as it is (OLMo 2/3, which normalise the outputs instead).",
      "jaxtrain", status=HONORED),
    K("residual_multiplier", "float", 1.0, "Granite: multiply each attention and MLP output by "
      "this before adding it to the residual stream.", "jaxtrain", status=HONORED),
    K("logits_scaling", "float", 1.0, "Granite: divide the output logits by this.", "jaxtrain",
      status=HONORED),
    K("mamba_chunk_size", "int", 128, "Mamba-2 layers: tokens per chunk of the chunked scan "
      "(Megatron's mixer uses 128); changes speed and memory, not the result.", "jaxtrain",
      status=HONORED),
    K("mamba_conv_kernel_dim", "int", 4, "Mamba-2 layers: width of the short causal "
      "convolution (Megatron fixes 4; Hugging Face's conv_kernel).", "jaxtrain", status=HONORED),
    K("mamba_norm_epsilon", "float", 1e-5, "Mamba-2 layers: epsilon of the gated group RMSNorm "
      "before the output projection (Megatron fixes 1e-5; Hugging Face uses the model's).",
      "jaxtrain", status=HONORED),
    K("mamba_time_step_floor", "float", 0.0, "Mamba-2 layers: clamp each step size dt from below "
      "after its softplus (Hugging Face's time_step_min; Megatron does not clamp).", "jaxtrain",
      status=HONORED),
    K("parallel_residual", "bool", False, "GPT-NeoX's parallel layer: the MLP reads the layer's "
      "input through its own norm, as the attention does, and both outputs add to it.",
      "jaxtrain", status=HONORED),
    K("parallel_residual_shared_norm", "bool", False, "With parallel_residual: the MLP reads "
      "the attention's normed input, one norm per layer (GPT-J, PaLM, MaxText's default "
      "block).", "jaxtrain", status=HONORED),
    K("qk_norm_across_heads", "bool", False, "With qk_layernorm: one norm over all heads' "
      "queries (and one over the keys), as OLMo 2/3, instead of one per head.", "jaxtrain",
      status=HONORED),
    K("query_pre_attn_scalar", "float", None, "Scale attention scores by this value ** -0.5 "
      "(Gemma); null uses the head width.", "jaxtrain", status=HONORED),
    K("local_rotary_base", "float", None, "RoPE base of the sliding-window layers, plain RoPE "
      "without scaling (Gemma 3's local layers); null: every layer uses rotary_base.",
      "jaxtrain", status=HONORED),
    K("global_kv_channels", "int", None, "Head width of the global (full-attention) layers "
      "when it differs from kv_channels (Gemma 4); null: kv_channels.", "jaxtrain",
      status=HONORED),
    K("global_num_query_groups", "int", None, "Key/value-head count of the global "
      "(full-attention) layers (Gemma 4); null: num_query_groups.", "jaxtrain", status=HONORED),
    K("attention_k_eq_v", "bool", False, "Gemma 4's global layers: the values are the key "
      "projection's output (before the key norm and RoPE), so those layers have no value "
      "projection.", "jaxtrain", status=HONORED),
    K("global_rotary_percent", "float", None, "Gemma 4's proportional RoPE on the global layers: "
      "this share of the channel pairs rotates, at the frequencies of the whole head width; "
      "null: the global layers rotate like the others.", "jaxtrain", status=HONORED),
    K("v_norm", "str", None, "RMS-normalise each value head: plain (no learned scale, Gemma 4) "
      "or scaled; null: no value norm.", "jaxtrain", status=HONORED,
      choices=(None, "plain", "scaled")),
    K("layer_scalar", "bool", False, "Gemma 4: each layer's output times a per-layer constant "
      "read from the checkpoint (1 when initialised; not trained).", "jaxtrain",
      status=HONORED),
    K("qk_layernorm", "bool", False, "Normalise queries and keys per head before the dot product.",
      "megatron", status=HONORED),
    K("temperature_tuning_scale", "float", 0.1, "Strength of the temperature tuning (Llama 4's "
      "attn_scale).", "jaxtrain", status=HONORED),
    K("temperature_tuning_floor_scale", "float", 8192.0, "Positions per step of the temperature "
      "tuning (Llama 4's floor_scale).", "jaxtrain", status=HONORED),
    K("linear_attention_kind", "str", "gdn", "The linear-attention layers' kind: gdn (Gated "
      "DeltaNet, a decay per head) or kda (Kimi Delta Attention: a decay per key channel and "
      "low-rank decay and output-gate projections, Kimi Linear).", "jaxtrain", status=HONORED,
      choices=("gdn", "kda")),
    K("mla_latent_norm_epsilon", "float", None, "Epsilon of multi-latent attention's q and kv "
      "latent norms; null uses norm_epsilon (Megatron). Hugging Face's DeepSeek-V3 and Kimi "
      "Linear fix 1e-6.", "jaxtrain", status=HONORED),
    K("mla_nope", "bool", False, "Multi-latent attention without rotary embeddings: the "
      "qk_pos_emb_head_dim part of the queries and the shared key stays as projected (Kimi "
      "Linear).", "jaxtrain", status=HONORED),
    K("linear_attention_impl", "str", "xla", "GDN/KDA layers: how the state walks across "
      "chunks; xla is a lax.scan, pallas the Pallas kernel (Triton on GPUs) that keeps the state "
      "on chip (needs gdn_chunk_size a power of two of at least 16).", "jaxtrain",
      status=HONORED, choices=("xla", "pallas")),
    K("qk_norm_rope_layers_only", "bool", False, "Apply the query/key norm (qk_layernorm or "
      "qk_l2_norm) only on the layers that use RoPE, as Llama 4 skips it on its NoPE layers.",
      "jaxtrain", status=HONORED),
    K("qk_l2_norm", "bool", False, "Scale queries and keys to unit L2 norm per head before the dot "
      "product.", "megatron", status=HONORED),
    K("add_qkv_bias", "bool", False, "Give the query/key/value projections a bias term.",
      "megatron", status=HONORED),
    K("use_post_attn_norm", "bool", False, "MaxText: normalise the attention output before the "
      "residual add (gemma2/3/4 sandwich norm).", _MT, HONORED, "decoder_block gemma2/3/4: "
      "post_attention_norm (config/dialects/maxtext_model.py); the other blocks do not read it "
      "and refuse a set value"),
    K("use_post_ffw_norm", "bool", False, "MaxText: normalise the MLP output before the residual "
      "add (gemma2/3/4 sandwich norm).", _MT, HONORED, "decoder_block gemma2/3/4: "
      "post_mlp_norm; the other blocks do not read it and refuse a set value"),
    K("float32_qk_product", "bool", None, "MaxText dot_product attention: take the query-key "
      "product in float32; null (non-MaxText files) keeps jaxtrain's float32 scores.", _MT,
      HONORED, doc_defaults={_MT: False}),
    K("float32_logits", "bool", None, "MaxText dot_product attention: take the softmax over the "
      "scores in float32; null (non-MaxText files) keeps jaxtrain's float32 softmax.", _MT,
      HONORED, doc_defaults={_MT: False}),
    K("attention_dropout", "float", 0.1, "Dropout probability on the attention weights.",
      "megatron", status=HONORED, doc_defaults={_MT: 0.0}),
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
      "learned table, RoPE (yarn: RoPE with YaRN scaling), multimodal RoPE, relative bias or "
      "none.", "megatron",
      choices=_POSITION_EMBEDDINGS, status=HONORED, planned_values={"mrope": None, "relative": None},
      doc_defaults={_MT: "rope"}),
    K("max_position_embeddings", "int", None, "Longest sequence the position encoding is built "
      "for, in tokens.", "megatron", status=HONORED),
    K("original_max_position_embeddings", "int", None, "Context length the model was pretrained "
      "with, the base for RoPE scaling, in tokens.", "megatron", status=HONORED,
      aliases=(Alias("yarn_original_max_position_embeddings", "megatron-lm",
                     note="Megatron-LM's name for it on the YaRN path"),)),
    K("use_rotary_position_embeddings", "bool", None, "Legacy switch: true forces "
      "position_embedding_type to rope.", "megatron", status=HONORED),
    K("rotary_base", "int", 10000, "RoPE base period theta.", "megatron", status=HONORED,
      aliases=(Alias("rope_max_timescale", _MT, note="with rope_min_timescale 1 (the default) "
                     "this is the RoPE base"),)),
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
    K("rope_type", "str", None, "RoPE variant: plain rope, YaRN or (MaxText) llama3.1 scaling; "
      "null lets the attention type choose.", ("megatron", _MT),
      choices=("rope", "yarn", "llama3.1"), value_aliases={"default": "rope"},
      doc_defaults={_MT: "rope"}, status=HONORED),
    K("rope_use_scale", "bool", True, "MaxText rope_type llama3.1: apply its frequency scaling "
      "(factor 8, 8192-token original context).", _MT, HONORED),
    K("rope_min_timescale", "float", 1.0, "MaxText RoPE: shortest wavelength scale; timescales "
      "run geometrically from it to rope_max_timescale.", _MT, HONORED),
    K("rope_linear_scaling_factor", "float", 1.0, "MaxText RoPE: divide positions by this factor "
      "(linear position interpolation).", _MT, HONORED),

    # MLP and activations
    K("swiglu", "bool", True, "Gated SiLU MLP (SwiGLU) instead of a plain GELU MLP.", "megatron", status=HONORED),
    K("quick_geglu", "bool", False, "Gated MLP with the quick GELU x*sigmoid(1.702x) as gate.",
      "megatron", status=HONORED),
    K("openai_gelu", "bool", False, "Use the tanh approximation of GELU in the MLP.", "megatron", status=HONORED),
    K("squared_relu", "bool", False, "Use relu(x)^2 as the MLP activation.", "megatron", status=HONORED),
    K("add_bias_linear", "bool", False, "Give every linear layer a bias term (implies "
      "add_qkv_bias).", "megatron", status=HONORED),
    K("mlp_activations", "list[str]", None, "MaxText MLP: one input projection per entry, "
      "multiplied together; [silu, linear] is SwiGLU, [gelu] a plain tanh-GELU MLP.", _MT,
      HONORED, doc_defaults={_MT: ["silu", "linear"]}),
    K("fused_qkv", "bool", False, "MaxText: compute the query/key/value projections as one "
      "matmul.", _MT, MAPPED, "XLA fuses and schedules the three projections of one input "
      "itself; the parameters stay separate wq/wk/wv and the result is the same"),
    K("fused_mlp", "bool", False, "MaxText: compute the gated MLP's input projections as one "
      "matmul.", _MT, MAPPED, "XLA fuses and schedules the MLP input projections itself; the "
      "parameters stay separate wi_0/wi_1 and the result is the same"),

    # Norms, residuals and dropout
    K("normalization", "str", "LayerNorm", "Norm layer used throughout the model.", "megatron",
      choices=("LayerNorm", "RMSNorm"), status=HONORED, doc_defaults={_MT: "RMSNorm"}),
    K("norm_epsilon", "float", 1e-5, "Epsilon added to the variance inside every norm.",
      "megatron", status=HONORED,
      aliases=(Alias("normalization_layer_epsilon", _MT),
               Alias("layernorm_epsilon", ("megatron-lm", "primus"),
                     note="Megatron-LM's dest of --norm-epsilon"),)),
    K("apply_layernorm_1p", "bool", False, "Store norm scales as offsets from 1 (zero-centred "
      "gamma).", "megatron", status=HONORED,
      aliases=(Alias("layernorm_zero_centered_gamma", "megatron-lm",
                     note="Megatron-LM's dest of --apply-layernorm-1p"),)),
    K("apply_residual_connection_post_layernorm", "bool", False, "Take the residual from the "
      "normalised input rather than the raw input.", "megatron", status=HONORED),
    K("fp32_residual_connection", "bool", False, "Keep the residual stream in float32.",
      "megatron", status=HONORED),
    K("hidden_dropout", "float", 0.1, "Dropout probability on each block's output before the "
      "residual add.", "megatron", status=HONORED, doc_defaults={_MT: 0.0}),
    K("enable_dropout", "bool", True, "MaxText switch for all dropout; false makes the model "
      "deterministic whatever the dropout rates.", _MT, HONORED),
    K("dropout_rate", "float", 0.0, "MaxText dropout probability (after embeddings, inside the "
      "MLP, after each residual add, shared over the sequence).", _MT, REJECTED,
      "MaxText drops at other places than jaxtrain (after the residual add, with one mask for "
      "all positions, and inside the MLP); for dropout in jaxtrain set hidden_dropout and "
      "attention_dropout"),

    # Embeddings and output head
    K("untie_embeddings_and_output_weights", "bool", True, "Give the output head its own weights "
      "instead of reusing the embedding table.", "megatron", status=HONORED,
      aliases=(Alias("logits_via_embedding", _MT, to_canonical=_negate,
                     note="true ties the output head to the embedding (the inverse of "
                     "untie_embeddings_and_output_weights)"),)),
    K("normalize_embedding_logits", "bool", False, "MaxText: with logits_via_embedding, divide "
      "the tied logits by sqrt(emb_dim).", _MT, HONORED, doc_defaults={_MT: True}),
    K("use_iota_embed", "bool", False, "Look up embeddings as a one-hot matmul built with iota "
      "instead of a gather (Primus's MaxText preset turns it on).", "maxtext", status=HONORED),
    K("logits_dot_in_fp32", "bool", False, "Compute the output-head matmul in float32.",
      "maxtext", status=HONORED),
    K("cast_logits_to_fp32", "bool", True, "MaxText: hand the loss float32 logits.", _MT, INERT,
      "jaxtrain's output head always yields float32 logits; false (logits kept in the compute "
      "dtype) is not reproduced"),
    K("final_logit_softcapping", "float", None, "Soft-cap the output logits to c*tanh(x/c); null "
      "disables.", "megatron", status=HONORED,
      aliases=(Alias("final_logits_soft_cap", _MT, to_canonical=_uncapped_if_zero,
                     note="0 means no cap"),)),
    K("clone_scatter_output_in_embedding", "bool", True, "Copy the embedding output after the "
      "sequence-parallel scatter (a PyTorch autograd workaround).", "megatron", INERT,
      "guards PyTorch autograd against an in-place view; JAX arrays are immutable"),

    # Softcapping inside attention and routing
    K("sliding_window_size", "int", None, "Mistral-style local attention: each token sees at "
      "most this many tokens back (itself included); null or 0 attends to the whole prefix.",
      ("jaxtrain", _MT), HONORED),
    K("attn_logit_softcapping", "float", None, "Soft-cap attention scores to c*tanh(x/c) before "
      "the softmax; null disables.", "megatron", status=HONORED,
      aliases=(Alias("attn_logits_soft_cap", _MT, to_canonical=_uncapped_if_zero,
                     note="0 means no cap"),)),
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
      "kernels (Primus's Kimi K3: the activation module slot, where its SiTU goes).",
      "megatron", HONORED,
      "a CUDA kernel choice for the same function elsewhere (XLA fuses the activation); with "
      "model_type kimi_k3 true selects SiTU (activation_situ_beta) in every gated unit and "
      "false plain SwiGLU, as Primus's K3 layer specs"),
    K("gradient_accumulation_fusion", "bool", True, "Accumulate weight gradients straight into "
      "float32 buffers inside the backward matmul.", "megatron", status=INERT, reason='names a fused CUDA kernel that adds weight gradients into an fp32 buffer; under XLA the accumulation dtype follows grad_reduce_in_bf16 / accumulate_allreduce_grads_in_fp32'),
    K("delay_wgrad_compute", "bool", False, "Postpone weight-gradient matmuls so they overlap "
      "expert-parallel communication.", "megatron", INERT,
      "reorders PyTorch kernel launches without changing results; XLA's scheduler orders the "
      "backward pass itself"),

    # Hugging Face model source (pgs)
    K("model.name_or_path", "str", None, "Hugging Face model id or local directory whose "
      "config and weights start the model.", "pgs-train", HONORED,
      "its config.json (a local directory, else a snapshot in the local Hugging Face cache; "
      "nothing is downloaded) sets the architecture knobs, under any the file sets, and a "
      "tokenizer beside it the tokenizer (config/dialects/hf.py); a fresh run starts from its "
      "safetensors weights, placed shard by shard into the sharded state "
      "(checkpoint/hf_init.py; the dry run checks they are there); null builds the model from "
      "the architecture knobs alone, randomly initialised",
      doc_defaults={"pgs-train": "meta-llama/Llama-3.1-8B-Instruct", "pgs-distill": None},
      aliases=(Alias("model.student", "pgs-distill", note="the student model of distillation"),)),
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
      "pgs-distill", status=HONORED),
    K("model.chat_template_kwargs", "dict", {}, "Extra keyword arguments for every "
      "apply_chat_template call, e.g. enable_thinking.", "pgs-distill", status=HONORED),
]
