"""Megatron-LM model arguments beyond the reference document: attention variants, MTP, hybrid
and linear-attention layers, MuP, mHC, MoE extras, activation offloading and kernel switches.

Keys are Megatron-LM's argparse dests (megatron/training/arguments.py and the config dataclasses
it builds flags from). Parallelism, training and checkpoint arguments are in
``megatron_lm_train``; inference and RL in ``megatron_lm_infer``.
"""
from jaxtrain.config.knob import HONORED, INERT, REJECTED, Alias, K

_L = "megatron-lm"
_LP = ("megatron-lm", "primus")   # Megatron-LM arguments that Primus presets or experiments set
_HYBRID = ("with model_type mamba/hybrid or is_hybrid_model: the hybrid layer stack "
           "(models/spec.py HYBRID_STACKS, from_knobs._hybrid_fields)")
_MAMBA = "the Mamba-2 mixers of hybrid models (models/mamba.py, kernels/ssd)"
_MTP = ("multi-token prediction (models/mtp.py; train step: step._mtp_weights; under "
        "pipeline parallelism the modules run with the output layer after the last stage)")
_GDN = ("with experimental_attention_variant gdn: the Gated DeltaNet layers "
        "(models/linear_attention.py)")
_DSA = ("with experimental_attention_variant dsa: DeepSeek sparse attention on every "
        "multi-latent attention layer (models/dsa.py)")
_GDN_ALIAS = "MaxText's name for it in its qwen3_next and qwen3_5 blocks"
# Megatron-LM arguments that MaxText's base.yml has too; MaxText files default to base.yml's value.
_LM = ("megatron-lm", "maxtext")
_LPM = ("megatron-lm", "primus", "maxtext")

_FUSED = ("selects a fused PyTorch/Transformer Engine kernel of the same math; XLA fuses these "
          "ops itself when it compiles the step")
_KERNEL = ("chooses between PyTorch/CUDA kernel implementations of the same math; XLA generates "
           "jaxtrain's kernels")
_LAYOUT = ("a weight layout that Megatron's fused PyTorch kernels expect; jaxtrain keeps each "
           "projection as its own array and XLA picks the layout")
_MODELOPT = ("drives NVIDIA ModelOpt's export of a trained model (layer library, attention "
             "kernel, checkpoint layout, quantized storage); training numbers do not change, "
             "and jaxtrain exports with train.save_final / jaxtrain.models.to_hf")
_CUDA_GRAPH = ("XLA compiles the whole step into one executable that is replayed every step, so "
               "there are no CUDA graphs to capture")
_STREAMS = ("orders work on PyTorch CUDA streams; XLA's scheduler orders and overlaps the ops of "
            "the compiled step itself")
_SMS = ("reserves GPU streaming multiprocessors for a CUDA communication library; XLA's "
        "collectives size their own launches")
_PAD = ("the padding routes extra tokens to an expert with weight 0, so outputs and gradients are "
        "unchanged; it only aligns Transformer Engine's quantized grouped GEMM, and XLA's grouped "
        "matmul needs no alignment")
_DISPATCH = ("tunes the CUDA kernels behind Megatron's flex token dispatcher (DeepEP/HybridEP/"
             "NCCL-EP); jaxtrain runs flex as its own all-to-all expert dispatch, compiled by "
             "XLA, with nothing of theirs to tune")
_LOSSY = ("changes what the NCCL-EP/HybridEP kernels behind Megatron's flex dispatcher send; "
          "jaxtrain's all-to-all dispatch (which runs flex) sends tokens as they are and drops "
          "only by per-expert capacity (moe_expert_capacity_factor)")


def _zero_is_off(value):
    """Kimi K3's num_nextn_predict_layers writes 0 for "no MTP"; Megatron's knob says null."""
    return None if value in (0, "0") else value


