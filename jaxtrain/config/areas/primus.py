"""Primus-only keys of its Megatron presets and experiments (not Megatron-LM arguments):
trainer stage and SFT data, ODC communication, Primus-Turbo kernel choices, weight
de-oscillation, MLflow/TraceLens uploads, runtime patches and environment variables written
among overrides. Model-family keys (DeepSeek-V4, Kimi K3, hybrid/FLA, LFM2, Flux diffusion)
are in ``primus_models``. Defaults are the Primus presets' values, else Primus's own fallback.
"""
from jaxtrain.config.knob import HONORED, INERT, REJECTED, K

_P = "primus"

_ENV = ("an environment variable of the ROCm/Primus launcher written among a module's "
        "overrides, where Primus reads nothing by this name; set it in the environment instead")
_TRACELENS = ("TraceLens analyses PyTorch profiler traces and uploads its reports to MLflow; "
              "jaxtrain's traces come from jax.profiler")
_TURBO = ("chooses among Primus-Turbo's ROCm kernels for the same math; XLA generates "
          "jaxtrain's kernels")
_FP8_ATTN = ("FP8 attention is a Transformer Engine path; jaxtrain's attention kernels compute in "
             "the compute dtype and its FP8 covers the projections (fp8)")
_UNREAD = "Primus itself reads no key of this name, so it has no effect there either"

