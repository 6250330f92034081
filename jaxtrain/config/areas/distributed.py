"""Distributed runtime: process setup, data-parallel gradient/parameter sync, FSDP and ZeRO."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_HEAD_IN_TICK = ("jaxtrain's pipeline executor computes the output layer's gradients on every "
                 "rank in the tick of the last stage's forward, beside the other ranks' ops "
                 "(a tick lasts as long as its slowest rank), so there is no flush latency "
                 "for deferred weight GEMMs to hide; the gradients are the same either way")

_DP_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_BACKENDS = ("nccl", "gloo")
_SHARP_GROUPS = ("dp", "dp_replica")

_RUNTIME = "JAX's runtime: jax.distributed.initialize"


def _seconds_to_minutes(value):
    """MaxText's jax_distributed_initialization_timeout is in seconds; whole minutes, rounded up."""
    try:
        if value is not None and not isinstance(value, bool):
            return -(-int(float(value)) // 60)
    except (TypeError, ValueError):
        pass
    return value


_NCCL_ENV = ("XLA creates and tunes its own NCCL/RCCL communicators; set NCCL_* environment "
             "variables for the job instead")

KNOBS = [
    # Process setup (torch.distributed specifics)
    K("distributed_backend", "str", "nccl", "torch.distributed backend for the process groups.",
      "megatron", REJECTED,
      f"{_RUNTIME} sets up the processes and XLA always uses NCCL/RCCL on GPU; there is no "
      "backend to choose", choices=_BACKENDS),
    K("distributed_timeout_minutes", "int", 60, "How long processes wait for each other at "
      "start-up and in collectives, in minutes.", "megatron", MAPPED,
      "jax.distributed.initialize(initialization_timeout=minutes x 60 s) at start-up; on CPU also "
      "the gloo collective timeout (--xla_cpu_collective_timeout_seconds); XLA's GPU collectives "
      "(NCCL/RCCL) take no timeout",
      aliases=(Alias("jax_distributed_initialization_timeout", "maxtext",
                     to_canonical=_seconds_to_minutes,
                     note="MaxText's jax.distributed.initialize timeout in seconds (rounded up "
                          "to whole minutes)"),)),
    K("local_rank", "int", None, "This process's index on its node, normally given by the "
      "launcher.", "megatron", REJECTED,
      f"{_RUNTIME} assigns each process its local devices (from the launcher's environment or "
      "local_device_ids); a rank in the config file would be the same for every process"),
    K("lazy_mpu_init", "bool", None, "Let an outside manager finish process-group setup instead "
      "of Megatron's initialize.", "megatron", INERT,
      "a hook for embedding Megatron in another launcher; jaxtrain is its own program and always "
      "initializes jax.distributed and its mesh itself"),
    K("nccl_communicator_config_path", "str", None, "YAML of per-communicator NCCL settings "
      "(CTA counts, cluster size).", "megatron", REJECTED, f"{_RUNTIME}; {_NCCL_ENV}"),
    K("use_sharp", "bool", False, "Use InfiniBand SHARP in-network reduction for data-parallel "
      "collectives.", "megatron", REJECTED,
      f"{_RUNTIME}; SHARP is a torch process-group option here, {_NCCL_ENV} "
      "(e.g. NCCL_COLLNET_ENABLE)"),
    K("sharp_enabled_group", "str", None, "Which data-parallel group SHARP is enabled on (dp or "
      "dp_replica).", "megatron", REJECTED,
      f"{_RUNTIME}; SHARP is a torch process-group option here, {_NCCL_ENV}",
      choices=_SHARP_GROUPS),
    K("use_tp_pp_dp_mapping", "bool", False, "Order ranks tp-cp-ep-pp-dp instead of "
      "tp-cp-ep-dp-pp when assigning devices to groups.", "megatron", status=HONORED),
    K("empty_unused_memory_level", "int", 0, "How often to release cached allocator memory "
      "(0 never, 1 after each step, 2 also after eval).", "megatron", INERT,
      "calls torch.cuda.empty_cache; XLA manages its own preallocated device memory pool and has "
      "no cache to release between steps", choices=(0, 1, 2)),
    K("deterministic_mode", "bool", False, "Use only deterministic kernels and reductions "
      "(slower, bitwise reproducible).", "megatron", MAPPED,
      "--xla_gpu_deterministic_ops=true (run-to-run deterministic GPU kernels, scatters and "
      "reductions) and jax_threefry_partitionable=True (random bits independent of the "
      "sharding); XLA on CPU is deterministic already"),

    # Data-parallel gradient reduction (DDP buckets and overlap)
    K("overlap_grad_reduce", "bool", False, "Overlap the data-parallel gradient reduction with "
      "the backward pass.", "megatron", MAPPED,
      "on GPU: --xla_gpu_enable_latency_hiding_scheduler=true (async gradient all-reduces and "
      "reduce-scatters overlap the rest of the backward) and --xla_gpu_enable_pipelined_all_reduce"
      "=true, --xla_gpu_enable_pipelined_reduce_scatter=true (a scanned layer's reduction runs "
      "during the next layer's backward); off keeps XLA's defaults"),
    K("align_grad_reduce", "bool", True, "Launch the gradient reductions of all pipeline stages "
      "together rather than each stage on its own.", "megatron", INERT,
      "orders the gradient reductions of the pipeline stages in Megatron's per-rank schedules; a "
      "jaxtrain step is one SPMD program in which every device issues the same collectives in "
      "the same order, so there is nothing to align"),
    K("ddp_num_buckets", "int", None, "Number of buckets the gradients are grouped into for "
      "reduction.", "megatron", MAPPED,
      "on GPU: as ddp_bucket_size, with ceil(parameters per tensor x pipeline shard / buckets) "
      "elements per bucket; sets --xla_gpu_all_reduce_combine_threshold_bytes, "
      "--xla_gpu_reduce_scatter_combine_threshold_bytes and "
      "--xla_gpu_all_gather_combine_threshold_bytes"),
    K("ddp_bucket_size", "int", None, "Size of each gradient-reduction bucket, in elements.",
      "megatron", MAPPED,
      "on GPU: XLA combines collectives up to a byte threshold: "
      "--xla_gpu_all_reduce_combine_threshold_bytes and "
      "--xla_gpu_reduce_scatter_combine_threshold_bytes = elements x gradient bytes (4; 2 when "
      "reduced in bf16/fp16), --xla_gpu_all_gather_combine_threshold_bytes = elements x "
      "weight_dtype bytes"),
    K("ddp_pad_buckets_for_high_nccl_busbw", "bool", False, "Pad buckets to a multiple of 2^16 "
      "elements for better NCCL bandwidth.", "megatron", INERT,
      "pads Megatron's gradient buffer so NCCL messages are multiples of 2^16 elements; XLA "
      "allocates and lays out its combined collective buffers itself, with no bucket to pad"),
    K("ddp_average_in_collective", "bool", False, "Average gradients inside the collective "
      "instead of dividing by the DP size first.", "megatron", INERT,
      "picks NCCL's AVG reduction over dividing first; XLA's all-reduce and reduce-scatter only "
      "sum, and the 1/N of the mean gradient is ordinary arithmetic in the compiled step that XLA "
      "places and fuses itself"),
    K("gradient_reduce_div_fusion", "bool", True, "Fuse the divide-by-DP-size into the gradient "
      "reduction.", "megatron", INERT,
      "folds the 1/N scaling into the NCCL reduce-scatter (a pre-multiplied sum); XLA's "
      "collectives only sum, and XLA fuses the scaling into neighbouring kernels on its own"),

    # Distributed optimizer / parameter gather (ZeRO)
    K("use_distributed_optimizer", "bool", True, "Shard optimizer state and master weights over "
      "the data-parallel devices (ZeRO-1).", "megatron", status=HONORED),
    K("num_distributed_optimizer_instances", "int", 1, "Split the data-parallel group into this "
      "many replicas, each sharding the optimizer state.", "megatron", status=HONORED,
      aliases=(Alias("data_parallel_replicate_degree", "primus",
                     note="Primus's HSDP replica count, which it maps onto this knob"),)),
    K("overlap_param_gather", "bool", False, "Overlap the parameter all-gather of the sharded "
      "optimizer with the next forward pass.", "megatron", MAPPED,
      "on GPU: --xla_gpu_enable_latency_hiding_scheduler=true (async parameter all-gathers "
      "overlap compute) and --xla_gpu_enable_pipelined_all_gather=true (the next scanned layer's "
      "parameters are gathered during the current layer); off keeps XLA's defaults"),
    K("overlap_param_gather_with_optimizer_step", "bool", False, "Start the first bucket's "
      "parameter all-gather while the optimizer step is still running.", "megatron", MAPPED,
      "on GPU: --xla_gpu_enable_latency_hiding_scheduler=true; the update and the parameter "
      "all-gathers after it are one compiled step, and the scheduler starts each gather while "
      "the rest of the update runs"),
    K("align_param_gather", "bool", True, "Launch the parameter all-gathers of all pipeline "
      "stages together rather than each stage on its own.", "megatron", INERT,
      "orders the parameter all-gathers of the pipeline stages in Megatron's per-rank schedules; "
      "a jaxtrain step is one SPMD program in which every device issues the same collectives in "
      "the same order, so there is nothing to align"),
    K("check_weight_hash_across_dp_replicas_interval", "int", None, "Every this many steps, check "
      "that weight hashes agree on all data-parallel replicas.", "megatron", status=HONORED),

    # FSDP
    K("use_megatron_fsdp", "bool", False, "Fully shard parameters, gradients and optimizer state "
      "over data parallel (Megatron-FSDP).", "megatron", status=HONORED,
      aliases=(Alias("use_custom_fsdp", "megatron",
                     note="deprecated Megatron name of the Megatron-FSDP switch"),)),
    K("use_torch_fsdp2", "bool", False, "Fully shard parameters over data parallel the way "
      "PyTorch FSDP2 does.", "megatron", status=HONORED),
    K("data_parallel_sharding_strategy", "str", "no_shard", "What FSDP shards over data parallel: "
      "nothing, optimizer state, + gradients, + parameters.", "megatron", status=HONORED,
      choices=_DP_SHARDING),
    K("init_model_with_meta_device", "bool", False, "Build the model shapes first and create each "
      "parameter directly in its shard.", "megatron", MAPPED,
      "always on: shapes come from jax.eval_shape and every parameter is created directly in its "
      "shard by a jit with out_shardings, so no device ever holds a full copy; false cannot be "
      "honoured and is not needed"),
    K("suggested_communication_unit_size", "int", 400000000, "FSDP elements communicated per "
      "collective; also sets how far parameter gathers prefetch.", "megatron", MAPPED,
      "with use_megatron_fsdp, on GPU: --xla_gpu_all_gather_combine_threshold_bytes = elements x "
      "weight_dtype bytes and --xla_gpu_reduce_scatter_combine_threshold_bytes = elements x "
      "gradient bytes; how far gathers run ahead is up to XLA's latency-hiding scheduler",
      nullable=True),
    K("keep_fp8_transpose_cache_when_using_custom_fsdp", "bool", False, "Keep Transformer "
      "Engine's fp8 transposed-weight cache under FSDP.", "megatron", INERT,
      "a Transformer Engine cache of fp8 weight transposes; XLA forms transposes inside the "
      "compiled step, so there is no cache to keep",
      aliases=(Alias("keep_fp8_transpose_cache", "megatron-lm",
                     note="Megatron-LM's current name"),)),

    # Local-checkpoint replication
    K("replication", "bool", False, "Replicate local (non-persistent) checkpoints onto other "
      "nodes.", "megatron", REJECTED,
      "jaxtrain does not copy local checkpoints between nodes: a lost node takes its local "
      "checkpoint with it and the run resumes from the newest global checkpoint; for that "
      "protection use non_persistent_ckpt_type global on shared storage"),
    K("replication_jump", "int", None, "Rank distance between a rank and the ranks holding its "
      "checkpoint replicas.", "megatron", INERT,
      "only places the copies made by replication, which jaxtrain rejects"),
    K("replication_factor", "int", None, "Number of nodes holding a copy of each rank's local "
      "checkpoint.", "megatron", INERT,
      "only sizes the copies made by replication, which jaxtrain rejects"),

    # MoE expert-parallel overlap
    K("overlap_moe_expert_parallel_comm", "bool", False, "Overlap MoE expert-parallel all-to-all "
      "with compute of another microbatch.", "megatron", INERT,
      "interleaves two microbatches' expert all-to-alls with each other's compute on CUDA "
      "streams; the numbers are unchanged, and the scanned JAX step runs microbatches in "
      "order, with XLA overlapping each one's collectives with its own independent work"),
    K("patch_moe_overlap", "bool", False, "Primus variant of the MoE all-to-all overlap schedule, "
      "with its own weight-gradient handling.", "megatron", INERT,
      "Primus's variant of that CUDA-stream overlap schedule; the numbers are unchanged"),

    # Pipeline-specific; no issue builds pipeline parallelism yet
    K("overlap_p2p_comm", "bool", True, "Overlap pipeline send/recv with forward and backward "
      "compute.", "megatron", status=MAPPED,
      reason="a pipeline transfer is an XLA collective-permute after each tick's op; XLA's "
      "scheduler overlaps it with independent work (there is no blocking mode to choose)"),
    K("scatter_gather_tensors_in_pipeline", "bool", True, "Send pipeline activations as TP "
      "shards and all-gather them on arrival.", "megatron", status=MAPPED,
      reason="activations cross stages in the sharding they have: split over the tensor axis "
      "with sequence_parallel, whole otherwise; no separate scatter/all-gather is inserted"),
    K("use_ring_exchange_p2p", "bool", False, "Use a custom ring-exchange kernel for pipeline "
      "send/recv.", "megatron", status=INERT,
      reason="pipeline transfers are XLA collective-permutes over the pipeline axis; there is no "
      "custom ring-exchange kernel to pick"),
    K("defer_embedding_wgrad_compute", "bool", False, "Postpone the output-layer weight-gradient "
      "GEMMs to the pipeline flush.", "megatron", INERT, _HEAD_IN_TICK),
    K("wgrad_deferral_limit", "int", 0, "Microbatches whose output-layer weight gradients are "
      "deferred; 0 means all.", "megatron", INERT, _HEAD_IN_TICK),
    K("account_for_embedding_in_pipeline_split", "bool", False, "Count the input embedding as one "
      "layer when splitting layers over pipeline stages.", "megatron", status=HONORED),
    K("account_for_loss_in_pipeline_split", "bool", False, "Count the loss as one layer when "
      "splitting layers over pipeline stages.", "megatron", status=HONORED),
    K("standalone_embedding_stage", "bool", False, "Put the input embedding alone on the first "
      "pipeline stage.", "megatron", status=HONORED),
    K("decoder_pipeline_manual_split_list", "list[int]", None, "Layers per pipeline stage, "
      "given explicitly (Primus).", "megatron", status=HONORED),
]


KNOBS += [
    # MaxText runtime switches
    K("skip_jax_distributed_system", "bool", False, "MaxText: never start jax.distributed; run "
      "as one process even when a launcher describes several.", "maxtext", HONORED),
    K("jax_cache_dir", "str", None, "Directory of JAX's persistent compilation cache (~ "
      "expanded); empty turns it off. Unset: $JAXTRAIN_COMPILATION_CACHE (a folder or off), "
      "else jax_cache beside the run directory.", "maxtext", HONORED,
      doc_defaults={"maxtext": "~/jax_cache"}),
    K("compile_topology", "str", "", "MaxText: compile ahead of time for a named TPU topology "
      "(e.g. v5e-256) instead of running.", "maxtext", REJECTED,
      "jaxtrain compiles for the devices it runs on; to check memory of a layout ahead of time "
      "use benchmarks/aot_memory.py on the target machine"),
]
