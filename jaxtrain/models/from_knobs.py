"""The flat knobs -> :class:`~jaxtrain.models.config.ModelConfig` translation.

:func:`build` is what ``ModelConfig.from_config`` runs. It reads canonical knobs only: it
completes the mapping with the registry's defaults first (:func:`jaxtrain.config.complete`; a
resolved Config is complete already) and has no defaults of its own. The dialects have done
their part by then (config/dialects and config/rules.py: aliases, MaxText's blocks and YaRN keys,
Megatron's precision switches into ``dtype``); what is left here is how knobs of several systems
become one model field:

- the attention implementation from every knob that names a kernel (:func:`_attention_choice`;
  those naming one must agree), and the softmax precision Megatron and MaxText ask for;
- the MLP activation from Megatron's switches or MaxText's ``mlp_activations``
  (:mod:`jaxtrain.config.activations`), GPT-OSS's clamped GLU in MoE experts;
- RoPE from Megatron's knobs and MaxText's timescales, YaRN's correction range;
- the sliding window and sink attention of Primus and Megatron-LM, multi-latent attention;
- remat from MaxText's ``remat_policy`` or Megatron's ``recompute_*`` (:func:`_recompute`);
- the MoEConfig of Megatron's MoE knobs (:func:`_moe_config`).

Problems name the knob: a ModelConfig or MoEConfig check on a field read from a knob of another
name is reported under the knob's name (:func:`_knob_message`, :func:`_moe_knob_message`).
The checks on the model's own fields are ModelConfig's and MoEConfig's; the ones here are about
knobs that do not reach the model as they are (``recompute_granularity``, ``window_size``, ...).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

from jaxtrain.config import complete
from jaxtrain.config.activations import megatron_activation, mlp_from_activations
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.patterns import PRIMUS_SPECS, dsa_shared_pattern, spec_name
from jaxtrain.models.moe.config import MoEConfig, moe_pattern, parse_layer_freq
from jaxtrain.models.spec import linear_pattern, window_pattern
from jaxtrain.quant.config import from_config as quant_config


def _cp_comm_type(cfg) -> str | tuple[str, ...] | None:
    """Megatron's cp_comm_type when context_parallel_size > 1: one kind, or one per layer."""
    if (cfg["context_parallel_size"] or 1) <= 1:
        return None
    kind = cfg["cp_comm_type"]
    if not isinstance(kind, list | tuple):
        return kind   # the registry spells all_gather as allgather
    kinds = tuple("allgather" if k == "all_gather" else k for k in kind)
    if len(kinds) == 1:   # Megatron: one kind listed serves every layer
        return kinds[0]
    if len(kinds) != cfg["num_layers"]:
        raise ConfigError(f"cp_comm_type lists {len(kinds)} kinds for {cfg['num_layers']} "
                          f"layers (num_layers); give one per layer or a single kind")
    return kinds[0] if len(set(kinds)) == 1 else kinds


def _cp_a2a_size(cfg) -> int | None:
    """The all-to-all level of hierarchical CP (a2a+p2p): the first of
    hierarchical_context_parallel_sizes."""
    sizes = cfg.get("hierarchical_context_parallel_sizes")
    kind = cfg["cp_comm_type"]
    used = "a2a+p2p" in (kind if isinstance(kind, list | tuple) else [kind])
    return sizes[0] if used and sizes and (cfg["context_parallel_size"] or 1) > 1 else None


def _cp_reorder(cfg) -> str | None:
    """MaxText's context_parallel_load_balance / _reorder_strategy (auto: Megatron's dual chunk
    swap, which Megatron always uses)."""
    if not cfg["context_parallel_load_balance"]:
        return None
    kind = cfg["context_parallel_reorder_strategy"]
    return "dual_chunk_swap" if kind == "auto" else kind


