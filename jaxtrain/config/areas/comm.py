"""Overlap of tensor-parallel communication with the GEMMs around it."""
from jaxtrain.config.knob import INERT, MAPPED, REJECTED, K

_BOOTSTRAP = ("nccl", "mpi", "gloo")

_TE_SPLIT = ("deprecated since Transformer Engine 1.6, which ignores it; XLA's collective-matmul "
             "decomposition has no split-versus-atomic choice")

KNOBS = [
    # Main switch and per-direction overlaps
    K("tp_comm_overlap", "bool", False, "Overlap TP all-gathers/reduce-scatters with the GEMMs "
      "that consume or produce them (needs sequence parallel).", "megatron", MAPPED,
      "on GPU: XLA collective matmul (--xla_gpu_threshold_for_windowed_einsum_mib=0, "
      "--xla_gpu_multi_streamed_windowed_einsum=true) splits each TP all-gather/reduce-scatter "
      "and its GEMM into overlapped chunks, with --xla_gpu_enable_latency_hiding_scheduler=true; "
      "the tp_comm_overlap_* and tp_comm_bulk_* knobs choose which"),
    K("tp_comm_overlap_ag", "bool", True, "With tp_comm_overlap: pipeline the all-gather with the "
      "GEMM that consumes it.", "megatron", MAPPED,
      "with tp_comm_overlap, keeps XLA's collective matmul on "
      "(--xla_gpu_threshold_for_windowed_einsum_mib=0, --xla_gpu_multi_streamed_windowed_"
      "einsum=true, latency-hiding scheduler); XLA has one switch for every direction, so "
      "it is on while any of tp_comm_overlap_ag, _rs and _rs_dgrad is"),
    K("tp_comm_overlap_rs", "bool", True, "With tp_comm_overlap: pipeline the reduce-scatter with "
      "the GEMM that produces it.", "megatron", MAPPED,
      "with tp_comm_overlap, keeps XLA's collective matmul on "
      "(--xla_gpu_threshold_for_windowed_einsum_mib=0, --xla_gpu_multi_streamed_windowed_"
      "einsum=true, latency-hiding scheduler); XLA has one switch for every direction, so "
      "it is on while any of tp_comm_overlap_ag, _rs and _rs_dgrad is"),
    K("tp_comm_overlap_rs_dgrad", "bool", False, "With tp_comm_overlap: pipeline the "
      "reduce-scatter with the backward data-gradient GEMM.", "megatron", MAPPED,
      "with tp_comm_overlap, keeps XLA's collective matmul on "
      "(--xla_gpu_threshold_for_windowed_einsum_mib=0, --xla_gpu_multi_streamed_windowed_"
      "einsum=true, latency-hiding scheduler); XLA has one switch for every direction, so "
      "it is on while any of tp_comm_overlap_ag, _rs and _rs_dgrad is"),
    K("tp_comm_bulk_wgrad", "bool", True, "With tp_comm_overlap: run the backward all-gather "
      "alongside the activation-gradient GEMM.", "megatron", MAPPED,
      "with tp_comm_overlap, turns on --xla_gpu_enable_latency_hiding_scheduler=true, "
      "which runs the TP collective beside the independent GEMM; that flag is also on "
      "whenever collective matmul or another overlap knob is"),
    K("tp_comm_bulk_dgrad", "bool", True, "With tp_comm_overlap: run the backward reduce-scatter "
      "alongside the weight-gradient GEMM.", "megatron", MAPPED,
      "with tp_comm_overlap, turns on --xla_gpu_enable_latency_hiding_scheduler=true, "
      "which runs the TP collective beside the independent GEMM; that flag is also on "
      "whenever collective matmul or another overlap knob is"),

    # Transformer Engine userbuffer specifics
    K("tp_comm_overlap_cfg", "str", None, "YAML file of Transformer Engine userbuffer settings per "
      "GEMM (method, SM count, splits).", "megatron", REJECTED,
      "Transformer Engine userbuffer settings have no XLA counterpart; use tp_comm_overlap and its "
      "per-direction switches, which map to XLA's collective-matmul flags"),
    K("tp_comm_split_ag", "bool", True, "Split the all-gather into chunks pipelined with the "
      "forward GEMM (TE, deprecated).", "megatron", INERT, _TE_SPLIT),
    K("tp_comm_split_rs", "bool", True, "Split the reduce-scatter into chunks pipelined with the "
      "forward GEMM (TE, deprecated).", "megatron", INERT, _TE_SPLIT),
    K("tp_comm_bootstrap_backend", "str", "nccl", "Backend that bootstraps Transformer Engine's TP "
      "userbuffer communicators.", "megatron", REJECTED,
      "JAX's runtime: jax.distributed.initialize connects the processes and XLA needs no separate "
      "communicator bootstrap", choices=_BOOTSTRAP),
    K("async_tensor_model_parallel_allreduce", "bool", True, "Run the TP all-reduce of input "
      "gradients asynchronously with the weight-gradient GEMM.", "megatron", INERT,
      "deprecated and ignored by Megatron (the overlap is always on); in jaxtrain XLA's scheduler "
      "overlaps these collectives, steered by tp_comm_overlap"),

    # Timers
    K("barrier_with_L1_time", "bool", True, "Synchronize all processes before starting each "
      "level-1 timer, so timings exclude waiting.", "megatron", MAPPED,
      "a jax multihost_utils.sync_global_devices barrier before each level-1 host timer "
      "(timing_log_level >= 1); a no-op with one process"),
]
