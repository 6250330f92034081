"""Megatron-LM inference-engine and RL arguments beyond the reference document (dynamic
batching, prefix caching, speculative decoding, rollout scheduling). Keys are argparse dests."""
from jaxtrain.config.knob import INERT, K

_L = "megatron-lm"

_CUDA_GRAPH = ("XLA compiles the whole step into one executable that is replayed every step, so "
               "there are no CUDA graphs to capture")
_KERNEL = ("chooses between PyTorch/CUDA kernel implementations of the same math; XLA generates "
           "jaxtrain's kernels")
_COMM = ("picks how Megatron's PyTorch inference engine communicates (NCCL, NVLS multimem, "
         "symmetric memory, ZMQ); XLA compiles jaxtrain's collectives")
_UVM = ("places PyTorch buffers in CUDA unified memory; XLA places jaxtrain's buffers in device "
        "or pinned host memory itself")

KNOBS = [
    # --- inference kernels and communication ---
    K("symmetric_ar_type", "str", None, "All-reduce built on symmetric memory for inference "
      "(two_shot, one_shot, multimem_all_reduce); null uses NCCL.", _L, INERT, _COMM,
      choices=("two_shot", "one_shot", "multimem_all_reduce")),
    K("nccl_all_reduce_for_prefill", "bool", False, "Use NCCL all-reduce for prefill even when a "
      "symmetric all-reduce is configured.", _L, INERT, _COMM),
    K("inference_fuse_tp_communication", "bool", False, "Fuse reduce-scatter, residual add, norm "
      "and all-gather into one kernel during inference.", _L, INERT, _KERNEL),
    K("inference_disable_triton_nvls_kernels", "bool", False, "Do not use Triton NVLS "
      "(NVLink SHARP) kernels during inference.", _L, INERT, _COMM),
    K("inference_grouped_gemm_backend", "str", "vllm", "Grouped GEMM of MoE inference: "
      "flashinfer, torch or vllm kernels.", _L, INERT, _KERNEL,
      choices=("flashinfer", "torch", "vllm")),
    K("inference_moe_disable_fused_quant_kernels", "bool", False, "Run MoE inference's MXFP8 "
      "quantisation as separate kernels instead of fused ones.", _L, INERT, _KERNEL),
    K("inference_moe_token_dispatcher_type", "str", "nvls", "Expert-parallel dispatch of MoE "
      "inference: NCCL all-gather/reduce-scatter or NVLS multimem kernels.", _L, INERT, _COMM,
      choices=("nccl", "nvls")),
    K("inference_use_synchronous_zmq_collectives", "bool", False, "Use synchronous ZMQ "
      "collectives in the inference control loop.", _L, INERT, _COMM),
    K("inference_dynamic_batching_sampling_backend", "str", "torch", "Sampling kernels of the "
      "inference engine: torch or flashinfer.", _L, INERT, _KERNEL,
      choices=("torch", "flashinfer")),
    K("use_legacy_static_engine", "bool", False, "Serve static batches with the legacy static "
      "engine instead of the dynamic engine.", _L, INERT,
      "chooses between two Megatron inference engines producing the same generations; jaxtrain "
      "has one sampler"),
    K("inference_dynamic_batching_unified_memory_level", "int", 0, "Put the inference KV memory "
      "buffer in CUDA unified memory (1) or not (0).", _L, INERT, _UVM, choices=(0, 1)),

    # --- inference CUDA graphs ---
    K("inference_cuda_graph_scope", "str", None, "Inference CUDA graph ownership: none, layer or "
      "block; null follows cuda_graph_impl.", _L, INERT, _CUDA_GRAPH,
      choices=("none", "layer", "block")),
    K("decode_only_cuda_graphs", "bool", False, "Capture CUDA graphs for decode-only steps only.",
      _L, INERT, _CUDA_GRAPH),
    K("inference_cuda_graph_all_prefills", "bool", False, "Capture prefill/mixed CUDA graphs up "
      "to the engine's max tokens.", _L, INERT, _CUDA_GRAPH),
    K("inference_cuda_graph_max_tokens", "int", 512, "Token count of the largest captured "
      "prefill/mixed CUDA graph.", _L, INERT, _CUDA_GRAPH),
    K("inference_dynamic_batching_num_cuda_graphs", "int", 16, "Number of batch sizes captured "
      "as CUDA graphs; -1 chooses from max requests.", _L, INERT, _CUDA_GRAPH),
    K("inference_dynamic_batching_cuda_graph_mixed_prefill_count", "int", 16, "Mixed prefill "
      "requests captured in one CUDA graph.", _L, INERT, _CUDA_GRAPH),
    K("inference_dynamic_batching_cuda_graph_sizing_distribution", "str", "exponential",
      "Spacing of the token counts of captured CUDA graphs: exponential or linear.", _L, INERT,
      _CUDA_GRAPH, choices=("exponential", "linear")),

    # --- dynamic batching engine ---
    K("inference_dynamic_batching_block_size", "int", 256, "Tokens per KV-cache block (a "
      "multiple of 256).", _L),
    K("inference_dynamic_batching_paused_buffer_size_gb", "float", None, "Memory (GB) that "
      "bounds how many KV blocks paused requests may keep.", _L),
    K("inference_dynamic_batching_mamba_memory_ratio", "float", None, "Share of the inference "
      "memory buffer given to Mamba states of hybrid models.", _L, issue=25),
    K("inference_dynamic_batching_track_paused_request_events", "bool", False, "Add a 'paused' "
      "event to a request's history each time it is paused.", _L),
    K("inference_dynamic_batching_track_generated_token_events", "bool", False, "Record a "
      "timestamped event for every generated token.", _L),
    K("inference_dynamic_batching_async_sched_mode", "str", "legacy", "Order of the engine's "
      "scheduling phases: legacy, or async (prepare the next step before resolving this one).",
      _L, choices=("legacy", "async")),
    K("inference_dynamic_batching_logprobs_mode", "str", "raw_logprobs", "Returned log-probs: "
      "from the raw logits, or after temperature and top-k/top-p filtering.", _L,
      choices=("raw_logprobs", "processed_logprobs")),
    K("enable_chunked_prefill", "bool", False, "Split long prompts' prefill over several engine "
      "steps.", _L),
    K("num_speculative_tokens", "int", 0, "Tokens drafted speculatively per decode step (e.g. "
      "with MTP heads).", _L),
    K("mlp_chunks_for_prefill", "int", 1, "Run the MLP over this many sequence chunks during "
      "prefill.", _L),
    K("cache_mla_latents", "bool", False, "Keep MLA's compressed latents in the KV cache instead "
      "of full keys and values (flash-MLA decode).", _L),
    K("offset_sampling_seed_by_dp_rank", "bool", True, "Offset the sampling seed by the "
      "data-parallel rank so each replica draws differently.", _L),
    K("inference_disable_ep_consensus", "bool", False, "Skip the expert-parallel agreement "
      "all-reduce of the engine loop (safe only with one EP rank).", _L),
    K("inference_shards", "str", None, "Split the world into independent inference models, e.g. "
      "'tp=2,role=prefill+tp=1,dp=2,role=decode'.", _L),
    K("inference_coordinator_port", "int", None, "Port of the inference coordinator on node 0.",
      _L),
    K("inference_logging_step_interval", "int", 0, "Log inference metrics every N engine steps; "
      "0 turns it off.", _L),
    K("inference_text_gen_server_logging", "bool", False, "Log each request of the text "
      "generation server.", _L),
    K("inference_wandb_logging", "bool", False, "Send inference metrics to Weights & Biases.",
      _L),
    K("mamba_inference_conv_states_dtype", "str", "bf16", "Dtype of Mamba convolution states in "
      "inference.", _L, issue=25, choices=("bf16", "fp16", "fp32")),
    K("mamba_inference_ssm_states_dtype", "str", "bf16", "Dtype of Mamba SSM states in "
      "inference.", _L, issue=25, choices=("bf16", "fp16", "fp32")),

    # --- prefix caching ---
    K("inference_dynamic_batching_enable_prefix_caching", "bool", False, "Share KV-cache blocks "
      "between requests with the same prompt prefix.", _L),
    K("inference_dynamic_batching_prefix_caching_eviction_policy", "str", "ref_zero", "When "
      "cached blocks are freed: as soon as unused (ref_zero) or least-recently-used under "
      "pressure (lru).", _L, choices=("ref_zero", "lru")),
    K("inference_dynamic_batching_prefix_caching_coordinator_policy", "str", "load_balanced",
      "Routing of requests to ranks: load_balanced, first_prefix_block or longest_prefix "
      "affinity.", _L, choices=("longest_prefix", "first_prefix_block", "load_balanced")),
    K("inference_dynamic_batching_prefix_caching_routing_alpha", "float", 0.5, "Routing score "
      "weight: alpha x prefix match + (1 - alpha) x normalised load.", _L),
    K("inference_dynamic_batching_prefix_caching_mamba_gb", "float", None, "Device memory (GB) "
      "for cached Mamba states at block boundaries of hybrid models.", _L, issue=25),

    # --- RL rollouts ---
    K("rl_default_top_k", "int", -1, "Top-k of rollout sampling; -1 turns it off.", _L),
    K("rl_generation_lag", "float", None, "Trainer batches of rollout generation allowed in "
      "flight ahead of training (may be fractional); null autotunes.", _L),
    K("rl_max_inflight_requests", "int", None, "Most rollout requests in flight (the "
      "alternative to rl_generation_lag).", _L),
    K("rl_submission_granularity", "str", "B", "Unit of rollout work submitted: R one rollout, G "
      "one group, B a training batch of groups.", _L, choices=("R", "G", "B")),
    K("rl_consumption_granularity", "str", "B", "Unit in which training takes finished rollouts: "
      "G groups as they finish or B whole batches.", _L, choices=("R", "G", "B")),
    K("rl_durable_rollout_bank", "bool", False, "Write finished rollout groups to a durable "
      "ledger so a restart reuses them.", _L),
    K("rl_rollout_bank_dir", "str", None, "Directory of the durable rollout bank; null means "
      "<save>/rollout_bank.", _L),
    K("rl_rollout_bank_max_bytes", "int", 0, "Soft size cap of the rollout bank (a warning when "
      "exceeded); 0 is unbounded.", _L),
    K("rl_kv_cache_management_mode", "str", "persist", "KV cache between rollout phases: keep it "
      "(persist), move it to host (offload), or free and rebuild it (recompute).", _L,
      choices=("persist", "offload", "recompute")),
    K("rl_use_sequence_packing", "bool", False, "Pack several rollouts into each training "
      "sequence.", _L),
    K("rl_sequence_packing_max_sequences_per_bin", "int", 50, "Most rollouts packed into one "
      "sequence.", _L),
    K("rl_sequence_packing_algo", "str", "fifo", "How packed bins are spread over ranks: fifo or "
      "round-robin.", _L, choices=("fifo", "round-robin")),
    K("rl_inference_tensor_model_parallel_size", "int", None, "Tensor-parallel size of the "
      "rollout model; null uses training's.", _L),
    K("rl_inference_pipeline_model_parallel_size", "int", None, "Pipeline-parallel size of the "
      "rollout model; null uses training's.", _L),
    K("rl_inference_expert_model_parallel_size", "int", None, "Expert-parallel size of the "
      "rollout model; null uses training's.", _L),
    K("rl_inference_expert_tensor_model_parallel_size", "int", None, "Expert tensor-parallel "
      "size of the rollout model; null uses training's.", _L),
    K("rl_offload_inference_model_weights_when_idle", "bool", False, "Move a separate rollout "
      "model's weights to host memory between rollout phases.", _L),
    K("rl_verify_model_weights_swap", "bool", False, "On the first weight transfer to the "
      "rollout model, compare forward outputs to check it.", _L),
    K("rl_skip_bos_token", "bool", False, "Leave the BOS token off rollout sequences.", _L),
    K("rl_inference_parsers", "list[str]", [], "Response parsers applied to rollouts (e.g. "
      "deepseek-r1-reasoning, qwen3-coder-tool).", _L),
    K("rl_profile", "bool", False, "Collect detailed RL timers (JSONL and CSV).", _L),
    K("rl_profile_dir", "str", None, "Directory of the RL timing data; null means "
      "<save>/profiles.", _L),
    K("rl_persist_cuda_graphs", "bool", False, "Keep the rollout engine's CUDA graphs while it "
      "is suspended instead of recapturing them.", _L, INERT, _CUDA_GRAPH),
    K("rl_training_cuda_graphs", "bool", False, "Leave CUDA graphs on when switching between "
      "rollout and training.", _L, INERT, _CUDA_GRAPH),
    K("rl_inference_model_unified_memory_level", "int", 0, "Allocate a separate rollout model's "
      "weights in CUDA unified memory (1) or not (0).", _L, INERT, _UVM, choices=(0, 1)),
    K("refit_method", "str", "gloo", "How trained weights are copied into the rollout model: "
      "nccl, gloo or nvshmem.", _L, INERT,
      "a transport for the same weight copy between PyTorch process groups; jaxtrain's sampler "
      "reads the training parameters", choices=("nccl", "gloo", "nvshmem")),
]
