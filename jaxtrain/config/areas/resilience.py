"""Straggler reports, fault-tolerance tooling, heterogeneous layers, rerun and error injection."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, K

_M = "megatron"
_NO_CONTROLLER = ("Megatron switches its straggler detector on and off through a control server on "
                  "this port; jaxtrain runs no such server, so use log_straggler alone")
_FT = ("nvidia-resiliency-ext's fault-tolerance package (ft_launcher heartbeats and section "
       "timeouts) hooks PyTorch jobs only; restart a jaxtrain run from its last checkpoint instead")
_RERUN_MODES = ("disabled", "validate_results", "report_determinism_stats")
_INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")

KNOBS = [
    # Straggler detection
    K("log_straggler", "bool", False, "Report the slowest and fastest processes by step time.", _M,
      HONORED),
    K("straggler_minmax_count", "int", 1, "How many slowest and fastest processes the straggler "
      "report names.", _M, HONORED),
    K("disable_straggler_on_startup", "bool", False, "Start with the straggler detector off until "
      "it is switched on at run time.", _M, REJECTED, _NO_CONTROLLER),
    K("straggler_ctrlr_port", "int", 65535, "Port of the server that switches the straggler "
      "detector on and off at run time.", _M, REJECTED, _NO_CONTROLLER),

    # Fault-tolerance package and tooling
    K("enable_ft_package", "bool", False, "Hook the run into NVIDIA's fault-tolerance package for "
      "hang detection and restarts.", _M, REJECTED, _FT),
    K("calc_ft_timeouts", "bool", False, "Let the fault-tolerance package work out its timeouts "
      "from observed step times.", _M, REJECTED, _FT),
    K("run_workload_inspector_server", "bool", False, "Run a server that takes profiles on demand "
      "while training runs (jaxtrain: jax.profiler server).", _M, MAPPED,
      "jax.profiler.start_server on port 9012 + process index: capture a trace on demand from "
      "TensorBoard's profile tab or XProf while the run goes on"),

    # Heterogeneous layers and in-process restart
    K("heterogeneous_layers_config_path", "str", None, "JSON file (HF Nemotron-NAS format) giving "
      "each layer its own attention and MLP shape.", _M),
    K("heterogeneous_layers_config_encoded_json", "str", None, "The same per-layer description "
      "inline as a JSON string.", _M),
    K("inprocess_restart", "bool", False, "Recover from a fault by restarting training inside the "
      "running processes.", _M),

    # Rerun validation and error injection
    K("rerun_mode", "str", "disabled", "Rerun engine: off, rerun a suspect step to tell transient "
      "from persistent faults, or report determinism.", _M, choices=_RERUN_MODES,
      value_aliases={"report_stats": "report_determinism_stats"}),
    K("error_injection_rate", "int", 0, "Inject a fake faulty result once every this many checked "
      "results; 0 injects none.", _M),
    K("error_injection_type", "str", "transient_error", "Kind of fault injected for testing the "
      "rerun engine.", _M, choices=_INJECTION_TYPES),
    K("enable_experimental", "bool", False, "Unlock Megatron's experimental code paths.", _M, INERT,
      "gates Megatron's own experimental code; each jaxtrain feature is switched by its own knob "
      "and none sits behind this flag"),
]
