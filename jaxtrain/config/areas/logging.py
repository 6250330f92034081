"""Console log cadence, training metrics, TensorBoard/W&B/MLflow/trackio writers, telemetry."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_M = "megatron"
_PGS = ("pgs-train", "pgs-distill")
_TIMING_OPTIONS = ("max", "minmax", "all")
_ONE_LOGGER = ("NVIDIA OneLogger telemetry: jaxtrain sends no telemetry to it, so the value cannot "
               "change training or its logs")
_LEVELS = (0, 10, 20, 30, 40, 50, "NOTSET", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_MEM_STATS = ("served by JAX's Device.memory_stats() (bytes in use, peak, limit of the local "
              "devices, filled in by XLA's CUDA and ROCm backends) instead of rocm-smi; the mem_* "
              "fields join the metrics row and a log line, and backends without stats add none")
_APP_TAG = ("application tag for NVIDIA's OneLogger telemetry, which jaxtrain does not send; it "
            "cannot change training or its logs")


def _negate(value):
    """enable_* written for a disable_* knob."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    return (not value) if isinstance(value, (bool, int)) else value


def _empty_to_none(value):
    """pgs-distill writes an empty run name for 'choose one automatically', pgs-train null."""
    return None if value == "" else value


KNOBS = [
    # Console cadence and training metrics (built with the train loop)
    K("log_interval", "int", 1, "Steps between console lines of loss, learning rate and timing.",
      _M, doc_defaults={"maxtext": 100},
      aliases=(Alias("log_period", "maxtext"),
               Alias("train.logging_steps", "pgs-train"),
               Alias("logging.log_every", "pgs-distill")), status=HONORED),
    K("log_throughput", "bool", True, "Report tokens per second and TFLOP/s per device with each "
      "log line.", _M, status=HONORED),
    K("log_avg_skip_iterations", "int", 2, "Number of first steps (compilation, warm-up) left out "
      "of the running throughput average.", _M, status=HONORED),
    K("log_avg_reset_interval", "int", 10, "Steps after which the running throughput average "
      "starts again.", _M, status=HONORED),
    K("log_params_norm", "bool", False, "Compute and log the global L2 norm of the parameters.", _M, status=HONORED),
    K("log_num_zeros_in_grad", "bool", False, "Count and log how many gradient entries are exactly "
      "zero.", _M, status=HONORED),
    K("logging.log_grad_norm", "bool", True, "Put the global gradient norm in the logged metrics.",
      "pgs-train", status=HONORED),
    K("log_progress", "bool", False, "Append consumed tokens, FLOPs and throughput to progress.txt "
      "in the run directory at job start, each checkpoint save and job end.", _M, status=HONORED),
    K("timing_log_level", "int", 0, "Detail of step timers: 0 step time only, 1 adds once-per-step "
      "phases, 2 adds fine-grained ones.", _M, status=HONORED, choices=(0, 1, 2)),
    K("timing_log_option", "str", "minmax", "How timers are combined across processes: the max, "
      "min and max, or every process.", _M, status=HONORED, choices=_TIMING_OPTIONS),
    K("logging_level", "int|str", None, "Python logging level for the root logger (a number "
      "such as 20 or a name such as INFO); null keeps it.", _M, status=HONORED, choices=_LEVELS,
      value_aliases={str(l).lower(): l for l in _LEVELS if isinstance(l, str)}),
    K("config_logger_dir", "str", "", "Directory where the resolved model and optimizer "
      "configs are dumped as JSON; empty dumps nothing.", _M, status=HONORED),

    # Device memory reporting
    K("use_rocm_mem_info", "bool", False, "Report device memory use every step (Primus reads "
      "rocm-smi; jaxtrain reads the devices' memory stats).", _M, MAPPED, _MEM_STATS),
    K("use_rocm_mem_info_iters", "list[int]", [1, 2], "Steps at which device memory use is "
      "reported when use_rocm_mem_info is off.", _M, MAPPED, _MEM_STATS, nullable=True),

    # TensorBoard
    K("disable_tensorboard", "bool", True, "Turn the TensorBoard writer off (Primus switch).", _M,
      status=HONORED, doc_defaults={"maxtext": False},
      aliases=(Alias("enable_tensorboard", "maxtext", to_canonical=_negate,
                     note="the opposite switch: true writes TensorBoard events"),)),
    K("tensorboard_dir", "str", None, "Directory for TensorBoard event files; null puts them in "
      "the run directory.", _M, status=HONORED),
    K("tensorboard_log_interval", "int", 1, "Steps between scalar writes to TensorBoard.", _M,
      status=HONORED),
    K("tensorboard_queue_size", "int", 1000, "Pending TensorBoard events held before the writer "
      "flushes to disk.", _M, status=HONORED),
    K("log_timers_to_tensorboard", "bool", True, "Log the timing breakdown of each step in "
      "TensorBoard.", _M, status=HONORED),
    K("log_batch_size_to_tensorboard", "bool", True, "Write the global batch size to TensorBoard.",
      _M, status=HONORED),
    K("log_learning_rate_to_tensorboard", "bool", True, "Write the learning rate to TensorBoard.",
      _M, status=HONORED),
    K("log_validation_ppl_to_tensorboard", "bool", False, "Write validation perplexity next to "
      "validation loss in TensorBoard.", _M, status=HONORED),
    K("log_memory_to_tensorboard", "bool", False, "Write device memory statistics to TensorBoard.",
      _M, status=HONORED),
    K("log_world_size_to_tensorboard", "bool", False, "Write the number of devices to TensorBoard.",
      _M, status=HONORED),
    K("log_loss_scale_to_tensorboard", "bool", True, "Write the fp16 loss scale to TensorBoard.",
      _M, status=HONORED),

    # Weights & Biases
    K("disable_wandb", "bool", True, "Turn the Weights & Biases writer off (Primus switch).", _M,
      status=HONORED,
      aliases=(Alias("enable_wandb", "maxtext", to_canonical=_negate,
                     note="the opposite switch: true writes to Weights & Biases"),)),
    K("logging.use_wandb", "bool", False, "Mirror the logged metrics to Weights & Biases (on by "
      "default in pgs train files); a tracker failure only warns.", _PGS, status=HONORED,
      doc_defaults={"pgs-train": True}),
    K("wandb_project", "str", None, "Weights & Biases project the run is logged under.", _M,
      status=HONORED,
      doc_defaults={"pgs-train": "palingenesis", "pgs-distill": "palingenesis-opd"},
      aliases=(Alias("logging.project", _PGS, note="also names the trackio project"),
               Alias("wandb_project_name", "maxtext"))),
    K("wandb_exp_name", "str", None, "Weights & Biases run name; null lets the trainer derive one.",
      _M, status=HONORED,
      aliases=(Alias("logging.run_name", _PGS, to_canonical=_empty_to_none,
                     note="an empty name means automatic"),
               Alias("wandb_run_name", "maxtext", to_canonical=_empty_to_none,
                     note="an empty name means automatic"))),
    K("wandb_save_dir", "str", None, "Local directory for Weights & Biases files; null uses "
      "the run directory.", _M, status=HONORED),
    K("wandb_entity", "str", None, "Weights & Biases team or user that owns the project.", _M,
      status=HONORED),

    # MLflow and trackio
    K("disable_mlflow", "bool", True, "Turn the MLflow writer off (Primus switch).", _M,
      status=HONORED),
    K("mlflow_run_name", "str", None, "Label given to the run in MLflow.", _M, status=HONORED),
    K("mlflow_experiment_name", "str", None, "MLflow experiment the run is logged under.", _M,
      status=HONORED),
    K("logging.use_trackio", "bool", False, "Mirror the logged metrics to trackio (on by default "
      "in pgs train files); a tracker failure only warns.", "pgs-train", status=HONORED,
      doc_defaults={"pgs-train": True}),

    # pgs training-health monitors
    K("logging.health_tier2_every", "int", 0, "Steps between health/* gradient cosine "
      "similarity and noise scale (an extra forward/backward) and device memory, at logged "
      "steps. pgs files default to 10; 0: off.", "pgs-train", status=HONORED,
      doc_defaults={"pgs-train": 10, "pgs-distill": 10}),
    K("logging.health_tier3_every", "int", 0, "Steps between health/* weight norms, stable "
      "rank and drift from the first tier-3 step, at logged steps. pgs files default to 100; "
      "0: off.", "pgs-train", status=HONORED, doc_defaults={"pgs-train": 100,
                                                            "pgs-distill": 100}),
    K("logging.rl_readiness", "bool", False, "Track the entropy of the model's output distribution "
      "at logged steps (health/output_entropy) and warn when it collapses (SFT before RL).",
      "pgs-train", status=HONORED),
    K("logging.rl_entropy_floor", "float", 1.0, "Mean output entropy (nats) below which "
      "logging.rl_readiness warns.", "pgs-train", status=HONORED),

    # NVIDIA OneLogger / application tags
    K("enable_one_logger", "bool", True, "Send run telemetry to NVIDIA OneLogger.", _M, INERT,
      _ONE_LOGGER),
    K("one_logger_project", "str", "megatron-lm", "Project that OneLogger files runs under.", _M,
      INERT, _ONE_LOGGER),
    K("one_logger_run_name", "str", None, "Run label shown in OneLogger.", _M, INERT, _ONE_LOGGER),
    K("one_logger_async", "bool", False, "Flush OneLogger records asynchronously.", _M, INERT,
      _ONE_LOGGER),
    K("app_tag_run_name", "str", None, "Name shared by the jobs of one training run, for "
      "telemetry.", _M, INERT, _APP_TAG),
    K("app_tag_run_version", "str", "0.0.0", "Version tag of the training application, for "
      "telemetry.", _M, INERT, _APP_TAG),
]


