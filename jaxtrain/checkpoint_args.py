"""Settings taken from the checkpoint a run restores, before the model is built.

Megatron's ``use_checkpoint_args`` (``load_args_from_checkpoint``) reads the arguments stored
in the checkpoint and overwrites the run's model-shape arguments with them;
``use_mp_args_from_checkpoint_args`` adds the model-parallel sizes and
``use_tokenizer_model_from_checkpoint_args`` (on by default) the tokenizer. A jaxtrain
checkpoint stores the resolved config in its meta, so :func:`checkpoint_overrides` turns those
stored values into ``key=value`` overrides that the caller appends to the command line and
resolves again (``jaxtrain.train`` does so once it knows the device count).

As in Megatron, a *forced* knob always takes the checkpoint's value; an unforced one only when
this config leaves it at its default (Megatron: "when the argument is None"). The same pass
adopts the checkpoint's LR-schedule knobs under ``use_checkpoint_opt_param_scheduler`` when
the run resumes its train state (not for a finetune, which starts the schedule afresh).
"""
from __future__ import annotations

import json
import logging

from jaxtrain.checkpoint import Checkpointer, schedule_policy, schedule_settings
from jaxtrain.config.resolved import is_default
from jaxtrain.config.rules import DERIVED
from jaxtrain.logs import run_dir

log = logging.getLogger("jaxtrain.checkpoint")

