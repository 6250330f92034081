"""MaxText runtime keys: mesh and sharding hints, pipeline and context parallelism, DiLoCo,
compilation and XLA dumps, kernel tuning, profiling, cloud services and multi-host setup.

Canonical keys are MaxText's own (configs/base.yml); defaults are its base.yml values.
"""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_MT = "maxtext"
_CP = 23
_PP_XLA = ("when the FSDP all-gathers of a stage's weights run inside MaxText's pipeline loop; "
           "in jaxtrain's executor XLA places them (the values are the same)")
_PP_SCAN = "jaxtrain's pipeline executor always runs its ticks under one jax.lax.scan"
_PP_REMAT = ("a jaxtrain pipeline stage always recomputes its forward from its input in the "
             "backward, and its layers follow remat_policy")

_LAYOUT = ("at MaxText's default the layout is jaxtrain's own logical-axis table "
           "(jaxtrain/parallel/sharding.py); other values are checked by the MaxText dialect "
           "rules")
_SPLASH = ("tunes MaxText's TPU splash-attention kernel, which jaxtrain does not run; its own "
           "attention kernels choose their blocks and the values are the same")
_GMM_TILE = ("a tile size of MaxText's TPU grouped-matmul (megablox/tokamax) kernels; jaxtrain's "
             "grouped expert matmul tiles itself and the values are the same")
_SPARSECORE = ("controls MaxText's TPU SparseCore gather kernels, which jaxtrain does not run; "
               "the gathered values are the same")
_TPU_PROFILE = "a TPU-only profiler option; XLA's GPU profiler has no such setting"
_CLOUD = "reports to a Google Cloud service (Goodput, Cloud Monitoring, Vertex AI) jaxtrain never calls"
_GCS_DUMP = ("concerns MaxText's upload of the dump to Cloud Storage; jaxtrain keeps files "
             "local")
_DILOCO = ("DiLoCo (islands of replicas with an outer optimizer and rare synchronisation) is not "
           "built: jaxtrain synchronises every step; leave DiLoCo off")
_PATHWAYS = ("needs Google's Pathways single-controller runtime; jaxtrain runs one JAX process per "
             "host with jax.distributed")
_AOT_TOOL = "read only by MaxText's ahead-of-time compile tool (train_compile), not by training"
_TC = ("shapes the host network with Linux tc to simulate slow cross-slice links; jaxtrain does not "
       "throttle the network and the computed values are the same")