def build(cls, cfg: Mapping[str, Any], accelerator: Callable[[], str]):
    """``cls`` (ModelConfig) from a flat config of canonical knobs; ``accelerator()`` names
    the device kind the quantization is for ('cuda', 'rocm', 'cpu').

    A Megatron ``recompute_granularity`` wins over ``remat_policy``. The attention
    implementation comes from the knobs of every dialect that name a kernel (see
    `_attention_choice`); those naming one must agree. Megatron's ``attention_softmax_in_fp32``
    is read only when a Megatron knob picked the unfused (xla) path, as in Megatron, whose fused
    kernels always work in fp32.
    """
    cfg = complete(cfg)
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    groups = cfg["num_query_groups"] if cfg["group_query_attention"] else None
    if cfg["mlp_activations"] is not None:    # what no Megatron switch names (see activations)
        try:
            activation, gated = mlp_from_activations(cfg["mlp_activations"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        activation, gated = megatron_activation(cfg)

    vocab = cfg["vocab_size"]
    if vocab is None:
        raise ValueError("vocab_size is unset; set it or let the tokenizer supply it")
    multiple = cfg["make_vocab_size_divisible_by"] * cfg["tensor_model_parallel_size"]
    vocab = int(math.ceil(vocab / multiple) * multiple)

    pos = cfg["position_embedding_type"]
    if cfg["use_rotary_position_embeddings"]:
        pos = "rope"
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(
        str(cfg["normalization"]).lower(), cfg["normalization"])
    dtype = cfg["dtype"]   # config/rules.py derives it from Megatron's bf16/fp16 switches

    attention_impl, chosen_by, megatron_unfused = _attention_choice(cfg)
    softmax_fp32 = (cfg["attention_softmax_in_fp32"] or not megatron_unfused
                    or cfg["apply_query_key_layer_scaling"])
    f32_product, f32_logits = cfg["float32_qk_product"], cfg["float32_logits"]
    if cfg["attention"] == "dot_product" and not megatron_unfused and (
            f32_product is not None or f32_logits is not None):
        # MaxText's dot_product attention (its knobs set, as in every MaxText file) keeps
        # scores and softmax in the compute dtype unless float32_qk_product (an fp32
        # product, hence fp32 scores) or float32_logits asks for float32.
        softmax_fp32 = bool(f32_product or f32_logits or cfg["apply_query_key_layer_scaling"])

    remat, method, nlayers, layer_ids, modules = _recompute(cfg)
    if cfg["moe_layer_recompute"]:   # Megatron: selective recompute of the MoE block
        if cfg["recompute_granularity"] == "full":
            raise ConfigError("moe_layer_recompute recomputes the MoE block selectively; it "
                              "cannot be combined with recompute_granularity full")
        modules = tuple(modules) + ("moe",)
    custom = tuple((name, cfg[name]) for name in _REMAT_TENSOR_NAMES if cfg[name] is not None)
    mla = bool(cfg["multi_latent_attention"])
    rope_type = cfg["rope_type"] or ("yarn" if mla else "rope")   # Megatron: MLA takes yarn
    hidden_dropout, attention_dropout = (float(cfg["hidden_dropout"]),
                                         float(cfg["attention_dropout"]))
    if cfg["enable_dropout"] is False:    # MaxText: no dropout anywhere
        hidden_dropout = attention_dropout = 0.0

    hybrid = _hybrid_fields(cfg)
    depths = hybrid.pop("mtp_num_layers", None)   # a hybrid pattern's MTP depths (Megatron
    mtp = _mtp_fields(cfg if depths is None else {**cfg, "mtp_num_layers": depths})   # infers)
    fields = dict(
        num_layers=cfg["num_layers"], hidden_size=h, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=cfg["kv_channels"],
        ffn_hidden_size=cfg["ffn_hidden_size"], vocab_size=vocab,
        max_position_embeddings=cfg["max_position_embeddings"] or cfg["seq_length"],
        position_embedding_type=pos, rotary_percent=float(cfg["rotary_percent"]),
        rotary_interleaved=cfg["rotary_interleaved"], **_rope_fields(cfg, rope_type),
        yarn_scaling_factor=float(cfg["rotary_scaling_factor"]),
        yarn_mscale=float(cfg["mscale"]), yarn_mscale_all_dim=float(cfg["mscale_all_dim"]),
        **_yarn_range(cfg),
        normalization=norm, norm_epsilon=float(cfg["norm_epsilon"]),
        apply_layernorm_1p=cfg["apply_layernorm_1p"],
        qk_layernorm=cfg["qk_layernorm"] or hybrid.pop("qk_layernorm", False),
        qk_l2_norm=cfg["qk_l2_norm"],
        activation=activation, gated_linear_unit=gated,
        add_bias_linear=cfg["add_bias_linear"],
        add_qkv_bias=cfg["add_qkv_bias"] or (cfg["add_bias_linear"] and not mla),
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
        untie_embeddings_and_output_weights=cfg["untie_embeddings_and_output_weights"],
        fp32_residual_connection=cfg["fp32_residual_connection"],
        apply_residual_connection_post_layernorm=cfg["apply_residual_connection_post_layernorm"],
        init_method_std=float(cfg["init_method_std"]),
        init_method_xavier_uniform=cfg["init_method_xavier_uniform"],
        apply_query_key_layer_scaling=cfg["apply_query_key_layer_scaling"],
        attention_softmax_in_fp32=softmax_fp32,
        **_sink_fields(cfg), **_mla_fields(cfg), **_dsa_fields(cfg), **_linear_fields(cfg),
        **_nope_fields(cfg), **_hyper_fields(cfg), glu_clamp=_glu_clamp(cfg),
        attention_output_dim=(cfg["attention_output_dim"]
                              if cfg["attention_output_dim"] > 0 else None),
        **hybrid, **mtp, **_short_conv_fields(cfg),
        attention_output_gate=cfg["attention_output_gate"],
        final_logit_softcapping=cfg["final_logit_softcapping"] or None,
        attn_logit_softcapping=cfg["attn_logit_softcapping"] or None,
        embedding_multiplier=cfg["embedding_multiplier"],
        normalize_embedding_logits=bool(cfg["normalize_embedding_logits"])
        and not cfg["untie_embeddings_and_output_weights"],
        post_attention_norm=cfg["post_attention_norm"], post_mlp_norm=cfg["post_mlp_norm"],
        pre_norm=cfg["pre_norm"], qk_norm_across_heads=cfg["qk_norm_across_heads"],
        parallel_residual=bool(cfg["parallel_residual"]),
        parallel_shared_norm=bool(cfg["parallel_residual_shared_norm"]),
        residual_multiplier=float(cfg["residual_multiplier"]),
        logits_scaling=float(cfg["logits_scaling"]),
        query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
        local_rotary_base=cfg["local_rotary_base"],
        global_kv_channels=cfg["global_kv_channels"],
        global_num_query_groups=cfg["global_num_query_groups"],
        attention_k_eq_v=bool(cfg["attention_k_eq_v"]),
        global_rotary_percent=cfg["global_rotary_percent"], v_norm=cfg["v_norm"],
        layer_scalar=bool(cfg["layer_scalar"]),
        per_layer_input_size=int(cfg["hidden_size_per_layer_input"] or 0),
        per_layer_vocab_size=cfg["vocab_size_per_layer_input"] or None,
        kv_shared_layers=int(cfg["num_kv_shared_layers"] or 0),
        double_wide_shared_mlp=bool(cfg["use_double_wide_mlp"]),
        linear_short_conv=bool(cfg["use_short_conv"]),
        attention_impl=attention_impl, cp_comm_type=_cp_comm_type(cfg),
        cp_a2a_size=_cp_a2a_size(cfg), cp_reorder=_cp_reorder(cfg),
        dtype=dtype, weight_dtype=_weight_dtype(cfg, dtype),
        quant=quant_config(cfg, accelerator()),
        quantize_kvcache=cfg["quantize_kvcache"],
        kv_quant_axis=cfg["kv_quant_axis"] or "", kv_quant_dtype=cfg["kv_quant_dtype"],
        logits_dot_in_fp32=cfg["logits_dot_in_fp32"], use_iota_embed=cfg["use_iota_embed"],
        scan_layers=cfg["scan_layers"], param_scan_axis=cfg["param_scan_axis"],
        remat_policy=remat, remat_tensors=custom, recompute_method=method,
        recompute_num_layers=nlayers, recompute_layer_ids=layer_ids, recompute_modules=modules,
        moe=_moe_config(cfg),
    )
    fields.update(_v4_fields(cfg))   # DeepSeek-V4's window, sinks and heads win
    fields.update(_k3_fields(cfg, fields))
    _check_expert_activation(cfg, fields["moe"], fields["num_layers"])
    try:
        return cls(**fields)
    except ConfigError as e:
        raise ConfigError([f"{p} ({attention_impl!r} was chosen by {chosen_by}.)"
                           for p in e.problems]) from None
    except ValueError as e:
        raise ValueError(_knob_message(str(e))) from None


def _linear_fields(cfg) -> dict:
    """Gated DeltaNet layers (experimental_attention_variant gdn; Kimi Delta Attention with
    linear_attention_kind kda) placed as Megatron's linear_attention_freq says: N makes every
    N-th layer softmax attention and the others linear; a 0/1 list (or its string form) marks
    each layer, 1 = linear."""
    variant = cfg["experimental_attention_variant"]
    if variant not in ("gdn", "gated_delta_net"):
        if cfg["linear_attention_kind"] != "gdn":
            raise ConfigError(f"linear_attention_kind {cfg['linear_attention_kind']} picks the "
                              "kind of the linear-attention layers, and there are none: set "
                              "experimental_attention_variant gdn and linear_attention_freq")
        return {}
    freq, n = cfg["linear_attention_freq"], cfg["num_layers"]
    if freq is None:
        raise ConfigError(f"experimental_attention_variant {variant} needs "
                          "linear_attention_freq: which layers are linear attention (N: every "
                          "N-th layer is softmax attention; or a 0/1 list, 1 = linear)")
    try:
        pattern = linear_pattern(parse_layer_freq(freq), n)
    except ValueError as e:
        raise ConfigError(f"linear_attention_freq: {e}") from None
    return dict(linear_attention_layers=pattern,
                **{k: cfg[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_num_key_heads",
                                       "linear_num_value_heads")},
                linear_chunk_size=cfg["gdn_chunk_size"],
                linear_qk_l2_norm=cfg["use_qk_norm_in_gdn"],
                linear_attention_impl=cfg["linear_attention_impl"],
                linear_attention_kind=cfg["linear_attention_kind"])


def pattern_from_ratios(n: int, attention: float, mlp: float) -> str:
    """Megatron's hybrid layer allocation from ratios: round(n·attention) attention layers
    spread evenly between Mamba runs (the pattern starts and ends with Mamba), then
    round(n·mlp) of the Mamba layers turned into MLP layers, spread evenly."""
    if not (0 <= attention <= 1 and 0 <= mlp <= 1 and attention + mlp <= 1):
        raise ConfigError(f"hybrid_attention_ratio {attention} and hybrid_mlp_ratio {mlp} must "
                          "be in [0, 1] with a sum of at most 1")
    kinds = ["M"] * n
    n_attn = round(n * attention)
    mamba = n - n_attn
    section = mamba / (n_attn + 1)
    x = section
    for i in range(n):
        if x < 0.5:
            kinds[i] = "*"
            x += section
        else:
            x -= 1
    n_mlp = round(n * mlp)
    if n_mlp:
        ratio = (mamba - n_mlp) / n_mlp
        x = ratio
        for i in range(n):
            if kinds[i] == "M":
                if x < 0.5:
                    kinds[i] = "-"
                    x += ratio
                else:
                    x -= 1
    return "".join(kinds)


def primus_hybrid_pattern(n: int, attention: float) -> str:
    """Primus's HybridStack allocation (its hybrid_mamba_mla_layer_specs stacks, used when no
    pattern is given): n/2 mixer + MLP pairs, int(n/2 · ratio) of them attention; below half,
    each attention pair leads a block of its share of Mamba pairs and the spare Mamba pairs
    close the list; above half, the spare attention pairs open it. hybrid_mlp_ratio is not
    read (every mixer is followed by an MLP)."""
    half = n // 2
    n_attn = int(half * attention)
    n_mamba = half - n_attn
    if n_attn == 0:
        return "M-" * half
    if attention <= 0.5:
        return ("*-" + "M-" * (n_mamba // n_attn)) * n_attn + "M-" * (n_mamba % n_attn)
    return "*-" * (n_attn - n_mamba) + "*-M-" * n_mamba


def _hybrid_fields(cfg) -> dict:
    """Megatron's hybrid models (model_type mamba or hybrid, is_hybrid_model, or a
    hybrid_layer_pattern): one layer per symbol of hybrid_layer_pattern, else of the pattern
    the ratios allocate (Megatron's, or Primus's for its hybrid_mamba_mla_layer_specs stacks);
    Primus's ``spec`` says what its M layers are."""
    pattern, spec = cfg["hybrid_layer_pattern"], cfg["spec"]
    hybrid = cfg["model_type"] in ("mamba", "hybrid") or cfg["is_hybrid_model"] or pattern
    name = spec_name(spec)
    if not hybrid:
        if spec is not None:
            raise ConfigError(f"spec = {spec!r} names a PyTorch module spec; jaxtrain models are "
                              "JAX functions chosen by the model knobs (only the hybrid stacks "
                              "of model_type mamba are read): remove it")
        return {}
    if spec is not None and name not in PRIMUS_SPECS:
        raise ConfigError(f"spec = {spec!r}: jaxtrain reads the hybrid stack specs "
                          f"{sorted(PRIMUS_SPECS)} (what the M layers are); remove it for "
                          "Megatron's Mamba-2 layers")
    n = cfg["num_layers"]
    primus_stack = spec is not None and "hybrid_mamba_mla_layer_specs" in str(spec)
    if pattern is None and primus_stack:
        pattern = primus_hybrid_pattern(n, float(cfg["hybrid_attention_ratio"]))
    elif pattern is None:
        pattern = pattern_from_ratios(n, float(cfg["hybrid_attention_ratio"]),
                                      float(cfg["hybrid_mlp_ratio"]))
    main, mtp = _mtp_pattern(str(pattern), cfg)
    if "|" in main and (cfg["pipeline_model_parallel_size"] or 1) > 1:
        raise ConfigError(f"hybrid_layer_pattern {pattern!r}: its '|' pipeline cuts are not "
                          "followed (jaxtrain cuts stages by layer counts); remove them")
    main = main.replace("|", "")
    if "D" in main:   # DeepSeek sparse attention layers: every attention layer of the model
        if "+" in main or "*" in main:
            raise ConfigError(f"not implemented yet: hybrid_layer_pattern {pattern!r} mixes DSA "
                              "(D) with other attention layers; jaxtrain gives DeepSeek sparse "
                              "attention to every attention layer of a model")
        if not (cfg["multi_latent_attention"]
                and cfg["experimental_attention_variant"] == "dsa"):
            raise ConfigError(f"hybrid_layer_pattern {pattern!r}: 'D' (DSA) layers need "
                              "multi_latent_attention and experimental_attention_variant dsa "
                              "(with its dsa_indexer_* sizes), as in Megatron")
        if (cfg["dsa_indexer_topk_freq"] or 1) > 1:
            raise ConfigError(f"not implemented yet: dsa_indexer_topk_freq "
                              f"{cfg['dsa_indexer_topk_freq']} with the hybrid stack's DSA "
                              f"layers ({pattern!r})")
        main = main.replace("D", "*")
    if "+" in main:   # Megatron's MLA symbol; jaxtrain builds one attention kind per model
        if "*" in main or not cfg["multi_latent_attention"]:
            raise ConfigError(f"hybrid_layer_pattern {pattern!r}: '+' (MLA) layers need "
                              "multi_latent_attention and no '*' layers beside them")
        main = main.replace("+", "*")
    if len(main) != n:
        raise ConfigError(f"hybrid_layer_pattern {pattern!r} names {len(main)} layers and "
                          f"num_layers is {n}; they must agree")
    linear = spec is not None and PRIMUS_SPECS[name] in "GK"   # M slots: GDN or KDA layers
    if linear:
        main = main.replace("M", "G")
    if mtp is not None:
        mtp_pattern, depths = mtp
        if "+" in mtp_pattern and cfg["multi_latent_attention"]:
            mtp_pattern = mtp_pattern.replace("+", "*")
        if linear:
            mtp_pattern = mtp_pattern.replace("M", "G")
        bad = sorted(set(mtp_pattern) - set("M*G-E"))
        if bad:
            raise ConfigError(f"hybrid_layer_pattern {pattern!r}: the MTP layers after '/' "
                              f"use {bad}; jaxtrain builds M, *, G, - and E there")
    out = dict(hybrid_layers=main,
               **{k: cfg[k] for k in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                                      "mamba_num_heads", "mamba_chunk_size",
                                      "mamba_conv_kernel_dim", "mamba_norm_epsilon")},
               mamba_dt_floor=float(cfg["mamba_time_step_floor"]),
               mamba_state_dtype={"fp32": "float32", "bf16": "bfloat16"}.get(
                   cfg["mamba_training_ssm_states_dtype"]))
    if mtp is not None:
        out.update(mtp_hybrid_layers=mtp_pattern, mtp_num_layers=depths)
    if "G" in main + (out.get("mtp_hybrid_layers") or ""):
        out.update({k: cfg[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                        "linear_value_head_dim", "linear_num_key_heads",
                                        "linear_num_value_heads")},
                   linear_chunk_size=cfg["gdn_chunk_size"],
                   linear_qk_l2_norm=cfg["use_qk_norm_in_gdn"],
                   linear_attention_impl=cfg["linear_attention_impl"])
    if spec is not None and PRIMUS_SPECS[name] == "K":
        out.update(_primus_kda(cfg, name))
    if spec is not None and cfg["multi_latent_attention"]:
        out["qk_layernorm"] = True   # Primus's hybrid MLA spec norms both latents always
    return out


def _primus_kda(cfg, name: str) -> dict:
    """Primus's hybrid KDA layer (FLA's KDA): the decay's bottleneck as wide as a value head,
    a bias on the output gate's up projection, the convolution and the q/k L2 norm always on
    (Primus reads neither use_short_conv nor use_qk_norm_in_gdn there)."""
    for key in ("use_short_conv", "use_qk_norm_in_gdn"):
        if not cfg[key]:
            raise ConfigError(f"{key} false: Primus's KDA layers ({name}) always convolve and "
                              "L2-normalise q and k; remove it")
    return dict(linear_attention_kind="kda", kda_decay_rank=cfg["linear_value_head_dim"],
                kda_gate_bias=True)


def _mtp_pattern(pattern: str, cfg) -> tuple[str, tuple[str, int] | None]:
    """(the main pattern, (the MTP pattern, its depths) or None) of a unified
    hybrid_layer_pattern "main/mtp/mtp..." (Megatron's: every depth the same pattern; the
    depths set mtp_num_layers). The legacy mtp_hybrid_override_pattern joins it as Megatron
    converts it: one copy per mtp_num_layers."""
    legacy, depth = cfg["mtp_hybrid_override_pattern"], cfg["mtp_num_layers"] or 0
    if legacy and depth and "/" not in pattern:
        pattern = pattern + "/" + "/".join([legacy] * depth)
    main, *mtp = pattern.split("/")
    if not any(mtp):
        return main, None
    if len(set(mtp)) > 1:
        raise ConfigError(f"hybrid_layer_pattern {pattern!r}: every MTP depth after '/' must "
                          f"have the same pattern (Megatron's rule); got {mtp}")
    return main, (mtp[0], len(mtp))


def _short_conv_fields(cfg) -> dict:
    """LFM2's layer kinds (Primus's lfm_layer_types: conv or full_attention per layer)."""
    kinds = cfg["lfm_layer_types"]
    if kinds is None:
        return {}
    bad = sorted(set(kinds) - {"conv", "full_attention"})
    if bad:
        raise ConfigError(f"lfm_layer_types: {bad} are not layer kinds; use conv (a gated short "
                          "convolution) or full_attention")
    return dict(short_conv_layers=tuple(k == "conv" for k in kinds),
                short_conv_kernel=int(cfg["conv_L_cache"]),
                short_conv_bias=bool(cfg["conv_bias"]))


def _mtp_fields(cfg) -> dict:
    """Megatron's multi-token prediction: the depths (None or 0: off), their loss weight, one
    module for every depth (refused when that module would be an MoE layer)."""
    depth = cfg["mtp_num_layers"] or 0
    if not depth:
        return {}
    return dict(mtp_num_layers=int(depth),
                mtp_loss_scaling_factor=float(cfg["mtp_loss_scaling_factor"]),
                mtp_repeated_layer=bool(cfg["mtp_use_repeated_layer"]))


def _nope_fields(cfg) -> dict:
    """Llama 4's layers: NoPE layers as Megatron's no_rope_freq says (N: every N-th layer skips
    RoPE; a 0/1 list, 1 = skip), q/k norms on the RoPE layers only, chunked attention on the
    RoPE layers (MaxText's chunk_attn_window_size) and temperature tuning on the NoPE ones."""
    out = dict(qk_norm_rope_layers_only=bool(cfg["qk_norm_rope_layers_only"]),
               attention_chunk_size=cfg["chunk_attn_window_size"] or None,
               attn_temperature_tuning=bool(cfg["temperature_tuning"]),
               attn_temperature_scale=float(cfg["temperature_tuning_scale"]),
               attn_temperature_floor_scale=float(cfg["temperature_tuning_floor_scale"]))
    freq, n = cfg["no_rope_freq"], cfg["num_layers"]
    if freq is None:
        return out
    try:
        freq = parse_layer_freq(freq)
    except ValueError as e:
        raise ConfigError(str(e).replace("moe_layer_freq", "no_rope_freq")) from None
    if isinstance(freq, int):
        if freq < 1 or n % freq:
            raise ConfigError(f"no_rope_freq = {freq}: give a positive N dividing num_layers "
                              f"{n} (every N-th layer skips RoPE) or a 0/1 list per layer")
        pattern = tuple((i + 1) % freq == 0 for i in range(n))
    else:
        pattern = tuple(bool(v) for v in freq)
        if len(pattern) != n:
            raise ConfigError(f"no_rope_freq has {len(pattern)} entries for {n} layers "
                              "(num_layers)")
    return {**out, "no_rope_layers": pattern}


# ModelConfig fields read from a knob of another name: a config's problem names the knob.
_FIELD_KNOBS = {"sliding_window": "sliding_window_size", "linear_chunk_size": "gdn_chunk_size",
                "hybrid_layers": "hybrid_layer_pattern", "mamba_dt_floor": "mamba_time_step_floor",
                "mamba_state_dtype": "mamba_training_ssm_states_dtype",
                "mtp_repeated_layer": "mtp_use_repeated_layer",
                "short_conv_kernel": "conv_L_cache", "short_conv_layers": "lfm_layer_types",
                "linear_attention_layers": "linear_attention_freq",
                "sliding_window_layers": "window_attn_skip_freq",
                "yarn_scaling_factor": "rotary_scaling_factor", "yarn_mscale": "mscale",
                "yarn_mscale_all_dim": "mscale_all_dim", "no_rope_layers": "no_rope_freq",
                "attention_chunk_size": "chunk_attn_window_size",
                "attn_temperature_tuning": "temperature_tuning",
                "attn_temperature_scale": "temperature_tuning_scale",
                "attn_temperature_floor_scale": "temperature_tuning_floor_scale",
                "per_layer_input_size": "hidden_size_per_layer_input",
                "per_layer_vocab_size": "vocab_size_per_layer_input",
                "kv_shared_layers": "num_kv_shared_layers",
                "double_wide_shared_mlp": "use_double_wide_mlp",
                "hc_streams": "mhc_expansion_rate / mhc_num_residual_streams",
                "hc_sinkhorn_iters": "sinkhorn_iterations / mhc_sinkhorn_iterations",
                "hc_lite": "enable_mhc_lite", "hc_style": "enable_mhc_connections",
                "linear_short_conv": "use_short_conv",
                "hc_head": "hc_mult", "hc_eps": "hc_eps",
                "glu_clamp": "swiglu_limit / activation_func_clamp_value",
                "attention_output_dim": "attention_output_dim",
                "compress_rotary_base": "compress_rope_theta",
                "compress_index_heads": "index_n_heads",
                "compress_index_head_dim": "index_head_dim",
                "compress_index_topk": "index_topk",
                "compress_index_loss_coeff": "v4_indexer_distill_loss_coeff",
                "compress_index_fp8": "use_v4_fp8_indexer"}


def _knob_message(text: str) -> str:
    """A ModelConfig validation message ("ModelConfig.field: ...") as the config's knob."""
    prefix, sep, rest = text.partition(": ")
    if not sep or not prefix.startswith("ModelConfig."):
        return text
    field = prefix.removeprefix("ModelConfig.")
    return f"{_FIELD_KNOBS.get(field, field)}: {rest}"


# MoEConfig fields (in its messages) -> the Megatron knobs they are read from.
_MOE_KNOBS = {"topk": "moe_router_topk", "num_groups": "moe_router_num_groups",
              "group_topk": "moe_router_group_topk",
              "group_score_topk": "moe_router_group_score_topk",
              "score_function": "moe_router_score_function",
              "drop_policy": "moe_token_drop_policy", "dispatcher": "moe_token_dispatcher_type",
              "force_balancing": "moe_router_force_load_balancing_type",
              "router_dtype": "moe_router_dtype", "aux_loss_coeff": "moe_aux_loss_coeff",
              "pad_to_capacity": "moe_pad_expert_input_to_capacity",
              "load balancing type": "moe_router_load_balancing_type",
              "load balancing types": "moe_router_load_balancing_type",
              "expert bias": "moe_router_enable_expert_bias",
              "capacity factor": "moe_expert_capacity_factor"}
_MOE_WORDS = re.compile(r"(?<![\w.])(" + "|".join(
    re.escape(k) for k in sorted(_MOE_KNOBS, key=len, reverse=True)) + r")(?![\w])")


def _moe_knob_message(text: str) -> str:
    """An MoEConfig problem with its fields named as the knobs they come from."""
    return _MOE_WORDS.sub(lambda m: _MOE_KNOBS[m.group(1)], text.removeprefix("MoEConfig: "))


# Per knob: value -> implementation ("auto": the knob leaves the choice open).
_ATTENTION_SPELLINGS = {
    "attention": {"dot_product": "xla", "flash": "flash", "cudnn_flash_jax": "cudnn",
                  "cudnn_flash_te": "auto", "autoselected": "auto"},
    "attention_backend": {"flash": "flash", "fused": "flash", "unfused": "xla", "local": "xla",
                          "auto": "auto"},
    "use_flash_attn": {True: "auto", False: "xla"},
    "transformer_impl": {"local": "xla", "transformer_engine": "auto",
                         "inference_optimized": "auto"},
    "model.attn_implementation": {"eager": "xla", "sdpa": "auto", "flash_attention_2": "flash"},
}
_MEGATRON_ATTENTION_KNOBS = ("attention_backend", "use_flash_attn", "transformer_impl")


def _attention_choice(cfg: Mapping[str, Any]) -> tuple[str, str, bool]:
    """(attention_impl, the knobs that chose it, whether a Megatron knob asked for unfused).

    Every knob that names a kernel must name the same implementation, whatever its dialect; a
    conflict is a ConfigError naming them. Values meaning "a fused kernel where it fits" name
    none and leave the choice to auto (`auto_attention_impl`: the flash kernel on a GPU): MaxText
    autoselected and cudnn_flash_te (TransformerEngine; the Primus default), Megatron auto,
    use_flash_attn true and transformer_impl transformer_engine, HF sdpa. So every knob's
    default leaves it open. Primus ``use_turbo_attention`` names flash only with
    ``enable_primus_turbo`` on, as in Primus.
    """
    asks = []
    for key, spellings in _ATTENTION_SPELLINGS.items():
        value = cfg[key]
        if value is None:
            continue
        if value not in spellings:
            raise ConfigError(f"{key} = {value!r} is not an attention kernel jaxtrain trains "
                              f"with; use one of {sorted(spellings, key=str)}.")
        asks.append((key, value, spellings[value]))
    if cfg["use_turbo_attention"] and cfg["enable_primus_turbo"]:
        asks.append(("use_turbo_attention", True, "flash"))
    named = [(k, v, impl) for k, v, impl in asks if impl != "auto"]
    impls = {impl for _, _, impl in named}
    if len(impls) > 1:
        raise ConfigError("attention knobs disagree: " + ", ".join(
            f"{k} = {v!r} selects {impl!r}" for k, v, impl in named)
            + ". Set one of them, or make them name the same implementation.")
    if not impls:
        return "auto", "no attention knob naming a kernel (auto)", False
    impl = impls.pop()
    unfused = impl == "xla" and any(k in _MEGATRON_ATTENTION_KNOBS for k, _, _ in named)
    return impl, ", ".join(f"{k} = {v!r}" for k, v, _ in named), unfused


def _rope_fields(cfg: Mapping[str, Any], rope_type: str) -> dict:
    """RoPE fields from Megatron's knobs and MaxText's timescales.

    MaxText's timescales run geometrically from rope_min_timescale m to rope_max_timescale M
    (the rotary_base alias) and rope_linear_scaling_factor s multiplies them: the angle of
    channel pair i is pos / (s m (M/m)^(2i/R)), which is RoPE with base M/m on positions
    divided by s*m. MaxText's llama3.1 rope_type is Llama-3.1 scaling with fixed constants."""
    low, factor = float(cfg["rope_min_timescale"]), float(cfg["rope_linear_scaling_factor"])
    if low <= 0 or factor <= 0:
        raise ConfigError(f"rope_min_timescale ({low}) and rope_linear_scaling_factor ({factor}) "
                          "must be positive")
    interpolation = (cfg["rotary_seq_len_interpolation_factor"] or 1.0) * low * factor
    fields = dict(rotary_base=float(cfg["rotary_base"]) / low,
                  rotary_seq_len_interpolation_factor=(None if interpolation == 1.0
                                                       else interpolation),
                  use_rope_scaling=cfg["use_rope_scaling"],
                  rope_scaling_factor=float(cfg["rope_scaling_factor"]),
                  rope_low_freq_factor=float(cfg["rope_low_freq_factor"]),
                  rope_high_freq_factor=float(cfg["rope_high_freq_factor"]),
                  original_max_position_embeddings=cfg["original_max_position_embeddings"],
                  rope_type=rope_type)
    if rope_type == "llama3.1":
        fields.update(rope_type="rope")
        if cfg["rope_use_scale"]:   # MaxText's constants: factor 8, 1/4, 8192 tokens
            fields.update(use_rope_scaling=True, rope_scaling_factor=8.0,
                          original_max_position_embeddings=8192)
    return fields


def _yarn_range(cfg: Mapping[str, Any]) -> dict:
    """YaRN's correction range (Megatron-LM's yarn_* names; unset: its 32, 1 and rounding)."""
    fast, slow, rounded = (cfg["yarn_beta_fast"], cfg["yarn_beta_slow"],
                           cfg["yarn_correction_range_round_to_int"])
    return dict(yarn_beta_fast=32.0 if fast is None else float(fast),
                yarn_beta_slow=1.0 if slow is None else float(slow),
                yarn_truncate=True if rounded is None else bool(rounded))


def _expert_activation(cfg: Mapping[str, Any]) -> tuple[str | None, float | None]:
    """(MoEConfig.activation, glu_limit): GPT-OSS's clamped GLU is Megatron's quick_geglu with
    glu_linear_offset 1 and activation_func_clamp_value; other offsets or clamps are not built."""
    clamp, offset = cfg["activation_func_clamp_value"], float(cfg["glu_linear_offset"] or 0.0)
    if (clamp is None or not cfg["quick_geglu"]) and not offset:   # plain: see _glu_clamp
        return None, None
    if not (cfg["quick_geglu"] and offset == 1.0 and clamp is not None and clamp > 0):
        raise ConfigError(f"activation_func_clamp_value = {clamp!r} with glu_linear_offset = "
                          f"{offset!r}: jaxtrain builds only GPT-OSS's clamped GLU (quick_geglu, "
                          f"offset 1, a positive clamp), in MoE experts")
    return "swiglu_oai", float(clamp)


def _glu_clamp(cfg: Mapping[str, Any]) -> float | None:
    """ModelConfig.glu_clamp: Megatron's activation_func_clamp_value on a plain gated unit (no
    quick_geglu, no glu_linear_offset) and DeepSeek-V4's swiglu_limit (Primus sets both)."""
    plain = cfg["activation_func_clamp_value"]
    if cfg["quick_geglu"] or cfg["glu_linear_offset"]:
        plain = None
    limit = cfg["swiglu_limit"] or None
    for key, value in (("swiglu_limit", limit), ("activation_func_clamp_value", plain)):
        if value is not None and float(value) <= 0:
            raise ConfigError(f"{key} = {value}: give a positive clamp (or leave it unset: "
                              "none)")
    if plain is not None and limit is not None and float(plain) != float(limit):
        raise ConfigError(f"activation_func_clamp_value = {plain} and swiglu_limit = {limit} both "
                          "clamp the gated units: make them equal or set one")
    value = limit if limit is not None else plain
    return None if value is None else float(value)


def _check_expert_activation(cfg: Mapping[str, Any], moe, num_layers: int) -> None:
    """The clamped GLU exists in the experts only: every layer must be an MoE layer."""
    if _expert_activation(cfg)[0] is None:
        return
    if moe is None or not all(moe_pattern(moe, num_layers)):
        raise ConfigError("GPT-OSS's clamped GLU (activation_func_clamp_value, "
                          "glu_linear_offset) is built in MoE experts only, and this model has "
                          "dense layers (moe_layer_freq)")


def _weight_dtype(cfg: Mapping[str, Any], dtype: str) -> str:
    """The parameters' storage dtype: MaxText's ``weight_dtype``, or the training dtype when
    the optimizer keeps the master weights itself (Megatron ``main_params_dtype`` fp16)."""
    if cfg["use_precision_aware_optimizer"] and cfg["main_params_dtype"] != "fp32":
        return dtype
    return cfg["weight_dtype"]


def _sink_fields(cfg: Mapping[str, Any]) -> dict:
    """Window and sink fields from ``sliding_window_size`` and Primus's sink-attention knobs.

    ``use_sink_attention`` gives every layer a learned sink logit per head. Primus hands
    ``sink_sliding_window`` W to flash-attn as the window (W, 0): W keys back plus the query's
    own, so W + 1 keys here; on the even (0-based) layers with ``sink_window_even_layers_only``,
    else on all. As in Primus both window knobs act only with sinks on, and a model-wide window
    beside them is refused.
    """
    fields = {"sliding_window": cfg["sliding_window_size"] or None,
              "attention_sinks": bool(cfg["use_sink_attention"])}
    sink_window = cfg["sink_sliding_window"] or 0
    if fields["attention_sinks"] and sink_window:
        if fields["sliding_window"]:
            raise ConfigError(f"sliding_window_size = {fields['sliding_window']} and "
                              f"sink_sliding_window = {sink_window} both set a window; sink "
                              "attention takes only sink_sliding_window (as in Primus): set one.")
        fields["sliding_window"] = sink_window + 1
        if cfg["sink_window_even_layers_only"]:
            fields["sliding_window_layers"] = tuple(i % 2 == 0
                                                    for i in range(cfg["num_layers"]))
    megatron = _megatron_window(cfg)
    if megatron:
        if fields["sliding_window"]:
            raise ConfigError(f"window_size = {cfg['window_size']!r} and a window of "
                              f"{fields['sliding_window']} tokens (sliding_window_size or "
                              "sink_sliding_window) both set the sliding window: set one.")
        fields.update(megatron)
    return fields


def _megatron_window(cfg: Mapping[str, Any]) -> dict:
    """Megatron-LM's ``window_size`` (left, right): each token sees ``left`` tokens back and
    itself (left + 1 keys; -1: unbounded), none ahead (a causal model; right 0 or -1), on the
    layers ``window_attn_skip_freq`` picks (1-based layer l is windowed unless N divides l, or
    as a 0/1 per-layer list says; unset: every layer), as ``is_layer_window_attention`` does."""
    size = cfg["window_size"]
    if size is None:
        return {}
    if isinstance(size, str):
        size = [int(v) for v in size.strip("()[] ").split(",") if v.strip()]
    if len(size) != 2 or size[1] not in (0, -1) or size[0] < -1:
        raise ConfigError(f"window_size = {cfg['window_size']!r}: give (left, 0), left tokens "
                          "back (-1: unbounded) and none ahead, as a causal model attends")
    if size[0] == -1:
        return {}
    layers, freq = cfg["num_layers"], cfg["window_attn_skip_freq"]
    if freq is None:
        return {"sliding_window": size[0] + 1}
    try:
        freq = parse_layer_freq(freq)   # the same int / 0-1 list forms as moe_layer_freq
        pattern = window_pattern(freq, layers)
    except ValueError as e:
        raise ConfigError(str(e).replace("moe_layer_freq", "window_attn_skip_freq")) from None
    return {"sliding_window": size[0] + 1, "sliding_window_layers": pattern} if any(
        pattern) else {}


def _mla_fields(cfg: Mapping[str, Any]) -> dict:
    """Multi-latent attention fields when it is switched on."""
    if not cfg["multi_latent_attention"]:
        if cfg["mla_nope"]:
            raise ConfigError("mla_nope leaves multi-latent attention unrotated, and "
                              "multi_latent_attention is off")
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=cfg["q_lora_rank"] or None,
                kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_head_dim"],
                qk_pos_emb_head_dim=cfg["qk_pos_emb_head_dim"], v_head_dim=cfg["v_head_dim"],
                mla_nope=bool(cfg["mla_nope"]),
                mla_latent_norm_epsilon=cfg["mla_latent_norm_epsilon"])


def _dsa_fields(cfg: Mapping[str, Any]) -> dict:
    """DeepSeek sparse attention: Megatron's experimental_attention_variant dsa (dsa_indexer_*
    knobs; the indexer losses of the layers summed) or MaxText's use_indexer (indexer_* knobs;
    averaged over layers, a key norm of epsilon 1e-6 as Flax's LayerNorm)."""
    megatron, maxtext = cfg["experimental_attention_variant"] == "dsa", cfg["use_indexer"]
    if not (megatron or maxtext):
        return {}
    if megatron and maxtext:
        raise ConfigError("experimental_attention_variant dsa and use_indexer both switch on "
                          "DeepSeek sparse attention (Megatron's and MaxText's names); set one")
    if not cfg["multi_latent_attention"]:
        raise ConfigError(f"{'use_indexer' if maxtext else 'experimental_attention_variant dsa'}"
                          ": DeepSeek sparse attention is built on multi-latent attention; set "
                          "multi_latent_attention (MaxText: attention_type mla)")
    if maxtext:
        recall = cfg["indexer_approx_top_k_recall"] if cfg["indexer_use_approx_top_k"] else None
        return dict(dsa_index_heads=cfg["indexer_n_heads"],
                    dsa_index_head_dim=cfg["indexer_head_dim"],
                    dsa_index_topk=cfg["indexer_topk"], dsa_k_norm_epsilon=1e-6,
                    dsa_exact_topk=cfg["indexer_mask_exact_topk"],
                    dsa_approx_topk_recall=recall,
                    dsa_loss_coeff=float(cfg["indexer_loss_scaling_factor"]),
                    dsa_sparse_loss=cfg["indexer_sparse_training"], dsa_loss_layer_mean=True,
                    dsa_head_chunk=cfg["mla_qk_head_chunk_size"])
    missing = [k for k in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
               if cfg[k] is None]
    if missing:
        raise ConfigError(f"experimental_attention_variant dsa needs {', '.join(missing)} (the "
                          "indexer's heads, head width and keys kept per query)")
    try:
        shared = dsa_shared_pattern(cfg["dsa_indexer_topk_freq"],
                                    cfg["dsa_indexer_skip_topk_offset"], cfg["num_layers"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dict(dsa_index_heads=cfg["dsa_indexer_n_heads"], dsa_shared_layers=shared,
                dsa_index_head_dim=cfg["dsa_indexer_head_dim"],
                dsa_index_topk=cfg["dsa_indexer_topk"],
                dsa_rope_interleaved=cfg["dsa_indexer_rope_interleaved"],
                dsa_scoring_relu=cfg["dsa_indexer_scoring_relu"],
                dsa_k_norm_epsilon=cfg["dsa_indexer_k_norm_epsilon"],
                dsa_loss_coeff=float(cfg["dsa_indexer_loss_coeff"] or 0.0),
                dsa_sparse_loss=cfg["dsa_indexer_use_sparse_loss"])


# DeepSeek-V4's keys (Primus's names; MaxText's deepseek4 and HF's deepseek_v4 translate to them)
# with the value that leaves them off: any other needs model_type deepseek_v4.
_V4_KEYS = {"compress_ratios": None, "index_topk": 0, "v4_indexer_distill_loss_coeff": 0.0,
            "attn_sliding_window": 0, "attn_sink": False, "o_lora_rank": 0, "hc_mult": 1,
            "num_hash_layers": 0, "use_v4_fp8_indexer": False}
_V4_SPARSE_RATIO = 4   # DeepSeek-V4's compressed sparse attention (overlap + indexer)


def parse_ratios(value, num_layers: int) -> tuple[int, ...]:
    """compress_ratios as a tuple of num_layers ints: a list or its string ('[0, 4, 128]');
    entries past the decoder (the MTP layers') dropped, as Primus and Hugging Face do."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.strip().strip("[]()").split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"compress_ratios = {value!r}: give a list of ints, one per layer "
                              "(0 none, 4 sparse, 128 heavy)") from None
    ratios = tuple(int(v) for v in value)
    if len(ratios) < num_layers:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries for {num_layers} layers: "
                          "give one per layer")
    return ratios[:num_layers]


def _v4_fields(cfg: Mapping[str, Any]) -> dict:
    """DeepSeek-V4 (model_type deepseek_v4; models/compressed.py): compressed attention per
    compress_ratios (4: sparse, with the indexer), the window and sinks of every layer, the
    grouped output projection, mHC with a learned final head (hc_mult) and hash-routed leading
    MoE layers (num_hash_layers, in _moe). Its keys with another model_type are refused. From
    MaxText's deepseek4 (mhc_expansion_rate set) the hyper-connection gates start at 0.01 (its
    mhc.py), else at 1 (transformers)."""
    if cfg["model_type"] != "deepseek_v4":
        on = [k for k, off in _V4_KEYS.items() if cfg[k] not in (off, None, [], "")]
        if on:
            raise ConfigError(f"{', '.join(on)}: DeepSeek-V4's settings, and model_type is "
                              f"{cfg['model_type']!r}; set model_type deepseek_v4 (MaxText: "
                              "decoder_block deepseek4)")
        return {}
    if cfg["compress_ratios"] in (None, [], ""):
        raise ConfigError("model_type deepseek_v4 needs compress_ratios (one ratio per layer: "
                          "0 none, 4 compressed sparse attention, 128 heavily compressed)")
    if not cfg["o_lora_rank"]:
        raise ConfigError("model_type deepseek_v4: o_lora_rank 0 (a full-rank output projection) "
                          "is not built; give the grouped projection's rank")
    streams = int(cfg["hc_mult"] or 1)
    if streams > 1 and cfg["mtp_num_layers"] and not cfg["mtp_use_separate_hc_head"]:
        raise ConfigError("mtp_use_separate_hc_head false with hc_mult > 1: MTP layers that "
                          "share the decoder's stream head are not built (Primus raises too)")
    fields = dict(
        compress_ratios=parse_ratios(cfg["compress_ratios"], cfg["num_layers"]),
        compress_sparse_ratio=_V4_SPARSE_RATIO,
        compress_rotary_base=float(cfg["compress_rope_theta"]),
        o_groups=int(cfg["o_groups"]), o_lora_rank=int(cfg["o_lora_rank"]),
        compress_index_heads=int(cfg["index_n_heads"]),
        compress_index_head_dim=int(cfg["index_head_dim"]),
        compress_index_topk=int(cfg["index_topk"]),
        compress_index_loss_coeff=float(cfg["v4_indexer_distill_loss_coeff"]),
        compress_index_fp8=bool(cfg["use_v4_fp8_indexer"]),
        sliding_window=int(cfg["attn_sliding_window"]) or None,
        attention_sinks=bool(cfg["attn_sink"]), hc_eps=float(cfg["hc_eps"]),
        num_query_groups=cfg["num_query_groups"] or 1, q_lora_rank=cfg["q_lora_rank"] or None,
        qk_pos_emb_head_dim=int(cfg["qk_pos_emb_head_dim"]))
    if streams > 1:
        fields.update(hc_streams=streams, hc_style="deepseek", hc_head=True,
                      hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
                      hc_init_gate=0.01 if cfg["mhc_expansion_rate"] > 1 else 1.0)
    return fields


def _hyper_fields(cfg: Mapping[str, Any]) -> dict:
    """Manifold-constrained hyper-connections (models/hyper.py): MaxText's
    mhc_expansion_rate > 1 (its convention, with sinkhorn_iterations and enable_mhc_lite) or
    Megatron's enable_mhc_connections (mhc_num_residual_streams, mhc_sinkhorn_iterations,
    mhc_init_gating_factor)."""
    if cfg["model_type"] == "deepseek_v4":   # DeepSeek-V4's own mHC (see _v4_fields)
        return {}
    maxtext, megatron = cfg["mhc_expansion_rate"] != 1, bool(cfg["enable_mhc_connections"])
    if maxtext and megatron:
        raise ConfigError("mhc_expansion_rate and enable_mhc_connections both switch on "
                          "hyper-connections (MaxText's and Megatron's conventions); set one")
    other = ({"mhc_sinkhorn_iterations": 20, "mhc_init_gating_factor": 0.01} if maxtext else
             {"sinkhorn_iterations": 20, "enable_mhc_lite": False} if megatron else {})
    for key, default in other.items():
        if cfg[key] != default:
            raise ConfigError(f"{key} belongs to the other dialect's hyper-connections than "
                              f"{'mhc_expansion_rate' if maxtext else 'enable_mhc_connections'}"
                              " switches on; it would be ignored")
    if maxtext:
        return dict(hc_streams=cfg["mhc_expansion_rate"], hc_style="deepseek",
                    hc_sinkhorn_iters=cfg["sinkhorn_iterations"],
                    hc_lite=bool(cfg["enable_mhc_lite"]))
    if megatron:
        return dict(hc_streams=cfg["mhc_num_residual_streams"], hc_style="megatron",
                    hc_sinkhorn_iters=cfg["mhc_sinkhorn_iterations"],
                    hc_init_gate=float(cfg["mhc_init_gating_factor"]))
    return {}


# Kimi K3's keys (Primus's names) with their defaults: another value needs model_type kimi_k3.
_K3_KEYS = {"attn_res_block_size": None, "routed_expert_hidden_size": None,
            "latent_moe_use_norm": False, "activation_situ_beta": None,
            "activation_situ_linear_beta": None, "kda_gate_lower_bound": -5.0,
            "kda_use_full_rank_gate": True, "mla_use_nope": True, "mla_use_output_gate": True,
            "kda_chunk_size": 64, "moe_router_bias_update_rule": "sign",
            "mtp_layer_type": "mirror_last", "quantile_balancing_num_bins": 1024,
            "quantile_balancing_margin_min": -1.0, "quantile_balancing_margin_max": 1.0,
            "quantile_balancing_center_bias": True, "quantile_balancing_ema_decay": None,
            "quantile_balancing_update_interval": 1}
# Primus's KimiK3TransformerConfig.mla_latent_layernorm_epsilon (no yaml sets it)
_K3_LATENT_NORM_EPS = 1e-6


def _k3_fields(cfg: Mapping[str, Any], fields: dict) -> dict:
    """Kimi K3 (model_type kimi_k3, Primus's text backbone): Kimi Delta Attention layers
    (bounded decay, full-rank output gate) where linear_attention_freq has 1, else
    multi-latent attention without RoPE (mla_use_nope) with a sigmoid output gate; attention
    residuals (attn_res_block_size); SiTU gated units where Primus builds them
    (use_te_activation_func: its module slot); routed experts in a latent space
    (routed_expert_hidden_size, Megatron's moe_latent_size) with its norm. Its keys with
    another model_type are refused."""
    if cfg["model_type"] != "kimi_k3":
        on = [k for k, off in _K3_KEYS.items() if cfg[k] != off]
        if on:
            raise ConfigError(f"{', '.join(on)}: Kimi K3's settings, and model_type is "
                              f"{cfg['model_type']!r}; set model_type kimi_k3")
        return {}
    if cfg["multi_latent_attention"]:
        raise ConfigError("model_type kimi_k3 builds its own multi-latent attention layers "
                          "(Primus requires multi_latent_attention false, which would swap "
                          "its config class): set multi_latent_attention false")
    if not cfg["kda_use_full_rank_gate"]:
        raise ConfigError("kda_use_full_rank_gate false (Kimi Linear's low-rank output gate in "
                          "Kimi K3's KDA layers) is not built; Primus raises too")
    if cfg["mtp_num_layers"] and not float(cfg["mtp_loss_scaling_factor"] or 0) > 0:
        raise ConfigError("mtp_loss_scaling_factor must be positive with Kimi K3's multi-token "
                          "prediction (a zero weight leaves the MTP layer untrained; Primus "
                          "raises too)")
    freq, n = cfg["linear_attention_freq"], cfg["num_layers"]
    try:
        pattern = None if freq is None else linear_pattern(parse_layer_freq(freq), n)
    except ValueError as e:
        raise ConfigError(f"linear_attention_freq: {e}") from None
    if pattern is not None and not any(pattern):
        pattern = None
    out = dict(multi_latent_attention=True, q_lora_rank=cfg["q_lora_rank"] or None,
               kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_head_dim"],
               qk_pos_emb_head_dim=cfg["qk_pos_emb_head_dim"], v_head_dim=cfg["v_head_dim"],
               mla_nope=bool(cfg["mla_use_nope"]), qk_layernorm=True,
               # Primus: no position embedding with NoPE; else MLA rotates (its own RoPE)
               position_embedding_type="none" if cfg["mla_use_nope"] else "rope",
               mla_latent_norm_epsilon=_K3_LATENT_NORM_EPS,
               attention_output_gate=bool(cfg["mla_use_output_gate"]),
               attn_res_block_size=int(cfg["attn_res_block_size"] or 0),
               mtp_mixer={"mirror_last": None, "mla": "attention",
                          "kda": "linear"}[cfg["mtp_layer_type"]])
    if pattern is not None:
        out.update(linear_attention_layers=pattern, linear_attention_kind="kda",
                   **{k: cfg[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                          "linear_value_head_dim", "linear_num_key_heads",
                                          "linear_num_value_heads")},
                   linear_chunk_size=int(cfg["kda_chunk_size"]), linear_qk_l2_norm=True,
                   kda_gate_lower_bound=(None if cfg["kda_gate_lower_bound"] is None
                                         else float(cfg["kda_gate_lower_bound"])),
                   kda_full_rank_gate=True)
    if cfg["use_te_activation_func"] and fields["gated_linear_unit"]:
        beta, lin = cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"]
        out.update(situ_beta=float(beta) if beta else 1.0,   # Primus: `beta or 1.0`
                   situ_linear_beta=None if lin is None else float(lin))
    moe = fields["moe"]
    latent, megatron_latent = cfg["routed_expert_hidden_size"], cfg["moe_latent_size"]
    if latent is not None and megatron_latent is not None and latent != megatron_latent:
        raise ConfigError(f"routed_expert_hidden_size {latent} and moe_latent_size "
                          f"{megatron_latent} name the same latent width: set one")
    latent = latent if latent is not None else megatron_latent
    if moe is not None:
        ema = cfg["quantile_balancing_ema_decay"]
        changes = dict(bias_rule=cfg["moe_router_bias_update_rule"],
                       k3_bins=int(cfg["quantile_balancing_num_bins"]),
                       k3_range=(float(cfg["quantile_balancing_margin_min"]),
                                 float(cfg["quantile_balancing_margin_max"])),
                       k3_center=bool(cfg["quantile_balancing_center_bias"]),
                       k3_ema=None if ema is None else float(ema),
                       k3_interval=int(cfg["quantile_balancing_update_interval"]))
        if latent is not None:
            changes.update(latent_size=int(latent), latent_norm=bool(cfg["latent_moe_use_norm"]))
        out["moe"] = dataclasses.replace(moe, **changes)
    return out


_REMAT_TENSOR_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj",
                       "qkv_proj", "context", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo",
                       "indexer_cutoff_threshold")


# pgs train.gradient_checkpointing -> remat_policy (pgs's selective keeps attention outputs and
# about half the matmuls: here q/k/v, the attention context and the out projection).
PGS_CHECKPOINTING = {"none": "none", "full": "full",
                     "selective": "save_dot_with_context_except_mlp"}


def _recompute(cfg: Mapping[str, Any]):
    """(remat_policy, method, num_layers, layer_ids, modules) from MaxText or Megatron knobs.

    The rules on ``recompute_granularity`` and Megatron's legacy switches live here (they never
    reach the model); ModelConfig checks the fields: a positive layer count for a method, layer
    ids without a method and in range, known modules."""
    granularity = cfg["recompute_granularity"]
    if granularity is None and cfg["recompute_activations"]:
        granularity = "selective"
    if granularity is None and cfg["checkpoint_activations"]:
        return "full", "uniform", cfg["recompute_num_layers"] or 1, None, ()
    if granularity is None:
        policy = cfg["remat_policy"]
        if policy in (None, "", "none"):
            policy = PGS_CHECKPOINTING[cfg["train.gradient_checkpointing"]]
        return policy, None, None, None, ()
    if granularity == "selective":
        if cfg["recompute_method"] is not None or cfg["recompute_num_layers"] is not None:
            raise ValueError("recompute_granularity='selective' takes no recompute_method or "
                             "recompute_num_layers")
        modules = cfg["recompute_modules"] or ["core_attn"]
        return "none", None, None, None, tuple(modules)
    if granularity != "full":
        raise ValueError(f"recompute_granularity={granularity!r} is not 'full' or 'selective'")
    ids, method = cfg["recompute_layer_ids"], cfg["recompute_method"]
    if not ids and method is None:
        raise ValueError("recompute_granularity='full' needs recompute_method "
                         "('uniform' or 'block') or recompute_layer_ids")
    if method == "block" and cfg["recompute_num_layers"] == 0 and not ids:
        return "none", None, None, None, ()   # Megatron's block of 0 layers rematerialises none
    # layer ids beside a method: ModelConfig refuses the pair
    return ("full", method, None if method is None else cfg["recompute_num_layers"],
            None if ids is None else tuple(ids), ())


def _moe_config(cfg: Mapping[str, Any]):
    """The MoEConfig of Megatron's MoE knobs; None without ``num_experts`` (a dense model)."""
    if not cfg["num_experts"]:
        return None
    tp, etp = cfg["tensor_model_parallel_size"], cfg["expert_tensor_parallel_size"]
    if etp not in (None, 1, tp):
        raise ConfigError(f"expert_tensor_parallel_size {etp}: jaxtrain splits each expert over "
                          f"the whole tensor axis ({tp}) or not at all (1)")
    turbo = cfg["enable_primus_turbo"]
    dispatcher = cfg["moe_token_dispatcher_type"]
    if dispatcher in ("alltoall_seq", "flex") or (turbo and cfg["use_turbo_deepep"]):
        # Primus's older name; Megatron's flex and Turbo's DeepEP are all-to-all dispatches
        dispatcher = "alltoall"
    factor = cfg["moe_expert_capacity_factor"]
    activation, glu_limit = _expert_activation(cfg)
    maxtext_v4 = cfg["model_type"] == "deepseek_v4" and cfg["mhc_expansion_rate"] > 1
    if maxtext_v4 and cfg["mlp_activations_limit"] > 0:   # MaxText: the routed experts only
        glu_limit = float(cfg["mlp_activations_limit"])
    try:
        return _moe(cfg, etp, tp, turbo, dispatcher, factor, activation, glu_limit)
    except ValueError as e:
        raise ValueError(_moe_knob_message(str(e))) from None


def _moe(cfg, etp, tp, turbo, dispatcher, factor, activation, glu_limit):
    return MoEConfig(
        num_experts=cfg["num_experts"], topk=cfg["moe_router_topk"],
        layer_freq=parse_layer_freq(cfg["moe_layer_freq"]),
        ffn_hidden_size=cfg["moe_ffn_hidden_size"],
        shared_expert_size=cfg["moe_shared_expert_intermediate_size"],
        shared_expert_gate=cfg["moe_shared_expert_gate"],
        apply_probs_on_input=cfg["moe_apply_probs_on_input"],
        branch_norms=bool(cfg["moe_branch_norms"]),
        router_input_norm=bool(cfg["moe_router_input_norm"]),
        per_expert_scale=bool(cfg["moe_per_expert_scale"]),
        score_function=cfg["moe_router_score_function"],
        pre_softmax=cfg["moe_router_pre_softmax"], router_dtype=cfg["moe_router_dtype"],
        topk_scaling_factor=cfg["moe_router_topk_scaling_factor"],
        num_groups=cfg["moe_router_num_groups"], group_topk=cfg["moe_router_group_topk"],
        group_score_topk=cfg["moe_router_group_score_topk"],
        expert_bias=cfg["moe_router_enable_expert_bias"],
        score_bias=bool(cfg["moe_router_score_bias"]),
        bias_update_rate=float(cfg["moe_router_bias_update_rate"]),
        load_balancing=cfg["moe_router_load_balancing_type"],
        aux_loss_coeff=cfg["moe_aux_loss_coeff"], z_loss_coeff=cfg["moe_z_loss_coeff"],
        qb_ema=float(cfg["moe_router_quantile_balancing_ema"]),
        input_jitter_eps=cfg["moe_input_jitter_eps"],
        router_softcap=cfg["router_logit_softcapping"] or None,
        force_balancing=(cfg["moe_router_force_load_balancing_type"]
                         if cfg["moe_router_force_load_balancing"] else None),
        capacity_factor=None if factor is None or factor < 0 else float(factor),
        capacity_per_sequence=bool(cfg["moe_capacity_per_sequence"]),
        pad_to_capacity=cfg["moe_pad_expert_input_to_capacity"],
        drop_policy=cfg["moe_token_drop_policy"],
        dispatcher=dispatcher,
        grouped_gemm=cfg["moe_grouped_gemm"] or (turbo and cfg["use_turbo_grouped_gemm"]),
        per_layer_logging=cfg["moe_per_layer_logging"],
        expert_tensor_parallel=etp in (None, tp),
        router_bias=bool(cfg["add_bias_linear"]),   # Megatron: the router is a linear layer
        activation=activation, glu_limit=glu_limit, latent_size=cfg["moe_latent_size"],
        hash_layers=int(cfg["num_hash_layers"] or 0),
        aux_softmax_biased=(cfg["model_type"] == "deepseek_v4"
                            and cfg["load_balance_loss_weight"] > 0))