# (knob, forced) in Megatron's order; knobs jaxtrain lacks are left out, and jaxtrain's own
# shape knobs (qk_layernorm, the other activation switches, norm and RoPE details) join the
# forced ones, since the stored weights mean nothing without them.
MODEL_ARGS = (
    ("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False),
    ("seq_length", False), ("num_attention_heads", False), ("num_query_groups", True),
    ("group_query_attention", True), ("kv_channels", False),
    ("max_position_embeddings", False), ("position_embedding_type", True),
    ("use_rotary_position_embeddings", True), ("rotary_base", True), ("rotary_percent", True),
    ("rotary_interleaved", True), ("add_bias_linear", True), ("add_qkv_bias", True),
    ("squared_relu", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
    ("apply_layernorm_1p", True), ("normalization", True),
    ("apply_query_key_layer_scaling", True), ("attention_dropout", True),
    ("hidden_dropout", True), ("num_experts", True), ("moe_layer_freq", True),
    ("moe_ffn_hidden_size", True), ("moe_router_topk", True),
    ("moe_token_dispatcher_type", False), ("moe_router_pre_softmax", True),
    ("moe_grouped_gemm", True), ("moe_shared_expert_intermediate_size", True),
    ("moe_router_load_balancing_type", True), ("moe_aux_loss_coeff", True),
    ("moe_router_score_function", True), ("moe_router_enable_expert_bias", True),
    ("moe_router_topk_scaling_factor", True), ("tiktoken_pattern", True),
    ("vocab_size", False), ("make_vocab_size_divisible_by", False),
    # jaxtrain's additions
    ("qk_layernorm", True), ("qk_l2_norm", True), ("quick_geglu", True),
    ("openai_gelu", True), ("norm_epsilon", True), ("use_rope_scaling", True),
    ("rope_scaling_factor", True), ("rope_type", True),
    ("original_max_position_embeddings", True), ("rotary_seq_len_interpolation_factor", True),
    ("sliding_window_size", True), ("attn_logit_softcapping", True),
    ("final_logit_softcapping", True), ("apply_residual_connection_post_layernorm", True),
    ("multi_latent_attention", True), ("q_lora_rank", True), ("kv_lora_rank", True),
    ("qk_head_dim", True), ("qk_pos_emb_head_dim", True), ("v_head_dim", True),
    ("attention_output_gate", True), ("no_rope_freq", True), ("window_attn_skip_freq", True),
    ("post_attention_norm", True), ("post_mlp_norm", True), ("pre_norm", True),
    ("qk_norm_across_heads", True), ("embedding_multiplier", True),
    ("query_pre_attn_scalar", True), ("local_rotary_base", True), ("parallel_residual", True),
    ("residual_multiplier", True), ("logits_scaling", True), ("global_kv_channels", True),
    ("global_num_query_groups", True), ("attention_k_eq_v", True),
    ("global_rotary_percent", True), ("v_norm", True), ("layer_scalar", True),
    ("experimental_attention_variant", True), ("linear_attention_freq", True),
    ("linear_conv_kernel_dim", True), ("linear_key_head_dim", True),
    ("linear_value_head_dim", True), ("linear_num_key_heads", True),
    ("linear_num_value_heads", True),
    # hybrid models: the layer pattern and the Mamba-2 shapes
    ("model_type", True), ("is_hybrid_model", True), ("hybrid_layer_pattern", True),
    ("hybrid_attention_ratio", True), ("hybrid_mlp_ratio", True), ("mamba_state_dim", True),
    ("mamba_head_dim", True), ("mamba_num_groups", True), ("mamba_num_heads", True),
    ("mamba_conv_kernel_dim", True), ("mamba_norm_epsilon", True),
    ("mamba_time_step_floor", True),
)
TOKENIZER_ARGS = (("tokenizer_model", True), ("tokenizer_type", True))
MP_ARGS = (("tensor_model_parallel_size", True), ("pipeline_model_parallel_size", True),
           ("virtual_pipeline_model_parallel_size", True),
           ("num_layers_per_virtual_pipeline_stage", False),
           ("expert_model_parallel_size", True))


def _chosen(cfg, key) -> bool:
    """Set by a preset, file or the command line (a default or a derived value is not)."""
    return not is_default(cfg.origin(key)) and cfg.origin(key) != DERIVED


def _take(cfg, saved: dict, knobs) -> dict:
    out = {}
    for key, forced in knobs:
        if key not in saved or key not in cfg or saved[key] is None and not forced:
            continue
        if not forced and _chosen(cfg, key):
            continue
        if saved[key] != cfg[key]:
            out[key] = saved[key]
    return out


def checkpoint_overrides(cfg, run_directory=None) -> list[str]:
    """``key=value`` overrides from the checkpoint ``cfg`` will restore (the one
    :meth:`Checkpointer.plan` picks), for use_checkpoint_args (with
    use_mp_args_from_checkpoint_args / use_tokenizer_model_from_checkpoint_args) and
    use_checkpoint_opt_param_scheduler; empty when none of them is on or there is no
    checkpoint. Resolve the config again with these appended to the command line."""
    use_args = bool(cfg.get("use_checkpoint_args"))
    adopt_schedule = schedule_policy(cfg) == "checkpoint"
    if not use_args and not adopt_schedule:
        return []
    if run_directory is None:
        run_directory = run_dir(cfg)
    ckpt = Checkpointer.from_config(cfg, run_directory)
    try:
        plan = ckpt.plan()
        if plan is None:
            log.info("no checkpoint to take settings from; using the config's")
            return []
        root, step, mode = plan
        meta = ckpt.read_meta(root, step)
    finally:
        ckpt.close()
    where = ckpt.where(root, step)
    saved = meta.get("config") or {}
    values = {}
    if use_args:
        if not saved:
            log.warning("checkpoint %s stores no config; using the config's settings", where)
        values.update(_take(cfg, saved, MODEL_ARGS))
        if cfg.get("use_tokenizer_model_from_checkpoint_args"):
            values.update(_take(cfg, saved, TOKENIZER_ARGS))
        if cfg.get("use_mp_args_from_checkpoint_args"):
            values.update(_take(cfg, saved, MP_ARGS))
    if adopt_schedule and mode == "full":
        stored = meta.get("schedule") or (schedule_settings(saved) if saved else {})
        here = schedule_settings(cfg)
        values.update({k: v for k, v in stored.items() if k in here and here[k] != v})
    for key, value in values.items():
        log.info("%s = %r from checkpoint %s (was %r)", key, value, where, cfg.get(key))
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]
