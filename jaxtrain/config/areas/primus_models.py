"""Primus model-family keys: DeepSeek-V4 attention and hyper-connections, Kimi K3 (Kimi Delta
Attention, attention residuals, latent MoE, quantile balancing), hybrid Mamba/Gated DeltaNet
models and their FLA kernels, LFM2, and the Flux diffusion trainer. Defaults are Primus's own
fallbacks (its config dataclasses), so an unset key means the feature is off.
"""
from jaxtrain.config.knob import HONORED, INERT, K, REJECTED

_P = "primus"
_LFM = "LFM2's gated short-convolution layers (models/short_conv.py, stacks conv_layers)"
_RATIO = ("without hybrid_layer_pattern, the hybrid model's pattern is Megatron's evenly spaced "
          "allocation of attention, then MLP layers among the Mamba ones "
          "(from_knobs.pattern_from_ratios); with Primus's hybrid_mamba_mla_layer_specs stacks "
          "Primus's own (mixer + MLP pairs, from_knobs.primus_hybrid_pattern, which reads no "
          "MLP ratio)")
_PM = ("primus", "maxtext")   # also MaxText base.yml keys; MaxText files default to its value

_FLA = ("picks flash-linear-attention (Triton) or other PyTorch kernels of the same math for "
        "Primus's hybrid layers; XLA generates jaxtrain's kernels")
_V4_KERNEL = ("picks a Triton/Gluon kernel of Primus's DeepSeek-V4 attention; XLA generates "
              "jaxtrain's kernels")
_FLUX = ("a setting of Primus's Flux diffusion (image) trainer; jaxtrain trains decoder-only "
         "language models")
_UNREAD = "Primus itself reads no key of this name, so it has no effect there either"
_V4 = ("DeepSeek-V4 (model_type deepseek_v4; models/compressed.py, the reference semantics of "
       "transformers' and MaxText's DeepSeek-V4; Primus's own departures - zero-filled first "
       "sparse window, the indexer's own low-rank query, untransposed stream mixing, its YaRN "
       "ramp - are not reproduced)")
_K3 = ("Kimi K3 (model_type kimi_k3; from_knobs._k3_fields, checked against a torch "
       "transcription of Primus's layer on transformers' Kimi Linear modules)")

_K3_QB = (_K3 + ": Kimi K3's quantile rule (moe_router_bias_update_rule quantile; "
          "moe/router.margin_histogram, moe/step._k3_bias): each MoE layer's expert bias set "
          "once per global batch from the pooled histogram of margins s - tau")