KNOBS = [
    # --- attention variants and softmax ---
    K("softmax_type", "str", "vanilla", "Attention softmax: vanilla, off-by-one (an extra zero "
      "logit in the denominator) or learnable (a learned per-head offset logit).", _L, HONORED,
      choices=("vanilla", "off-by-one", "learnable"), planned_values={"off-by-one": None}),
    K("attention_output_gate", "bool", False, "Multiply the attention output by a sigmoid gate "
      "computed from the layer input (Qwen3-Next gated attention).", _LP, HONORED,
      "a per-head-channel gate projection wg [D,N,H]; HF Qwen3-Next/3.5 q_proj carry it beside "
      "the query (models/hf/qwen3_next.py)"),
    K("experimental_attention_variant", "str", None, "Replace softmax attention in some layers: "
      "gdn/gdn2 (Gated DeltaNet linear attention) or dsa (DeepSeek sparse attention); "
      "gated_delta_net is the old name of gdn.", _LP, HONORED,
      "gdn: Gated DeltaNet layers (models/linear_attention.py, kernels/gated_delta) where "
      "linear_attention_freq says; dsa: the DeepSeek-V3.2 indexer on every multi-latent "
      "attention layer (models/dsa.py)", choices=("gdn", "gdn2", "dsa", "gated_delta_net"),
      planned_values={"gdn2": 25}),
    K("flash_attention_version", "int", None, "Pin the FlashAttention generation (2, 3 or 4) of "
      "the training and inference attention; null lets each path pick.", _L, INERT,
      "selects among CUDA FlashAttention library generations; jaxtrain's attention kernels are "
      "its own (attention_backend)", choices=(2, 3, 4)),
    K("qk_clip", "bool", False, "MuonClip: after each step rescale query and key weights of heads "
      "whose largest attention logit exceeded qk_clip_threshold.", _L),
    K("qk_clip_alpha", "float", 0.5, "Share of the qk-clip rescale applied to the query side "
      "(the key side takes the rest).", _L),
    K("qk_clip_threshold", "float", 100.0, "Largest attention logit qk-clip allows; heads above it "
      "are scaled by threshold / max logit.", _LM),
    K("window_size", "list[int]|str", None, "Sliding-window attention as (left, right) token "
      "counts, -1 meaning unbounded; null is full attention.", _LP, HONORED,
      "(W, 0) lets each token see W tokens back and itself (a window of W + 1 keys, as "
      "TransformerEngine counts it); a causal model has nothing ahead, so right is 0 (or -1); "
      "exclusive with sliding_window_size and sink_sliding_window"),
    K("window_attn_skip_freq", "int|list[int]|str", None, "Which layers use the sliding window: N "
      "means every Nth layer attends fully, or a 0/1 list (or list expression) per layer, 1 = "
      "windowed.", _LP, HONORED, "with window_size: 1-based layer l is windowed unless N "
      "divides l, or as the list says (Megatron's is_layer_window_attention)"),
    K("no_rope_freq", "int|list[int]|str", None, "Layers that skip rotary embeddings: N skips "
      "every Nth layer, or a 0/1 per-layer pattern where 1 skips RoPE (Llama 4 NoPE layers).",
      _L, HONORED, "ModelConfig.no_rope_layers: 1-based layer l skips RoPE when N divides l (N "
      "must divide num_layers, as Megatron asserts), or as the list says; those layers rotate "
      "by the identity"),
    K("mrope_section", "list[int]", None, "Split of the rotary channels among temporal, height "
      "and width positions for multimodal RoPE (position_embedding_type mrope).", _LM, HONORED,
      "read with MaxText's use_mrope in the qwen3_5 block, where text makes the split "
      "irrelevant (plain RoPE); Megatron reads it only with position_embedding_type mrope, "
      "which is planned and refused", doc_defaults={"maxtext": [24, 20, 20]}),
    K("yarn_beta_fast", "float", None, "YaRN: rotation count above which frequencies are kept "
      "unscaled (high-frequency boundary of the ramp).", _L, HONORED,
      "jaxtrain's YaRN ramp (rope_type yarn); null is Megatron-LM's 32"),
    K("yarn_beta_slow", "float", None, "YaRN: rotation count below which frequencies are fully "
      "interpolated (low-frequency boundary of the ramp).", _L, HONORED,
      "jaxtrain's YaRN ramp (rope_type yarn); null is Megatron-LM's 1"),
    K("yarn_correction_range_round_to_int", "bool", None, "Round YaRN's correction-range "
      "endpoints to whole dimensions before building the ramp.", _L, HONORED,
      "jaxtrain's YaRN ramp (rope_type yarn; Hugging Face's truncate); null is Megatron-LM's "
      "true"),
    K("relative_attention_num_buckets", "int", 32, "Number of buckets of T5-style relative "
      "position biases.", _L, REJECTED,
      "T5-style relative position biases only serve position_embedding_type relative, which "
      "jaxtrain does not build; use rope"),
    K("relative_attention_max_distance", "int", 128, "Distance beyond which T5-style relative "
      "positions share the last bucket.", _L, REJECTED,
      "T5-style relative position biases only serve position_embedding_type relative, which "
      "jaxtrain does not build; use rope"),

    # --- MLP activation ---
    K("glu_linear_offset", "float", 0.0, "Constant added to the linear half of a gated MLP: "
      "act(gate) * (up + offset); GPT-OSS uses 1.", _L, HONORED,
      "1 with quick_geglu and activation_func_clamp_value is GPT-OSS's clamped GLU, built in MoE "
      "experts (every layer MoE); other offsets are refused"),
    K("activation_func_clamp_value", "float", None, "Clamp the first MLP projection's output to "
      "this magnitude before the activation (clamped SwiGLU of GPT-OSS and DeepSeek-V4).", _LP,
      HONORED, "with quick_geglu and glu_linear_offset 1: GPT-OSS's clamped GLU in the MoE "
      "experts (every layer MoE); other combinations (DeepSeek-V4's clamped SwiGLU) are "
      "refused"),

    # --- multi-token prediction ---
    K("mtp_num_layers", "int", None, "Number of multi-token-prediction modules; each predicts one "
      "more future token from the previous depth's hidden state. Null (MaxText: 0) turns MTP "
      "off.", _LPM, HONORED, _MTP + " (Megatron's; MaxText files' are refused: theirs "
      "differs)", parse=_zero_is_off,
      aliases=(Alias("num_nextn_predict_layers", "primus", to_canonical=_zero_is_off,
                     note="Kimi K3's name (Hugging Face's) for the MTP depth; 0 means none"),)),
    K("mtp_loss_scaling_factor", "float", 0.1, "Weight of the MTP loss (mean over depths) added "
      "to the main language-model loss.", _LPM, HONORED, "the objective adds it times the mean "
      "of the depths' losses (each over its own tokens); the reported loss is the main one and "
      "each depth's is reported as mtp_<k>_loss"),
    K("mtp_use_repeated_layer", "bool", False, "Reuse one MTP module for every depth instead of "
      "one module per depth.", _L, HONORED, _MTP + ": one module's parameters serve every "
      "depth (refused when the MTP layer is an MoE layer)"),
    K("mtp_detach_heads", "bool", False, "Stop MTP gradients at the main model's hidden states, "
      "so the MTP loss trains only the MTP modules.", _L),
    K("mtp_hsm", "bool", False, "Hidden-state mixing: at each MTP depth every token draws its "
      "input from the main hidden state or an earlier depth's output (training, 2+ depths).", _L),
    K("mtp_hybrid_override_pattern", "str", None, "Old per-layer pattern for the MTP layers of a "
      "hybrid model; hybrid_layer_pattern now carries it after a '/'.", _L, HONORED,
      "joined to hybrid_layer_pattern as Megatron converts it (one copy per mtp_num_layers "
      "depth); each depth's sublayers run in models/mtp.py"),

    # --- DeepSeek sparse attention (DSA) indexer ---
    K("dsa_indexer_n_heads", "int", None, "Heads of the DeepSeek sparse-attention indexer that "
      "scores which earlier tokens each query attends to.", _L, HONORED, _DSA),
    K("dsa_indexer_head_dim", "int", None, "Width of each DSA indexer head.", _L, HONORED, _DSA),
    K("dsa_indexer_topk", "int", None, "Tokens each query keeps from the DSA indexer's ranking.",
      _L, HONORED, _DSA + "; a query with fewer visible keys keeps them all"),
    K("dsa_indexer_topk_freq", "int", 1, "Compute the DSA top-k every N layers and share it with "
      "the layers in between; 1 computes it in every layer.", _L, HONORED, _DSA + ": the "
      "sharing layers have no indexer (stacks dsa_shared_layers / dsa_shared_moe_layers) and "
      "attend with the last computing layer's selection; pipeline stages must start on a "
      "computing layer"),
    K("dsa_indexer_skip_topk_offset", "int", 0, "Layer offset of the cross-layer top-k sharing "
      "(dsa_indexer_topk_freq).", _L, HONORED, _DSA + ": 1-based layer L computes its own "
      "selection when max(L - max(offset, 1), 0) is a multiple of dsa_indexer_topk_freq"),
    K("dsa_indexer_loss_coeff", "float", None, "Weight of the KL loss that trains the DSA indexer "
      "to match the attention distribution; 0 turns it off.", _L, HONORED, _DSA + ": each "
      "layer's KL(summed attention probabilities || indexer softmax), a mean over the "
      "microbatch's rows, times this, summed over layers into the objective; logged as "
      "indexer_loss (the layers' mean)"),
    K("dsa_indexer_use_sparse_loss", "bool", False, "Compute the DSA indexer loss only over the "
      "selected top-k tokens.", _L, HONORED, _DSA + ": both distributions of the KL restricted "
      "to the selected keys"),
    K("dsa_kernel_backend", "str", "none", "Fused DSA kernels to use: none, tilelang or cudnn; "
      "other layouts fall back to PyTorch.", _L, INERT, _KERNEL,
      choices=("none", "tilelang", "cudnn")),
    K("dsa_indexer_rope_interleaved", "bool", False, "Apply the DSA indexer's rotary embedding to "
      "interleaved channel pairs, as MLA does.", _L, HONORED, _DSA),
    K("dsa_indexer_rotate_activation", "bool", True, "Hadamard-rotate indexer queries and keys "
      "before scoring.", _L, INERT, "an orthonormal rotation of both queries and keys leaves "
      "every indexer score unchanged; Megatron needs it for its FP8 scoring kernels only"),
    K("dsa_indexer_scoring_relu", "bool", True, "Apply ReLU to the indexer's query-key scores "
      "before weighting them per head.", _L, HONORED, _DSA),
    K("dsa_indexer_k_norm_epsilon", "float", None, "Epsilon of the indexer key LayerNorm; null "
      "uses the model's norm epsilon.", _L, HONORED, _DSA),
    K("dsa_indexer_k_norm_fp32", "bool", False, "Run the indexer key LayerNorm on float32 "
      "inputs.", _L, INERT, "jaxtrain's norms compute in float32 whatever their input dtype"),

    # --- linear attention (Gated DeltaNet) and hybrid models ---
    K("linear_attention_freq", "int|list[int]|str", None, "Mix of linear-attention and softmax "
      "layers: N puts one softmax layer after N-1 linear ones, or a 0/1 per-layer pattern (1 = "
      "linear).", _LP, HONORED, _GDN),
    K("linear_conv_kernel_dim", "int", 4, "Width of the short causal convolution in Gated "
      "DeltaNet layers.", _LP, HONORED, _GDN,
      aliases=(Alias("gdn_conv_kernel_dim", "maxtext", note=_GDN_ALIAS),)),
    K("linear_key_head_dim", "int", 128, "Query/key head width of Gated DeltaNet layers.", _LP,
      HONORED, _GDN, aliases=(Alias("gdn_key_head_dim", "maxtext", note=_GDN_ALIAS),)),
    K("linear_value_head_dim", "int", 128, "Value/gate head width of Gated DeltaNet layers.", _LP,
      HONORED, _GDN, aliases=(Alias("gdn_value_head_dim", "maxtext", note=_GDN_ALIAS),)),
    K("linear_num_key_heads", "int", 16, "Query/key heads of Gated DeltaNet layers.", _LP,
      HONORED, _GDN, aliases=(Alias("gdn_num_key_heads", "maxtext", note=_GDN_ALIAS),)),
    K("linear_num_value_heads", "int", 32, "Value/gate heads of Gated DeltaNet layers.", _LP,
      HONORED, _GDN, aliases=(Alias("gdn_num_value_heads", "maxtext", note=_GDN_ALIAS),)),
    K("is_hybrid_model", "bool", False, "The model mixes Mamba/linear-attention layers with "
      "attention and MLP layers (Megatron's hybrid model).", _LP, HONORED, _HYBRID),
    K("hybrid_layer_pattern", "str", None, "Per-layer type string of a hybrid model: M Mamba, G "
      "Gated DeltaNet, * attention, D DSA, - MLP, E MoE; '|' marks pipeline cuts, '/' MTP "
      "layers.", _LP, HONORED, _HYBRID + "; one layer per symbol, each a single sublayer with "
      "its own pre-norm (M, *, +, G, D, - and E are built, D as multi-latent attention with "
      "experimental_attention_variant dsa and no other attention symbol beside it; MTP layers "
      "after '/' are refused as not implemented; '|' cuts are accepted only without pipeline "
      "parallelism)",
      aliases=(Alias("hybrid_override_pattern", ("megatron-lm", "primus"),
                     note="the former name; Megatron-LM forwards it to hybrid_layer_pattern"),)),
    K("mamba_state_dim", "int", 128, "Size of the recurrent state of each Mamba head.", _LP,
      HONORED, _MAMBA),
    K("mamba_head_dim", "int", 64, "Channel width of each Mamba head.", _LP, HONORED, _MAMBA),
    K("mamba_num_groups", "int", 8, "Groups sharing the B/C projections in Mamba layers.", _LP,
      HONORED, _MAMBA),
    K("mamba_num_heads", "int", None, "Mamba heads per layer; null means hidden_size x expand / "
      "mamba_head_dim.", _LP, HONORED, _MAMBA),
    K("use_mamba_mem_eff_path", "bool", True, "Run Mamba layers through the fused "
      "memory-efficient kernel path.", _L, INERT,
      "chooses between PyTorch/Triton implementations of the same Mamba math; jaxtrain would "
      "compile its own"),
    K("mamba_training_ssm_states_dtype", "str", None, "Dtype of the inter-chunk SSM states kept "
      "in Mamba training; null follows the activation dtype.", _L, HONORED,
      choices=("fp32", "bf16")),
    K("gdp_num_householder", "int", 3, "Householder reflections per token in Gated Delta Product "
      "layers.", _L, issue=25),
    K("gdp_cutedsl_kernel", "bool", False, "Run the Gated Delta Product mixer with its CuTeDSL "
      "kernel.", _L, INERT, _KERNEL),
    K("gdp_num_chunk_states_to_recompute", "int", 2, "CuTeDSL Gated Delta Product kernel: keep "
      "one chunk state in N+1 for backward and recompute the rest.", _L, INERT,
      "only the CuTeDSL Gated Delta Product kernel reads it; a memory trade inside a CUDA "
      "kernel"),

    # --- initialisation and MuP ---
    K("embedding_init_method_std", "float", None, "Std of the embedding initialisation (null: "
      "init_method_std); setting it also exempts embeddings from weight decay.", _L),
    K("use_mup", "bool", False, "Maximal Update Parametrisation: scale initialisation, learning "
      "rates and output multipliers with width so hyperparameters transfer.", _L),
    K("mup_width_mult", "float", 1.0, "MuP width multiplier (hidden_size / "
      "mup_base_hidden_size); computed when use_mup is on.", _L),
    K("mup_base_hidden_size", "int", None, "Width of the MuP base (proxy) model; null means "
      "hidden_size (multiplier 1).", _L),
    K("mup_embedding_mult", "float", 1.0, "Multiplier on the embedding output.", _L),
    K("mup_output_mult", "float", 1.0, "Multiplier on the output logits; with MuP and 1.0 it "
      "becomes 1 / mup_width_mult.", _L),
    K("mup_base_head_dim", "float", None, "Base head width for MuP attention scaling: softmax "
      "scale = sqrt(base) / head_dim ** mup_attn_scale_power.", _L),
    K("mup_attn_scale_power", "float", 1.0, "Exponent of the head width in the attention scale "
      "(0.5 standard, 1.0 MuP).", _L),

    # --- manifold-constrained hyper-connections (mHC) ---
    K("enable_mhc_connections", "bool", False, "Replace the residual stream with several mixed "
      "streams (manifold-constrained hyper-connections).", _L, HONORED,
      "Megatron's convention of models/hyper.py (unweighted norm, exp-start Sinkhorn, mean of "
      "the streams at the end)"),
    K("mhc_num_residual_streams", "int", 4, "Number of parallel residual streams of mHC.", _L,
      HONORED, "the streams' axis n of models/hyper.py"),
    K("mhc_sinkhorn_iterations", "int", 20, "Sinkhorn-Knopp iterations that make the mHC mixing "
      "matrix doubly stochastic.", _L, HONORED, "row/column rounds of hyper._sinkhorn"),
    K("mhc_init_gating_factor", "float", 0.01, "Initial value of the mHC gating factor.", _L,
      HONORED, "initial value of each half's three gates (alpha)"),
    K("mhc_recompute_layer_num", "int", None, "Layers per mHC recompute block; null puts all "
      "layers of the stack in one block.", _L, INERT,
      "groups Megatron's discard-and-recompute of mHC outputs, a memory schedule; the values are "
      "the same. jaxtrain recomputes mHC per layer with recompute_modules mhc"),

    # --- MoE ---
    K("moe_shared_expert_gate", "bool", False, "Scale the shared expert's output by a learned "
      "sigmoid gate of the token (Qwen2/Qwen3-Next style).", _LP, HONORED,
      "a [D,1] gate beside the shared expert (models/moe/block.py)"),
    K("moe_apply_probs_on_input", "bool", False, "Multiply expert inputs by the routing "
      "probabilities instead of the expert outputs.", _LP, HONORED,
      "models/moe/block.py: the token times its probability enters the expert, whose output "
      "is added with weight 1 (Llama 4); top-1 routing only, as Megatron asserts"),
    K("moe_latent_size", "int", None, "Width of a latent bottleneck the routed experts run in "
      "(projected down before dispatch, up after); null keeps model width.", _LP, HONORED,
      "models/moe/block.py: latent_in/latent_out around the routed experts; the router and the "
      "shared expert read the full-width token"),
    K("moe_router_quantile_balancing_ema", "float", 0.0, "EMA coefficient of the per-expert bias "
      "of quantile balancing; 0 replaces it with each batch's quantile.", _L, HONORED,
      "MoEConfig.qb_ema: once per global batch qb_beta = ema qb_beta + (1 - ema) mean "
      "quantile, then centred (models/moe/step.py)"),
    K("moe_router_force_biased", "float", None, "Benchmarking: add random normal bias of this std "
      "to router logits (positive: new each pass; negative: fixed per layer).", _L),
    K("moe_enable_routing_replay", "bool", False, "Record routing decisions and replay them in a "
      "later pass (so RL training sees the experts the rollout used).", _L),
    K("moe_upcycling_granularity", "int", 1, "Granular upcycling: each dense MLP becomes this "
      "many smaller experts per original expert; 1 is plain upcycling.", _L),
    K("moe_expert_rank_capacity_factor", "float", None, "Per-rank token budget of the HybridEP/"
      "NCCL-EP dispatchers as a multiple of the even share; tokens beyond it are dropped.", _L,
      REJECTED, _LOSSY),
    K("moe_router_padding_for_quantization", "bool", False, "Pad each expert's token count to a "
      "multiple of 16/32 in the routing map for FP8/FP4 grouped GEMMs.", _LP, INERT,
      _PAD),
    K("moe_router_padding_for_fp8", "bool", False, "Former name for routing-map padding for FP8; "
      "turns moe_router_padding_for_quantization on.", _LP, INERT,
      _PAD),
    K("moe_router_fusion", "bool", False, "Fuse top-k routing and aux-loss computation in one "
      "Transformer Engine kernel.", _LP, INERT, _FUSED),
    K("moe_flex_dispatcher_backend", "str", "deepep", "Communication backend of the flex token "
      "dispatcher: deepep, hybridep or ncclep.", _LP, INERT, _DISPATCH,
      choices=("deepep", "hybridep", "ncclep"), nullable=True),
    K("moe_permute_fusion_into_hybridep", "bool", False, "Fuse token permutation into HybridEP's "
      "dispatch kernels.", _L, INERT, _DISPATCH),
    K("moe_hybridep_pad_uneven_dispatch_inputs", "bool", False, "Pad HybridEP dispatch inputs to "
      "the largest per-rank token count.", _L, INERT, _DISPATCH),
    K("moe_flex_dispatcher_num_sms", "int", None, "SMs given to the flex dispatcher's "
      "communication kernels; null lets the backend choose.", _L, INERT, _SMS),
    K("moe_deepep_num_sms", "int", None, "Former DeepEP-only spelling of "
      "moe_flex_dispatcher_num_sms.", _LP, INERT, _SMS),
    K("moe_hybridep_num_sms", "int", None, "Former HybridEP-only spelling of "
      "moe_flex_dispatcher_num_sms.", _LP, INERT, _SMS),
    K("moe_hybridep_num_blocks_permute", "int", None, "CUDA thread blocks of HybridEP's permute "
      "kernel.", _L, INERT, _SMS),
    K("moe_hybridep_num_blocks_unpermute", "int", None, "CUDA thread blocks of HybridEP's "
      "unpermute kernel.", _L, INERT, _SMS),
    K("moe_hybridep_num_sms_preprocessing", "int", 108, "SMs for HybridEP's metadata scan "
      "kernel.", _L, INERT, _SMS),
    K("moe_ncclep_zero_copy", "bool", False, "NCCL-EP dispatcher: send from symmetric-memory "
      "buffers without a staging copy.", _L, INERT, _DISPATCH),
    K("moe_dispatch_fwd_dtype", "str", "bf16", "Wire dtype of the NCCL-EP dispatch payload; "
      "mxfp8 quantizes tokens before the all-to-all.", _L, REJECTED, _LOSSY,
      choices=("bf16", "mxfp8")),
    K("moe_combine_bwd_dtype", "str", "bf16", "Wire dtype of the NCCL-EP combine gradient in the "
      "backward pass; mxfp8 quantizes it before the all-to-all.", _L, REJECTED, _LOSSY,
      choices=("bf16", "mxfp8")),
    K("moe_pad_experts_for_cuda_graph_inference", "bool", False, "At decode time route with "
      "fixed per-expert capacity (no tokens dropped) so the step needs no host sync.", _L, INERT,
      "serves CUDA-graph capture of Megatron's decode step; " + _CUDA_GRAPH),
    K("moe_use_grouped_tensor", "bool", False, "Run grouped expert GEMMs on Transformer Engine's "
      "GroupedTensor with padded expert segments.", _L, INERT, _KERNEL),
    K("moe_single_grouped_weight", "bool", False, "Store all experts' weights of a layer as one "
      "Transformer Engine grouped parameter.", _L, INERT,
      "jaxtrain already stores a layer's expert weights as one stacked array; the flag picks a "
      "Transformer Engine storage class"),
    K("moe_single_grouped_bias", "bool", False, "Store all experts' biases of a layer as one "
      "Transformer Engine grouped parameter.", _L, INERT,
      "jaxtrain already stores a layer's expert biases as one stacked array; the flag picks a "
      "Transformer Engine storage class"),
    K("moe_mlp_glu_interleave_size", "int", None, "Interleave gate and up blocks of this size in "
      "the grouped expert GLU weight, for fused kernels.", _L, INERT, _LAYOUT),
    K("moe_shared_expert_glu_interleave_size", "int", None, "Interleave gate and up blocks of "
      "this size in the shared expert's GLU weight.", _L, INERT, _LAYOUT),
    K("use_grouped_gemm_for_shared_expert", "bool", False, "Run the shared expert as a "
      "one-group grouped GEMM to reach Transformer Engine's fused SwiGLU path.", _L, INERT,
      _KERNEL),
    K("use_grouped_gemm_for_dense_mlp", "bool", False, "Run dense MLPs as one-group grouped "
      "GEMMs to reach a fused MXFP8 SwiGLU kernel.", _L, INERT, _KERNEL),
    K("use_fused_weighted_squared_relu", "bool", False, "Use a fused kernel for MoE's "
      "probability-weighted squared ReLU.", _L, INERT, _FUSED),
    K("gtp_remat_opt_in_modules", "list[str]", [], "Extra modules (moe_latent_proj) whose "
      "weights are also sharded and re-gathered by GTP weight rematerialisation.", _L),

    # --- recompute, chunking and activation offloading ---
    K("recompute_modules", "list[str]", None, "Submodules selective recompute reruns in backward "
      "(core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts, mhc); null means "
      "core_attn.", (_L, "primus"), HONORED,
      choices=("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
               "shared_experts", "mhc")),
    K("mlp_chunks_for_training", "int", 1, "Run the MLP over this many sequence chunks in "
      "training to cap its activation memory.", _L),
    K("cpu_offloading_num_layers", "int", 0, "Number of transformer layers whose activations are "
      "moved to host memory during the forward pass.", _L),
    K("cpu_offloading_retain_pinned_cpu_buffers", "bool", False, "Keep the pinned host buffers "
      "of activation offloading between steps.", _L, INERT,
      "buffer reuse of PyTorch's offloading; XLA plans host transfers inside the compiled "
      "step"),
    K("fine_grained_activation_offloading", "bool", False, "Offload the inputs of the modules in "
      "offload_modules to host memory instead of whole layers.", _L),
    K("offload_modules", "list[str]", [], "Modules whose inputs fine-grained offloading moves to "
      "host (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, ...).",
      _L),
    K("min_offloaded_tensor_size", "int", 1048576, "Smallest tensor (elements) fine-grained "
      "offloading moves to host.", _L),
    K("delay_offload_until_cuda_graph", "bool", False, "Start fine-grained offloads only when "
      "the captured CUDA graph runs.", _L, INERT, _CUDA_GRAPH),
    K("delta_offload_bytes_across_pp_ranks", "int", 0, "Difference in offloaded bytes between "
      "consecutive pipeline stages, to balance memory.", _L),
    K("activation_offload_fraction", "float", 1.0, "Share of eligible offload groups that are "
      "actually offloaded.", _L),
    K("fine_grained_offloading_max_inflight_offloads", "int", None, "Most offloads per module "
      "name in flight before the main stream waits for them; null never waits.", _L, INERT,
      _STREAMS),
    K("moe_paged_stash", "bool", False, "Keep routed-expert activations needed by backward in "
      "paged buffers (optionally spilling to host).", _L),
    K("moe_paged_stash_page_size", "int", 64, "Tokens per page of the MoE paged stash.", _L),
    K("moe_paged_stash_buffer_size_factor_cuda", "float", 1.1, "Device buffer size of the paged "
      "stash as headroom over average (positive) or maximum (negative) use.", _L),
    K("moe_paged_stash_buffer_size_factor_cpu", "float", 0.0, "Host buffer size of the paged "
      "stash, same convention; 0 has no host buffer.", _L),

    # --- kernel and fusion switches ---
    K("disable_bf16_reduced_precision_matmul", "bool", False, "Forbid cuBLAS from reducing bf16 "
      "GEMM partial sums in bf16.", _L, INERT,
      "XLA's GPU GEMMs on bfloat16 inputs accumulate in float32; there is no reduced-precision "
      "reduction to forbid"),
    K("fused_residual_rmsnorm", "bool", False, "Fuse the residual add into the RMSNorm backward "
      "kernel (Transformer Engine).", _L, INERT, _FUSED),
    K("use_transformer_engine_op_fuser", "bool", False, "Let submodules use Transformer Engine's "
      "operation fuser for larger fused kernels.", _L, INERT, _FUSED),
    K("mla_down_proj_fusion", "bool", False, "Fuse MLA's query and key/value down-projections "
      "with the input norm where the backend supports it.", _L, INERT, _FUSED),
    K("use_kitchen_attention", "bool", False, "Compute attention with NVIDIA's kitchen extension "
      "instead of Transformer Engine.", _L, REJECTED,
      "the kitchen extension is a PyTorch/CUDA library with its own quantized attention "
      "numerics; jaxtrain's attention kernels are chosen with attention_backend"),
    K("kitchen_attention_backend", "str", "sdpa", "Kitchen attention implementation: sdpa or fa "
      "(flash).", _L, INERT, "only read with use_kitchen_attention, which jaxtrain refuses",
      choices=("sdpa", "fa")),
    K("high_priority_a2a_comm_stream", "bool", False, "Create the all-to-all stream of 1F1B "
      "expert-parallel overlap with high CUDA priority.", _L, INERT, _STREAMS),
    K("batch_invariant_mode", "bool", False, "Use kernels whose results do not depend on batch "
      "size, so a sequence gives bitwise the same output in any batch.", _L),
    K("batch_invariant_backend", "str", "te_native", "GEMM library of batch-invariant mode: "
      "te_native, deepgemm or triton.", _L, INERT, _KERNEL,
      choices=("te_native", "deepgemm", "triton")),

    # --- CUDA graphs ---
    K("cuda_graph_impl", "str", "none", "CUDA graph capture: none, local (Megatron's), "
      "transformer_engine, or full_iteration.", _L, INERT, _CUDA_GRAPH,
      choices=("none", "local", "transformer_engine", "full_iteration")),
    K("cuda_graph_modules", "list[str]", [], "Parts of each layer captured in per-layer CUDA "
      "graphs (attn, mlp, moe, moe_router, moe_preprocess, mamba); empty captures the layer.",
      _L, INERT, _CUDA_GRAPH),

    # NVIDIA ModelOpt arguments (megatron/post_training/arguments.py), which pretrain_gpt.py
    # adds when ModelOpt is installed: export, quantization and distillation flows.
    K("export_model_type", "str", "GPTModel", "ModelOpt: the model class a ModelOpt export "
      "builds.", _L, INERT, _MODELOPT, choices=("GPTModel", "HybridModel", "MambaModel")),
    *[K(name, "bool", False, f"ModelOpt export: {what}.", _L, INERT, _MODELOPT)
      for name, what in (
          ("export_legacy_megatron", "read a legacy Megatron checkpoint"),
          ("export_te_mcore_model", "build the model with TransformerEngine layers"),
          ("export_default_te_spec", "use the default TransformerEngine layer spec"),
          ("export_force_local_attention", "use Megatron's local dot-product attention "
           "instead of TransformerEngine's"),
          ("export_qk_l2_norm", "export with query/key L2 normalisation"),
          ("export_moe_apply_probs_on_input", "export MoE layers applying router weights to "
           "their inputs"),
          ("export_offline_model", "export for offline speculative decoding"),
          ("modelopt_enabled", "set when a ModelOpt checkpoint is loaded"))],
    K("export_kv_cache_quant", "str", "none", "ModelOpt: KV-cache quantization of the exported "
      "model.", _L, INERT, _MODELOPT,
      choices=("none", "fp8", "fp8_affine", "nvfp4", "nvfp4_affine", "nvfp4_rotate")),
    K("export_real_quant_cfg", "str", None, "ModelOpt: real (stored) quantization of the "
      "exported weights; null: none.", _L, INERT, _MODELOPT,
      choices=("fp8_real_quant", "fp8_blockwise_real_quant")),
    K("export_quant_cfg", "str", None, "ModelOpt: quantization recipe for quantization-aware "
      "training.", _L, issue=None),
    K("export_kd_teacher_load", "str", None, "ModelOpt: teacher checkpoint of knowledge "
      "distillation.", _L),
    K("export_kd_teacher_model_config", "str", None, "ModelOpt: the teacher's model config "
      "file.", _L),
    K("export_kd_teacher_ckpt_format", "str", None, "ModelOpt: checkpoint format of the "
      "teacher.", _L, choices=("torch", "torch_dist", "torch_dcp")),
    K("export_kd_cfg", "str", None, "ModelOpt: distillation config file (losses, layers).", _L),
    K("finetune_hf_dataset", "str", None, "ModelOpt: Hugging Face dataset to fine-tune on.", _L,
      ),
    K("finetune_data_split", "str", "train", "ModelOpt: split of finetune_hf_dataset.", _L,
      ),
    K("finetune_data_files", "list[str]", None, "ModelOpt: data files of finetune_hf_dataset.", _L,
      ),
    K("qad_train_target", "str", None, "ModelOpt quantization-aware distillation: what trains "
      "(base, mtp or both).", _L, choices=("base", "mtp", "both")),
    K("freeze_base_for_mtp", "bool", False, "ModelOpt: train only the multi-token-prediction "
      "layers.", _L),
    K("enable_gpt_oss", "bool", False, "ModelOpt: configure YaRN RoPE with gpt-oss's values.",
      _L, status=HONORED, reason="config/rules.py enable_gpt_oss: rope_type yarn, factor 32, "
      "original 131072 positions, beta fast 32 / slow 1, mscale 1, mscale_all_dim 0, no "
      "rounding of the correction range, written over the command line's values (with a "
      "warning naming them), as Megatron's model builder does"),
]
