"""Megatron-LM training-side arguments beyond the reference document: parallelism, DDP/FSDP
buffers, optimizer extras, evaluation, logging, checkpoint plumbing, data, tokenizers,
resilience, fault injection and logits distillation. Keys are Megatron-LM's argparse dests."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, K, REJECTED

_L = "megatron-lm"
_LP = ("megatron-lm", "primus")

_KERNEL = ("chooses between PyTorch/CUDA kernel implementations of the same math; XLA generates "
           "jaxtrain's kernels")
_CUDA_GRAPH = ("XLA compiles the whole step into one executable that is replayed every step, so "
               "there are no CUDA graphs to capture")
_STREAMS = ("orders work on PyTorch CUDA streams; XLA's scheduler orders and overlaps the ops of "
            "the compiled step itself")
_NCCL_UB = ("registers PyTorch's communication buffers with NCCL (user buffers / symmetric "
            "memory); XLA allocates and registers the buffers of its own collectives")
_FSDP_BUF = ("allocation strategy of Megatron-FSDP's communication buffers; XLA plans the "
             "buffers of its gathers and reduce-scatters when it compiles the step")
_FLIGHT = ("configures PyTorch's NCCL flight recorder (TORCH_NCCL_* variables) for debugging "
           "hangs; jaxtrain's collectives are XLA's, which it does not trace")
_DIST_CKPT = ("tunes how Megatron's torch_dist checkpoints are exchanged and validated between "
              "ranks; orbax reads and writes jaxtrain's sharded checkpoints with the same "
              "contents whatever it says")
_ASYNC_CKPT = ("tunes the process that writes Megatron's asynchronous checkpoints; orbax writes "
               "jaxtrain's asynchronous checkpoints in its own background threads")
_FT = ("nvidia-resiliency-ext's fault-tolerance package (ft_launcher heartbeats and section "
       "timeouts) hooks PyTorch jobs only; restart a jaxtrain run from its last checkpoint "
       "instead")

_HYBRID_CP = ("Megatron-LM regroups ranks into context-parallel groups of a different size for "
              "each microbatch; a jaxtrain step is one program compiled for one mesh, so every "
              "sample is split over the same context axis. Use context_parallel_size for the "
              "whole run (with packing for short samples)")

KNOBS = [
    # --- parallelism ---
    K("tensor_parallel_num_weight_shards", "int", None, "Shards of each weight across the "
      "tensor-parallel and GTP axes (weights re-gathered for use); null means "
      "tensor_model_parallel_size.", _L),
    K("expert_tensor_parallel_num_weight_shards", "int", None, "The same for expert weights "
      "across expert-tensor-parallel and expert-GTP axes; null means "
      "expert_tensor_parallel_size.", _L),
    K("gtp_remat_reduce_scatter_with_fp32_accumulation", "bool", False, "Reduce-scatter the GTP "
      "weight gradients in low precision on the wire but accumulate them in float32.", _L),
    K("hybrid_context_parallel", "bool", False, "Balance packed variable-length samples across "
      "data x context parallel ranks instead of splitting each sample evenly.", _L, REJECTED,
      _HYBRID_CP),
    K("max_seqlen_per_dp_cp_rank", "int", None, "Longest sequence one data x context parallel "
      "rank takes under hybrid_context_parallel.", _L, REJECTED, _HYBRID_CP),
    K("overlap_p2p_comm_warmup_flush", "bool", False, "Also overlap pipeline send/receive with "
      "compute in the warm-up and flush phases of the schedule.", _L, issue=24, status=MAPPED,
      reason="as overlap_p2p_comm: XLA schedules the collective-permutes of every phase the "
      "same way"),
    K("mtp_standalone", "bool", False, "The MTP layers sit in their own virtual pipeline stage "
      "(normally derived from the pipeline layout).", _L, MAPPED,
      "Megatron derives it from pipeline_model_parallel_layout (MTP layers on a rank other "
      "than the last) to exchange stage outputs of varying shape; jaxtrain reads the layout "
      "itself and runs the MTP modules with the output layer on the last rank"),
    K("overlap_dispatch_backward_with_experts_wgrad", "bool", False, "Compute expert weight "
      "gradients on a side stream so they overlap the dispatch all-to-all of the backward "
      "pass.", _L, INERT, _STREAMS),
    K("ep_overlap_early_attn_memory_release", "bool", False, "In expert-parallel overlap, run "
      "the attention backward earlier to free its activations sooner.", _L, INERT, _STREAMS),

    # --- distributed runtime ---
    K("distributed_timeout_seconds_after_init", "int", None, "Collective timeout applied once "
      "initialisation and the first step are done; null keeps distributed_timeout_minutes.",
      _L),
    K("fake_process_group", "bool", False, "Run one GPU with a fake process group that skips all "
      "communication, to study the memory of a large job.", _L, REJECTED,
      "a PyTorch fake process group with collectives skipped; to study a large mesh's memory, "
      "compile the step for fake devices (jax_num_cpu_devices) instead"),
    K("disable_jit_fuser", "bool", False, "Turn off PyTorch's JIT fuser (TorchScript/nvFuser).",
      _L, INERT, "PyTorch's JIT fusion of eager ops; XLA compiles jaxtrain's step whole"),
    K("flight_recorder_dump_path", "str", None, "Where PyTorch's NCCL flight recorder writes its "
      "trace dumps.", _L, INERT, _FLIGHT),
    K("flight_recorder_trace_buffer_size", "int", 2000, "Entries kept by the NCCL flight "
      "recorder.", _L, INERT, _FLIGHT),
    K("flight_recorder_dump_on_timeout", "bool", True, "Dump the flight recorder's traces when a "
      "NCCL collective times out.", _L, INERT, _FLIGHT),
    K("flight_recorder_include_stack_trace", "bool", False, "Include Python stack traces in "
      "flight recorder dumps.", _L, INERT, _FLIGHT),
    K("flight_recorder_include_only_active", "bool", True, "Include only operations still in "
      "flight in flight recorder dumps.", _L, INERT, _FLIGHT),
    K("flight_recorder_extra_dump_on_exec", "bool", True, "Write an extra flight recorder dump "
      "when an exception is raised.", _L, INERT, _FLIGHT),

    # --- data-parallel and FSDP buffers ---
    K("ddp_reduce_scatter_with_fp32_accumulation", "bool", False, "Send gradients in low "
      "precision but sum them in float32 (an all-to-all based reduce-scatter).", _L),
    K("ddp_param_name_patterns_for_fp32_local_accumulation", "list[str]", [], "Parameter name "
      "patterns (fnmatch; 'all' for every one) whose gradients accumulate in float32 locally.",
      _L),
    K("use_layer_wise_param_layout", "bool", True, "Layer-wise distributed optimizer: shard "
      "non-Muon parameters through a precomputed byte-level layout (false: the legacy single "
      "buffer).", _L, INERT,
      "a buffer layout of Megatron's layer-wise distributed optimizer; XLA lays out jaxtrain's "
      "sharded optimizer state itself"),
    K("megatron_fsdp_version", "int", 1, "Which implementation of Megatron-FSDP to run (1 or 2).",
      _L, INERT, "picks between two PyTorch implementations of the same FSDP; jaxtrain's FSDP "
      "is a sharding of its arrays", choices=(1, 2)),
    K("megatron_fsdp_main_params_dtype", "str", "fp32", "Dtype of Megatron-FSDP's main "
      "(master) weights; auto uses the model parameters' dtype.", _L,
      choices=("fp32", "bf16", "fp16", "auto")),
    K("megatron_fsdp_main_grads_dtype", "str", "auto", "Dtype of Megatron-FSDP's main gradient "
      "buffer; auto uses the gradients' dtype.", _L, choices=("fp32", "bf16", "fp16", "auto")),
    K("megatron_fsdp_grad_comm_dtype", "str", "auto", "Dtype in which Megatron-FSDP communicates "
      "gradients; auto uses the main gradient dtype.", _L,
      choices=("fp32", "fp16", "bf16", "auto")),
    K("megatron_fsdp_enable_fine_grained_param_gather", "bool", False, "Gather FSDP parameters "
      "in smaller pieces for more overlap with the forward pass.", _L, INERT,
      "sets the granularity of Megatron-FSDP's all-gathers; XLA splits and schedules the "
      "gathers of the compiled step"),
    K("outer_dp_sharding_strategy", "str", "no_shard", "Hybrid-sharded data parallel: whether "
      "the outer (replica) group also shards optimizer state.", _L,
      choices=("no_shard", "optim")),
    K("enable_full_sharding_in_hsdp", "bool", False, "Hybrid-sharded data parallel: shard "
      "across the whole data-parallel group rather than within replicas.", _L),
    K("nccl_ub", "bool", False, "Register data-parallel/FSDP buffers as NCCL user buffers to "
      "save SMs during overlapped communication.", _L, INERT, _NCCL_UB),
    K("disable_symmetric_registration", "bool", False, "Register NCCL user buffers locally "
      "instead of as symmetric windows.", _L, INERT, _NCCL_UB),
    K("gtp_remat_nccl_ub", "bool", False, "Register GTP wgrad reduce-scatter buffers with NCCL "
      "symmetric memory.", _L, INERT, _NCCL_UB),
    K("gtp_expert_remat_nccl_ub", "bool", False, "Register expert-GTP wgrad reduce-scatter "
      "buffers with NCCL symmetric memory.", _L, INERT, _NCCL_UB),
    K("fsdp_manual_registration", "bool", False, "Register FSDP communication buffers with NCCL "
      "in few large calls.", _L, INERT, _NCCL_UB),
    K("create_all_gather_group", "bool", False, "Give all-gathers their own process group so "
      "they can overlap reduce-scatters.", _L, INERT,
      "a communicator per collective kind for PyTorch; XLA's asynchronous collectives overlap "
      "without extra groups"),
    K("fsdp_double_buffer", "bool", False, "Reuse two persistent buffers for Megatron-FSDP's "
      "temporary communication memory.", _L, INERT, _FSDP_BUF),
    K("megatron_fsdp_max_pool_double_buffer", "bool", False, "Size Megatron-FSDP's double "
      "buffers for the largest FSDP unit so uneven units share them.", _L, INERT, _FSDP_BUF),
    K("fsdp_db_use_persist_buf_on_alloc_fail", "bool", False, "Fall back to a persistent buffer "
      "for an FSDP bucket that does not fit the double buffer.", _L, INERT, _FSDP_BUF),
    K("reuse_grad_buf_for_mxfp8_param_ag", "bool", False, "Reuse the gradient buffer for the "
      "MXFP8 parameter all-gather.", _L, INERT,
      "buffer reuse inside Megatron's distributed optimizer; XLA assigns the step's buffers"),
    K("fp4_param_gather", "bool", False, "Keep compute weights in FP4 and all-gather them in "
      "FP4.", _L, REJECTED, "weights are stored in weight_dtype and quantized after XLA gathers "
      "them; there is no FP4 copy of the weights to gather"),

    # --- precision ---
    K("fp8_quantizer_factory", "str", None, "Import path of a Python callable that builds the "
      "FP8 quantizers of the custom recipe.", _L, REJECTED,
      "a Transformer Engine quantizer written in Python for PyTorch; choose jaxtrain's FP8 "
      "scaling with fp8_recipe"),
    K("fp4_quantizer_factory", "str", None, "Import path of a Python callable that builds the "
      "FP4 quantizers of the custom recipe.", _L, REJECTED,
      "a Transformer Engine quantizer written in Python for PyTorch; choose jaxtrain's FP4 "
      "scaling with fp4_recipe"),
    K("te_precision_config_file", "str", None, "File of per-module precision overrides for "
      "Transformer Engine.", _L, REJECTED,
      "per-module Transformer Engine precision rules for PyTorch modules; keep chosen layers in "
      "bf16 with first_last_layers_bf16 / num_layers_at_start_in_bf16 / "
      "num_layers_at_end_in_bf16"),
    K("fp8_output_proj", "bool", False, "Run the output (LM-head) projection under MXFP8 too.",
      _L),
    K("logit_dtype", "str", None, "Dtype of the output-layer GEMM's result (the logits); null "
      "keeps the input dtype.", _L, choices=("bf16", "fp32")),

    # --- optimizer ---
    K("apply_wd_to_qk_layernorm", "bool", False, "Apply weight decay to the query/key norm "
      "weights too (other norms and biases stay exempt).", _LP, HONORED,
      "optim/leaves.py decayed(): the q/k norm scales (and MLA's query-latent norm, Megatron's "
      "q_layernorm) join the decayed leaves"),
    K("no_weight_decay_cond_type", "str", None, "Former way to ask for apply_wd_to_qk_layernorm.",
      _L, HONORED, "apply_wd_to_qk_layernorm turns apply_wd_to_qk_layernorm on",
      choices=("apply_wd_to_qk_layernorm",)),
    K("muon_coefficient_type", "str", "quintic", "Newton-Schulz coefficient schedule of Muon "
      "(quintic, simple, polar_express, aol, ...); jaxtrain runs quintic.", _L),
    K("muon_use_syrk", "bool", False, "Form Muon's Gram matrix with a Triton SYRK kernel.", _L,
      INERT, _KERNEL),
    K("muon_scalar_optimizer", "str", "adam", "Optimizer for the parameters Muon does not "
      "handle (embeddings, norms, biases): adam or lion.", _L, choices=("adam", "lion")),
    K("lion_beta1", "float", 0.95, "Lion: interpolation weight of the momentum in the sign "
      "update.", _L),
    K("lion_beta2", "float", 0.98, "Lion: decay of the momentum average.", _L),
    K("optimizer_cuda_graph", "bool", False, "Capture the optimizer step in a CUDA graph.", _L,
      INERT, _CUDA_GRAPH),
    K("dump_param_to_param_group_map", "str", None, "Write a JSON file saying which optimizer "
      "parameter group each parameter belongs to.", _L),

    # --- training loop and evaluation ---
    K("step_batch_size_schedule", "str", None, "Global batch size by progress, e.g. '0:768 "
      "250B:1536' (tokens with K/M/B/T suffixes, or samples).", _L, HONORED,
      "config/batch_schedule.py + optim/schedules.py: each step's global batch is the entry "
      "whose threshold (tokens // seq_length samples) the samples consumed have reached, as "
      "Megatron-LM's StepBatchsizeNumMicroBatchesCalculator; the run length, the LR horizons "
      "and resumption count the scheduled batches"),
    K("phase_transition_iterations", "str", None, "Comma-separated steps where training moves to "
      "the next data phase (fixed global batch size).", _L),
    K("freeze_all_layers", "bool", False, "Freeze every parameter: run forward passes only, with "
      "no gradients and no updates.", _L),
    K("exit_signal", "int|str", 15, "Signal the exit handler listens for (default SIGTERM).",
      _L),
    K("exit_signal_handler_for_dataloader", "bool", False, "Install the exit signal handler in "
      "data-loader workers as well.", _L),
    K("exit_signal_handler_for_training", "bool", False, "Shut training down cleanly on SIGINT or "
      "SIGTERM instead of dying with a traceback.", _L),
    K("gpu_sniff_test_interval", "int", None, "Every N steps, time GEMMs, all-to-all and "
      "send/receive on each rank and flag ranks more than a std off the mean.", _L),
    K("start_eval_at_iter", "int", None, "Run no evaluation before this step.", _L),
    K("eval_global_batch_size", "int", None, "Global batch size of evaluation; null uses "
      "global_batch_size.", _L, HONORED, "evaluation._eval_global_batch: each validation "
      "iteration reads this many sequences, in micro-batches of micro_batch_size; unset under "
      "step_batch_size_schedule, micro_batch_size x data-parallel size (Megatron-LM's "
      "global_batch_size then)"),
    K("eval_micro_batch_size", "int", None, "Micro batch size of evaluation; null uses "
      "micro_batch_size.", _L),
    K("validation_set_names", "list[str]", None, "Names of the validation sets (with "
      "multiple_validation_sets), used in logs instead of indices.", _L),
    K("sft", "bool", False, "Train with Megatron's supervised fine-tuning data path (loss on "
      "response tokens only).", _L),
    K("sft_tokenizer_prompt_format", "str", "nemotron-h-aligned", "Prompt/chat format of the "
      "SFT tokenizer.", _L),

    # --- debugging dumps ---
    K("save_params_interval", "int", None, "Every N steps write each parameter's values to "
      "disk.", _L),
    K("save_activations_interval", "int", None, "Every N steps write named activations to disk.",
      _L),
    K("save_tokens_per_expert_interval", "int", None, "Every N steps write tokens-per-expert "
      "routing counts to disk.", _L),
    K("save_wgrads_interval", "int", None, "Every N steps write the weight gradients to disk.",
      _L),
    K("save_dgrads_interval", "int", None, "Every N steps write activation gradients to disk.",
      _L),

    # --- logging and profiling ---
    K("pytorch_profiler_collect_chakra", "bool", False, "Also record a Chakra execution trace "
      "with the PyTorch profiler.", _LP, INERT,
      "Chakra execution traces are a PyTorch profiler output; jax.profiler writes XPlane (and "
      "Perfetto) traces"),
    K("record_shapes", "bool", False, "Record tensor shapes in the NVTX ranges emitted for "
      "nsys.", _LP, INERT, "shapes on PyTorch's autograd NVTX ranges; XLA kernels in an nsys "
      "trace are named after their HLO ops"),
    K("nvtx_ranges", "bool", False, "Mark Megatron's phases with NVTX ranges for profilers.",
      _LP, INERT, "annotations of Megatron's PyTorch code for nsys; jaxtrain's traces come from "
      "jax.profiler"),
    K("log_memory_interval", "int", None, "Report device memory every N steps.", _L),
    K("log_device_memory_used", "bool", False, "Log the device memory in use as the driver "
      "(nvidia-smi) reports it.", _L),
    K("log_max_attention_logit", "bool", False, "Log the largest attention logit over the whole "
      "model.", _L),
    K("log_energy", "bool", False, "Log the energy the GPUs used, in joules.", _L),
    K("moe_routing_trace_path", "str", None, "Directory for JSONL traces of every router "
      "decision during training.", _L),
    K("moe_routing_trace_max_training_iters", "int", None, "Stop routing traces after this many "
      "steps; null traces all.", _L),
    K("moe_routing_trace_capture_logits", "bool", False, "Add the router's pre-top-k logits to "
      "routing traces.", _L),
    K("moe_routing_trace_capture_hidden_states", "bool", False, "Add each router call's input "
      "hidden states to routing traces.", _L),
    K("moe_routing_trace_dump_weights", "bool", False, "Save the router weights beside the "
      "routing traces.", _L),
    K("otel_enabled", "bool", False, "Emit OpenTelemetry traces and metrics of the run.", _L),
    K("otel_service_name", "str", None, "OpenTelemetry service name of this run.", _L),
    K("otel_span_groups", "str", None, "Which OpenTelemetry spans to emit: presets (default, "
      "per_step, full, all) or groups (job, checkpoint, step, optimizer, ...).", _L),

    # --- checkpoints ---
    K("async_strategy", "str", "nvrx", "Implementation of asynchronous checkpoint saving: nvrx or "
      "mcore.", _L, INERT, _ASYNC_CKPT, choices=("nvrx", "mcore")),
    K("async_ckpt_cpu_priority", "int", 10, "Nice value of the asynchronous checkpoint writer "
      "process.", _L, INERT, _ASYNC_CKPT),
    K("async_ckpt_io_priority", "int", 3, "I/O scheduling class of the asynchronous checkpoint "
      "writer process.", _L, INERT, _ASYNC_CKPT),
    K("async_ckpt_use_cpu_shm", "bool", False, "Copy tensors to host shared memory before handing "
      "them to the checkpoint writer.", _L, INERT, _ASYNC_CKPT),
    K("dist_ckpt_workers", "int", 1, "Processes writing an asynchronous distributed checkpoint.",
      _L, INERT, _ASYNC_CKPT),
    K("ckpt_fully_parallel_load_exchange_algo", "str", "broadcast", "How ranks exchange shards "
      "in a fully parallel load: broadcast, gather_rounds or gather_object.", _L, INERT,
      _DIST_CKPT, choices=("broadcast", "gather_rounds", "gather_object")),
    K("ckpt_fully_parallel_load_per_rank_objects", "bool", False, "In a fully parallel load, read "
      "each rank's non-tensor objects itself instead of gathering them.", _L, INERT, _DIST_CKPT),
    K("ckpt_fully_parallel_save_process_group", "str", "dp", "Group over which a fully parallel "
      "save splits the work: dp or ep_dp.", _L, INERT, _DIST_CKPT, choices=("dp", "ep_dp")),
    K("ckpt_fully_parallel_load_process_group", "str", "dp", "Group over which a fully parallel "
      "load splits the work: dp or ep_dp.", _L, INERT, _DIST_CKPT, choices=("dp", "ep_dp")),
    K("ckpt_pg_tensors_cache_path", "str", None, "Directory caching which rank saves/loads each "
      "shard, to skip that collective next time.", _L, INERT, _DIST_CKPT),
    K("ckpt_pg_tensors_cache_create", "bool", False, "Write that shard-distribution cache in this "
      "run.", _L, INERT, _DIST_CKPT),
    K("ckpt_load_validate_sharding_integrity", "bool", True, "Check that every shard is saved or "
      "loaded by exactly one rank.", _L, INERT, _DIST_CKPT),
    K("strict_fsdp_dtensor_load", "bool", True, "Require every tensor when loading an "
      "fsdp_dtensor checkpoint; false allows partial loads.", _L, INERT,
      "applies to Megatron's fsdp_dtensor (PyTorch DTensor) format only; jaxtrain's loading "
      "strictness is dist_ckpt_strictness"),
    K("distrib_optim_fully_reshardable_mem_efficient", "bool", False, "Save and load a fully "
      "reshardable distributed-optimizer checkpoint through one rank over Gloo to save "
      "memory.", _L, INERT, _DIST_CKPT),
    K("ckpt_drop_redundant_extra_state", "bool", False, "Leave Transformer Engine extra state "
      "that holds nothing irreplaceable out of checkpoints.", _L, INERT,
      "Transformer Engine's per-module extra state does not exist in jaxtrain's checkpoints"),
    K("save_tokenizer_assets", "bool", True, "Copy the tokenizer files into each checkpoint so it "
      "is self-contained.", _L),
    K("verify_integrity", "bool", False, "Hash checkpoint files when saving and verify the hashes "
      "when loading.", _L, HONORED),
    K("override_ckpt_iteration", "int", None, "Treat the loaded checkpoint as taken at this step "
      "(and replay data from there).", _L),

    # --- data ---
    K("per_dataset_sequences_path", "str", None, "JSON file with the sequence count of each "
      "dataset, to skip scanning them.", _L),
    K("dataloader_fast_cache_load", "bool", False, "Build datasets from an existing index cache "
      "in data_cache_path without checks.", _L, INERT,
      "a start-up shortcut of Megatron's dataset builder; jaxtrain builds the same indices "
      "either way"),
    K("dataloader_defer_npy_index_mmap", "bool", False, "Memory-map the cached .npy dataset "
      "indices only on first access.", _L, INERT,
      "when an index file is memory-mapped changes start-up time only, not the samples"),
    K("dataloader_inter_document_masking", "bool", False, "Return document boundaries "
      "(cu_seqlens) so attention stays within each document of a sample.", _L),
    K("object_storage_cache_path", "str", None, "Local cache of dataset index files read from "
      "S3 or Multi-Storage Client storage.", _L),
    K("mid_level_dataset_surplus", "float", 0.005, "Extra share of samples built for the "
      "datasets under a blend, so the blend never runs them dry.", _L),
    K("allow_ambiguous_pad_tokens", "bool", False, "Keep pad tokens in the loss when the pad id "
      "is shared with another special token.", _L),
    K("fim_data", "bool", False, "Apply fill-in-the-middle rearrangement to training samples.",
      _L),
    K("fim_rate", "float", 0.5, "Probability that a sample is rearranged for fill-in-the-middle.",
      _L),
    K("fim_spm_rate", "float", 0.5, "Probability that a FIM sample uses suffix-prefix-middle "
      "order instead of prefix-suffix-middle.", _L),
    K("fim_split_sample", "str", None, "Split samples at this string and apply FIM to each "
      "fragment.", _L),
    K("fim_fragment_rate", "float", None, "FIM probability of each fragment when "
      "fim_split_sample is set.", _L),
    K("fim_no_prefix", "str", None, "Do not apply FIM to fragments starting with this string.",
      _L),
    K("fim_prefix_token", "str", "<fim_prefix>", "Token that opens the FIM prefix part.", _L),
    K("fim_middle_token", "str", "<fim_middle>", "Token that opens the FIM middle part.", _L),
    K("fim_suffix_token", "str", "<fim_suffix>", "Token that opens the FIM suffix part.", _L),
    K("fim_pad_token", "str", "<fim_pad>", "Padding token of FIM samples.", _L),
    K("fim_eod_token", "str", "<|endoftext|>", "End-of-document token FIM samples are split at.",
      _L),

    # --- tokenizer ---
    K("padded_vocab_size", "int", None, "Vocabulary size of the model's embedding and output "
      "layer; null pads vocab_size to make_vocab_size_divisible_by.", _L),
    K("pad_vocab_size", "bool", True, "Pad the vocabulary automatically when padded_vocab_size "
      "is not given.", _L),
    K("metadata_path", "str", None, "JSON metadata file describing the tokenizer "
      "(--tokenizer-metadata).", _L),
    K("special_tokens", "list[str]", None, "Special tokens added to the tokenizer "
      "(SentencePiece, Hugging Face, TikToken).", _L),
    K("tokenizer_sentencepiece_legacy", "bool", False, "SentencePiece wrapper's legacy behaviour, "
      "which lets special tokens through.", _L),
    K("tokenizer_sentencepiece_ignore_extra_whitespaces", "bool", True, "SentencePiece: drop "
      "extra whitespace from the text while encoding.", _L),
    K("tokenizer_hf_no_use_fast", "bool", False, "Load the slow (Python) Hugging Face tokenizer "
      "instead of the fast one.", _L),
    K("tokenizer_hf_no_include_special_tokens", "bool", False, "Hugging Face tokenizer: do not "
      "add special tokens when encoding text.", _L),
    K("null_tokenizer_eod_id", "int", None, "End-of-document id of the NullTokenizer; null means "
      "vocab_size - 1.", _L),
    K("null_tokenizer_pad_id", "int", -1, "Pad id of the NullTokenizer; -1 has no pad token.",
      _L),
    K("chat_template", "str", None, "Jinja chat template used to format conversations; null "
      "(MaxText: empty) uses the tokenizer's own.", ("megatron-lm", "maxtext"), HONORED,
      "replaces the Hugging Face tokenizer's template when chat (SFT) data is rendered "
      "(jaxtrain/data/sft.py); the dry run checks it renders a user/assistant exchange",
      doc_defaults={"maxtext": ""}),
    K("use_gigatoken", "bool", False, "Run the Hugging Face tokenizer through gigatoken's faster "
      "re-implementation.", _L, INERT,
      "swaps in a faster implementation of the same Hugging Face tokenizer inside Megatron; "
      "jaxtrain tokenizes with its own loaders"),

    # --- resilience ---
    K("inprocess_max_iterations", "int", None, "Most in-process restarts before giving up.", _L),
    K("inprocess_monitor_thread_interval", "float", 1.0, "Seconds between checks of the "
      "in-process restart monitor thread.", _L),
    K("inprocess_monitor_process_interval", "float", 1.0, "Seconds between checks of the "
      "in-process restart monitor process.", _L),
    K("inprocess_progress_watchdog_interval", "float", 1.0, "Seconds between automatic progress "
      "timestamps of the watchdog.", _L),
    K("inprocess_heartbeat_interval", "float", 30, "Seconds between heartbeats that detect "
      "unresponsive ranks.", _L),
    K("inprocess_soft_timeout", "float", 60, "Seconds without progress before a soft fault is "
      "declared.", _L),
    K("inprocess_hard_timeout", "float", 90, "Seconds without progress before ranks are killed.",
      _L),
    K("inprocess_heartbeat_timeout", "float", 60, "Seconds of missing heartbeats before a rank "
      "counts as lost.", _L),
    K("inprocess_barrier_timeout", "float", 120, "Timeout of the restart's internal barrier, in "
      "seconds.", _L),
    K("inprocess_completion_timeout", "float", 120, "Timeout of the completion barrier on all "
      "ranks, in seconds.", _L),
    K("inprocess_last_call_wait", "float", 1, "Seconds other ranks get to report concurrent "
      "failures.", _L),
    K("inprocess_termination_grace_time", "float", 1, "Seconds between SIGTERM and SIGKILL on a "
      "hard timeout.", _L),
    K("inprocess_granularity", "str", "node", "Unit that restarts in place: a node or a rank.",
      _L, choices=("node", "rank")),
    K("inprocess_active_world_size", "int", 1, "Ranks that start working; the rest wait as warm "
      "spares.", _L),
    K("inprocess_empty_cuda_cache", "bool", False, "Release PyTorch's cached GPU memory on every "
      "in-process restart.", _L, INERT,
      "PyTorch's caching allocator; XLA's allocator does not keep a cache to empty"),
    K("ft_num_warmup_iters", "int", 5, "Steps the fault-tolerance package leaves out of its "
      "timeout monitoring.", _L, REJECTED, _FT),
    K("enable_msc", "bool", False, "Read data and checkpoints through NVIDIA's Multi-Storage "
      "Client (object storage).", _L),
    K("disable_msc_deprecated", "bool", False, "Former switch that turned the Multi-Storage "
      "Client off; now does nothing.", _L, INERT,
      "Megatron-LM itself ignores it (the client is off unless enable_msc)"),
    K("fault_injector_ranks", "str", None, "Comma-separated ranks that get injected faults.", _L),
    K("fault_injector_num_ranks", "int", None, "Number of randomly chosen ranks that get "
      "injected faults.", _L),
    K("fault_injector_fault_types", "str", None, "Comma-separated fault kinds to inject (e.g. "
      "hang, crash).", _L),
    K("fault_injector_fault_probabilities", "str", None, "Comma-separated relative probabilities "
      "of the fault kinds.", _L),
    K("fault_injector_fault_delay", "float", None, "Seconds after the start (or the start step) "
      "when the fault fires.", _L),
    K("fault_injector_delay_start_iteration", "int", None, "Start the fault delay timer after "
      "this step.", _L),
    K("fault_injector_mtti_seconds", "float", None, "Mean seconds to an injected fault, used "
      "when no fixed delay is set.", _L),
    K("fault_injector_offset_seconds", "float", None, "Seconds added to the sampled fault "
      "delay.", _L),
    K("fault_injector_seed", "int", None, "Random seed of the fault injector.", _L),

    # --- offline logits distillation ---
    K("logits_save_dir", "str", None, "Directory where a teacher run saves its top logits for "
      "offline distillation.", _L),
    K("logits_save_top_k", "int", None, "Logits kept per token when saving.", _L),
    K("logits_save_top_p", "float", None, "After top-k, keep only the smallest set of entries "
      "reaching this probability mass (0 < p <= 1).", _L),
    K("logits_save_top_p_min_k", "int", 1, "Entries kept per token under top-p whatever their "
      "mass.", _L),
    K("logits_save_dtype", "str", "fp16", "Dtype of the saved log-probabilities.", _L,
      choices=("fp16", "bf16", "fp32")),
    K("logits_load_dir", "str", None, "Directory of saved teacher logits to distill from.", _L),
    K("logits_load_decode_threads", "int", 4, "Threads that decompress and decode saved logits.",
      _L),
    K("logits_load_prefetch_factor", "int", 3, "Batches of decoded logits read ahead.", _L),
    K("logits_load_msc_prefetch_depth", "int", 2, "Whole logits shards fetched ahead from object "
      "storage.", _L),
    K("logits_load_kd_loss_alpha", "float", 1.0, "Loss = alpha x distillation loss + (1 - alpha) "
      "x language-model loss.", _L),
    K("logits_load_ignore_errors", "bool", False, "On a distillation-loss error, warn and train "
      "on the language-model loss alone.", _L),
]
