"""Valid ranges of numeric knobs and the path knobs that must name existing files.

One table, applied to the knobs when the registry is built (``Knob.low``/``high``,
``Knob.existing_path``): a value out of range, or a path that does not exist, is a
configuration error naming the key, in the dry run. A list value is checked item by item.

Sentinels stay valid: null is never range-checked (it means unset), and where a knob gives a
number a meaning of its own (MaxText's -1 "fill the remaining devices" or "the whole split",
0 "off" where the code reads 0 as off) the bound leaves it in. A bound one cannot write as an
inclusive pair (a beta of exactly 1, a MaxText mesh size of 0, a layer pattern that is either a
period or a 0/1 list) is checked where the value is read, by a message naming the key.
"""
from __future__ import annotations

# (low, high), inclusive; None: unbounded on that side.
POSITIVE = (1, None)          # sizes, degrees, intervals, lengths: at least one
NON_NEGATIVE = (0, None)      # counts and offsets where 0 means none (or off)
ABOVE_ZERO = (1e-30, None)    # epsilons, standard deviations, bases, scales: strictly positive
FRACTION = (0.0, 1.0)         # probabilities, shares, momenta (beta = 1 is refused by OptimConfig)
FILL = (-1, None)             # -1 is a sentinel (fill, automatic, whole split, unbounded)
SEED = (0, 2**32 - 1)         # what numpy's generators take


def _all(keys: str, bound) -> dict:
    return dict.fromkeys(keys.split(), bound)


_MESH_AXES = ("diloco data fsdp fsdp_transpose tensor tensor_sequence expert sequence context "
              "context_usp_ulysses context_autoregressive autoregressive pipeline").split()