_GCP = "Google Cloud telemetry that jaxtrain does not send; training and its logs are the same"

KNOBS += [
    # MaxText metrics and telemetry
    K("metrics_file", "str", "", "MaxText: a local file that also gets every metrics row "
      "(jaxtrain's names, one JSON line per logged step, as metrics.jsonl); empty writes none.",
      "maxtext", status=HONORED),
    K("gcs_metrics", "bool", False, "MaxText: upload step metrics to Cloud Storage under the "
      "run directory.", "maxtext", REJECTED,
      "jaxtrain uploads nothing to Cloud Storage; metrics go to metrics.jsonl in the run "
      "directory (and TensorBoard/W&B/MLflow when enabled)"),
    K("save_config_to_gcs", "bool", False, "MaxText: upload the resolved config to Cloud "
      "Storage under the run directory.", "maxtext", INERT,
      "jaxtrain uploads nothing to Cloud Storage; the resolved config is stored in every "
      "checkpoint's metadata"),
    K("enable_goodput_recording", "bool", False, "MaxText: record Goodput events for Google "
      "Cloud's ML Goodput service.", "maxtext", INERT, _GCP),
    K("monitor_goodput", "bool", False, "MaxText: upload Goodput measurements while training.",
      "maxtext", INERT, _GCP),
]