KNOBS = [
    # --- DeepSeek-V4: compressed/sparse attention ---
    K("compress_ratios", "list[int]|str", None, "DeepSeek-V4 per-layer KV compression: 0 dense, "
      "4 compressed sparse attention, 128 heavily compressed (a list or its string).", _PM,
      HONORED, _V4 + ": a ratio per layer (entries past num_layers, the MTP layers', dropped); "
      "4 pools overlapping windows and keeps the indexer's top-k entries, another ratio pools "
      "plain windows, 0 keeps the window only", doc_defaults={"maxtext": []}),
    K("compress_rope_theta", "float", 160000.0, "DeepSeek-V4 RoPE base of the compressed "
      "attention layers.", _P, HONORED, _V4 + ": the RoPE of the compressing layers' queries, "
      "keys, entries and indexer (YaRN-scaled with rope_type yarn, no attention factor); "
      "ratio-0 layers rotate at rotary_base"),
    K("index_topk", "int", 0, "DeepSeek-V4 indexer: compressed positions each query attends to; "
      "0 turns the indexer off.", _P, HONORED, _V4 + ": the entries each query of a ratio-4 "
      "layer keeps (all visible ones while it sees no more)"),
    K("index_head_dim", "int", 128, "DeepSeek-V4 indexer head width.", _P, HONORED, _V4),
    K("index_n_heads", "int", 64, "DeepSeek-V4 indexer heads.", _P, HONORED, _V4),
    K("use_v4_fp8_indexer", "bool", False, "Score the DeepSeek-V4 indexer's query-key products in "
      "FP8.", _P, HONORED, _V4 + ": the indexer's queries and entry keys are fake-quantized to "
      "FP8 E4M3 before their product, each tensor scaled by 448 / its max magnitude (as "
      "Primus: the matmul stays in the compute dtype; the gradient passes straight through)"),
    K("v4_indexer_distill_loss_coeff", "float", 0.0, "Weight of the loss that distils attention "
      "into the DeepSeek-V4 indexer; 0 turns it off.", _P, HONORED, _V4 + ": per layer "
      "KL(heads' attention over the kept entries, summed and renormalised || the indexer's "
      "softmax), averaged over tokens, summed over layers times this (Primus's "
      "indexer_distill_loss); only the indexer learns from it (its inputs are detached)"),
    K("attn_sliding_window", "int", 0, "DeepSeek-V4 sliding window of the dense attention "
      "layers, in tokens; 0 is none.", _P, HONORED, _V4 + ": every layer's local keys, the "
      "window counting the query itself (Primus's i-W < j <= i)"),
    K("attn_sink", "bool", False, "DeepSeek-V4 learned per-head attention sink logit.", _P,
      HONORED, _V4 + ": one fp32 logit per head joins each softmax (no value)"),
    K("o_groups", "int", 8, "DeepSeek-V4 grouped output projection: head groups projected "
      "separately.", _PM, HONORED, _V4 + ": consecutive heads in o_groups groups, each "
      "projected to o_lora_rank, then all to the hidden size",
      doc_defaults={"maxtext": 0}),
    K("o_lora_rank", "int", 0, "DeepSeek-V4 low rank of the grouped output projection; 0 is full "
      "rank.", _PM, HONORED, _V4 + "; 0 (full rank) is refused by name (not built)"),
    K("use_v4_attention_backend", "str", "triton_v1", "Kernel of DeepSeek-V4's dense and heavily "
      "compressed attention.", _P, INERT, _V4_KERNEL),
    K("use_v4_csa_attention_backend", "str", "triton_v1", "Kernel of DeepSeek-V4's compressed "
      "sparse attention.", _P, INERT, _V4_KERNEL),
    K("hybrid_attention_enabled", "bool", True, "Marks DeepSeek-V4's mix of dense and compressed "
      "attention layers.", _P, INERT, _UNREAD),

    # --- DeepSeek-V4: hyper-connections, MoE, MTP ---
    K("hc_mult", "int", 1, "DeepSeek-V4 manifold-constrained hyper-connections: parallel "
      "residual streams per token; 1 is a plain residual.", _P, HONORED, _V4 + ": the streams "
      "of models/hyper.py in the DeepSeek convention (comb transposed, as transformers and "
      "MaxText), collapsed at the end by a learned head (hc_head)"),
    K("hc_sinkhorn_iters", "int", 20, "Sinkhorn iterations that make the hyper-connection mixing "
      "doubly stochastic.", _P, HONORED, _V4),
    K("hc_eps", "float", 1e-6, "Epsilon of the hyper-connection norms and Sinkhorn steps.", _P,
      HONORED, _V4 + ": added to the read weights, the mixing matrix and its row/column sums"),
    K("hc_use_sinkhorn", "bool", True, "Project hyper-connection mixing with Sinkhorn.", _P, INERT,
      _UNREAD),
    K("use_v4_compiled_sinkhorn", "bool", False, "Run the hyper-connection Sinkhorn under "
      "torch.compile.", _P, INERT,
      "torch.compile of the same Sinkhorn loop; XLA compiles jaxtrain's step"),
    K("mtp_use_separate_hc_head", "bool", True, "DeepSeek-V4 MTP: give each depth its own "
      "hyper-connection head.", _P, HONORED, _V4 + ": each MTP depth lifts its input into the "
      "streams and collapses them with its own head; false is refused (Primus raises too)"),
    K("num_hash_layers", "int", 0, "DeepSeek-V4: the first N MoE layers route tokens by a hash "
      "of the token id instead of a learned router.", _P, HONORED, _V4 + ": the first N layers "
      "take each token's experts from a fixed random table of its id (hash_routes, k distinct "
      "experts, not trained; loaded from a checkpoint's tid2eid), the router's scores weighing "
      "them"),
    K("swiglu_limit", "float", 0.0, "DeepSeek-V4 clamp of SwiGLU inputs (gate and up); 0 turns "
      "it off.", _P, HONORED, "ModelConfig.glu_clamp: silu(min(gate, c)) * clip(up, -c, c) in "
      "every gated MLP, the experts and the shared expert"),
    K("v4_grouped_experts_support_clamped_swiglu", "bool", False, "The grouped expert GEMM path "
      "applies the clamped SwiGLU itself.", _P, INERT,
      "declares what a Transformer Engine expert backend supports; jaxtrain's experts take the "
      "activation from the model config"),

    # --- Kimi K3: Kimi Delta Attention and MLA ---
    K("kda_gate_lower_bound", "float", -5.0, "Kimi Delta Attention: lower bound of the bounded "
      "log-decay gate.", _P, HONORED, _K3 + ": models/linear_attention.py: g = lb * "
      "sigmoid(exp(A_log) * (a + dt_bias)); null keeps Kimi Linear's -exp(A_log) * softplus"),
    K("kda_use_full_rank_gate", "bool", True, "Kimi Delta Attention: full-rank output gate (a "
      "hidden -> heads x dim projection).", _P, HONORED, _K3 + ": the KDA output gate is one "
      "[D,H,Dv] projection (wg); false, Kimi Linear's low-rank pair, is refused (Primus raises "
      "too)"),
    K("kda_chunk_size", "int", 64, "Chunk length of Kimi Delta Attention's chunked recurrence.",
      _P, HONORED, _K3 + ": the chunk length of kernels/gated_delta's chunked form (the WY "
      "blocks; the result is the recurrence's at any length)"),
    K("kda_backend", "str", "eager", "Kernel of Kimi Delta Attention: eager, eager_recurrent, "
      "fla or flydsl.", _P, INERT, _FLA),
    K("use_kimi_k3_attention_backend", "str", None, "One switch for all Kimi K3 attention "
      "kernels (overrides kda_backend).", _P, INERT, _FLA),
    K("mla_use_nope", "bool", True, "Kimi K3 MLA: no rotary embedding (the rotary head "
      "dimensions are carried unrotated).", _P, HONORED, _K3 + ": ModelConfig.mla_nope; "
      "false rotates the qk_pos_emb_head_dim part with RoPE as other MLA models do"),
    K("mla_use_output_gate", "bool", True, "Kimi K3 MLA: gate the attention output with a "
      "sigmoid of the layer input.", _P, HONORED, _K3 + ": attention_output_gate on MLA (wg "
      "[D,N,v_head_dim], sigmoid(x wg) times each head's output before the projection)"),
    K("attn_res_block_size", "int", None, "Kimi K3 attention residuals: every N layers a block "
      "summary is kept that later layers attend over; null turns them off.", _P, HONORED,
      _K3 + ": models/attn_res.py (softmax mixes over the block summaries and the running sum "
      "before each sublayer and the final norm; the layer loops run block by block; pipeline "
      "stages send the sum and the summaries folded, attn_res.fold)"),
    K("activation_situ_beta", "float", None, "Kimi K3 SiTU activation: soft clamp of the gate "
      "branch; null is plain SiLU.", _P, HONORED, _K3 + ": layers.glu: b tanh(g/b) sigmoid(g) "
      "* u in every gated MLP, the shared and the routed experts, where Primus builds SiTU "
      "(use_te_activation_func true, as its K3 yaml; null: b = 1 as Primus's `beta or 1.0`)"),
    K("activation_situ_linear_beta", "float", None, "Kimi K3 SiTU activation: soft clamp of the "
      "up branch.", _P, HONORED, _K3 + ": layers.glu: the up branch soft-clamped as c tanh(u/c) "
      "(null: as is)"),

    # --- Kimi K3: latent MoE, routing, MTP ---
    K("routed_expert_hidden_size", "int", None, "Kimi K3 latent MoE: width the routed experts "
      "work in (projected from and back to hidden_size); null is model width.", _P, HONORED,
      _K3 + ": Megatron's moe_latent_size under Primus's name (both set: they must agree)"),
    K("latent_moe_use_norm", "bool", False, "Kimi K3 latent MoE: normalise the combined routed "
      "output in the latent space.", _P, HONORED, _K3 + ": moe.latent_norm: an RMS norm of the "
      "combined routed output before the up projection (without a latent space none, as "
      "Primus)"),
    K("moe_router_bias_update_rule", "str", "sign", "Kimi K3 expert-bias update: sign (aux-loss-"
      "free) or quantile (quantile balancing).", _P, HONORED, _K3_QB + "; sign: Megatron's "
      "rate-sized steps", choices=("sign", "quantile")),
    K("quantile_balancing_num_bins", "int", 1024, "Histogram bins of quantile balancing's score "
      "quantile estimate.", _P, HONORED, _K3_QB + ": the bins"),
    K("quantile_balancing_margin_min", "float", -1.0, "Lower end of the score range the "
      "quantile histogram covers.", _P, HONORED, _K3_QB + ": margins below fall in the first "
      "bin"),
    K("quantile_balancing_margin_max", "float", 1.0, "Upper end of the score range the quantile "
      "histogram covers.", _P, HONORED, _K3_QB + ": margins above fall in the last bin"),
    K("quantile_balancing_center_bias", "bool", True, "Remove the common offset of the expert "
      "biases after each update.", _P, HONORED, _K3_QB + ": false keeps the offset"),
    K("quantile_balancing_update_interval", "int", 1, "Steps whose scores one bias update of "
      "quantile balancing pools.", _P, HONORED, _K3_QB + ": the routers' k3_hist leaf (fp32 "
      "counts, not trained, checkpointed) pools the histograms; at global batches n, 2n, ... "
      "the bias is set from the pool and it empties, as Primus's update counter does"),
    K("quantile_balancing_ema_decay", "float", None, "Turn the quantile-balancing bias into an "
      "EMA with this decay; null replaces it each update.", _P, HONORED,
      _K3_QB + ": decay·old + (1 - decay)·new"),
    K("mtp_layer_type", "str", "mirror_last", "Kimi K3 MTP layer kind: like the last backbone "
      "layer, MLA, or KDA.", _P, HONORED, _K3 + ": ModelConfig.mtp_mixer: the MTP layer's "
      "mixer (the last layer's FFN kept), without attention residuals as Primus builds it",
      choices=("mirror_last", "mla", "kda")),

    # --- hybrid Mamba / Gated DeltaNet models ---
    K("hybrid_attention_ratio", "float", 0.0, "Share of attention layers when a hybrid model's "
      "layer pattern is generated.", _P, HONORED, _RATIO),
    K("hybrid_mlp_ratio", "float", 0.0, "Share of MLP layers when a hybrid model's layer pattern "
      "is generated.", _P, HONORED, _RATIO),
    K("mamba_expand", "int", 2, "Mamba inner-width expansion factor.", _P, INERT,
      "Primus passes nothing by this name to Megatron's Mamba layers, which use their fixed "
      "expansion of 2"),
    K("mamba_d_conv", "int", 4, "Width of Mamba's causal convolution.", _P, INERT,
      "Primus passes nothing by this name to Megatron's Mamba layers, which use their fixed "
      "width of 4"),
    K("disable_mamba_mem_eff_path", "bool", False, "Turn off Mamba's fused memory-efficient "
      "path.", _P, INERT,
      "Primus's spelling of Megatron's --disable-mamba-mem-eff-path, a choice between PyTorch "
      "implementations of the same Mamba math"),
    K("use_short_conv", "bool", True, "Gated DeltaNet: apply the short causal convolution to q/k/v "
      "(false: SiLU only).", _P, HONORED,
      "models/linear_attention.py: false drops conv_q/k/v (and their decoding state); q, k, v "
      "are silu of their projections"),
    K("use_fla_data", "bool", None, "Order training samples as flash-linear-attention's training "
      "scripts do, for comparison runs.", _P, INERT,
      "Primus serves FLA's sample order only when fla_cache_dir (or PRIMUS_FLA_CACHE_DIR) names "
      "FLA's data cache too; alone it leaves Megatron's dataset, as jaxtrain reads it (the "
      "Zebra-Llama files set it with the cache directory commented out). With a cache directory "
      "the run stops: fla_cache_dir is planned"),
    K("fla_cache_dir", "str", None, "Cache directory of the FLA-ordered dataset.", _P),
    K("use_fla_fused_swiglu", "bool", None, "Use FLA's fused SwiGLU kernel in MLPs.", _P, INERT,
      _FLA),
    K("use_fla_fused_rmsnorm", "bool", None, "Use FLA's fused RMSNorm kernel.", _P, INERT, _FLA),
    K("use_fla_fused_gated_norm", "bool", None, "Use FLA's fused gated norm in Gated DeltaNet "
      "layers.", _P, INERT, _FLA),
    K("use_fla_fused_norm_gated", "bool", None, "Use FLA's fused norm + gate in Kimi Delta "
      "Attention layers.", _P, INERT, _FLA),
    K("use_fla_short_conv", "bool", None, "Use FLA's short-convolution kernel.", _P, INERT, _FLA),
    K("use_fla_triton_kda", "bool", None, "Use FLA's Triton kernels for Kimi Delta Attention.",
      _P, INERT, _FLA),
    K("use_fla_kda_in_kernel_gate", "bool", None, "Compute the KDA decay gate inside FLA's kernel.",
      _P, INERT, _FLA),
    K("fla_mla_attn", "str", None, "Force (1) or forbid (0) FLA's flash-attention wrapper for MLA "
      "layers of hybrid models.", _P, INERT, _FLA),
    K("fused_ce_mode", "int", None, "Cross-entropy of Primus's hybrid models: 0 Megatron's, 1 or "
      "2 FLA's fused kernels.", _P, INERT,
      "FLA's fused cross-entropy kernels compute the same loss; jaxtrain's loss is compiled by "
      "XLA and chunked with memory.chunked_loss"),
    K("fused_ce_chunks", "int", None, "Chunks of FLA's fused cross-entropy.", _P, INERT,
      "FLA's fused cross-entropy kernels compute the same loss; jaxtrain's loss is compiled by "
      "XLA and chunked with memory.chunked_loss"),

    # --- LFM2 ---
    K("lfm_layer_types", "list[str]", None, "LFM2 layer kinds, one per layer: conv (gated short "
      "convolution) or full_attention; null means all attention.", _P, HONORED, _LFM),
    K("conv_L_cache", "int", 3, "LFM2 short-convolution kernel length.", _P, HONORED, _LFM),
    K("conv_bias", "bool", False, "Give LFM2's short convolution a bias.", _P, HONORED,
      _LFM + "; the input and output projections get biases too, as in LFM2"),

    # --- Flux diffusion trainer ---
    K("mock_dataset", "dict", {"class": None, "params": {"num_samples": 1000, "image_size": 512}},
      "Synthetic dataset of Primus's diffusion trainer: class path and its parameters.", _P,
      REJECTED, _FLUX + "; language-model mock data is mock_data"),
    K("activation_func", "str", None, "Activation of Primus's Flux model, by name (e.g. "
      "openai_gelu).", _P, REJECTED,
      _FLUX + "; pick a language model's activation with swiglu, quick_geglu, openai_gelu or "
      "squared_relu"),
    K("adaln_always_jit_fuser", "bool", False, "Flux: always JIT-fuse the adaptive LayerNorm "
      "modulation.", _P, REJECTED, _FLUX),
    K("adaln_plain_ops", "bool", False, "Flux: compute adaptive LayerNorm modulation with plain "
      "ops.", _P, REJECTED, _FLUX),
    K("use_triton_ops", "bool", False, "Flux: Triton kernels for fused LayerNorm modulation.", _P,
      REJECTED, _FLUX),
    K("use_dual_fp8_output_projection", "bool", False, "Flux: FP8 for both output projections of "
      "its blocks.", _P, REJECTED, _FLUX),
    K("cfg_dropout_prob", "float", 0.0, "Flux: probability of dropping the text condition "
      "(classifier-free guidance training).", _P, REJECTED, _FLUX),
    K("timestep_sampling_strategy", "str", "logit_normal", "Flux: how diffusion timesteps are "
      "drawn.", _P, REJECTED, _FLUX),
    K("vae_latent_mode", "str", "presampled", "Flux: use presampled VAE latents or resample them "
      "from stored distributions.", _P, REJECTED, _FLUX),
    K("vae_scale", "float", None, "Flux: scale of the VAE latent normalisation.", _P, REJECTED,
      _FLUX),
    K("vae_shift", "float", None, "Flux: shift of the VAE latent normalisation.", _P, REJECTED,
      _FLUX),
    K("nemo_chimera_init", "bool", False, "Flux: initialise weights the way NeMo's reference "
      "does.", _P, REJECTED, _FLUX),
    K("per_step_rng_reseed", "bool", False, "Flux: reseed the random generators every step.", _P,
      REJECTED, _FLUX),
    K("max_samples_per_sequence", "int", None, "Flux (Megatron-Energon data): samples read from "
      "one shard before switching; null means 100.", _P, REJECTED, _FLUX),
    # Flux model presets (primus/configs/models/megatron/diffusion)
    K("num_joint_layers", "int", None, "Flux: double-stream (joint text-image) blocks.", _P,
      REJECTED, _FLUX),
    K("num_single_layers", "int", None, "Flux: single-stream blocks.", _P, REJECTED, _FLUX),
    K("context_dim", "int", None, "Flux: width of the T5 text embeddings fed to the model.", _P,
      REJECTED, _FLUX),
    K("vec_in_dim", "int", None, "Flux: width of the pooled CLIP text vector.", _P, REJECTED,
      _FLUX),
    K("model_channels", "int", None, "Flux: width of the timestep-embedding MLPs.", _P, REJECTED,
      _FLUX),
    K("in_channels", "int", None, "Flux: channels of the packed VAE latents going in.", _P,
      REJECTED, _FLUX),
    K("out_channels", "int", None, "Flux: channels of the latents coming out.", _P, REJECTED,
      _FLUX),
    K("patch_size", "int", None, "Flux: spatial patch size of the latent image.", _P, REJECTED,
      _FLUX),
    K("theta", "float", None, "Flux: base period of its 3-D rotary embedding.", _P, REJECTED,
      _FLUX),
    K("axes_dim", "list[int]", None, "Flux: head channels given to each rotary axis.", _P,
      REJECTED, _FLUX),
    K("guidance_embed", "bool", False, "Flux: embed the classifier-free guidance scale as an "
      "input.", _P, REJECTED, _FLUX),
    K("guidance_scale", "float", None, "Flux: guidance scale fed to the guidance embedding in "
      "training; null means 3.5.", _P, REJECTED, _FLUX),
    K("vae", "dict", None, "Flux: the VAE that encodes images to latents (type, weights, "
      "scaling, caching).", _P, REJECTED, _FLUX),
    K("t5", "dict", None, "Flux: the T5 text encoder (type, weights, tokenizer, length).", _P,
      REJECTED, _FLUX),
    K("clip", "dict", None, "Flux: the CLIP text encoder (type, weights, tokenizer, pooled "
      "output).", _P, REJECTED, _FLUX),
]