RANGES: dict[str, tuple[float | None, float | None]] = {
    # model shape (null where a knob takes it means "derived")
    **_all("num_layers hidden_size ffn_hidden_size num_attention_heads kv_channels "
           "num_query_groups global_parameter_scale max_position_embeddings "
           "original_max_position_embeddings", POSITIVE),
    **_all("attention_dropout hidden_dropout rotary_percent", FRACTION),
    # positions: RoPE bases and factors, YaRN
    **_all("rotary_base rotary_seq_len_interpolation_factor", POSITIVE),
    **_all("rope_scaling_factor rope_min_timescale rope_linear_scaling_factor "
           "rope_low_freq_factor rope_high_freq_factor rotary_scaling_factor rope_factor "
           "yarn_beta_fast yarn_beta_slow beta_fast beta_slow", ABOVE_ZERO),
    **_all("mscale mscale_all_dim yarn_softmax_mscale", NON_NEGATIVE),
    # norms, caps, init (null turns a cap off; MaxText's 0 becomes null on the way in)
    **_all("norm_epsilon init_method_std final_logit_softcapping attn_logit_softcapping "
           "router_logit_softcapping activation_func_clamp_value", ABOVE_ZERO),
    # windows: 0 (or null) attends to the whole prefix; Megatron's window_size uses -1
    **_all("sliding_window_size sink_sliding_window", NON_NEGATIVE),
    "window_size": FILL,
    # tokenizer
    "vocab_size": POSITIVE,
    **_all("vocab_extra_ids tiktoken_num_special_tokens", NON_NEGATIVE),
    # multi-latent attention (MaxText's q_lora_rank 0 projects queries directly)
    "q_lora_rank": NON_NEGATIVE,
    **_all("kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim", POSITIVE),
    # recompute (Primus files write recompute_num_layers 0 with recompute off; with a
    # recompute_method the model config asks for a positive count)
    **_all("recompute_num_layers recompute_layer_ids", NON_NEGATIVE),
    "param_scan_axis": (0, 1),
    # MoE (a negative capacity factor means dropless, as in Megatron)
    **_all("num_experts moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_router_topk "
           "moe_router_num_groups moe_router_group_topk moe_router_group_score_topk "
           "inhomogeneous_layer_cycle_interval", POSITIVE),
    **_all("moe_router_topk_scaling_factor routed_scaling_factor", ABOVE_ZERO),
    **_all("moe_input_jitter_eps moe_aux_loss_coeff moe_z_loss_coeff moe_router_bias_update_rate "
           "load_balance_loss_weight shared_experts first_num_dense_layers "
           "routed_bias_update_rate", NON_NEGATIVE),
    # MaxText's MoE sizes and routing groups: -1 is unset
    **_all("base_moe_mlp_dim n_routing_groups topk_routing_group", FILL),
    # precision and quantization
    **_all("loss_scale initial_loss_scale min_loss_scale", ABOVE_ZERO),
    **_all("loss_scale_window hysteresis fp8_amax_history_len", POSITIVE),
    **_all("fp8_margin num_layers_at_start_in_bf16 num_layers_at_end_in_bf16", NON_NEGATIVE),
    # parallelism (MaxText's ici/dcn sizes: -1 fills the remaining devices, 0 is refused by the
    # MaxText mesh rule)
    **_all("tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size "
           "expert_model_parallel_size expert_tensor_parallel_size "
           "num_distributed_optimizer_instances", POSITIVE),
    **{f"{level}_{axis}_parallelism": FILL for level in ("ici", "dcn") for axis in _MESH_AXES},
    **_all("distributed_timeout_minutes ddp_num_buckets ddp_bucket_size "
           "check_weight_hash_across_dp_replicas_interval suggested_communication_unit_size",
           POSITIVE),
    # run length, batches, exits (exit_* 0 is off, as in Megatron)
    **_all("train_samples train.epochs micro_batch_size global_batch_size "
           "train.gradient_accumulation_steps num_epoch make_vocab_size_divisible_by "
           "seq_length", POSITIVE),
    "train_iters": FILL,      # MaxText's steps -1: learning_rate_schedule_steps; 0: no steps
    "per_device_batch_size": ABOVE_ZERO, "rampup_batch_size": NON_NEGATIVE,
    **_all("exit_duration_in_mins exit_interval manual_gc_interval", NON_NEGATIVE),
    **_all("seed data.seed", SEED),
    "train.spike_z_threshold": ABOVE_ZERO,
    # validation: eval_interval 0 is off (MaxText's base.yml writes -1 for off); eval_iters -1
    # is MaxText's whole split
    **_all("eval_interval eval_iters", FILL),
    "data.eval_samples": POSITIVE, "eval_per_device_batch_size": NON_NEGATIVE,
    # optimizer
    **_all("adam_beta1 adam_beta2 sgd_momentum muon_momentum optimizer_offload_fraction",
           FRACTION),
    **_all("adam_eps muon_extra_scale_factor", ABOVE_ZERO),
    **_all("adam_eps_root weight_decay start_weight_decay end_weight_decay clip_grad",
           NON_NEGATIVE),
    "muon_num_ns_steps": POSITIVE,
    # learning-rate schedule
    **_all("lr min_lr decoupled_lr decoupled_min_lr lr_warmup_init lr_warmup_iters "
           "lr_warmup_samples lr_warmup_offset", NON_NEGATIVE),
    **_all("lr_decay_iters lr_decay_samples lr_wsd_decay_iters lr_wsd_decay_samples",
           POSITIVE),
    **_all("lr_warmup_fraction learning_rate_final_fraction wsd_decay_steps_fraction", FRACTION),
    # loss and data loading (grain worker counts: -1 picks one automatically)
    "memory.loss_num_chunks": POSITIVE,
    **_all("num_workers grain_shuffle_buffer_size", NON_NEGATIVE),
    "num_dataset_builder_threads": POSITIVE, "reuse_example_batch": NON_NEGATIVE,
    **_all("grain_worker_count grain_worker_count_eval expansion_factor_real_data", FILL),
    # checkpoints (save_interval 0 saves only at exits and the end, as in Megatron)
    **_all("save_interval train.keep_checkpoints ckpt_step", NON_NEGATIVE),
    **_all("save_retain_interval non_persistent_save_interval", POSITIVE),
    # logging, profiling, stragglers
    **_all("log_interval log_avg_reset_interval tensorboard_log_interval tensorboard_queue_size "
           "profiler_steps straggler_minmax_count use_rocm_mem_info_iters", POSITIVE),
    **_all("log_avg_skip_iterations logging_level logging.health_tier2_every "
           "logging.health_tier3_every logging.rl_entropy_floor profile_ranks "
           "profile_step_start profile_step_end skip_first_n_steps_for_profiler", NON_NEGATIVE),
    "timing_log_level": (0, 2),
}

# Knobs whose value must name an existing file or folder, checked as the config resolves.
# Empty on purpose: an input is checked by the dry run where the run reads it, with the key
# named (the data plan: tokenizer, vocab/merge files, data files, globs, args files and the OLMo
# index; the validation plan; the checkpoints a restore reads), so that a config naming another
# machine's files (the upstream corpus, a file being inspected) still resolves, and a path the
# run does not read (a tokenizer beside mock data) stops nothing. Outputs (save,
# tensorboard_dir, ...) are created by the run.
EXISTING_PATHS: frozenset[str] = frozenset()


def bounds(key: str) -> dict:
    """The Knob fields this table sets for ``key``."""
    low, high = RANGES.get(key, (None, None))
    return {"low": low, "high": high, "existing_path": key in EXISTING_PATHS}
