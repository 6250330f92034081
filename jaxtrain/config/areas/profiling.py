"""Profiler traces over a step window, device memory profiles, and knobs Primus files with them."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, Alias, K

_M = "megatron"
_PROFILERS = ("", "xplane", "nsys")

KNOBS = [
    # Megatron step-window profiling (torch/nsys names; jax.profiler traces in jaxtrain)
    K("profile", "bool", False, "Profile the steps from profile_step_start to profile_step_end "
      "(Megatron: an nsys capture range).", _M, HONORED),
    K("use_pytorch_profiler", "bool", False, "Record a profiler trace of the step window that "
      "TensorBoard can show (a jax.profiler trace here).", _M, MAPPED,
      "the window is always a jax.profiler trace (XPlane for TensorBoard/XProf); this switch "
      "applies the torch_profiler_* options to it, as Megatron applies them to torch.profiler"),
    K("profile_ranks", "list[int]", [0], "Global process ranks that record the profile.", _M,
      HONORED),
    K("profile_step_start", "int", 10, "Step at which profiling starts.", _M, HONORED),
    K("profile_step_end", "int", 12, "Step at which profiling stops.", _M, HONORED),
    K("disable_profiler_activity_cpu", "bool", False, "Leave host (CPU) activity out of the trace "
      "and keep only device activity.", _M, MAPPED,
      "jax.profiler.ProfileOptions.host_tracer_level = 0 (host TraceMe events off; device "
      "activity is still traced)"),
    K("torch_profiler_record_shapes", "bool", True, "Record operand shapes in the trace.", _M,
      INERT, "XLA traces carry each op's HLO, operand shapes included, whatever this says; "
      "there is no shape recording to switch",
      aliases=(Alias("pytorch_profiler_collect_shapes", ("megatron-lm", "primus"),
                     note="Megatron-LM's switch for the same torch.profiler option"),)),
    K("torch_profiler_with_stack", "bool", True, "Record Python call stacks in the trace.", _M,
      MAPPED, "with use_pytorch_profiler: jax.profiler.ProfileOptions.python_tracer_level = 1 "
      "(Python function calls in the trace); otherwise the Python tracer is off",
      aliases=(Alias("pytorch_profiler_collect_callstack", ("megatron-lm", "primus"),
                     note="Megatron-LM's switch for the same torch.profiler option"),)),
    K("torch_profiler_use_gzip", "bool", False, "Write the trace files gzip-compressed.", _M,
      INERT, "jax.profiler always writes its Chrome/Perfetto traces gzip-compressed "
      "(<host>.trace.json.gz) and the XPlane as protobuf; there is no uncompressed form to pick"),
    K("profiler_perfetto_trace", "bool", False, "Also write perfetto_trace.json.gz, a trace the "
      "Perfetto UI opens, next to the XPlane of a profile window.", "jaxtrain", HONORED),

    # MaxText profiler
    K("profiler", "str", "", "Profiler to run: xplane (jax.profiler trace), nsys (CUDA "
      "profiler range) or empty for none.", "maxtext", HONORED, choices=_PROFILERS),
    K("skip_first_n_steps_for_profiler", "int", 3, "Steps run before profiling starts, to keep "
      "compilation and warm-up out of the trace.", "maxtext", HONORED),
    K("profiler_steps", "int", 1, "How many steps a profile covers after it begins.", "maxtext",
      HONORED),

    # Device memory history
    K("record_memory_history", "bool", False, "Record device memory allocations and dump a memory "
      "profile (pprof in jaxtrain) for debugging.", _M, MAPPED,
      "jax.profiler.save_device_memory_profile: a pprof profile of the live device buffers and "
      "their allocating Python stacks, written after the first step and on out-of-memory"),
    K("memory_snapshot_path", "str", "snapshot.pickle", "File the device memory profile is written "
      "to.", _M, HONORED),

    # Training-loop and runtime knobs that Primus lists in this section
    K("iterations_to_skip", "list[int]", None, "Steps whose batch is read and dropped without an "
      "update (to step over bad data).", _M, HONORED,
      "as Megatron: the step's global batch is read and counted as consumed, no forward, "
      "update, LR-schedule step, metrics row, validation or save happens for it"),
    K("result_rejected_tracker_filename", "str", None, "File that records rerun 'result rejected' "
      "events; its steps are added to iterations_to_skip.", _M, issue=None),
    K("enable_gloo_process_groups", "bool", True, "Create Gloo (CPU) process groups beside the "
      "NCCL ones for host-side collectives.", _M, INERT,
      "jaxtrain creates no torch process groups; host-side coordination goes through "
      "jax.distributed, so neither value changes a run",
      aliases=(Alias("use_gloo_process_groups", "megatron-lm",
                     note="Megatron-LM's dest of --disable-gloo-process-groups"),)),
]
