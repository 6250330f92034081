"""Module plumbing, config-file mechanics and Primus experiment metadata."""
from jaxtrain.config.knob import HONORED, INERT, REJECTED, Alias, K

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_BOTH = ("megatron", "maxtext")



def _maxtext_output(value):
    """MaxText's empty base_output_directory means ./maxtext_output."""
    return "maxtext_output" if value in ("", None) else value


KNOBS = [
    K("trainable", "bool", True, "Whether this run trains; false evaluates only, like skip_train.",
      _BOTH, HONORED),
    K("sink_level", "str", None, "Level of the root jaxtrain logger; null leaves it at DEBUG so "
      "each sink filters on its own.", _BOTH, HONORED, choices=_LEVELS,
      value_aliases={l.lower(): l for l in _LEVELS}),
    K("file_sink_level", "str", "DEBUG", "Lowest level written to the run directory's log file.",
      _BOTH, HONORED, choices=_LEVELS, value_aliases={l.lower(): l for l in _LEVELS}),
    K("stderr_sink_level", "str", "INFO", "Lowest level printed on stderr.", _BOTH, HONORED,
      choices=_LEVELS, value_aliases={l.lower(): l for l in _LEVELS}),
    K("base_config", "str", None, "YAML file this one extends (relative to it, then to configs/); "
      "base.yml means the built-in defaults.", "maxtext", HONORED, doc_defaults={"maxtext": None}),
    K("hardware", "str", "gpu", "Accelerator to run on: gpu, gpu_multiprocess or cpu; sets the JAX "
      "platform before any device is touched.", "maxtext", HONORED,
      choices=("gpu", "gpu_multiprocess", "cpu", "tpu"),
      rejected_values={"tpu": "jaxtrain trains on GPUs (and on the CPU for tests); set "
                              "hardware: gpu"}),
    K("model_name", "str", "default", "Model preset from configs/models/ to load under the file's "
      "own keys; 'default' loads none.", "maxtext", HONORED),
    K("override_model_config", "bool", True, "Let the file and command line override keys the model "
      "preset sets; false makes such a clash an error.", "maxtext", HONORED),
    K("yaml_cfg", "str", None, "Megatron's YAML-config argument.", "megatron", REJECTED,
      "the config file is the positional argument of python -m jaxtrain.train; pass it there"),
    K("spec", "str|list[str]", None, "Megatron's PyTorch module-spec hook.", "megatron", HONORED,
      "jaxtrain models are JAX functions chosen by the model knobs; of the specs only the "
      "hybrid stacks Primus names for model_type mamba are read (what their M layers are: "
      "Mamba-2 for mamba_stack_spec, hybrid_stack_spec and mamba_hybrid_stack_spec_no_te, Gated "
      "DeltaNet for gdn_hybrid_stack_spec(_no_te), FLA's Kimi Delta Attention for "
      "kda_hybrid_stack_spec(_no_te): decay bottleneck of the value head width, a gate "
      "bias), any other value is refused"),
    K("framework", "str", "megatron", "Primus backend whose key names and defaults the file uses.",
      "primus", HONORED, choices=("megatron", "maxtext")),
    K("workspace", "str", "./output", "Primus output root; the run directory is "
      "workspace/work_group/user_name/exp_name.", "primus", HONORED,
      aliases=(Alias("base_output_directory", "maxtext", to_canonical=_maxtext_output,
                     note="MaxText's output root; empty means ./maxtext_output"),),
      doc_defaults={"maxtext": "maxtext_output"}),
    K("env", "dict", {}, "Primus: environment variables the run sets before JAX starts (e.g. "
      "XLA_PYTHON_CLIENT_MEM_FRACTION); a variable already set by the caller is kept.",
      "primus", HONORED),
    K("platform", "dict", None, "Primus: the cluster platform its launcher uses (platform: "
      "{config: platform_local.yaml}).", "primus", INERT,
      "chooses how Primus's own launcher starts processes; jaxtrain is started by srun, mpirun, "
      "torchrun-style variables or an explicit coordinator (docs/multihost.md)"),
    K("work_group", "str", "", "Primus team name, one level of the run directory.", "primus",
      HONORED),
    K("user_name", "str", "", "Primus user name, one level of the run directory.", "primus",
      HONORED),
    K("exp_name", "str", "", "Experiment name, the last level of the run directory.", "primus",
      HONORED),
    K("run_name", "str", "", "MaxText run name: without a Primus exp_name the run directory is "
      "base_output_directory/run_name (empty: base_output_directory itself).", "maxtext",
      HONORED),
]
