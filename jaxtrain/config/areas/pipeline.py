"""Pipeline schedules: Primus's zero-bubble runtime and Primus pipeline (jaxtrain.parallel)."""
from jaxtrain.config.knob import HONORED, INERT, K
from jaxtrain.parallel.schedules import SCHEDULES

_V_MEM_SETUPS = ("half", "min", "zb")
_PP_ALGORITHMS = ("1f1b", "1f1b-interleaved", "zero-bubble", "zero-bubble-heuristic",
                  "zbv-formatted", "v-half", "v-min")
_PP_COMM_METHODS = ("async_p2p", "batch_p2p")

KNOBS = [
    K("pipeline_schedule", "str", None, "Pipeline schedule by name, over the dialects' switches "
      "(null: 1F1B, interleaved with virtual stages, or what patch_zero_bubble / pp_algorithm "
      "pick).", "jaxtrain", HONORED, choices=SCHEDULES),
    # Zero-bubble runtime: switches
    K("patch_zero_bubble", "bool", False, "Swap in the zero-bubble pipeline runtime that Primus "
      "provides.",
      "megatron", status=HONORED),
    K("enable_zb_runtime", "bool", True, "Run pipeline schedules through the unified zero-bubble "
      "runtime.", "megatron", status=INERT,
      reason="jaxtrain has one executor for every schedule; the schedule is chosen by "
      "patch_zero_bubble / pp_algorithm / virtual stages"),
    K("enable_zero_bubble", "bool", True, "Use zero-bubble schedules (backward split into input "
      "and weight gradients) in that runtime.", "megatron", status=HONORED),
    K("zero_bubble_v_schedule", "bool", False, "Use the V-shaped zero-bubble schedule (two chunks "
      "per rank, no extra memory).", "megatron", status=HONORED),
    K("zero_bubble_v_schedule_mem_setup", "str", "half", "Memory target of the V schedule: half, "
      "min or zb (full zero bubble).", "megatron", choices=_V_MEM_SETUPS, status=HONORED),
    K("enable_1f1b_v", "bool", False, "Use the V-shaped 1F1B schedule.", "megatron",
      status=HONORED, reason="schedule 1f1b-v (jaxtrain.parallel.schedules): stages r and "
      "2p - 1 - r on rank r, whole backwards, at most 2p - 1 chunk forwards in flight; with "
      "enable_zero_bubble or zero_bubble_v_schedule it is refused, as Primus asserts"),
    K("debug_scheduler_table", "bool", False, "Print the pipeline schedule table of each rank.",
      "megatron", status=HONORED),

    # Zero-bubble runtime: automatic scheduling and memory
    K("pre_communication_optimization", "bool", False, "Send a tiny message before each real "
      "transfer to improve overlap.", "megatron", status=INERT,
      reason="a warm-up message for NCCL p2p channels; XLA's collective-permutes set up their "
      "communicators when the program loads"),
    K("zero_bubble_pipeline_timers_start_iter", "int", 100, "Step at which the timers feeding the "
      "automatic schedule start.", "megatron", status=INERT,
      reason="jaxtrain plans the zero-bubble schedule once from pp_cost_f/b/w; it does not "
      "time steps to re-plan"),
    K("zero_bubble_pipeline_timers_end_iter", "int", 110, "Step at which the timers feeding the "
      "automatic schedule stop.", "megatron", status=INERT,
      reason="jaxtrain plans the zero-bubble schedule once from pp_cost_f/b/w; it does not "
      "time steps to re-plan"),
    K("zero_bubble_max_pending_backward", "int|str", "auto", "Most backward passes held pending "
      "(PP picks ZB-1p, 2·PP ZB-2p); 'auto' adapts to memory.", "megatron", status=HONORED),
    K("zero_bubble_adaptive_memory_limit_percentile", "int", 85, "With 'auto': percent of device "
      "memory the adaptive schedule may fill.", "megatron", status=INERT,
      reason="zero_bubble_max_pending_backward auto is planned statically as ZB-H1 (1F1B's "
      "memory); there is no adaptive memory search"),
    K("allow_padding_num_layers", "bool", True, "Pad the layer count so it divides over the "
      "pipeline stages.", "megatron"),
    K("interleave_group_size", "int", 0, "Group size of the group-interleaved 1F1B schedule; 0 "
      "turns that schedule off.", "megatron"),
    K("num_seq_splits", "int", 1, "Split each microbatch along the sequence into this many "
      "pipeline units.", "megatron"),
    K("profile_memory_iter", "int", -1, "Step at which to record a memory profile; -1 never.",
      "megatron"),

    # Zero-bubble runtime: optimizer post-validation
    K("enable_optimizer_post_validation", "bool", False, "Step the optimizer before the global "
      "grad checks finish and roll back if they fail.", "megatron"),
    K("enable_exactly_numeric_match", "bool", True, "With post-validation: keep results bitwise "
      "equal to the unvalidated run.", "megatron"),

    # Zero-bubble runtime: activation offload
    K("cpu_offload", "bool", False, "Offload pipeline activations to host memory in the "
      "zero-bubble runtime.", "megatron"),
    K("offload_chunk_num", "int", 0, "Number of model chunks whose activations are offloaded.",
      "megatron"),
    K("offload_time", "float", 1.0, "Time cost of an offload assumed by the scheduler (relative "
      "units).", "megatron"),
    K("auto_offload_time", "bool", True, "Measure the offload time instead of using "
      "offload_time.", "megatron"),
    K("offload_overlap_sr", "bool", True, "Overlap offloading and reloading of activations with "
      "compute.", "megatron"),

    # Primus pipeline
    K("patch_primus_pipeline", "bool", False, "Install Primus's table-driven pipeline scheduler.",
      "megatron", status=HONORED),
    K("pp_algorithm", "str", "1f1b-interleaved", "Pipeline schedule of the Primus scheduler.",
      "megatron", choices=_PP_ALGORITHMS, status=HONORED),
    K("communication_method", "str", "async_p2p", "How the Primus scheduler sends activations: "
      "async_p2p or batch_p2p.", "megatron", choices=_PP_COMM_METHODS, status=INERT,
      reason="async vs batched torch p2p calls; every pipeline transfer here is one XLA "
      "collective-permute per tick"),
    K("offload", "bool", False, "Offload activations of the ops in offload_ops to host memory.",
      "megatron"),
    K("offload_ops", "str|list[str]", "", "Comma-separated ops whose activations are offloaded "
      "(attn today).", "megatron"),
    K("pp_max_mem", "float|list[float]", None, "Per-stage cap on activation memory for the "
      "zero-bubble-heuristic schedule; scalar or list, null for no cap.", "megatron",
      status=HONORED, reason="jaxtrain.parallel.schedules' ZB-H2 list scheduler holds at most "
      "that many microbatches' activations per rank (F done, W not: Primus's memory model, "
      "F +1, W -1), a forward waiting for a weight gradient; other schedules refuse it"),
    K("pp_cost_f", "float|list[float]", None, "Assumed forward-pass cost of each stage under "
      "zero-bubble-heuristic; scalar or list, 1000 when null.", "megatron", status=HONORED),
    K("pp_cost_b", "float|list[float]", None, "zero-bubble-heuristic: input-gradient cost per "
      "stage (one value or one per stage); null means 1000.", "megatron", status=HONORED),
    K("pp_cost_w", "float|list[float]", None, "Assumed weight-gradient cost of each stage under "
      "zero-bubble-heuristic; scalar or list, 1000 when null.", "megatron", status=HONORED),
    K("pp_warmup", "bool", False, "Run one pipeline pass before training so the first step is "
      "not slowed by start-up.", "megatron", status=INERT,
      reason="XLA compiles the whole step, pipeline transfers included, before the first "
      "step runs; there is no lazy communicator or buffer set-up for a warm-up pass to "
      "absorb"),
    K("dump_pp_data", "bool", False, "Write the pipeline's op timeline as JSON (jaxtrain: "
      "pp_schedule.json in the run directory, one entry per op with rank and tick).",
      "megatron", status=HONORED),
]
