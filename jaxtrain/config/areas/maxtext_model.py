"""MaxText model keys beyond the plain aliases: the decoder blocks, other families' layers,
attention variants, MoE routing, MLA/YaRN extras, position encodings, norms and model
quantization.

Canonical keys are MaxText's own (configs/base.yml); defaults are its base.yml values. The rules
that turn a block and its keys into the Megatron knobs are in config/dialects/maxtext_model.py.
Keys that only MaxText's other decoder blocks read (DeepSeek V3.2/V4) are planned
for issue 25; kernel tuning for those lives in maxtext_runtime.
"""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_MT = "maxtext"
_FAMILIES = 25

# MaxText's decoder blocks (common_types.DecoderBlockType) and what jaxtrain does with each.
BUILT_BLOCKS = ("llama2", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek", "gpt3",
                "gpt_oss", "gemma", "gemma2", "gemma3", "olmo3", "qwen3_next", "qwen3_5", "llama4",
                "gemma4", "gemma4_small", "envy", "deepseek4", "qwen3_custom_moe", "default")
PLANNED_BLOCKS = ()
REJECTED_BLOCKS = {
    b: "MaxText's test block of a single weight matrix per layer (or an MLP only) is not a "
       "language model architecture; use a real decoder block such as llama2"
    for b in ("simple", "simple_mlp")}
DECODER_BLOCKS = BUILT_BLOCKS + PLANNED_BLOCKS + tuple(REJECTED_BLOCKS)
MOE_BLOCKS = ("mixtral", "qwen3_moe", "deepseek", "gpt_oss", "qwen3_next", "qwen3_5", "llama4",
              "gemma4", "envy", "deepseek4", "qwen3_custom_moe")


def _family(key, type_, default, meaning, family, **kw):
    """A key read only by MaxText decoder blocks of families that issue 25 builds."""
    return K(key, type_, default, meaning, _MT, reason=f"read only by MaxText's {family}, which "
             "jaxtrain does not build yet", issue=_FAMILIES, **kw)


_NO_VALUE_CHANGE = "the computed values are the same either way"
_NNX = ("selects between MaxText's Flax NNX and Linen model code, which compute the same model; "
        "jaxtrain has one pure-JAX model")
_YARN = ("MaxText's YaRN rotary embedding (rope_type yarn); mapped onto jaxtrain's YaRN in "
         "config/dialects/maxtext_model.py")
_DEEPSEEK = "decoder_block deepseek; refused with the other blocks, which do not read it"
_REMAT = ("remat_policy custom: MaxText's checkpoint name for {what}; jaxtrain's layer does not "
          "tag that tensor yet, so only remat (recompute) is available")
_REMAT_CHOICES = ("remat", "device", "offload")
_INDEXER = ("DeepSeek sparse attention on every multi-latent attention layer (models/dsa.py; "
            "from_knobs._dsa_fields)")