_LORA_OFF = {"enabled": False, "dim": 32, "alpha": 32, "dropout": 0.0, "dropout_position": "pre",
             "lora_A_init_method": "xavier", "lora_B_init_method": "zero",
             "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def _lora(value):
    """Primus's lora mapping or MaxText's (enable_lora, lora_rank, ...): LoRA switched off, in
    either spelling, is the default (no adapters); a switched-on one is kept as written."""
    switch = [k for k in ("enabled", "enable_lora") if isinstance(value, dict) and k in value]
    if switch and not any(value[k] for k in switch):
        return dict(_LORA_OFF)
    return value


KNOBS = [
    # --- trainer stage and supervised fine-tuning data ---
    K("stage", "str", "pretrain", "Which Primus trainer runs the module: pretrain, sft or "
      "mlperf_pretrain.", _P, HONORED, choices=("pretrain", "sft", "mlperf_pretrain"),
      planned_values={"sft": None, "mlperf_pretrain": None}),
    K("sft_dataset_name", "str", "tatsu-lab/alpaca", "Hugging Face dataset (or local path) the "
      "SFT trainer reads conversations from.", _P),
    K("sft_conversation_format", "str", "alpaca", "How SFT rows become prompt and response: "
      "alpaca, squad, messages, ...", _P),
    K("sft_dataset_split", "str", "train", "Split of the SFT dataset to read.", _P),
    K("sft_bridge_compat_inline_bos", "bool", False, "Tokenize SFT samples the way Megatron-Bridge "
      "does (a BOS inside each packed sample) to match its packed data exactly.", _P),
    K("sft_sanitize_nan_grads", "bool", False, "Zero NaN/inf gradient entries before the NaN "
      "check so such steps do not stop the run (for benchmark SFT variants).", _P),
    K("enable_packed_sequences", "bool", False, "Pack several short SFT samples into each "
      "sequence.", _P),
    K("use_packed_attention", "bool", False, "With packed SFT samples, keep attention within each "
      "sample (varlen); false lets packed samples see each other.", _P),
    K("lora", "dict", _LORA_OFF,
      "LoRA adapters for SFT: enabled, rank (dim), alpha, dropout and where, init of A/B, and "
      "the target linear layers (MaxText: enable_lora, lora_rank, lora_alpha, ...).",
      (_P, "maxtext"), parse=_lora),
    K("enable_odc_lb_mini", "bool", False, "LB-Mini: serve variable-length SFT micro-batches "
      "balanced across data-parallel ranks by token cost.", _P),
    K("lb_mini_max_token_len", "int", 0, "Token cap per LB-Mini micro-batch; 0 means "
      "seq_length.", _P),
    K("lb_mini_cost_model", "str", "linear", "Cost LB-Mini balances: linear (tokens) or fit "
      "(attention-aware, about quadratic).", _P),

    # --- ODC (point-to-point FSDP gradient communication) ---
    K("enable_odc", "bool", False, "Route FSDP2 gradient reduce-scatters through ODC's "
      "point-to-point scatter-accumulate, letting ranks run different micro-batch counts.", _P),
    K("odc_phase", "int", 2, "ODC wiring depth: 1 installs hooks only, 2 routes the gradients "
      "too.", _P),
    K("odc_grad_spike_threshold", "float", 1000.0, "Skip the step when the gradient norm exceeds "
      "this under ODC (guards its rare bad reductions); <= 0 turns it off.", _P),
    K("odc_p2p_backend", "str", "mori", "Symmetric-memory library under ODC: mori or rocshmem.",
      _P),
    K("odc_mori_init", "str", "pg", "How MORI is initialised: from the process group (pg) or a "
      "unique id (uid).", _P),
    K("odc_max_buffer_size", "int", 67108864, "Largest ODC communication buffer, in bytes.", _P),
    K("odc_rocshmem_gda", "bool", False, "Use rocSHMEM's GPU-direct path for multi-node ODC.",
      _P),
    K("odc_rocshmem_lib", "str", None, "Path of a librs_host_gda.so to load instead of the "
      "built-in rocSHMEM GDA library.", _P),
    K("odc_gda_rs_blocks", "int", 64, "Thread blocks of ODC's GPU-direct reduce-scatter kernel.",
      _P),
    K("odc_gda_pipe", "int", 1, "Peer pipelining depth of ODC's GPU-direct reduce-scatter.", _P),
    K("odc_gda_defer_reduce", "str", "auto", "Defer ODC's cross-node reduction to once per "
      "mini-batch: auto, 1 or 0.", _P),
    K("odc_gda_warmup_mode", "str", "strided", "How ODC's GPU-direct path settles write "
      "visibility: strided, full, hdp, fence or hdpfence.", _P),
    K("odc_gda_stride_bytes", "int", 65536, "Page stride of the strided ODC warm-up, in bytes.",
      _P),

    # --- Primus-Turbo kernels ---
    K("use_turbo_autotune", "bool", False, "Let Primus-Turbo autotune its kernels.", _P, INERT,
      _TURBO),
    K("turbo_gemm_backend", "str", "default", "Kernel library of Turbo GEMMs, overall or per "
      "precision (e.g. fp8:triton,other:hipblaslt).", _P, INERT, _TURBO),
    K("turbo_grouped_gemm_backend", "str", "default", "Kernel library of Turbo grouped GEMMs, "
      "overall or per precision.", _P, INERT, _TURBO),
    K("turbo_grouped_gemm_without_padding", "bool", False, "Let Turbo grouped GEMMs take expert "
      "token counts that are not aligned, without FP8 padding.", _P, INERT, _TURBO),
    K("use_turbo_norm_te_linear", "bool", False, "Use Turbo's norm in the fused norm + linear "
      "layers while the GEMM stays on Transformer Engine.", _P, INERT, _TURBO),
    K("use_turbo_mega_moe", "bool", False, "Replace the MoE layer by Turbo's fused MegaMoE "
      "kernel (expert parallel only).", _P, INERT, _TURBO),
    K("turbo_mega_moe_precision", "str", "bf16", "Precision of MegaMoE's experts: bf16 or "
      "mxfp8.", _P, choices=("bf16", "mxfp8")),
    K("use_turbo_permute_padding", "bool", False, "Pad tokens during Turbo's MoE permutation.",
      _P, INERT, _UNREAD),
    K("mxfp4_gradient_stochastic_rounding", "bool", False, "Round gradients stochastically when "
      "quantizing them to MXFP4 in the backward GEMMs.", _P),

    # --- weight de-oscillation (MXFP4) ---
    K("weight_deosc", "bool", False, "MXFP4 training: snap weights whose quantized value keeps "
      "flipping between bins while the master weight barely moves.", _P),
    K("weight_deosc_period", "int", 200, "Optimizer steps per de-oscillation window.", _P),
    K("weight_deosc_ratio", "float", 4.0, "Quantized-over-master movement ratio above which an "
      "element is snapped to its bin centre.", _P),
    K("weight_deosc_start_step", "int", 0, "Step at which de-oscillation tracking starts.", _P),
    K("weight_deosc_log_freq", "int", 0, "Log a de-oscillation summary every N windows; 0 never.",
      _P),

    # --- logging and profiling ---
    K("mlflow_upload_traces", "bool", False, "Upload the profiler trace files to MLflow.", _P),
    K("mlflow_upload_logs", "bool", False, "Upload the training log files to MLflow.", _P),
    K("mlflow_upload_performance_metrics", "bool", False, "Log TFLOP/s, tokens/s, step time, "
      "memory and GPU utilisation to MLflow.", _P),
    K("generate_tracelens_report", "bool", False, "Build TraceLens analysis reports from the "
      "profiler traces.", _P, INERT, _TRACELENS),
    K("mlflow_upload_tracelens_report", "bool", False, "Upload TraceLens reports to MLflow.", _P,
      INERT, _TRACELENS),
    K("mlflow_tracelens_ranks", "list[int]", None, "Ranks whose traces TraceLens analyses; null "
      "means all.", _P, INERT, _TRACELENS),
    K("mlflow_tracelens_output_format", "str", "xlsx", "Format of TraceLens reports: xlsx, csv or "
      "all.", _P, INERT, _TRACELENS, choices=("xlsx", "csv", "all")),
    K("mlflow_tracelens_cleanup_after_upload", "bool", False, "Delete local TraceLens reports "
      "after uploading them.", _P, INERT, _TRACELENS),
    K("mlflow_tracelens_auto_install", "bool", True, "Install TraceLens when it is missing.", _P,
      INERT, _TRACELENS),
    K("wall_clock_step_timer", "bool", False, "Log each train step's wall-clock time, without "
      "barriers and logging overhead.", _P),
    K("use_nsys_profiler", "bool", False, "Megatron's config-field name for nsys profiling (the "
      "--profile flag).", _P, INERT,
      "Megatron fills that field from profile, so a file setting this name changes nothing "
      "there either; set profile"),
    K("check_for_nan_in_loss", "bool", True, "Megatron's rerun-config field for NaN checks of the "
      "loss.", _P, INERT,
      "Megatron fills it from check_for_nan_in_loss_and_grad, so a file setting this name "
      "changes nothing there either; set check_for_nan_in_loss_and_grad"),
    K("mlperf_mode", "bool", False, "Emit MLPerf logging events (run start/stop, evaluations) "
      "during training.", _P),
    K("target_val_loss", "float", None, "Stop training once the validation loss reaches this "
      "value (MLPerf target; Primus falls back to 0.586).", _P),
    K("warmup_train_steps", "int", 0, "MLPerf warm-up: train steps run on synthetic Flux data "
      "before the first real step.", _P, REJECTED,
      "Primus wires it only into its Flux (diffusion) trainer, a model family jaxtrain does not "
      "train"),
    K("nemo_aligned_lr_warmup", "bool", False, "Warm the learning rate up by NeMo's formula, "
      "base x (step + 1) / (warmup + 1), instead of Megatron's.", _P),

    # --- precision, FSDP2 and Megatron config fields outside argparse ---
    K("fp8_dot_product_attention", "bool", False, "Compute the attention core (dot products and "
      "softmax) in FP8 with Transformer Engine.", _P, REJECTED, _FP8_ATTN),
    K("fp8_multi_head_attention", "bool", False, "Run the whole attention block, projections "
      "included, through Transformer Engine's FP8 path.", _P, REJECTED, _FP8_ATTN),
    K("fp8_reduce_amax", "bool", False, "All-reduce the FP8 amax across ranks so all use the same "
      "scale.", _P, INERT,
      "jaxtrain takes the amax of the whole (sharded) array inside the compiled step, which is "
      "always the value reduced across ranks"),
    K("fp4_use_native_te_autocast", "bool", False, "Run FP4 layers under Transformer Engine's own "
      "autocast instead of Primus-Turbo's FP4 path.", _P, INERT, _TURBO),
    K("mxfp4_backward_precision", "str", "mxfp4", "Precision of the backward GEMMs of MXFP4 "
      "layers: mxfp4 or fp8.", _P, choices=("mxfp4", "fp8")),
    K("use_fsdp2_fp8_all_gather", "bool", False, "FSDP2: keep weights in FP8 and all-gather them "
      "in FP8.", _P, REJECTED, "weights are stored in weight_dtype and quantized after XLA "
      "gathers them; there is no FP8 copy of the weights to gather"),
    K("fp8_all_gather_stochastic_rounding", "bool", False, "Round stochastically when casting "
      "weights to FP8 for the FSDP2 FP8 all-gather.", _P, REJECTED,
      "only serves use_fsdp2_fp8_all_gather, which jaxtrain refuses"),
    K("fp8_precompute_data_cache", "bool", True, "Cache the FP8 weight data computed for the "
      "FSDP2 FP8 all-gather.", _P, INERT,
      "only serves use_fsdp2_fp8_all_gather, which jaxtrain refuses"),
    K("use_cpp_fp8_quantize", "bool", False, "Quantize weights for the FSDP2 FP8 all-gather with "
      "a C++ kernel.", _P, INERT, "only serves use_fsdp2_fp8_all_gather, which jaxtrain refuses"),
    K("use_fsdp2_bf16_master_weight_optimizer", "bool", False, "FSDP2 with bf16: keep the "
      "optimizer's master weights in bf16 instead of float32.", _P),
    K("use_fsdp2_fp32_param_optimizer", "bool", False, "FSDP2 with bf16: keep parameters in "
      "float32 and compute in bf16 through FSDP2's mixed-precision policy.", _P),
    K("fsdp_prefetch_depth", "int", 1, "FSDP2 layers whose weights are gathered ahead of use.",
      _P, INERT, "prefetching of PyTorch FSDP2's all-gathers; XLA schedules the gathers of the "
      "compiled step (overlap_param_gather)"),
    K("optimizer_foreach", "bool", True, "Use PyTorch's multi-tensor (foreach) optimizer "
      "kernels.", _P, INERT,
      "a PyTorch implementation choice of the same update; XLA fuses jaxtrain's update"),
    K("overlap_grad_norm", "bool", False, "Compute the squared gradient norms while the FSDP2 "
      "reduce-scatter is still running.", _P, INERT,
      "an overlap of PyTorch streams with the same result; XLA schedules the compiled step"),
    K("fused_single_qkv_rope", "bool", False, "Apply RoPE to the fused QKV tensor without "
      "splitting it first.", _P, INERT,
      "a fused Transformer Engine kernel of the same math; XLA fuses the rotary embedding "
      "itself"),
    K("fused_padded_mla_attention", "bool", False, "Run MLA attention with a fused kernel on "
      "padded head widths.", _P, INERT,
      "a fused PyTorch kernel of the same math; XLA generates jaxtrain's attention"),
    K("moe_token_dropping", "bool", False, "Megatron config field for capacity-based token "
      "dropping, which Megatron marks unsupported.", _P, INERT,
      "Megatron-LM does not read it; token dropping is set with moe_expert_capacity_factor"),
    K("moe_router_topk_limited_devices", "int", None, "Deprecated device-limited routing: pick "
      "experts from at most this many expert-parallel ranks per token.", _P),

    # --- PyTorch runtime ---
    K("torch_compile", "dict", {"enable": False, "backend": "inductor", "mode": "default",
                                "fullgraph": False},
      "torch.compile settings: enable, backend, mode, fullgraph (and per-model extras).", _P,
      INERT, "torch.compile of PyTorch modules; XLA already compiles jaxtrain's whole step"),
    K("dataloader_mp_context", "str", None, "Start method of PyTorch DataLoader workers: fork, "
      "spawn or forkserver; null keeps PyTorch's.", _P, INERT,
      "how PyTorch starts data-loader worker processes; jaxtrain's input pipeline does not "
      "fork PyTorch workers", choices=("fork", "spawn", "forkserver")),
    K("empty_cache_interval", "int", None, "Empty PyTorch's CUDA cache every N steps (null: "
      "Primus's default of every step).", _P, INERT,
      "PyTorch's caching allocator; XLA's allocator keeps no cache to empty"),
    K("prefetch_factor", "int", None, "Batches each data-loader worker reads ahead.", _P, INERT,
      "read-ahead depth of PyTorch/Energon data-loader workers; it changes no sample"),
    K("disable_delayed_scaling_patches", "bool", False, "Skip Primus's patches to Transformer "
      "Engine's delayed FP8 scaling.", _P, INERT,
      "Primus fixes inside Transformer Engine's PyTorch code; jaxtrain's delayed scaling is its "
      "own (fp8_recipe delayed)"),
    K("params_dtype", "str", None, "Dtype the weights are created in (Megatron's "
      "ModelParallelConfig field).", _P, INERT,
      "Megatron derives it from bf16/fp16 when it checks the arguments; jaxtrain derives its "
      "dtypes from bf16/fp16 and weight_dtype the same way"),

    # --- environment variables written among overrides ---
    K("CLEAN_DOCKER_CONTAINER", "any", None, "Launcher variable: remove old containers before "
      "starting.", _P, INERT, _ENV),
    K("GPU_MAX_HW_QUEUES", "any", None, "ROCm variable: number of hardware queues per GPU.", _P,
      INERT, _ENV),
    K("HSA_NO_SCRATCH_RECLAIM", "any", None, "ROCm variable: keep scratch memory instead of "
      "reclaiming it.", _P, INERT, _ENV),
    K("LEGACY_GG", "any", None, "Primus launcher variable choosing the legacy grouped GEMM.", _P,
      INERT, _ENV),
    K("NVTE_CK_USES_BWD_V3", "any", None, "Transformer Engine (ROCm) variable: use the v3 "
      "Composable Kernel attention backward.", _P, INERT, _ENV),
    K("PRIMUS_DETERMINISTIC", "any", None, "Primus launcher variable for deterministic runs.", _P,
      INERT, _ENV),
    K("TURBO_DEEPEEP", "any", None, "Primus launcher variable enabling Turbo DeepEP.", _P, INERT,
      _ENV),
    K("TURBO_GROUPED_MLP", "any", None, "Primus launcher variable enabling Turbo's grouped MLP.",
      _P, INERT, _ENV),
    K("USING_AIC", "any", None, "Launcher variable of AMD's internal cluster setup.", _P, INERT,
      _ENV),
]