KNOBS = [
    # --- mesh and sharding hints ---
    K("data_sharding_axes", "list", [["data", "stage", "fsdp", "fsdp_transpose", "context",
                                      "context_usp_ulysses", "context_autoregressive", "tensor",
                                      "tensor_sequence", "expert", "autoregressive"]],
      "MaxText: mesh axes the input batch is sharded over (its data_sharding).", _MT, MAPPED,
      _LAYOUT, aliases=(Alias("data_sharding", _MT, only_in=(_MT,), note=(
          "MaxText's data_sharding lists mesh axes; Megatron's data_sharding is a sampler "
          "switch")),)),
    K("input_data_sharding_logical_axes", "list[str]",
      ["activation_embed_and_logits_batch", "activation_norm_length"], "MaxText: logical axes "
      "of the input batch's batch and length dimensions.", _MT, MAPPED, _LAYOUT),
    K("override_logical_axis_rules", "bool", False, "MaxText: a logical_axis_rules list replaces "
      "the base rules instead of being merged into them.", _MT, MAPPED, _LAYOUT),
    K("custom_mesh_and_rule", "str", "", "MaxText: a named mesh + logical-rule preset from "
      "configs/custom_mesh_and_rule (e.g. ep-as-cp, pure-fsdp); empty keeps the defaults.", _MT,
      MAPPED, _LAYOUT),
    K("custom_mesh_and_rule_for_eval", "str", "", "MaxText: the mesh + rule preset used for "
      "evaluation steps; empty uses the training layout.", _MT, MAPPED, _LAYOUT),
    K("logical_axis_rules_for_eval", "list", [], "MaxText: logical-axis rules used for "
      "evaluation steps; empty uses the training rules.", _MT, MAPPED, _LAYOUT),
    K("context_sharding", "str", "context", "MaxText: mesh axis that plays context parallelism "
      "for input data and load balancing (context, or expert with ep-as-cp).", _MT, MAPPED,
      _LAYOUT),
    K("ulysses_context_sharding", "str", "context_usp_ulysses", "MaxText: mesh axis of the "
      "all-to-all (Ulysses) part of context_parallel_strategy usp.", _MT, MAPPED, _LAYOUT),
    K("custom_mesh", "str", "", "MaxText: a hand-built device order for the mesh (e.g. "
      "hybrid_ring_64x4); empty builds it from the topology.", _MT, MAPPED, _LAYOUT),
    K("shard_exp_on_fsdp", "bool", False, "MaxText: shard the experts' expert dimension over the "
      "fsdp axis.", _MT, MAPPED, _LAYOUT),
    K("use_2d_fsdp_sharding", "bool", False, "MaxText: shard weights over both fsdp and "
      "fsdp_transpose axes.", _MT, MAPPED, _LAYOUT),
    K("moe_dispatch_no_expert_sharding", "bool", False, "MaxText dense MoE path: keep the expert "
      "axis off the dispatch batch dimension so the expert matmul stays expert-parallel.", _MT,
      MAPPED, _LAYOUT),
    K("shard_mode", "str", "auto", "MaxText: JAX sharding mode, auto (shardings propagated by "
      "the partitioner) or explicit (sharding in the array types).", _MT, INERT,
      "jaxtrain shards with jit shardings and constraints (auto mode); explicit typing changes "
      "how the program is written, not its values", choices=("auto", "explicit")),
    K("shard_optimizer_over_data", "bool", False, "MaxText: shard optimizer state over the data "
      "axis too (ZeRO-1).", _MT, MAPPED,
      "optimizer-state sharding over the data-parallel devices is jaxtrain's "
      "use_distributed_optimizer (on by default) or FSDP; this switch does not change it, and "
      "where the state is stored does not change the values"),
    K("allow_split_physical_axes", "bool", False, "MaxText: let one physical TPU axis be split "
      "over several mesh axes when building the device mesh.", _MT, INERT,
      "a TPU-topology option of mesh_utils; jaxtrain orders GPU devices itself"),
    K("optimize_mesh_for_tpu_v6e", "bool", False, "MaxText: reorder the mesh devices for TPU "
      "v6e's torus.", _MT, INERT, "a TPU v6e topology tweak; jaxtrain runs on GPUs"),
    K("remove_size_one_mesh_axis_from_type", "bool", True, "MaxText: drop mesh axes of size 1 "
      "from explicit sharding types (a jax.config flag).", _MT, INERT,
      "matters only to explicit sharding types, which jaxtrain does not use"),
    K("sharding_tolerance", "float", 0.02, "MaxText: largest share of parameters allowed to stay "
      "unsharded before start-up fails.", _MT, INERT,
      "a MaxText start-up check; jaxtrain does not run it and training does not depend on it"),
    K("check_vma", "bool", False, "MaxText: turn on shard_map's varying-manual-axes check in its "
      "MoE shard_map.", _MT, INERT,
      "a tracing check of MaxText's own shard_map; jaxtrain's shard_maps set their own and the "
      "values are the same"),
    K("dense_fsdp_use_two_stage_all_gather", "bool", False, "MaxText: gather dense MLP weights "
      "sharded on fsdp and fsdp_transpose with two all-gathers.", _MT, INERT,
      "how XLA gathers the same weights; the values are the same"),
    K("moe_fsdp_use_two_stage_all_gather", "bool", False, "MaxText: gather MoE weights sharded "
      "on fsdp and fsdp_transpose with two all-gathers.", _MT, INERT,
      "how XLA gathers the same weights; the values are the same"),
    K("num_slices", "int", -1, "MaxText: number of TPU slices (-1 detects it).", _MT, INERT,
      "a TPU multislice count; a jaxtrain GPU job is one slice and its dcn_* sizes span hosts"),
    K("debug_sharding", "bool", False, "MaxText: print how each weight is sharded.", _MT,
      issue=None),

    # --- pipeline parallelism (run by jaxtrain's schedule executor, jaxtrain.parallel) ---
    K("num_layers_per_pipeline_stage", "int", 1, "Layers each pipeline stage runs per pass; "
      "layers = stages x this x repeats.", _MT, HONORED),
    K("num_pipeline_repeats", "int", -1, "Circular pipeline: passes through the stages; -1 "
      "derives it from the layer count; > 1 runs that many virtual stages per rank.", _MT,
      HONORED),
    K("pipeline_parallel_layers", "int", -1, "Pipeline only this many leading layers (the stage "
      "axis acts as data parallelism for the rest); -1 pipelines all (only -1 runs).", _MT,
      HONORED),
    K("num_pipeline_microbatches", "int", -1, "Microbatches per step in the pipeline (a "
      "multiple of the stages) splitting each micro-step's rows; -1 means the stage count.",
      _MT, HONORED),
    K("pipeline_delay_activation_forwarding", "bool", False, "Send activations to the next "
      "stage one iteration late (easier overlap, twice the bubble).", _MT, MAPPED,
      "doubles the default num_pipeline_microbatches as MaxText does; the delay itself is a "
      "detail of MaxText's loop: jaxtrain's tick program sends each activation right after "
      "its op and XLA overlaps the transfer"),
    K("pipeline_fsdp_ag_once", "bool", False, "All-gather the FSDP-sharded weights once before "
      "the pipeline loop instead of per microbatch.", _MT, INERT, _PP_XLA),
    K("pipeline_fsdp_ag_per_repeat", "bool", False, "Circular pipeline: prefetch each repeat's "
      "FSDP weight gathers ahead of its microbatches.", _MT, INERT, _PP_XLA),
    K("scan_pipeline_iterations", "bool", True, "Run the pipeline's microbatch iterations under "
      "jax.lax.scan.", _MT, INERT, _PP_SCAN),
    K("scan_pipeline_repeats", "bool", False, "Run the circular pipeline's repeats under "
      "jax.lax.scan.", _MT, INERT, _PP_SCAN),
    K("scan_layers_per_stage", "bool", False, "Scan over the layers inside each pipeline "
      "stage.", _MT, MAPPED, "the layers inside a stage follow scan_layers"),
    K("set_remat_policy_on_pipeline_iterations", "bool", True, "Apply remat_policy to each "
      "pipeline iteration.", _MT, MAPPED, _PP_REMAT),
    K("set_remat_policy_on_layers_per_stage", "bool", False, "Apply remat_policy to each layer "
      "inside a pipeline stage.", _MT, MAPPED, _PP_REMAT),

    # --- context parallelism ---
    K("context_parallel_load_balance", "bool", True, "Reorder the sequence so every context "
      "shard gets an equal share of causal-attention work.", _MT, HONORED),
    K("context_parallel_strategy", "str", "all_gather", "Context-parallel attention: all_gather "
      "K/V, ring, ulysses (all-to-all heads) or usp (both).", _MT, HONORED,
      choices=("all_gather", "ring", "ulysses", "usp")),
    K("context_parallel_reorder_strategy", "str", "auto", "Load-balancing order of the "
      "sequence: auto (dual_chunk_swap), dual_chunk_swap (Megatron's) or striped.", _MT,
      HONORED, choices=("auto", "dual_chunk_swap", "striped")),

    # --- DiLoCo and network simulation ---
    K("enable_diloco", "bool", False, "Train with DiLoCo: replicas step locally and synchronise "
      "through an outer optimizer every diloco_sync_period steps.", _MT, REJECTED, _DILOCO),
    K("diloco_sync_period", "int", 36, "DiLoCo: inner steps between synchronisations.", _MT,
      REJECTED, _DILOCO),
    K("diloco_outer_lr", "float", 0.3, "DiLoCo: learning rate of the outer optimizer.", _MT,
      REJECTED, _DILOCO),
    K("diloco_outer_momentum", "float", 0.9, "DiLoCo: momentum of the outer optimizer.", _MT,
      REJECTED, _DILOCO),
    K("enable_streaming_diloco", "bool", False, "Streaming DiLoCo: synchronise one fragment of "
      "the model per inner step, overlapping it with compute.", _MT, REJECTED, _DILOCO),
    K("num_diloco_fragments", "int", None, "Streaming DiLoCo: fragments the layers are split "
      "into.", _MT, REJECTED, _DILOCO),
    K("use_sequential_layers", "bool", False, "Streaming DiLoCo: fragments of consecutive layers "
      "(false: interleaved).", _MT, REJECTED, _DILOCO),
    K("num_communication_overlapping_steps", "int", 0, "Streaming DiLoCo: inner steps a "
      "synchronisation overlaps with.", _MT, REJECTED, _DILOCO),
    K("communication_overlapping_alpha", "float", 0.0, "Streaming DiLoCo: mix of local and "
      "synchronised parameters after an overlapped sync (0..1).", _MT, REJECTED, _DILOCO),
    K("dcn_bandwidth_limit", "str", "", "Throttle each host's network egress to this rate (e.g. "
      "10gbit); empty means no limit.", _MT, INERT, _TC),
    K("dcn_bandwidth_burst", "str", "10mb", "Network throttling: token-bucket burst size.", _MT,
      INERT, _TC),
    K("dcn_bandwidth_latency", "str", "50ms", "Network throttling: token-bucket latency.", _MT,
      INERT, _TC),
    K("dcn_bandwidth_interface", "str", "eth0", "Network throttling: interface the limit applies "
      "to.", _MT, INERT, _TC),

    # --- compilation ---
    K("compiled_trainstep_file", "str", "", "Load this serialized, ahead-of-time compiled train "
      "step instead of compiling.", _MT, INERT, "jaxtrain compiles the step itself (cached "
      "across runs by jax_cache_dir); the compiled program computes the same values"),
    K("compile_topology_num_slices", "int", -1, "Ahead-of-time compile: number of target TPU "
      "slices.", _MT, INERT, "read only together with compile_topology, which jaxtrain refuses"),
    K("internal_compile", "bool", False, "Ahead-of-time compile for Google-internal TPU "
      "topologies.", _MT, INERT, _AOT_TOOL),
    K("internal_compile_num_devices", "int", -1, "With internal_compile: number of devices.", _MT,
      INERT, _AOT_TOOL),
    K("compile_xla_flags", "str", "", "XLA options passed to the ahead-of-time compile only.",
      _MT, INERT, _AOT_TOOL),
    K("write_estimator_result", "bool", False, "MaxText's memory/remat estimator: write its "
      "result to a file.", _MT, INERT, "read only by MaxText's estimator.py tool"),
    K("max_checkify", "bool", False, "Run extra jax.checkify checks (slower).", _MT, issue=None),
    K("max_inflight_computations", "int", 2, "Most train steps the host may have dispatched and "
      "not yet finished.", _MT, INERT, "paces the host only; jaxtrain's loop reads each step's "
      "metrics one step behind and the values do not depend on it"),

    # --- XLA and jaxpr dumps ---
    K("dump_hlo", "bool", False, "Dump the compiled HLO modules (XLA --xla_dump_to).", _MT,
      issue=None, reason="not wired yet; XLA_FLAGS=--xla_dump_to=DIR in the environment dumps "
      "the same modules"),
    K("dump_step", "int", -1, "Dump the HLO at this step; -1 dumps at the first compile.", _MT,
      issue=None),
    K("dump_hlo_local_dir", "str", "/tmp/xla_dump/", "Local directory of the HLO dump.", _MT,
      issue=None),
    K("dump_hlo_local_module_name", "str", "jit_train_step", "Only modules whose name matches "
      "are dumped locally; empty dumps all.", _MT, issue=None),
    K("dump_hlo_xla_flags", "str", "", "Extra XLA flags for the dump (default: dump to the local "
      "dir, filtered by module name).", _MT, issue=None),
    K("dump_hlo_upload_all", "bool", False, "Every host dumps (false: only process 0).", _MT,
      issue=None),
    K("dump_hlo_delete_local_after", "bool", True, "Delete the local HLO dump once uploaded.",
      _MT, INERT, _GCS_DUMP),
    K("dump_hlo_gcs_dir", "str", "", "Cloud Storage directory the HLO dump is uploaded to.", _MT,
      INERT, _GCS_DUMP),
    K("dump_hlo_module_name", "str", "jit_train_step", "Only modules whose name matches are "
      "uploaded.", _MT, INERT, _GCS_DUMP),
    K("dump_jaxpr", "bool", False, "Dump the train step's jaxpr.", _MT, issue=None),
    K("dump_jaxpr_local_dir", "str", "/tmp/jaxpr_dump/", "Local directory of the jaxpr dump.",
      _MT, issue=None),
    K("dump_jaxpr_delete_local_after", "bool", True, "Delete the local jaxpr dump once "
      "uploaded.", _MT, INERT, _GCS_DUMP),
    K("dump_jaxpr_gcs_dir", "str", "", "Cloud Storage directory the jaxpr dump is uploaded to.",
      _MT, INERT, _GCS_DUMP),

    # --- attention kernel tuning (TPU splash attention) ---
    *[K(f"sa_{name}", "int", 512, f"Splash attention: {what}.", _MT, INERT, _SPLASH)
      for name, what in (("block_q", "query block size"), ("block_kv", "key/value block size"),
                         ("block_kv_compute", "key/value compute block size"),
                         ("block_q_dkv", "query block of the dK/dV pass"),
                         ("block_kv_dkv", "key/value block of the dK/dV pass"),
                         ("block_kv_dkv_compute", "key/value compute block of the dK/dV pass"),
                         ("block_q_dq", "query block of the dQ pass"),
                         ("block_kv_dq", "key/value block of the dQ pass"))],
    K("sa_use_fused_bwd_kernel", "bool", False, "Splash attention: one fused backward kernel.",
      _MT, INERT, _SPLASH),
    K("sa_bwd_dkv_megacore", "bool", False, "Splash attention: split the dK/dV grid over "
      "megacore by key/value-head groups.", _MT, INERT, _SPLASH),
    *[K(f"sa_{t}_layout", "str", "HEAD_DIM_MINOR", f"Splash attention: memory layout of "
        f"{t.upper()}.", _MT, INERT, _SPLASH) for t in ("q", "k", "v")],
    K("use_splash_scheduler", "bool", False, "Use Tokamax's experimental splash-attention "
      "scheduler.", _MT, INERT, _SPLASH),
    K("ring_scan_unroll", "int", 1, "Unroll factor of Tokamax's ring-attention scan (0: "
      "fully).", _MT, INERT, "a compile-time unrolling of MaxText's TPU ring attention; "
      "the values are the same"),
    K("sa_fuse_reciprocal", "bool", True, "Splash attention: fuse the softmax reciprocal.", _MT,
      INERT, _SPLASH),
    K("sa_use_base2_exp", "bool", True, "Splash attention: compute exponentials in base 2.", _MT,
      INERT, _SPLASH),
    *[K(f"local_{name}", type_, None, f"The {name} setting for local (sliding-window) layers; "
        "null inherits it.", _MT, INERT, _SPLASH)
      for name, type_ in (("sa_block_q", "int"), ("sa_block_kv", "int"),
                          ("sa_block_kv_compute", "int"), ("sa_block_q_dkv", "int"),
                          ("sa_block_kv_dkv", "int"), ("sa_block_kv_dkv_compute", "int"),
                          ("sa_block_q_dq", "int"), ("sa_block_kv_dq", "int"),
                          ("sa_use_fused_bwd_kernel", "bool"), ("sa_q_layout", "str"),
                          ("sa_k_layout", "str"), ("sa_v_layout", "str"),
                          ("use_splash_scheduler", "bool"), ("sa_fuse_reciprocal", "bool"),
                          ("sa_use_base2_exp", "bool"))],
    *[K(f"experimental_sa_quant_{t}_fp8", "bool", False, f"Splash attention: cast {t.upper()} "
        "to float8_e4m3 without scales.", _MT, REJECTED,
        "unscaled fp8 queries/keys change the attention values and exist only in MaxText's TPU "
        "kernel; jaxtrain's attention keeps them in the compute dtype") for t in ("q", "k")],
    K("use_max_logit_estimate", "int", -1, "Splash attention: a fixed estimate of the largest "
      "logit for the softmax; -1 computes the running max.", _MT, INERT, _SPLASH),
    K("cost_estimate_flops_fwd", "int", -1, "Splash attention: FLOP estimate of the forward "
      "kernel given to XLA's scheduler; -1 uses the kernel's own.", _MT, INERT, _SPLASH),
    K("cost_estimate_flops_bwd", "int", -1, "Splash attention: FLOP estimate of the backward "
      "kernel given to XLA's scheduler; -1 uses the kernel's own.", _MT, INERT, _SPLASH),
    K("dq_reduction_steps", "int", 0, "Splash attention: reduction steps of the dQ pass.", _MT,
      INERT, _SPLASH),
    K("use_tokamax_splash", "bool", False, "Use Tokamax's splash-attention kernel.", _MT, INERT,
      _SPLASH),
    K("use_jax_splash", "bool", False, "Use JAX's own (non-Pallas) splash attention.", _MT, INERT,
      _SPLASH),
    K("force_q_layout", "bool", False, "With use_jax_splash: lay queries out as [..., heads, "
      "head_dim, seq].", _MT, INERT, _SPLASH),

    # --- MoE kernel tuning ---
    *[K(f"{w}_tile_{p}_{d}", "int", 512 if d == "batch_seq" else 1024,
        f"Grouped matmul of {w}: {what} tile of the {d.replace('_', '/')} dimension.", _MT,
        INERT, _GMM_TILE)
      for w in ("wi", "wo")
      for p, what in (("fwd", "forward"), ("dlhs", "input-gradient"),
                      ("drhs", "weight-gradient"))
      for d in ("batch_seq", "embed_dim", "mlp_dim")],
    K("use_tokamax_gmm", "bool", False, "Use the Tokamax library's grouped-matmul kernel.", _MT,
      INERT, _GMM_TILE),
    K("use_gmm_v2", "bool", False, "With use_tokamax_gmm: its v2 grouped-matmul kernel.", _MT,
      INERT, _GMM_TILE),
    K("use_ragged_sort", "bool", False, "MoE: sort tokens by expert with Pallas ragged-sort "
      "kernels.", _MT, INERT, "a TPU kernel for the same permutation; the values are the same"),
    K("use_gather_mosaic_kernel", "bool", False, "MoE: gather tokens with a custom Mosaic "
      "kernel.", _MT, INERT, "a TPU kernel for the same gather; the values are the same"),
    K("ragged_gather_fallback", "bool", False, "Use the JAX reference instead of the SparseCore "
      "ragged-gather kernel.", _MT, INERT, _SPARSECORE),
    K("ragged_gather_reduce_fallback", "bool", False, "Use the JAX reference instead of the "
      "SparseCore ragged gather-reduce kernel.", _MT, INERT, _SPARSECORE),
    *[K(f"ragged_gather{r}_cost_estimate_{c}", "int", -1, f"Override the {what} cost estimate "
        f"of the ragged gather{' reduce' if r else ''} kernel; -1 computes it.", _MT, INERT,
        _SPARSECORE)
      for r in ("", "_reduce")
      for c, what in (("flops", "FLOP"), ("bytes_accessed", "bytes-accessed"))],
    K("use_mhc_pallas_kernel", "bool", False, "mHC-lite: use the Pallas TPU kernel.", _MT, INERT,
      "a TPU kernel for the same mixing; the values are the same"),
    K("mhc_pallas_kernel_fwd_block_size", "int", 256, "mHC Pallas kernel: forward block size.",
      _MT, INERT, "tunes a TPU kernel jaxtrain does not run; the values are the same"),
    K("mhc_pallas_kernel_bwd_block_size", "int", 128, "mHC Pallas kernel: backward block size.",
      _MT, INERT, "tunes a TPU kernel jaxtrain does not run; the values are the same"),

    # --- profiling ---
    K("upload_all_profiler_results", "bool", False, "Every process writes its profile into the "
      "run directory; false: the processes of profile_ranks (the first by default).", _MT,
      HONORED),
    K("hide_profiler_step_metric", "bool", False, "Leave the steps at a profile window's edges "
      "out of the logged step metrics.", _MT, INERT,
      "only hides MaxText's metrics of those steps; jaxtrain logs every step and training is "
      "unchanged"),
    K("profile_cleanly", "bool", True, "Wait for the device at the profile window's edges so "
      "the trace holds whole steps.", _MT, MAPPED,
      "jaxtrain's profile window waits for the last traced step's results before it stops the "
      "trace (jaxtrain/observe/profiler.py)"),
    K("profile_periodically_period", "int", -1, "When positive, take a profile every this many "
      "steps.", _MT, issue=None),
    K("enable_tpu_profiling_options", "bool", False, "Turn on TPU-specific profiler options.",
      _MT, INERT, _TPU_PROFILE),
    K("tpu_num_chips_to_profile_per_task", "int", 1, "TPU profiling: chips traced per task.", _MT,
      INERT, _TPU_PROFILE),
    K("tpu_num_sparse_core_tiles_to_trace", "int", 1, "TPU profiling: SparseCore tiles traced.",
      _MT, INERT, _TPU_PROFILE),
    K("tpu_num_sparse_cores_to_trace", "int", 2, "TPU profiling: SparseCores traced.", _MT,
      INERT, _TPU_PROFILE),
    K("xprof_tpu_power_trace_level", "int", 0, "TPU power trace level of the profile (0 none, 1 "
      "normal, 2 SPI).", _MT, INERT, _TPU_PROFILE, choices=(0, 1, 2)),
    *[K(f"xprof_e2e_enable_fw_{e}_event", "bool", False, f"Record TPU firmware {e.replace('_', ' ')} "
        "events in the profile.", _MT, INERT, _TPU_PROFILE)
      for e in ("throttle", "power_level", "thermal")],
    K("profile_power_events", "bool", False, "Record TPU power and thermal events in the "
      "profile.", _MT, INERT, _TPU_PROFILE),
    K("managed_mldiagnostics", "bool", False, "Register the run with Google Cloud's managed ML "
      "diagnostics and upload profiles and metrics there.", _MT, INERT, _CLOUD),
    K("managed_mldiagnostics_on_demand_profiling", "bool", True, "Managed ML diagnostics: run its "
      "on-demand profiling server.", _MT, INERT, _CLOUD),
    K("managed_mldiagnostics_run_group", "str", "", "Managed ML diagnostics: group name shared "
      "by related runs.", _MT, INERT, _CLOUD),
    K("managed_mldiagnostics_region", "str", "", "Managed ML diagnostics: Google Cloud region.",
      _MT, INERT, _CLOUD),
    K("managed_mldiagnostics_storage_path", "str", "", "Managed ML diagnostics: separate storage "
      "path for its data.", _MT, INERT, _CLOUD),

    # --- logging, cloud monitoring ---
    K("log_config", "bool", True, "Print the resolved configuration when the run starts.", _MT,
      issue=None, reason="jaxtrain prints it with --dry-run and writes it with "
      "config_logger_dir; printing at start is not built"),
    K("jax_debug_log_modules", "str", "", "Modules whose JAX debug logging is turned on (e.g. "
      "jax).", _MT, issue=None),
    K("enable_checkpoint_cloud_logger", "bool", False, "Send structured checkpoint events to "
      "Cloud Logging.", _MT, INERT, _CLOUD),
    K("goodput_upload_interval_seconds", "int", 30, "Goodput: seconds between uploads.", _MT,
      INERT, _CLOUD),
    K("enable_pathways_goodput", "bool", False, "Goodput monitoring for Pathways jobs.", _MT,
      INERT, _CLOUD),
    K("monitor_step_time_deviation", "bool", True, "Goodput: report how far step times deviate "
      "from the ideal.", _MT, INERT, _CLOUD),
    K("step_deviation_interval_seconds", "int", 30, "Goodput: seconds between step-deviation "
      "reports.", _MT, INERT, _CLOUD),
    K("enable_gcp_goodput_metrics", "bool", True, "Goodput: publish goodput to Cloud "
      "Monitoring.", _MT, INERT, _CLOUD),
    K("enable_gcp_step_deviation_metrics", "bool", True, "Goodput: publish step deviation to "
      "Cloud Monitoring.", _MT, INERT, _CLOUD),
    K("report_heartbeat_metric_for_gcp_monitoring", "bool", False, "Send a heartbeat metric to "
      "Cloud Monitoring.", _MT, INERT, _CLOUD),
    K("heartbeat_reporting_interval_in_seconds", "int", 5, "Seconds between heartbeats.", _MT,
      INERT, _CLOUD),
    K("report_performance_metric_for_gcp_monitoring", "bool", False, "Send step-time metrics to "
      "Cloud Monitoring.", _MT, INERT, _CLOUD),
    K("use_vertex_tensorboard", "bool", False, "Upload TensorBoard events to Vertex AI "
      "TensorBoard.", _MT, INERT, _CLOUD),
    K("vertex_tensorboard_project", "str", "", "Google Cloud project of the Vertex AI "
      "TensorBoard.", _MT, INERT, _CLOUD),
    K("vertex_tensorboard_region", "str", "", "Region of the Vertex AI TensorBoard.", _MT, INERT,
      _CLOUD),

    # --- Pathways, elastic training ---
    K("enable_single_controller", "bool", False, "Run under Pathways' single controller.", _MT,
      REJECTED, _PATHWAYS),
    K("subslice_shape", "str", "", "Pathways: use only this sub-grid of the TPU slice (e.g. "
      "8,8).", _MT, REJECTED, _PATHWAYS),
    K("elastic_enabled", "bool", False, "Pathways elastic training: keep going when TPU slices "
      "fail or return.", _MT, REJECTED, _PATHWAYS),
    K("elastic_backup_kind", "str", "snapshot", "Elastic training: back up state as an "
      "in-memory snapshot or a checkpoint.", _MT, REJECTED, _PATHWAYS,
      choices=("snapshot", "checkpoint")),
    K("elastic_timeout_seconds", "int", 300, "Elastic training: seconds to wait for enough "
      "slices.", _MT, REJECTED, _PATHWAYS),
    K("elastic_max_retries", "int", 10, "Elastic training: retries after slice failures.", _MT,
      REJECTED, _PATHWAYS),
    K("elastic_min_slice_count", "int", -1, "Elastic training: slices needed to start; -1 "
      "waits for all.", _MT, REJECTED, _PATHWAYS),
]