KNOBS = [
    # --- size and shape details of other blocks ---
    K("dense_init_scale", "float", 1.0, "Scale of the truncated-normal fan-in initialiser of the "
      "dense layers in MaxText's llama4, DeepSeek, gpt-oss and envy blocks.", _MT, issue=None,
      reason="jaxtrain initialises every matrix with Megatron's normal(init_method_std), not "
      "MaxText's fan-in truncated normal"),
    K("attention_output_dim", "int", -1, "Width of the attention block's output projection "
      "when positive (MaxText's qwen3_custom_moe block); -1 keeps emb_dim.", _MT, HONORED,
      "decoder_block qwen3_custom_moe: ModelConfig.attention_output_dim (attention to this "
      "width, normed, the MoE layer at this width, projected up to emb_dim, one residual "
      "add); other blocks refuse a value"),
    K("global_head_dim", "int", 0, "Query/key head width of the global-attention layers of "
      "Gemma 4; 0 uses head_dim.", _MT, HONORED, "decoder_block gemma4: global_kv_channels "
      "(config/dialects/maxtext_model.py); other blocks refuse a value"),
    K("global_num_kv_heads", "int", 0, "Key/value-head count of Gemma 4's global-attention "
      "layers; 0 uses num_kv_heads.", _MT, HONORED, "decoder_block gemma4: "
      "global_num_query_groups; other blocks refuse a value"),
    K("mlp_activations_limit", "float", -1.0, "Clip the MoE expert activations to at most this "
      "value (gpt-oss style clamp); -1 leaves them unclipped.", _MT, HONORED,
      "decoder_block gpt_oss: the clamp of GPT-OSS's GLU (jaxtrain's clamped expert GLU, "
      "Megatron's activation_func_clamp_value); deepseek4: silu(min(gate, c)) * clip(up, -c, c) "
      "in the routed experts only (MaxText's shared expert does not clamp); other blocks do not "
      "clamp, a limit there is refused"),
    K("inhomogeneous_layer_cycle_interval", "int", 1, "Length of the repeating pattern of unlike "
      "layers scanned as one block (gpt_oss: 2, a sliding-window layer then a global one).", _MT,
      HONORED, "decoder_block gpt_oss: with scan_layers layer i is windowed when (i mod interval) "
      "is even, as MaxText's scanned block does; other blocks take 1 (MaxText would build only "
      "num_layers / interval of their layers)"),
    K("interleave_moe_layer_step", "int", 1, "llama4/envy: every this-many-th layer is an MoE "
      "layer, the others dense.", _MT, HONORED, "decoder_block llama4 / envy: moe_layer_freq "
      "marks layer i MoE when step divides i + 1; other blocks refuse a value"),
    K("nope_layer_interval", "int", -1, "llama4: every this-many-th layer skips RoPE (NoPE); -1 "
      "gives every layer RoPE.", _MT, HONORED, "decoder_block llama4: no_rope_freq marks layer "
      "i NoPE when the interval divides i + 1; other blocks refuse a value"),
    K("hidden_size_per_layer_input", "int", 0, "Gemma 4 small: width of each layer's own "
      "per-token input (per-layer embeddings), added after the MLP through a gate and a "
      "projection; 0 turns them off.", _MT, HONORED, "ModelConfig.per_layer_input_size "
      "(models/per_layer.py); MaxText's gemma4_small block and Hugging Face's Gemma 4 read it, "
      "other blocks refuse a value"),
    K("vocab_size_per_layer_input", "int", 0, "Gemma 4 small: rows of the per-layer input "
      "embedding table; 0 uses vocab_size.", _MT, HONORED, "ModelConfig.per_layer_vocab_size; "
      "MaxText's gemma4_small block, which needs a positive value with "
      "hidden_size_per_layer_input (it skips the per-layer inputs otherwise), is refused with "
      "0"),
    K("num_kv_shared_layers", "int", 0, "Gemma 4 small: this many last layers have no key/value "
      "projections and attend over the keys and values of the last earlier layer of their kind "
      "(sliding-window or global).", _MT, HONORED, "ModelConfig.kv_shared_layers: the storing "
      "layers run as blocks of their own and hand their keys and values to the sharing layers' "
      "scan (transformer._run_layers); decoding keeps no cache for the sharing layers"),
    K("use_double_wide_mlp", "bool", False, "Gemma 4 small: the KV-sharing layers' MLP is twice "
      "as wide, making up for their missing key/value projections.", _MT, HONORED,
      "ModelConfig.double_wide_shared_mlp: the kv_shared_layers stacks' MLP is "
      "2·ffn_hidden_size wide"),
    K("share_kv_projections", "bool", False, "Gemma 4 global attention: keys and values come "
      "from one shared projection.", _MT, HONORED, "decoder_block gemma4: attention_k_eq_v on "
      "the global layers; other blocks refuse true"),
    K("attention_bias", "bool", False, "Give the query/key/value projections a learned bias "
      "(MaxText reads it in its qwen2 block, q/k/v only, and gpt_oss block, also the output).",
      _MT, HONORED, "qwen2: add_qkv_bias; gpt_oss: add_bias_linear (with mlp_bias and "
      "routed_bias, which must agree); other blocks do not read it and refuse true"),
    K("mlp_bias", "bool", False, "Give the MoE expert matmuls learned biases (added for "
      "gpt-oss).", _MT, HONORED, "decoder_block gpt_oss: expert biases with add_bias_linear; "
      "jaxtrain's experts get biases only together with biases on every projection, so other "
      "blocks refuse true"),

    # --- norms of other blocks ---
    K("use_qk_norm", "bool", False, "RMS-normalise queries and keys per head (read by MaxText's "
      "qwen2, qwen3, qwen3_moe, olmo3, llama4 and envy blocks).", _MT, HONORED, "qk_layernorm "
      "(qk_l2_norm without a scale); llama4: qk_l2_norm on its RoPE layers only "
      "(qk_norm_rope_layers_only); blocks that do not read it refuse true"),
    K("qk_norm_with_scale", "bool", True, "With query/key norms (use_qk_norm), give them a learned "
      "scale; false normalises without one.", _MT, HONORED,
      "true: qk_layernorm (RMSNorm with a scale); false: qk_l2_norm (the same norm without one)"),
    K("v_norm_with_scale", "bool", True, "With a value norm (Gemma 4), give it a learned "
      "scale.", _MT, HONORED, "decoder_block gemma4: v_norm scaled (true) or plain (false); "
      "other blocks have no value norm and refuse false"),

    # --- attention variants ---
    K("chunk_attn_window_size", "int", 0, "Chunked local attention (Llama 4): on the RoPE "
      "layers a token attends only to earlier tokens in its own block of this many positions; "
      "0 disables.", _MT, HONORED, "ModelConfig.attention_chunk_size: segment ids refined by "
      "position // chunk on the layers that rotate (every layer without no_rope_freq), so the "
      "flash kernel, cuDNN and context parallelism mask it as they mask packing"),
    K("causal_block_size", "int", 32, "Block diffusion: positions per block that attend to each "
      "other both ways (block-causal mask).", _MT, REJECTED, "block diffusion (diffusion LM "
      "training) is outside jaxtrain, which trains causal next-token models"),
    K("temperature_tuning", "bool", False, "Llama 4: on the NoPE layers scale queries by a "
      "temperature that grows with the token's position.", _MT, HONORED,
      "ModelConfig.attn_temperature_tuning: queries of the no_rope_freq layers times "
      "1 + temperature_tuning_scale * log(1 + floor((position + 1) / "
      "temperature_tuning_floor_scale)); a model without NoPE layers has no query it scales"),
    K("moba", "bool", False, "Mixture of Block Attention: each query attends to the top-k "
      "key/value chunks a gate picks, plus its own chunk.", _MT, issue=None,
      reason="block-sparse MoBA attention is not built in jaxtrain"),
    K("moba_chunk_size", "int", 1024, "MoBA: tokens per key/value chunk.", _MT, issue=None),
    K("moba_topk", "int", 8, "MoBA: chunks each query selects.", _MT, issue=None),

    # --- DeepSeek sparse attention (V3.2 indexer) ---
    K("use_indexer", "bool", False, "DeepSeek V3.2 sparse attention: a light indexer scores past "
      "tokens and each query attends to its top-k of them.", _MT, HONORED, _INDEXER + "; "
      "refused with experimental_attention_variant dsa, Megatron's switch for it"),
    K("indexer_head_dim", "int", 128, "Indexer: width of its query/key heads.", _MT, HONORED,
      _INDEXER),
    K("indexer_n_heads", "int", 64, "Indexer: number of its query heads.", _MT, HONORED,
      _INDEXER),
    K("indexer_topk", "int", 2048, "Indexer: tokens each query keeps.", _MT, HONORED, _INDEXER),
    K("indexer_use_approx_top_k", "bool", False, "Indexer: pick the top-k with the approximate "
      "(TPU) top-k instead of the exact one.", _MT, HONORED, _INDEXER + ": lax.approx_max_k "
      "(exact off TPU)"),
    K("indexer_approx_top_k_recall", "float", 0.95, "Indexer: recall target of the approximate "
      "top-k.", _MT, HONORED, _INDEXER + ": approx_max_k's recall_target"),
    K("indexer_mask_exact_topk", "bool", True, "Indexer: break ties so that exactly k tokens "
      "stay visible; false thresholds and may keep more.", _MT, HONORED, _INDEXER),
    K("indexer_sparse_training", "bool", False, "Indexer loss over the top-k tokens with the "
      "indexer input detached (sparse stage); false: over all tokens (dense warm-up).", _MT,
      HONORED, _INDEXER + ": the KL over the selected keys only (the indexer's inputs are "
      "detached in both stages)"),
    K("indexer_loss_scaling_factor", "float", 0.0, "Weight of the indexer's KL loss against the "
      "main attention; 0 adds none.", _MT, HONORED, _INDEXER + ": the layers' KL averaged, "
      "times this, joins the objective (also when the sequence is no longer than indexer_topk, "
      "where MaxText's indexer is bypassed and gets no gradient)"),
    K("mla_qk_head_chunk_size", "int", 0, "Compute the indexer's query-key product a chunk of "
      "heads at a time to save memory; 0 does all heads at once.", _MT, HONORED, _INDEXER +
      ": the indexer's scores and its loss's attention target summed a chunk of heads at a "
      "time under lax.scan (recomputed in the backward); the same values, less memory"),

    # --- MLA extras ---
    K("use_sliced_mla_proj", "bool", False, "MLA: slice the projection weights before the "
      "contraction instead of projecting whole and splitting the result.", _MT, INERT,
      "two ways of evaluating the same projections; " + _NO_VALUE_CHANGE),
    K("compressed_rope_max_timescale", "int", 160_000, "RoPE base period of DeepSeek V4's "
      "compressed sparse/heavy attention layers (used when positive).", _MT, HONORED,
      "decoder_block deepseek4: compress_rope_theta (the compressing layers' RoPE; MaxText "
      "applies no YaRN on this path, nor does jaxtrain without rope_type yarn)"),
    K("use_qk_clip", "bool", False, "QK-Clip (MuonClip): after each update, shrink query/key "
      "weights of heads whose largest attention logit passed qk_clip_threshold.", _MT,
      issue=None, reason="QK-Clip is not built in jaxtrain"),
    _family("mtp_eval_target_module", "int", 0, "Multi-token prediction: which MTP head "
            "(1-based) evaluation uses for its acceptance-rate metrics; 0 none.",
            "multi-token-prediction layers"),
    K("first_num_hash_layers", "int", 0, "DeepSeek V4: leading MoE layers that route by a "
      "fixed token-id hash instead of the router; 0 disables.", _MT, HONORED,
      "decoder_block deepseek4: num_hash_layers (MaxText starts the table at zeros, every "
      "token to expert 0, filled only from a checkpoint; jaxtrain draws k distinct experts per "
      "token id, which trains from scratch)"),

    # --- MoE details ---
    K("base_moe_mlp_dim", "int", -1, "Hidden width of each routed expert (qwen3_moe and "
      "deepseek blocks; must be positive with experts).", _MT, HONORED,
      "moe_ffn_hidden_size for decoder_block qwen3_moe and deepseek (times the "
      "global_parameter_scale factor); mixtral and gpt_oss size their experts by base_mlp_dim, "
      "and MaxText requires the two to agree in a model of MoE layers only"),
    K("capacity_factor", "float", -1.0, "Per-expert token capacity per sequence, as a multiple "
      "of the even share, on the dense path (sparse_matmul false); -1 drops no tokens.", _MT,
      HONORED),
    K("load_balance_loss_weight", "float", 0.0, "Weight of MaxText's per-sequence load-balancing "
      "loss (mean of token share x probability, times experts squared).", _MT, HONORED,
      "Megatron's seq_aux_loss with moe_aux_loss_coeff = weight x top-k / MoE layers (MaxText "
      "averages the layers' losses and leaves out Megatron's 1/top-k); the DeepSeek block, "
      "whose balance loss takes a softmax of its scores, refuses it"),
    K("shared_experts", "int", 0, "Number of always-on shared experts, each base_moe_mlp_dim "
      "wide.", _MT, HONORED, _DEEPSEEK + ": moe_shared_expert_intermediate_size (the "
      "qwen3_next and qwen3_5 blocks always have one gated shared expert and ignore it, as "
      "MaxText does; gemma4: its one dense MLP of mlp_dim beside the experts, 1 only)"),
    K("first_num_dense_layers", "int", 0, "Leading layers with a dense MLP (base_mlp_dim) before "
      "the MoE layers.", _MT, HONORED, _DEEPSEEK + ": moe_layer_freq"),
    K("routed_scaling_factor", "float", 1.0, "Multiplier on the chosen experts' routing "
      "weights.", _MT, HONORED, _DEEPSEEK + ": moe_router_topk_scaling_factor"),
    K("routed_score_func", "str", "", "Function applied to the router logits before the top-k "
      "(softmax, sigmoid, sqrtsoftplus; empty: raw logits).", _MT, HONORED,
      _DEEPSEEK + ": moe_router_score_function (softmax: over all experts before the top-k, "
      "moe_router_pre_softmax); raw-logit weights are refused",
      choices=("", "softmax", "sigmoid", "sqrtsoftplus")),
    K("routed_bias", "bool", False, "Routing bias: DeepSeek's selection-only expert bias, "
      "gpt-oss's learned router logit bias.", _MT, HONORED,
      "deepseek (model_name deepseek3*/deepseek4*, sigmoid scores): moe_router_enable_expert_bias, "
      "a float32 leaf outside the optimizer (MaxText's optimizer applies weight decay to it); "
      "gpt_oss: the router bias of add_bias_linear. Other blocks and model names, where MaxText "
      "adds the bias into the routing weights, refuse it"),
    K("routed_bias_update_rate", "float", 0.0, "Step size of the aux-loss-free routing-bias "
      "update (rate x sign of the load deficit, once per step).", _MT, HONORED,
      _DEEPSEEK + ": moe_router_bias_update_rate"),
    K("n_routing_groups", "int", -1, "Expert groups of group-limited routing (a group scored by "
      "its top-2 experts); -1 disables.", _MT, HONORED, _DEEPSEEK + " (model_name deepseek3*/"
      "deepseek4*, where MaxText applies it): moe_router_num_groups"),
    K("topk_routing_group", "int", -1, "Expert groups kept per token in group-limited routing; "
      "-1 disables.", _MT, HONORED, _DEEPSEEK + ": moe_router_group_topk (with top-k = 2 x "
      "groups kept, where Megatron's group score is MaxText's top-2 sum)"),
    K("float32_weight_sum", "bool", True, "MoE: add up the chosen experts' weighted outputs in "
      "float32.", _MT, issue=None, reason="jaxtrain combines expert outputs in the compute "
      "dtype; a float32 combine is not built yet"),
    K("megablox", "bool", True, "MoE: compute the experts with the megablox grouped-matmul "
      "kernel (false: jax.lax.ragged_dot).", _MT, MAPPED, "jaxtrain computes the experts with "
      "its own grouped expert matmul whichever kernel is named; " + _NO_VALUE_CHANGE),
    K("sparse_matmul", "bool", True, "MoE: sort tokens by expert and run grouped matmuls; false "
      "runs MaxText's dense one-hot einsum path.", _MT, MAPPED, "jaxtrain always runs the "
      "sorted grouped computation (its dropless expert matmul); without token dropping the "
      "dense path computes the same values"),
    K("num_moe_token_chunks", "int", 1, "Ring-of-experts: split each shard's tokens into this "
      "many chunks so communication of one overlaps the expert matmul of the previous.", _MT,
      INERT, "an overlap schedule of the expert-parallel exchange; " + _NO_VALUE_CHANGE),
    K("moe_chunk_barrier", "bool", False, "Profiling aid: fence each ring-of-experts chunk on "
      "the previous one so they run one after another.", _MT, INERT,
      "an optimisation barrier for profiling; " + _NO_VALUE_CHANGE),
    K("ragged_buffer_factor", "float", -1.0, "MoE: size the routed-token buffer as this multiple "
      "of the balanced share, dropping overflow; negative means worst case (no dropping).",
      _MT, issue=None, reason="buffer-bound token dropping is not built; jaxtrain's experts "
      "drop by capacity only (moe_expert_capacity_factor)"),
    K("moe_expert_input_dim", "int", -1, "Width of the tokens entering the MoE experts when "
      "positive (qwen3_custom_moe); -1 uses emb_dim.", _MT, HONORED, "decoder_block "
      "qwen3_custom_moe, where it must equal attention_output_dim (MaxText's rule; the experts "
      "work at that width); other blocks refuse a value"),
    K("use_random_routing", "bool", False, "Debug aid: send each token to randomly drawn "
      "experts instead of the router's choice.", _MT, issue=None,
      reason="random routing is not built (moe_router_force_load_balancing is Megatron's "
      "balanced-routing aid)"),
    K("use_custom_sort_vjp", "bool", True, "MoE: use MaxText's hand-written backward pass of the "
      "token sort.", _MT, INERT, "a faster backward of the same permutation; "
      + _NO_VALUE_CHANGE),
    K("use_ring_of_experts", "bool", False, "Expert parallelism by all-gathering tokens around "
      "the expert ring and reduce-scattering results instead of all-to-all.", _MT, INERT,
      "another communication pattern for the same routed computation; jaxtrain's dispatcher is "
      "chosen by moe_token_dispatcher_type and " + _NO_VALUE_CHANGE),
    K("num_moe_emb_chunks", "int", 0, "Split the token all-gather along the embedding dimension "
      "to overlap it with the grouped matmul; 0 disables.", _MT, INERT,
      "an overlap schedule; " + _NO_VALUE_CHANGE),
    K("merge_gating_gmm", "bool", False, "MoE: run the two gated input projections as one "
      "grouped matmul.", _MT, INERT, "a fusion of the same matmuls; " + _NO_VALUE_CHANGE),
    K("norm_topk_prob", "bool", False, "Renormalise the chosen experts' routing weights to sum "
      "to one (Qwen3 MoE).", _MT, MAPPED, "MaxText divides the top-k weights by their sum after "
      "its softmax over the chosen experts' logits, so they already sum to one: in the other "
      "blocks jaxtrain builds true and false give the same router (softmax over the chosen "
      "logits, moe_router_pre_softmax false); gemma4 takes a softmax over all experts, so false "
      "keeps those probabilities (moe_router_pre_softmax true); the DeepSeek block does not "
      "read it"),
    K("use_batch_split_schedule", "bool", False, "DeepSeek: split the batch into micro-batches "
      "so expert all-to-all overlaps compute of the other half.", _MT, INERT,
      "an overlap schedule of MaxText's DeepSeek block; XLA schedules the expert exchange "
      "itself and " + _NO_VALUE_CHANGE),
    K("batch_split_factor", "int", 1, "With use_batch_split_schedule: number of micro-batches.",
      _MT, INERT, "an overlap schedule; " + _NO_VALUE_CHANGE),
    K("log_moe_bias_norms", "bool", False, "Log the norms of the MoE routing biases (DeepSeek "
      "V4).", _MT, issue=None, reason="jaxtrain does not log routing-bias norms yet"),
    K("activations_in_float32", "bool", False, "MoE: cast expert activations to float32 before "
      "the nonlinearity.", _MT, issue=None,
      reason="jaxtrain's experts apply the activation in the compute dtype"),

    # --- positions ---
    K("use_untrainable_positional_embedding", "bool", False, "Add fixed sinusoidal position "
      "embeddings to the token embeddings.", _MT, issue=None,
      reason="sinusoidal position embeddings are not built in jaxtrain"),
    K("trainable_position_size", "int", -1, "When positive, add a learned GPT-3 style position "
      "table of this many positions to the token embeddings.", _MT, HONORED,
      "decoder_block gpt3: position_embedding_type learned_absolute with max_position_embeddings "
      "positions (none without it); other blocks refuse it, since MaxText adds the table on top "
      "of their RoPE and jaxtrain's learned table replaces RoPE"),
    K("local_rope_max_timescale", "int", -1, "RoPE base period of the local (sliding-window) "
      "layers when positive; otherwise rope_max_timescale serves both.", _MT, HONORED,
      "decoder_block gemma3/gemma4: local_rotary_base (config/dialects/maxtext_model.py); the "
      "other built blocks do not read it and refuse a set value"),
    K("global_rope_max_timescale", "int", -1, "Gemma 4: RoPE base period of the global layers "
      "when positive.", _MT, HONORED, "decoder_block gemma4: rotary_base (the global layers'; "
      "the local ones take local_rope_max_timescale); other blocks refuse a value"),
    K("global_rope_proportion", "float", 0.25, "Gemma 4: share of each global head's channels "
      "that RoPE rotates.", _MT, HONORED, "decoder_block gemma4 with a gemma4* model_name: "
      "global_rotary_percent (proportional RoPE); other blocks refuse a value"),
    K("local_rope_proportion", "float", 1.0, "Gemma 4: share of each local head's channels "
      "that RoPE rotates.", _MT, HONORED, "decoder_block gemma4: the local layers rotate "
      "whole heads (1.0); a smaller share is refused, other blocks refuse a value"),
    K("partial_rotary_factor", "float", 1.0, "Share of each head's channels that RoPE rotates "
      "in MaxText's qwen3-next and multimodal-RoPE paths.", _MT, HONORED,
      "decoder_block qwen3_next / qwen3_5: rotary_percent (config/dialects/maxtext_model.py); "
      "other blocks refuse a value they would not read"),
    K("rope_factor", "float", 40.0, "YaRN context-extension factor (also sets MLA's softmax "
      "mscale).", _MT, HONORED, _YARN + ": rotary_scaling_factor"),
    K("beta_fast", "float", 32.0, "YaRN: rotation count that bounds the extrapolated (high "
      "frequency) channels.", _MT, HONORED, _YARN + ": yarn_beta_fast"),
    K("beta_slow", "float", 1.0, "YaRN: rotation count that bounds the interpolated (low "
      "frequency) channels.", _MT, HONORED, _YARN + ": yarn_beta_slow"),
    K("rope_interleave", "bool", True, "YaRN: rotate interleaved channel pairs rather than the "
      "two halves.", _MT, HONORED, _YARN + ": rotary_interleaved; multi-latent attention "
      "rotates interleaved pairs only and refuses false"),
    K("rope_truncate", "bool", True, "YaRN: round the correction range outward to whole "
      "channels.", _MT, HONORED, _YARN + ": yarn_correction_range_round_to_int"),
    K("rope_attention_scaling", "bool", False, "YaRN: multiply the rotated queries/keys by the "
      "YaRN attention factor 0.1 ln(rope_factor) + 1 (gpt-oss).", _MT, HONORED,
      _YARN + ": the factor of the rotary cos/sin (mscale over mscale_all_dim)"),
    K("rope_pairwise", "bool", False, "YaRN: keep the rotation as [..., pairs, 2] and return an "
      "interleaved result (needs rope_interleave).", _MT, INERT,
      "changes only the order of the rotated query/key channels, the same for both, so the "
      "attention scores are the same"),
    K("yarn_softmax_mscale", "float", 1.0, "MaxText MLA: coefficient m of the softmax scale "
      "factor (0.1 m ln(rope_factor) + 1)^2, applied when max_position_embeddings > original.",
      _MT, HONORED, _YARN + ": mscale_all_dim of the MLA softmax scale (0 when "
      "max_position_embeddings <= original_max_position_embeddings)",
      aliases=(Alias("mscale", _MT, only_in=(_MT,), note=(
          "MaxText's mscale scales MLA's softmax only (Megatron's mscale_all_dim role) and "
          "never the rotary cos/sin, unlike Megatron's mscale")),)),

    # --- other architectures ---
    K("gdn_chunk_size", "int", 64, "Gated DeltaNet: chunk length of its chunked parallel scan.",
      _MT, HONORED, "the chunk length of jaxtrain's chunked gated delta rule (kernels/"
      "gated_delta); the result is the same for any length, the cost is not"),
    K("use_qk_norm_in_gdn", "bool", True, "Gated DeltaNet: L2-normalise queries and keys inside "
      "the delta rule.", _MT, HONORED, "kernels/gated_delta l2_qk"),
    K("mhc_expansion_rate", "int", 1, "Manifold-constrained hyper-connections: parallel "
      "residual streams per layer; 1 is the plain residual.", _MT, HONORED,
      "MaxText's (DeepSeek's) convention of models/hyper.py: learned-scale norm, softmax-start "
      "Sinkhorn, the streams summed at the end"),
    K("sinkhorn_iterations", "int", 20, "mHC: Sinkhorn-Knopp iterations that make the "
      "stream-mixing matrix doubly stochastic.", _MT, HONORED, "hyper._sinkhorn's rounds"),
    K("enable_mhc_lite", "bool", False, "mHC-lite: build the mixing matrix as a convex "
      "combination of permutations instead of Sinkhorn iterations.", _MT, HONORED,
      "softmax weights over the n! permutation matrices (models/hyper.py)"),
    _family("engram_layers", "list[int]", [], "DeepSeek Engram: layers that get an n-gram "
            "hash-memory branch; empty disables it.", "DeepSeek Engram"),
    _family("engram_max_ngram_size", "int", 3, "Engram: largest n of the hashed n-grams "
            "(2..n).", "DeepSeek Engram"),
    _family("engram_num_heads", "int", 8, "Engram: number of hash heads.", "DeepSeek Engram"),
    _family("engram_head_dim", "int", 1280, "Engram: width of each head's memory embedding.",
            "DeepSeek Engram"),
    _family("engram_vocab_bases", "list[int]", [], "Engram: smallest table size of each n-gram "
            "order.", "DeepSeek Engram"),
    _family("engram_kernel_size", "int", 4, "Engram: window of its temporal convolution.",
            "DeepSeek Engram"),
    _family("engram_seed", "int", 0, "Engram: seed of the n-gram hash functions.",
            "DeepSeek Engram"),

    # --- remat names of tensors jaxtrain's layer does not tag ---
    K("kv_proj", "str", "remat", "remat_policy custom: where a fused key/value projection goes "
      "(recomputed, kept on the device, or offloaded to host).", _MT, INERT,
      "jaxtrain projects keys and values separately (key_proj, value_proj), so no fused kv_proj "
      "tensor exists to place", choices=_REMAT_CHOICES),
    K("indexer_cutoff_threshold", "str", "remat", "remat_policy custom: where the "
      "sparse-attention indexer's cutoff (each query's k-th score) goes (recomputed, kept on the "
      "device, or offloaded to host).", _MT, HONORED, "a checkpoint name in models/dsa.py's "
      "selection, saved or offloaded by the custom policy (models/remat.py)",
      choices=_REMAT_CHOICES),
    *[K(name, "str", "remat", f"remat_policy custom: where {what} goes (recomputed, kept on the "
        "device, or offloaded to host).", _MT, choices=_REMAT_CHOICES, issue=issue,
        reason=_REMAT.format(what=what))
      for name, what, issue in (
          ("moe_mlpwi_0", "the MoE experts' first gated input projection", 26),
          ("moe_mlpwi_1", "the MoE experts' second gated input projection", 26),
          ("moe_mlpwo", "the MoE experts' output projection", 26),
          ("query_wa_proj", "MLA's query down-projection", 26),
          ("kv_wa_proj", "MLA's key/value down-projection", 26),
          ("mla_q", "MLA's query up-projection", 26),
          ("mla_kv", "MLA's key/value up-projection", 26),
          ("attention_out", "the attention output", 26),
          ("engram", "the Engram branch output", _FAMILIES))],

    # --- model code path ---
    K("enable_nnx", "bool", True, "Build MaxText's model with Flax NNX (false: Linen).", _MT,
      INERT, _NNX),
    K("pure_nnx_decoder", "bool", True, "Use MaxText's pure-NNX decoder (false: the Linen one).",
      _MT, INERT, _NNX),
    K("pure_nnx", "bool", True, "Run MaxText entirely in NNX mode (false: the Linen path).", _MT,
      INERT, _NNX),

    # --- model quantization ---
    K("constant_bound_config", "str|list", "", "fp8_full: six fixed scaling bounds for static "
      "fp8 scaling (comma-separated); empty uses dynamic scales.", _MT, issue=None,
      reason="static fp8 bounds are not built; jaxtrain's fp8 modes scale from the current or "
      "a delayed amax"),
    K("replicate_quant_scale", "bool", False, "Replicate quantization scales across devices to "
      "avoid a slow XLA fusion under 2-D sharding.", _MT, INERT,
      "where the scales are stored; " + _NO_VALUE_CHANGE),
    K("quant_cfg_path", "str", "", "JSON file of per-layer settings for quantization intmp.",
      _MT, REJECTED, "only quantization intmp reads it, and jaxtrain refuses intmp; use int8, "
      "int4, int8w or int4w"),
    K("save_quantized_params_path", "str", "", "Write the parameters quantized on the fly to "
      "this path (for serving).", _MT, issue=None,
      reason="jaxtrain does not export quantized parameters"),
    K("use_qwix_quantization", "bool", False, "Quantize with the qwix library instead of AQT.",
      _MT, MAPPED, "jaxtrain quantizes with its own fake-quant matmuls (jaxtrain.quant) "
      "following the qwix recipe whichever library is named; AQT's int8 quantization of the "
      "activation gradient is not applied (see quantization)"),
    K("use_manual_quantization", "bool", False, "With use_batch_split_schedule: quantize the "
      "grouped matmuls by hand in the batch-split path.", _MT, issue=26),
    *[K(f"{part}_quantization_calibration_method", "str", "absmax", f"How qwix picks the "
        f"quantization scale of the {what} (absmax or another calibration).", _MT, issue=None,
        reason="jaxtrain's quantization scales by absmax only")
      for part, what in (("weight", "weights"), ("act", "activations"),
                         ("bwd", "backward-pass gradients"))],
    K("quantization_local_shard_count", "int", -1, "Take quantization ranges per shard of the "
      "contraction axis, this many shards; -1 means the number of slices.", _MT, issue=None,
      reason="jaxtrain takes each quantization range over the whole contraction axis"),
    K("weight_sparsity_n", "int", None, "N of N:M structured weight sparsity: at most N non-zero "
      "values in each block of M; null disables.", _MT, issue=None,
      reason="structured weight sparsity is not built in jaxtrain"),
    K("weight_sparsity_m", "int", None, "M of N:M structured weight sparsity: the block length; "
      "null disables.", _MT, issue=None),
    K("weight_sparsity_update_step", "int", 10, "N:M sparsity: steps between mask updates.", _MT,
      issue=None),
    K("weight_sparsity_start_step", "int", 50, "N:M sparsity: steps before the first mask "
      "update.", _MT, issue=None),
    K("te_comm_gemm_overlap", "str", "disabled", "TransformerEngine collective-GEMM overlap under "
      "tensor-sequence parallelism: disabled, mlp, or full (also attention).", _MT, INERT,
      "TransformerEngine is not used; overlapping tensor-parallel collectives with GEMMs is "
      "XLA's scheduling (tp_comm_overlap) and " + _NO_VALUE_CHANGE,
      choices=("disabled", "mlp", "full")),
]
