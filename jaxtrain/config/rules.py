"""Cross-key rules and derived values, checked once before anything compiles.

The rules follow Megatron-LM's argument validation (``validate_args`` in
megatron/training/arguments.py) and pgs's (palingenesis's) config ``validate()``. Where Megatron
quietly adjusts a value (sequence parallel off at TP = 1), so do we, recording the new value's
origin as ``derived``. Where a default stands in the way of a value the user chose (Primus's
``lr_warmup_iters: 40`` against an explicit ``lr_warmup_fraction``), the default yields; two
explicit choices that contradict each other are an error.
"""
from __future__ import annotations

import dataclasses
import math
import os

from jaxtrain.config.resolved import DEFAULT_ORIGIN, is_default
from jaxtrain.config.areas.checkpoint import TORCH_FORMATS, TORCH_FORMATS_REASON
from jaxtrain.config.batch_schedule import parse_step_schedule
from jaxtrain.config.dialects.maxtext_rules import MAXTEXT_RULES
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.patterns import PRIMUS_SPECS, spec_name

DERIVED = "derived"


@dataclasses.dataclass
class Context:
    values: dict
    origins: dict
    derived: dict
    problems: list
    warnings: list
    world_size: int | None
    adjusted: dict = dataclasses.field(default_factory=dict)  # key -> value before a rule set it
    dialect: str = "megatron"  # the file's dialect (see config/dialects)
    defaults: dict = dataclasses.field(default_factory=dict)  # the dialect's default values

    def get(self, key, default=None):
        value = self.values.get(key, default)
        return default if value is None else value

    def explicit(self, key) -> bool:
        """Chosen by a preset, file or command line (not a default, not derived)."""
        origin = self.origins.get(key, DEFAULT_ORIGIN)
        return not is_default(origin) and origin != DERIVED

    def set(self, key, value):
        self.adjusted.setdefault(key, self.values.get(key))
        self.values[key], self.origins[key] = value, DERIVED

    def error(self, message):
        self.problems.append(message)

    def where(self, key):
        return f"{key} = {self.values.get(key)!r} ({self.origins.get(key, DEFAULT_ORIGIN)})"

    def chosen(self, key) -> bool:
        """Explicit and not just the dialect's default written out (as a --dry-run dump does)."""
        return self.explicit(key) and self.values.get(key) != self.defaults.get(key)

    def adopt(self, key: str, value, source: str):
        """Give a canonical knob the value another key implies; a chosen different value is
        the two-names error."""
        if self.values.get(key) == value:
            return
        if self.chosen(key):
            self.error(f"{source} implies {key} = {value!r}, but {self.where(key)}; they set the "
                       f"same thing: keep one")
        else:
            self.set(key, value)


def _yield_default(c: Context, chosen: str, other: str, cleared, message: str):
    """``chosen`` is set and excludes ``other``: a defaulted ``other`` is cleared, an explicit
    one is an error."""
    if c.explicit(other):
        c.error(f"{message}: {c.where(chosen)} and {c.where(other)}; keep one")
    else:
        c.set(other, cleared)



# Megatron's --enable-gpt-oss (its ModelOpt model builder): YaRN RoPE with gpt-oss's values,
# written over whatever the command line set.
_GPT_OSS_YARN = {"position_embedding_type": "rope", "rope_type": "yarn",
                 "rotary_scaling_factor": 32.0, "original_max_position_embeddings": 131072,
                 "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0,
                 "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False}


def enable_gpt_oss(c: Context):
    """enable_gpt_oss: the YaRN values of :data:`_GPT_OSS_YARN`, as Megatron sets them on the
    model config after the other arguments (an explicit different value is overridden, with a
    warning)."""
    if not c.get("enable_gpt_oss"):
        return
    replaced = [c.where(k) for k, v in _GPT_OSS_YARN.items()
                if c.explicit(k) and c.values.get(k) != v]
    for key, value in _GPT_OSS_YARN.items():
        c.set(key, value)
    if replaced:
        c.warnings.append("enable_gpt_oss sets gpt-oss's YaRN RoPE over " + ", ".join(replaced))


def precision(c: Context):
    if c.get("fp16") and c.get("bf16"):
        _yield_default(c, "fp16", "bf16", False, "fp16 and bf16 are exclusive")
    wanted = "float16" if c.get("fp16") else "bfloat16" if c.get("bf16") else "float32"
    if c.get("dtype") != wanted:
        if not c.explicit("dtype"):
            c.set("dtype", wanted)  # Megatron's switches choose the compute dtype
        elif any(c.explicit(k) for k in ("fp16", "bf16")):
            c.error(f"dtype {c.get('dtype')} contradicts {c.where('bf16')} / {c.where('fp16')}; "
                    f"these choose the compute dtype: keep one")
    if c.get("fp8") and c.get("fp4"):
        c.error(f"fp8 and fp4 are exclusive: {c.where('fp8')} and {c.where('fp4')}")
    quantization(c)


# MaxText quantization values that scale by an amax history (Flax's fp8 ops, TE delayed).
_DELAYED_MAXTEXT = ("fp8", "fp8_gpu", "nanoo_fp8", "fp8_nanoo", "te_fp8_delayedscaling")


def quantization(c: Context):
    """Quantized training: one knob picks the recipe; Megatron's layer rules."""
    chosen = [k for k in ("fp8", "fp4", "quantization", "memory.float8_training") if c.get(k)]
    if len(chosen) > 1:
        c.error("quantization knobs are exclusive, each picks the recipe: "
                + ", ".join(c.where(k) for k in chosen) + "; keep one")
    if not chosen:
        return
    delayed = (c.get("fp8") and c.get("fp8_recipe", "delayed") == "delayed") or \
        c.get("quantization") in _DELAYED_MAXTEXT
    if c.get("first_last_layers_bf16"):
        if delayed:
            c.error("first_last_layers_bf16 is not allowed with delayed scaling (Megatron's "
                    f"rule): {c.where('first_last_layers_bf16')}; use fp8_recipe tensorwise, "
                    "blockwise or mxfp8, or turn it off")
        layers = c.get("num_layers")
        for k in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            n = c.get(k, 1)
            if n < 0 or (layers and n > layers):
                c.error(f"{k} ({n}) must lie in [0, num_layers = {layers}]")


def _gated_delta_net(c: Context) -> bool:
    return c.get("experimental_attention_variant") in ("gdn", "gated_delta_net")


def gated_delta_net(c: Context):
    """Gated DeltaNet layers: heads split whole over TP; what they do not run yet, refused."""
    if not _gated_delta_net(c):
        return
    _heads_split(c, ("linear_num_key_heads", "linear_num_value_heads"), "the Gated DeltaNet")
    _not_yet(c, "Gated DeltaNet layers (experimental_attention_variant "
                f"{c.get('experimental_attention_variant')})", (
        ("memory.seco", "SeCO's chunk-wise step carries the earlier chunks' keys and values, "
                        "not the linear layers' recurrent state"),
        *_ONE_STACK))


def _heads_split(c: Context, keys, whose: str) -> None:
    """Each head count of ``keys`` must split whole over the tensor axis."""
    tp = c.get("tensor_model_parallel_size", 1)
    for key in keys:
        if c.get(key) and c.get(key) % tp:
            c.error(f"{key} ({c.get(key)}) must be divisible by tensor_model_parallel_size "
                    f"({tp}): {whose} heads split over the tensor axis")


def sparse_attention(c: Context):
    """DeepSeek sparse attention (experimental_attention_variant dsa or MaxText's use_indexer):
    what does not run it yet, refused by name."""
    by = ("use_indexer" if c.get("use_indexer") else "experimental_attention_variant dsa"
          if c.get("experimental_attention_variant") == "dsa" else None)
    if by is None:
        return
    if c.get("use_indexer") and c.get("experimental_attention_variant") == "dsa":
        c.error(f"{c.where('use_indexer')} and {c.where('experimental_attention_variant')} both "
                "switch on DeepSeek sparse attention (MaxText's and Megatron's names); set one")
    feature = f"DeepSeek sparse attention ({by})"
    if (c.get("dsa_indexer_topk_freq") or 1) > 1 and c.get("mtp_num_layers"):
        c.error(f"not implemented yet: mtp_num_layers {c.get('mtp_num_layers')} with "
                f"{c.where('dsa_indexer_topk_freq')}: the multi-token-prediction layers do not "
                "take part in index sharing")
    _not_yet(c, feature, (
        ("context_parallel_size", "the indexer ranks every earlier key of the whole sequence, "
                                  "which context parallelism splits"),
        ("memory.seco", "SeCO's chunk-wise step does not carry the indexer's keys"),
        *_ONE_STACK))
    loss = (c.get("indexer_loss_scaling_factor") if by == "use_indexer"
            else c.get("dsa_indexer_loss_coeff")) or 0
    if loss <= 0:
        return
    feature += " with its indexer loss"
    if c.get("mtp_num_layers"):
        c.error(f"not implemented yet: mtp_num_layers {c.get('mtp_num_layers')} with {feature}: "
                "the multi-token-prediction layers do not return the indexer's loss")
    _not_yet(c, feature, (
        ("dpo.enabled", "DPO's policy forward does not train the indexer"),
        ("calculate_per_token_loss", "the indexer's loss is averaged over each microbatch's "
                                     "rows, not summed per token")))


def hybrid_models(c: Context):
    """Megatron's hybrid stack (model_type mamba/hybrid): Mamba heads and groups split whole
    over TP (Megatron's asserts); what does not run its layers yet, refused."""
    by = next((c.where(k) for k in ("hybrid_layer_pattern", "is_hybrid_model") if c.get(k)),
              c.where("model_type") if c.get("model_type") in ("mamba", "hybrid") else None)
    if by is None:
        return
    if PRIMUS_SPECS.get(spec_name(c.get("spec"))) in ("G", "K"):   # linear layers, no Mamba
        _heads_split(c, ("linear_num_key_heads", "linear_num_value_heads"),
                     "the linear-attention layers'")
    else:
        tp = c.get("tensor_model_parallel_size", 1)
        heads = c.get("mamba_num_heads") or 2 * (c.get("hidden_size") or 0) // max(
            c.get("mamba_head_dim") or 1, 1)
        for key, n in (("mamba_num_heads", heads),
                       ("mamba_num_groups", c.get("mamba_num_groups"))):
            if n and n % tp:
                c.error(f"{key} ({n}) must be divisible by tensor_model_parallel_size ({tp}): "
                        "the Mamba heads and their groups split over the tensor axis")
    _not_yet(c, f"a hybrid model ({by})", (
        ("memory.seco", "SeCO's chunk-wise step carries keys and values, not recurrent states"),
        *_ONE_STACK))


# What covers the one dense layer stack only: (key, why) for _not_yet
_ONE_STACK = (("memory.gradient_release", "the fused step covers one dense layer stack"),
              ("moe_use_upcycling", "upcycling converts the dense layer stack only"))


def _not_yet(c: Context, feature: str, reasons) -> None:
    """Refuse each key of ``reasons`` ((key, why) pairs) that is on beside ``feature``: a
    switch set, or a parallel size above 1 (named with its value)."""
    for key, why in reasons:
        value = c.get(key)
        size = isinstance(value, int) and not isinstance(value, bool)
        if value > 1 if size else bool(value):
            name = f"{key} {value}" if size else key
            c.error(f"not implemented yet: {name} with {feature}: {why}")


def hyper_connections(c: Context):
    """Manifold-constrained hyper-connections (mhc_expansion_rate > 1 or enable_mhc_connections):
    what does not carry several residual streams yet, refused by name."""
    by = next((c.where(k) for k in ("mhc_expansion_rate", "enable_mhc_connections")
               if c.get(k) not in (None, False, 1)), None)
    if by is None:
        return
    _not_yet(c, f"hyper-connections ({by})", _ONE_STACK)


def deepseek_v4(c: Context):
    """DeepSeek-V4 (model_type deepseek_v4): what does not run it yet, refused by name."""
    if c.get("model_type") != "deepseek_v4":
        return
    _not_yet(c, "DeepSeek-V4 (model_type deepseek_v4)", (
        ("memory.seco", "SeCO's chunk-wise step covers one dense layer stack, and V4's "
                        "compressing and MoE layers are stacks of their own"),
        *_ONE_STACK))


def kimi_k3(c: Context):
    """Kimi K3 (model_type kimi_k3): KDA heads split whole over TP; what does not run it yet,
    refused by name."""
    if c.get("model_type") != "kimi_k3":
        return
    _heads_split(c, ("linear_num_key_heads", "num_attention_heads"), "Kimi K3's")
    _not_yet(c, "Kimi K3 (model_type kimi_k3)", (
        ("memory.seco", "SeCO's chunk-wise step carries keys and values, not KDA's recurrent "
                        "state or the attention residuals' summaries"),
        *_ONE_STACK))


def small_gemma4(c: Context):
    """Gemma 4 small's per-layer inputs and KV sharing: what does not run them yet, refused."""
    on = [k for k in ("hidden_size_per_layer_input", "num_kv_shared_layers") if c.get(k)]
    if on:
        _not_yet(c, f"{c.where(on[0])} (Gemma 4 small)", (
            ("pipeline_model_parallel_size", "the per-layer inputs are made from the embeddings "
                                             "on the first stage and the shared keys and values "
                                             "cross stages; neither is sent between stages"),
            ("context_parallel_size", "the shared keys and values are not exchanged around the "
                                      "context ring"),
            ("memory.seco", "SeCO's chunk-wise step runs every layer on its own keys and "
                            "values"),
            *_ONE_STACK))


# What multi-token prediction does not run with yet: key -> (is it on, why)
_MTP_NOT_YET = {
    "context_parallel_size": (lambda v: v > 1, "the shifted tokens would cross the context "
                              "split"),
    "memory.seco": (bool, "SeCO's chunk-wise step covers the decoder only"),
    "memory.gradient_release": (bool, "the fused step covers the decoder only"),
    "dpo.enabled": (bool, "DPO scores sequences, MTP predicts tokens further ahead"),
    "plugins.pre_rl": (bool, "pre_rl's base-model loss"),
    "plugins.dft": (bool, "the token-weighting objectives weigh the main tokens only"),
    "plugins.deft": (bool, "the token-weighting objectives weigh the main tokens only"),
    "plugins.cadft": (bool, "the token-weighting objectives weigh the main tokens only"),
    "plugins.info_sft": (bool, "the token-weighting objectives weigh the main tokens only"),
}


def multi_token_prediction(c: Context):
    """Megatron's multi-token prediction; what it does not run with yet, refused by name."""
    pattern = str(c.get("hybrid_layer_pattern") or "")
    depth = c.get("mtp_num_layers") or len([p for p in pattern.split("/")[1:] if p])
    if depth <= 0:
        return
    if c.dialect == "maxtext":
        c.error(f"not implemented yet: {c.where('mtp_num_layers')} in a MaxText file: "
                "MaxText's multi-token prediction differs from Megatron's, which jaxtrain "
                "builds (its modules read the hidden states before the final norm and share "
                "it, and the loss pools every depth's tokens); planned")
    for key, (on, why) in _MTP_NOT_YET.items():
        if on(c.get(key)):
            c.error(f"not implemented yet: {c.where(key)} with multi-token prediction "
                    f"(mtp_num_layers {depth}): {why}")
    if (c.get("fp8") and c.get("fp8_recipe", "delayed") == "delayed") or c.get(
            "quantization") in _DELAYED_MAXTEXT:
        c.error("not implemented yet: delayed-scaling FP8 with multi-token prediction (the "
                "MTP layers keep no amax history); use fp8_recipe tensorwise or blockwise")
    hybrid = (c.get("model_type") in ("mamba", "hybrid") or c.get("is_hybrid_model")
              or pattern)
    if hybrid and "/" not in pattern and not c.get("mtp_hybrid_override_pattern"):
        c.error(f"{c.where('mtp_num_layers')}: a hybrid model's MTP layers are the pattern "
                "after '/' in hybrid_layer_pattern (e.g. 'M*M*/*E/*E'; or the older "
                "mtp_hybrid_override_pattern); give it")
    if hybrid and c.get("pipeline_model_parallel_size", 1) > 1:
        c.error(f"not implemented yet: pipeline_model_parallel_size "
                f"{c.get('pipeline_model_parallel_size')} with a hybrid model's MTP layers")


def short_convolutions(c: Context):
    """LFM2's short-convolution layers (stacks of their own): what does not run them yet."""
    if not c.get("lfm_layer_types") or "conv" not in c.get("lfm_layer_types"):
        return
    _not_yet(c, "LFM2's short-convolution layers (lfm_layer_types)", (
        ("memory.seco", "SeCO's chunk-wise step carries keys and values, not convolution "
                        "states"),
        *_ONE_STACK))


_GLOBAL_SHAPE = ("global_kv_channels", "global_num_query_groups", "attention_k_eq_v",
                 "global_rotary_percent")


def gemma4_global_layers(c: Context):
    """Gemma 4's global layers (a layer stack of their own): their key/value heads split over
    TP as the others do; the features that cover one dense layer stack only, refused."""
    on = [k for k in _GLOBAL_SHAPE if c.get(k)]
    if not on:
        return
    tp = c.get("tensor_model_parallel_size", 1)
    groups = c.get("global_num_query_groups")
    if groups and groups % tp and tp % groups:
        c.error(f"global_num_query_groups ({groups}) must be a multiple or a divisor of "
                f"tensor_model_parallel_size ({tp})")
    for key, what in (("memory.seco", "SeCO's chunk-wise step"),
                      ("memory.gradient_release", "the fused gradient-release step"),
                      ("moe_use_upcycling", "upcycling")):
        if c.get(key):
            c.error(f"not implemented yet: {key} with {on[0]} (Gemma 4's global layers): "
                    f"{what} covers one dense layer stack, and the global layers are a stack "
                    "of their own")


def tensor_parallel(c: Context):
    tp = c.get("tensor_model_parallel_size", 1)
    heads = c.get("num_attention_heads")
    if heads and heads % tp:
        c.error(f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size "
                f"({tp})")
    groups = c.get("num_query_groups")
    if c.get("group_query_attention") and groups and groups % tp and tp % groups:
        c.error(f"num_query_groups ({groups}) must be a multiple or a divisor of "
                f"tensor_model_parallel_size ({tp})")
    if tp == 1 and c.get("sequence_parallel"):
        if c.explicit("sequence_parallel"):
            c.warnings.append("sequence_parallel is turned off: it needs "
                              "tensor_model_parallel_size > 1 (as Megatron does)")
        c.set("sequence_parallel", False)
    if c.get("distribute_saved_activations"):
        if tp == 1 or c.get("sequence_parallel") or c.get("recompute_granularity") != "full":
            c.error("distribute_saved_activations needs tensor_model_parallel_size > 1, "
                    "recompute_granularity full and sequence_parallel off (as Megatron)")
    if c.get("tp_comm_overlap") and not c.get("sequence_parallel"):
        c.error("tp_comm_overlap needs sequence_parallel (and tensor_model_parallel_size > 1)")
    if c.get("overlap_param_gather") and not (
            c.get("use_distributed_optimizer") and c.get("overlap_grad_reduce")):
        c.error("overlap_param_gather needs use_distributed_optimizer and overlap_grad_reduce")


def context_and_experts(c: Context):
    cp = c.get("context_parallel_size", 1)
    seq = c.get("seq_length")
    if cp > 1 and seq and seq % (2 * cp):
        c.error(f"seq_length ({seq}) must be divisible by 2 x context_parallel_size ({2 * cp})")
    experts, ep = c.get("num_experts"), c.get("expert_model_parallel_size", 1)
    if experts and experts % ep:
        c.error(f"num_experts ({experts}) must be divisible by expert_model_parallel_size ({ep})")
    if c.values.get("expert_tensor_parallel_size") is None:
        c.derived["expert_tensor_parallel_size"] = c.get("tensor_model_parallel_size", 1)


def model_shape(c: Context):
    """Megatron's derived sizes, and the rules on knobs the model does not read as they are
    (group_query_attention, vocabulary padding). Checks on the model's own fields (head
    counts dividing, the head dim, multi-latent attention's RoPE) are ModelConfig's; the dry run
    reaches them when it builds the model (jaxtrain/preflight.py)."""
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if hidden and heads:
        if c.values.get("kv_channels") is None and not hidden % heads:
            c.set("kv_channels", hidden // heads)
        if c.values.get("ffn_hidden_size") is None:
            ffn = int(4 * hidden * 2 / 3 / 64) * 64 if c.get("swiglu") else 4 * hidden
            c.set("ffn_hidden_size", ffn)
        v4 = c.get("model_type") == "deepseek_v4"   # one shared key/value head by design
        if not c.get("group_query_attention") and not c.get("multi_latent_attention") and not v4:
            if c.values.get("num_query_groups") not in (None, heads) and c.explicit(
                    "num_query_groups"):
                c.error(f"num_query_groups is set ({c.get('num_query_groups')}) but "
                        f"group_query_attention is false; set group_query_attention: true")
            c.derived["num_query_groups"] = heads
        elif c.get("group_query_attention") and not c.get("num_query_groups"):
            c.error("group_query_attention needs num_query_groups")
    vocab = c.get("vocab_size")
    if vocab:
        multiple = c.get("make_vocab_size_divisible_by", 1) * c.get(
            "tensor_model_parallel_size", 1)
        c.derived["padded_vocab_size"] = int(math.ceil(vocab / multiple) * multiple)
    if c.get("multi_latent_attention") and c.get("group_query_attention"):
        c.error("multi_latent_attention excludes group_query_attention")


def learning_rate(c: Context):
    lr, min_lr, init = c.get("lr"), c.get("min_lr"), c.get("lr_warmup_init")
    if c.dialect == "maxtext" and not c.explicit("min_lr") and lr is not None:
        min_lr = lr * c.get("learning_rate_final_fraction")   # MaxText's floor follows the lr
    if lr is not None and min_lr is not None and min_lr > lr:
        c.error(f"min_lr ({min_lr}) must not exceed lr ({lr})")
    if lr is not None and init is not None and init > lr:
        c.error(f"lr_warmup_init ({init}) must not exceed lr ({lr})")
    if c.get("lr_warmup_fraction") is not None:
        for other in ("lr_warmup_iters", "lr_warmup_samples"):
            if c.get(other):
                _yield_default(c, "lr_warmup_fraction", other, 0,
                               "lr_warmup_fraction excludes lr_warmup_iters/lr_warmup_samples")
    if c.get("lr_warmup_iters") and c.get("lr_warmup_samples"):
        c.error("lr_warmup_iters and lr_warmup_samples are exclusive: "
                f"{c.where('lr_warmup_iters')}, {c.where('lr_warmup_samples')}")
    if c.get("lr_decay_iters") and c.get("lr_decay_samples"):
        c.error("lr_decay_iters and lr_decay_samples are exclusive")
    decay = c.get("lr_decay_iters") or c.get("train_iters")
    warmup = c.get("lr_warmup_iters")
    # (pgs distill warms up with (step + 1) / warmup, whatever the run's length)
    if decay and warmup and warmup >= decay and c.dialect != "pgs-distill":
        given = "" if c.explicit("lr_warmup_iters") else ", Primus's default"
        c.error(f"lr_warmup_iters ({warmup}{given}) must be smaller than the decay horizon "
                f"(lr_decay_iters or train_iters: {decay}); set lr_warmup_iters lower")
    if c.get("lr_decay_style") == "WSD" and not (
            c.get("lr_wsd_decay_iters") or c.get("lr_wsd_decay_samples")):
        c.error("lr_decay_style WSD needs lr_wsd_decay_iters or lr_wsd_decay_samples")
    style = c.get("weight_decay_incr_style")
    start, end = c.values.get("start_weight_decay"), c.values.get("end_weight_decay")
    if style == "constant" and (start is not None or end is not None):
        c.error("start_weight_decay/end_weight_decay need weight_decay_incr_style linear or "
                "cosine (constant uses weight_decay)")
    if style not in (None, "constant") and (start is None or end is None):
        c.error(f"weight_decay_incr_style {style} needs start_weight_decay and end_weight_decay")


def iterations(c: Context):
    if c.get("train_samples") is not None and c.get("train_iters") is not None:
        _yield_default(c, "train_samples", "train_iters", None,
                       "train_iters and train_samples are exclusive")
    _step_batch_size_schedule(c)
    ramp = c.get("rampup_batch_size")
    if ramp:
        parts = ramp.split() if isinstance(ramp, str) else list(ramp)
        try:
            start, incr, samples = (int(p) for p in parts)
        except (TypeError, ValueError):
            c.error(f"rampup_batch_size must be three integers 'start increment samples', "
                    f"got {ramp!r}")
            return
        gbs = c.get("global_batch_size")
        if gbs is None:
            c.error(f"rampup_batch_size {ramp!r} ramps up to global_batch_size, which is unset")
        elif incr <= 0 or start > gbs or (gbs - start) % incr:
            c.error(f"rampup_batch_size {ramp!r}: need 0 < increment and (global_batch_size "
                    f"{gbs} - start {start}) divisible by the increment")
        if c.get("train_iters") is not None:
            _yield_default(c, "rampup_batch_size", "train_iters", None,
                           "rampup_batch_size needs sample-based training (train_samples)")


def _step_batch_size_schedule(c: Context):
    """Megatron's step_batch_size_schedule: a well-formed schedule, not beside an explicit
    global_batch_size or rampup_batch_size (Megatron's own refusals) nor with
    decrease_batch_size_if_needed; the run's global batch is the schedule's last."""
    text = c.get("step_batch_size_schedule")
    if not text:
        return
    try:
        schedule = parse_step_schedule(text, c.get("seq_length"))
    except ValueError as e:
        c.error(str(e))
        return
    for key in ("global_batch_size", "rampup_batch_size"):
        if c.explicit(key) and c.get(key):
            c.error(f"step_batch_size_schedule and {key} ({c.where(key)}) are exclusive, as in "
                    f"Megatron-LM: the schedule gives every step's global batch")
            return
    if c.get("decrease_batch_size_if_needed"):
        c.error("step_batch_size_schedule does not take decrease_batch_size_if_needed (as in "
                "Megatron-LM): give batch sizes that divide by micro_batch_size x data-parallel "
                "size")
    c.set("global_batch_size", schedule.final)


def batch(c: Context):
    if c.dialect == "pgs-distill":   # a step's sequences are its rollouts, scored in micro-batches
        c.set("global_batch_size", c.get("rollout.batch_prompts", 32)
              * c.get("rollout.group_size", 1))
        c.derived["num_microbatches"] = 1
        if c.world_size is not None:
            c.derived["data_parallel_size"] = c.world_size
        return
    mbs = c.get("micro_batch_size", 1)
    accum = c.get("train.gradient_accumulation_steps")
    if accum and not c.explicit("train.gradient_accumulation_steps") and c.explicit(
            "global_batch_size"):
        accum = None   # a default accumulation (MaxText's 1, pgs's 16) yields to a chosen batch
    if c.world_size is None:
        if accum:
            c.derived["num_microbatches"] = accum
        return
    model_parallel = (c.get("tensor_model_parallel_size", 1)
                      * c.get("pipeline_model_parallel_size", 1)
                      * c.get("context_parallel_size", 1))
    if c.world_size % model_parallel:
        c.error(f"world size {c.world_size} is not divisible by tensor x pipeline x context "
                f"parallel sizes ({model_parallel})")
        return
    dp = c.world_size // model_parallel
    c.derived["data_parallel_size"] = dp
    ep, instances = (c.get("expert_model_parallel_size", 1),
                     c.get("num_distributed_optimizer_instances", 1))
    if dp % (ep * instances):
        c.error(f"data-parallel size {dp} (world size {c.world_size} / tensor x pipeline x "
                f"context {model_parallel}) must be divisible by expert_model_parallel_size "
                f"({ep}) x num_distributed_optimizer_instances ({instances})")
        return
    gbs = c.get("global_batch_size")
    if gbs is None and not accum:
        c.error("set global_batch_size or train.gradient_accumulation_steps")
        return
    if accum:
        implied = mbs * accum * dp
        if c.explicit("global_batch_size") and gbs is not None and gbs != implied:
            c.error(f"global_batch_size ({gbs}) disagrees with micro_batch_size x "
                    f"train.gradient_accumulation_steps x data-parallel size "
                    f"({mbs} x {accum} x {dp} = {implied}); set one of them")
            return
        c.set("global_batch_size", implied)
        gbs = implied
    eval_batch = c.get("eval_global_batch_size")
    if eval_batch and eval_batch % (mbs * dp):
        c.error(f"eval_global_batch_size ({eval_batch}) must be divisible by micro_batch_size x "
                f"data-parallel size ({mbs} x {dp})")
    schedule = c.get("step_batch_size_schedule")
    if schedule and not c.explicit("global_batch_size"):
        try:
            entries = parse_step_schedule(schedule, c.get("seq_length")).entries
        except ValueError:   # reported by the iterations rule
            return
        odd = [b for _, b in entries if b % (mbs * dp)]
        if odd:
            c.error(f"step_batch_size_schedule batch sizes {odd} are not divisible by "
                    f"micro_batch_size x data-parallel size ({mbs} x {dp})")
            return
    if gbs % (mbs * dp):
        if c.get("decrease_batch_size_if_needed") and gbs >= mbs * dp:
            gbs = gbs // (mbs * dp) * (mbs * dp)
            c.set("global_batch_size", gbs)
        else:
            c.error(f"global_batch_size ({gbs}) must be divisible by micro_batch_size x "
                    f"data-parallel size ({mbs} x {dp}); change it or set "
                    f"decrease_batch_size_if_needed: true")
            return
    c.derived["num_microbatches"] = gbs // (mbs * dp)


def pgs_context_parallel(c: Context):
    """pgs's parallel.context_parallel: ring attention over min(world size, 8) devices (all of
    them when 8 does not divide the world size; none on one device), K/V moved as
    parallel.cp_rotate_method says: allgather gathers them, alltoall passes them round a ring."""
    if not c.get("parallel.context_parallel") or not c.world_size or c.world_size < 2:
        return
    cp = min(c.world_size, 8)
    cp = cp if c.world_size % cp == 0 else c.world_size
    c.adopt("context_parallel_size", cp, "parallel.context_parallel")
    method = c.get("parallel.cp_rotate_method", "allgather")
    c.adopt("cp_comm_type", {"allgather": "allgather", "alltoall": "p2p"}[method],
            "parallel.cp_rotate_method")


def context_parallel(c: Context):
    """What context-parallel attention (jaxtrain.parallel.context) needs of the run."""
    cp = c.get("context_parallel_size", 1)
    sizes = c.get("hierarchical_context_parallel_sizes")
    kind = c.get("cp_comm_type")
    kinds = set(kind) if isinstance(kind, list | tuple) else {kind}
    if "a2a+p2p" in kinds and cp > 1:
        if not sizes:
            c.error(f"cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes (the "
                    f"all-to-all group size, then the ring's) multiplying to "
                    f"context_parallel_size ({cp})")
        elif len(sizes) != 2 or math.prod(sizes) != cp or min(sizes) < 1:
            c.error(f"{c.where('hierarchical_context_parallel_sizes')}: give two sizes (the "
                    f"all-to-all level, then the ring) whose product is context_parallel_size "
                    f"({cp})")
    elif sizes and c.explicit("hierarchical_context_parallel_sizes"):
        c.error(f"{c.where('hierarchical_context_parallel_sizes')} sizes the levels of "
                f"cp_comm_type a2a+p2p, but {c.where('cp_comm_type')}; drop one")
    if cp <= 1:
        return
    seq = c.get("seq_length")
    if seq and seq % cp:
        c.error(f"seq_length ({seq}) must divide by context_parallel_size ({cp}): each "
                f"context-parallel device holds an equal slice of the sequence")
    a2a = cp if "a2a" in kinds else sizes[0] if "a2a+p2p" in kinds and sizes else None
    if a2a:
        heads = c.get("num_attention_heads")
        groups = c.get("num_query_groups") if c.get("group_query_attention") else heads
        tp = c.get("tensor_model_parallel_size", 1)
        size = "context_parallel_size" if "a2a" in kinds else "the all-to-all level"
        for name, n in (("num_attention_heads", heads), ("num_query_groups", groups)):
            if n and n % (a2a * tp):
                c.error(f"cp_comm_type {kind} splits the heads over the context-parallel "
                        f"devices: {name} ({n}) must divide by {size} x "
                        f"tensor_model_parallel_size ({a2a} x {tp})")
    if isinstance(kind, list | tuple) and len(kind) not in (1, c.get("num_layers", len(kind))):
        c.error(f"{c.where('cp_comm_type')} lists {len(kind)} kinds for num_layers = "
                f"{c.get('num_layers')}; give one per layer or a single kind")


def flex_dispatcher(c: Context):
    """Megatron's checks on its flex dispatcher, which jaxtrain runs as its all-to-all
    dispatch: DeepEP only behind flex, and DeepEP does not pad experts to capacity."""
    flex = c.get("moe_token_dispatcher_type") == "flex"
    if c.get("moe_enable_deepep") and not flex:
        c.error(f"{c.where('moe_enable_deepep')} selects the flex dispatcher's DeepEP backend; "
                f"set moe_token_dispatcher_type: flex (or drop moe_enable_deepep)")
    deepep = c.get("moe_enable_deepep") or c.get("moe_flex_dispatcher_backend") == "deepep"
    if flex and deepep and c.get("moe_pad_expert_input_to_capacity"):
        c.error(f"moe_token_dispatcher_type flex with the DeepEP backend does not pad experts "
                f"to capacity ({c.where('moe_pad_expert_input_to_capacity')}); use alltoall "
                f"or moe_flex_dispatcher_backend: hybridep")


def moe_router(c: Context):
    """Megatron's rule that MoEConfig leaves to the config: a top-1 softmax router needs
    pre-softmax scores (else its one weight is always 1), unless sinkhorn routes. A top-1 router
    with weight 1 is what HF Mixtral checkpoints with one expert per token do, so a hand-built
    MoEConfig may, and what MaxText's blocks build (a decoder_block warns). The other router
    rules (expert bias, expert groups) are MoEConfig's checks;
    the dry run reaches them when it builds the model (jaxtrain/preflight.py)."""
    score = c.get("moe_router_score_function", "softmax")
    balancing = c.get("moe_router_load_balancing_type")
    balancing = set(balancing) if isinstance(balancing, list) else {balancing}
    if (c.get("num_experts") and c.get("moe_router_topk") == 1 and score == "softmax"
            and not c.get("moe_router_pre_softmax") and "sinkhorn" not in balancing):
        if c.get("decoder_block"):   # MaxText's block: its top-1 router is built that way
            c.warnings.append(f"decoder_block {c.get('decoder_block')} with one expert per "
                              "token weighs it 1 (a softmax over the chosen logit, as MaxText "
                              "does): its router learns from the balancing loss only")
        else:
            c.error("moe_router_topk 1 with softmax scores needs moe_router_pre_softmax: true")
    if "quantile_balancing" in balancing and c.get("num_experts"):
        tokens = (c.get("micro_batch_size") or 1) * (c.get("seq_length") or 0)
        k, E = c.get("moe_router_topk"), c.get("num_experts")
        if tokens and (tokens * k) % E:
            c.error(f"quantile balancing gives each expert a rank's tokens x topk / experts: "
                    f"micro_batch_size x seq_length ({tokens}) x moe_router_topk ({k}) must be "
                    f"divisible by num_experts ({E}), as Megatron asserts")


def _family(c: Context, key: str, choosers: dict[str, str], what: str):
    """Switch a convention knob to the system whose knob the config sets explicitly; knobs of
    two systems set together are ambiguous."""
    chosen = {family: knob for family, knob in choosers.items() if c.chosen(knob)}
    if len(chosen) > 1:
        c.error(f"{' and '.join(c.where(k) for k in chosen.values())} both choose the {what}; "
                f"keep one")
        return
    if not chosen:   # written at its default value: counts when it is the only one written
        written = {family: knob for family, knob in choosers.items() if c.explicit(knob)}
        chosen = written if len(written) == 1 else {}
    if chosen:
        family, knob = next(iter(chosen.items()))
        c.adopt(key, family, knob)


def conventions(c: Context):
    """Optimizer and LR-schedule families follow the knobs a config sets, else its dialect."""
    _family(c, "optimizer_family", {"megatron": "optimizer", "pgs": "train.optimizer"},
            "optimizer")
    _family(c, "lr_schedule_family", {"megatron": "lr_decay_style", "maxtext":
                                      "lr_schedule_type", "pgs": "train.lr_scheduler"},
            "LR schedule")
    if c.get("optimizer_family") != "megatron" and c.get("decay_all_params") and \
            not c.explicit("decay_all_params"):
        c.set("decay_all_params", False)   # MaxText's all-parameter decay is its AdamW's


def checkpoint_format(c: Context):
    """A PyTorch checkpoint format (Primus and Megatron scripts write ckpt_format: torch) means
    jaxtrain's Orbax checkpoints, as torch_dist does; the run says so when it saves or loads (a
    PyTorch checkpoint in a directory it loads from is refused, by the dry run too)."""
    fmt = c.get("ckpt_format")
    if c.get("verify_integrity") and fmt not in (None, "torch_dist"):
        c.error(f"{c.where('verify_integrity')} needs ckpt_format torch_dist (as in Megatron); "
                f"{c.where('ckpt_format')}")
    if fmt not in TORCH_FORMATS:
        return
    io = [k for k in ("save", "load", "pretrained_checkpoint", "train.resume_from") if c.get(k)]
    if io or c.get("enable_checkpointing"):
        c.warnings.append(f"ckpt_format {fmt!r} is a PyTorch format: jaxtrain writes and reads "
                          f"Orbax checkpoints ({', '.join(io) or 'enable_checkpointing'} set), "
                          f"which PyTorch tools cannot open; {TORCH_FORMATS_REASON}")
    else:
        c.warnings.append(f"ckpt_format {fmt!r} has no effect: this run neither saves nor loads "
                          f"a checkpoint (save and load are unset)")
    c.set("ckpt_format", "torch_dist")


def fla_data(c: Context):
    """Primus resolves use_fla_data and fla_cache_dir from its launcher's environment first
    (PRIMUS_FLA_DATA, PRIMUS_FLA_CACHE_DIR); FLA's sample order needs both, and is not built."""
    env = os.environ.get("PRIMUS_FLA_DATA")
    wanted = (env not in ("0", "", "false", "False")) if env is not None else c.get(
        "use_fla_data")
    cache = os.environ.get("PRIMUS_FLA_CACHE_DIR")
    if wanted and cache:
        c.error(f"not implemented yet: FLA-ordered data (use_fla_data with "
                f"PRIMUS_FLA_CACHE_DIR={cache!r} in the environment, as Primus's launcher sets "
                f"it); unset PRIMUS_FLA_CACHE_DIR to read the data as Megatron's dataset does")


def softmax_type(c: Context):
    """Megatron-LM's learnable softmax offset is the per-head sink logit (Primus's
    use_sink_attention)."""
    if c.get("softmax_type") == "learnable":
        c.adopt("use_sink_attention", True, "softmax_type learnable")


def positions(c: Context):
    """Megatron's position_embedding_type yarn is RoPE with YaRN scaling."""
    if c.get("position_embedding_type") == "yarn":
        c.set("position_embedding_type", "rope")
        c.adopt("rope_type", "yarn", "position_embedding_type yarn")


# Megatron-LM's validate_args: arguments that have no default and must be given.
_MEGATRON_LM_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads",
                         "max_position_embeddings")


def hybrid_layer_count(c: Context):
    """Megatron derives num_layers from hybrid_layer_pattern (its main part, without the '|'
    stage cuts); a num_layers given beside it must agree (checked where the model is built)."""
    pattern = c.get("hybrid_layer_pattern")
    if pattern and not c.explicit("num_layers"):
        c.set("num_layers", len(str(pattern).split("/")[0].replace("|", "")))


def megatron_lm_required(c: Context):
    if c.dialect != "megatron-lm":
        return
    missing = [k for k in _MEGATRON_LM_REQUIRED if not c.explicit(k)
               and not (k == "num_layers" and c.get("hybrid_layer_pattern"))]
    if missing:
        flags = ", ".join("--" + k.replace("_", "-") for k in missing)
        c.error(f"a Megatron-LM command line must give {flags} "
                f"(Megatron-LM has no default for {'it' if len(missing) == 1 else 'them'})")


def upcycling(c: Context):
    """moe_use_upcycling converts a dense checkpoint into this MoE model at the first start."""
    if not c.get("moe_use_upcycling"):
        return
    freq = c.get("moe_layer_freq", 1)
    if isinstance(freq, str):
        from jaxtrain.models.moe import parse_layer_freq
        try:
            freq = parse_layer_freq(freq)
        except ValueError:
            freq = 1   # reported where the model is built
    if not c.get("num_experts"):
        c.error("moe_use_upcycling turns a dense checkpoint into an MoE model: set num_experts "
                "(the model has no MoE layers)")
    elif isinstance(freq, (list, tuple)) and not any(freq):
        c.error(f"moe_use_upcycling turns a dense checkpoint into an MoE model, but "
                f"{c.where('moe_layer_freq')} makes no layer an MoE layer")
    if not (c.get("load") or c.get("pretrained_checkpoint")):
        c.error("moe_use_upcycling reads the dense checkpoint to convert from load (or "
                "pretrained_checkpoint): set one of them")


def evaluate_only(c: Context):
    """Primus ``trainable: false`` runs no training step: Megatron's ``skip_train``."""
    if c.get("trainable", True) is False and not c.get("skip_train"):
        if c.explicit("skip_train"):
            c.error(f"trainable: false evaluates only, but {c.where('skip_train')} asks for "
                    "training; keep one")
        else:
            c.set("skip_train", True)


_TOKEN_WEIGHTING = ("plugins.deft", "plugins.dft", "plugins.cadft", "plugins.info_sft",
                    "plugins.pre_rl")


def pgs(c: Context):
    """pgs's own validate(): combinations its trainer refuses."""
    if c.get("packing") and c.get("parallel.context_parallel"):
        c.error("packing and parallel.context_parallel are exclusive (pgs)")
    weighting = [k for k in _TOKEN_WEIGHTING if c.get(k)]
    if len(weighting) > 1:
        c.error(f"choose one token-weighting objective, not {' and '.join(weighting)}")
    scaled = c.get("data.turn_scaling", "uniform") != "uniform"
    if scaled and any(k != "plugins.deft" for k in weighting):
        c.error(f"data.turn_scaling {c.get('data.turn_scaling')} weights the cross-entropy "
                f"(and DEFT); {weighting[0]} replaces it: keep one (pgs)")
    recurrent = _gated_delta_net(c) or "M" in str(c.get("hybrid_layer_pattern") or "") or (
        c.get("model_type") == "mamba" and not c.get("hybrid_layer_pattern"))
    if c.get("train.freeze_non_attention") and not recurrent:
        c.warnings.append("train.freeze_non_attention freezes linear-attention and recurrent "
                          "layers, and this model has none: nothing is frozen (as in pgs)")
    if c.get("data.pretokenize") and c.get("data.seq_len_curriculum"):
        c.error("data.pretokenize fixes the sequence length of the cached stream, and "
                "data.seq_len_curriculum would change it during training: keep one (pgs)")
    if c.get("data.pretokenize") and c.get("data.msft_tracking"):
        c.error("data.pretokenize fixes the data stream on disk, and data.msft_tracking would "
                "change it during training: keep one (pgs)")
    if c.get("plugins.schedule_free"):
        for k in ("train.mona", "train.hyperball"):
            if c.get(k):
                c.error(f"{k} cannot be combined with plugins.schedule_free")
    _pgs_optim_extras(c)
    if c.get("memory.gradient_release"):
        _gradient_release(c)
    if c.get("memory.seco"):
        _seco(c)
    for on, share, every in (("train.ema", "train.ema_decay", "train.ema_every"),
                             ("train.base_merge", "train.base_merge_ratio",
                              "train.base_merge_every")):
        if c.get(on) and not 0.0 <= c.get(share, 0.0) <= 1.0:
            c.error(f"{c.where(share)}: give a value from 0 to 1 ({on} is on)")
        if c.get(on) and c.get(every, 1) < 1:
            c.error(f"{c.where(every)}: give a step count of at least 1 ({on} is on)")
    if c.get("train.ema") and c.get("train.base_merge"):
        c.warnings.append("train.ema with train.base_merge: both change the weights outside the "
                          "optimizer; pgs calls the combination sound but unverified at scale")
    if c.get("preprocess.enabled") and c.get("data.sources"):
        c.error("preprocess.enabled trains on the rows prepared from data.dataset (in "
                "preprocess.output_dir), which replace it; data.sources mixes several datasets: "
                "keep one (to mix prepared sets, list their scored_data files in data.sources)")
    if c.get("preprocess.enabled") and c.get("dpo.enabled"):
        c.error("preprocess.enabled prepares SFT conversations; dpo.enabled trains on preference "
                "pairs: keep one (pgs)")
    if c.get("dpo.enabled"):
        if c.get("data.turn_scaling", "uniform") != "uniform":
            c.error("data.turn_scaling applies to SFT losses; DPO (dpo.enabled) rejects it")
        if c.get("packing") and c.explicit("packing"):
            c.error("dpo.enabled trains on preference pairs; packing is not supported with it")
        _dpo(c)
    smoothing = c.get("dpo.label_smoothing", 0.0)
    if c.get("dpo.loss_type") == "cdpo":
        if not 0.0 <= smoothing <= 1.0:
            c.error(f"{c.where('dpo.label_smoothing')}: the cdpo label smoothing lies in [0, 1]")
    elif smoothing >= 0.5:
        c.error(f"dpo.label_smoothing ({smoothing}) must be below 0.5")
    if smoothing and c.get("dpo.loss_type") not in ("robust", "cdpo"):
        c.error("dpo.label_smoothing applies to dpo.loss_type robust (and cdpo) only")


# dpo.enabled: settings DPO does not combine with (pgs's DPO guide), key -> why
_DPO_REFUSES = {
    "data.sources": "DPO reads its pairs from data.dataset only",
    "data.eval_sources": "DPO validates on data.eval_dataset's pairs only",
    "data.pretokenize": "the cache holds SFT samples, not preference pairs",
    "data.pretrain_replay_dataset": "replay mixes raw text into SFT conversations",
    "data.msft_tracking": "MSFT reweights SFT sources",
    "data.seq_len_curriculum": "the pairs are cut to one fixed length",
    "parallel.context_parallel": "the pair scores need whole sequences on one device",
    "memory.gradient_release": "the fused backward covers the token loss only",
    "memory.seco": "SeCO's chunk-wise step covers the token loss only",
    "rampup_batch_size": "the batch counts pairs, the ramp samples",
    "plugins.sym_noise": "embedding noise makes the policy differ from the reference",
    **{k: "it replaces the cross-entropy that DPO replaces too" for k in _TOKEN_WEIGHTING},
}


def _dpo(c: Context):
    """What pgs's DPO refuses (its guide's list) and what jaxtrain's DPO step does not cover."""
    for key, why in _DPO_REFUSES.items():
        if c.get(key):
            c.error(f"dpo.enabled with {c.where(key)}: not supported ({why})")


# memory.gradient_release (jaxtrain.release) updates each layer during the backward: settings
# that need every gradient before the first update, or that it does not cover. key -> (is it
# on, why)
_RELEASE_REFUSES = {
    "train.ga_ramp_start": (lambda v: v > 0, "the ramp accumulates micro-batches (pgs refuses "
                            "it too)"),
    "train.spike_detection": (bool, "the spike skip needs the global gradient norm before any "
                              "parameter is updated (pgs skips the check under release)"),
    "train.adagc": (bool, "jaxtrain's AdaGC clips globally during its warm-up"),
    "train.mona": (bool, "MONA changes the gradients before the step (pgs: untested)"),
    "train.llrd_decay": (lambda v: v < 1, "the layer-wise LR decay reads the whole stack"),
    "train.hyperball": (bool, "hyperball projects whole tensors after the update"),
    "plugins.schedule_free": (bool, "only element-wise optimizers are covered"),
    "plugins.pre_rl": (bool, "pre_rl's frozen base model is not covered"),
    "fp16": (bool, "fp16 loss scaling skips a step on overflow, which needs every gradient"),
    "num_experts": (lambda v: v > 0, "only dense decoders are covered"),
    "pipeline_model_parallel_size": (lambda v: v > 1, "pipeline stages are not covered"),
    "scan_layers": (lambda v: v is False, "the layer-wise backward scans the layer stack"),
}
_MUONS = ("muon", "dist_muon", "adaptive_muon")


def _seco(c: Context):
    """memory.seco (jaxtrain.seco): pgs's batch-1 single-device chunk-wise step, turn_scaling
    and DPO rejected as in pgs, and what jaxtrain's chunked step does not cover."""
    k = "memory.seco"
    if c.get("memory.seco_chunk_size", 4096) < 1:
        c.error(f"{k} with memory.seco_chunk_size = {c.get('memory.seco_chunk_size')}: give a "
                "chunk length of at least 1 token")
    if c.get("memory.spaco_budget", 0) < 0:
        c.error(f"{k} with memory.spaco_budget = {c.get('memory.spaco_budget')}: give 0 (exact "
                "SeCO) or a positive number of chunks")
    if c.get("micro_batch_size", 1) != 1:
        c.error(f"{k} with micro_batch_size = {c.get('micro_batch_size')}: SeCO trains one "
                "sequence at a time; use 1 (gradient accumulation for a larger batch)")
    if c.world_size is not None and c.world_size > 1:
        c.error(f"{k} with world size = {c.world_size}: SeCO runs on a single device")
    for key, why in (("packing", "packed documents need a segment mask across chunks"),
                     ("dpo.enabled", "DPO trains on preference pairs (pgs)"),
                     ("memory.gradient_release", "both replace the backward"),
                     ("plugins.sym_noise", "its noise scale depends on the whole sequence"),
                     ("plugins.cadft", "its statistics span the whole microbatch"),
                     ("plugins.info_sft", "its statistics span the whole microbatch"),
                     ("plugins.pre_rl", "it needs the base model's pass"),
                     ("num_experts", "MoE router statistics are per sequence")):
        if c.get(key):
            c.error(f"{k} with {key} = {c.get(key)}: not supported ({why})")
    if c.get("data.turn_scaling", "uniform") != "uniform":
        c.error(f"{k} with data.turn_scaling = {c.get('data.turn_scaling')}: pgs rejects "
                "turn_scaling with SeCO; use uniform")


def _gradient_release(c: Context):
    """pgs validate()'s gradient_release rules (GA 1, no Muon, no ga_ramp), what jaxtrain's
    fused step does not cover, and pgs's silent switch-off of global clipping."""
    ga = c.get("train.gradient_accumulation_steps") or c.derived.get("num_microbatches") or 1
    if ga > 1:
        c.error(f"memory.gradient_release with train.gradient_accumulation_steps = {ga}: the "
                "update happens during the backward, so nothing can accumulate; use 1 (a "
                "larger micro-batch instead)")
    for key in ("train.optimizer", "optimizer", "opt_type"):
        if c.get(key) in _MUONS and (key != "train.optimizer"
                                     or c.get("optimizer_family") == "pgs"):
            c.error(f"memory.gradient_release with {key} = {c.get(key)}: Muon orthogonalises "
                    "whole gradient matrices; use an element-wise optimizer (adamw, lion, sgd)")
    for key, (on, why) in _RELEASE_REFUSES.items():
        value = c.get(key)
        if value is not None and on(value):
            c.error(f"memory.gradient_release with {key} = {value!r}: {why}; keep one")
    if (c.get("clip_grad") or 0) > 0:
        c.warnings.append(f"memory.gradient_release turns global gradient clipping off "
                          f"(clip_grad / train.max_grad_norm {c.get('clip_grad')} -> 0): the "
                          "global norm exists only after every update, as in pgs")
        c.set("clip_grad", 0.0)


def _pgs_optim_extras(c: Context):
    """Where pgs's trainer quietly skips train.llrd_decay or train.adamc, refuse the pair."""
    llrd = c.get("train.llrd_decay", 1.0)
    if llrd < 1:
        name = c.get("train.optimizer") if c.get("optimizer_family") == "pgs" else None
        if c.get("plugins.schedule_free"):
            c.error(f"train.llrd_decay = {llrd} cannot be combined with plugins.schedule_free "
                    f"(pgs builds its schedule-free optimizer without per-layer LRs); keep one")
        elif name not in (None, "adamw"):
            c.error(f"train.llrd_decay = {llrd} with train.optimizer = {name}: pgs applies "
                    f"layer-wise LR decay to adamw only and ignores it for {name}; keep one")
    if c.get("train.adamc") and c.get("plugins.schedule_free"):
        c.error("train.adamc cannot be combined with plugins.schedule_free (no LR schedule to "
                "scale the weight decay by; pgs ignores adamc there); keep one")
    if c.get("train.adagc") and c.get("train.spike_detection"):
        c.warnings.append("train.adagc and train.spike_detection overlap: AdaGC already clips "
                          "each tensor's spikes (pgs warns the same); consider "
                          "train.spike_detection: false")


# What the pipeline executor (jaxtrain.parallel.pipeline) does not run yet: key -> (is it on,
# what it is)
_PIPELINE_NOT_YET = {
    "dpo.enabled": (bool, "DPO"),
    "memory.seco": (bool, "SeCO"),
    "plugins.pre_rl": (bool, "pre_rl's frozen base model"),
}


def deferred_wgrad(c: Context):
    """Megatron's checks on defer_embedding_wgrad_compute (which changes nothing here)."""
    if not c.get("defer_embedding_wgrad_compute"):
        return
    if c.get("pipeline_model_parallel_size", 1) <= 1:
        c.error(f"{c.where('defer_embedding_wgrad_compute')} defers work to the pipeline flush; "
                f"it needs pipeline_model_parallel_size > 1 (as in Megatron)")
    if not c.get("gradient_accumulation_fusion", True):
        c.error(f"{c.where('defer_embedding_wgrad_compute')} needs gradient_accumulation_fusion "
                f"(as in Megatron)")
    if c.get("wgrad_deferral_limit", 0) < 0:
        c.error(f"{c.where('wgrad_deferral_limit')} must be at least 0 (0: every microbatch)")


def pipeline_parallel(c: Context):
    """Pipeline parallelism with what its executor does not run yet, refused by name."""
    if c.get("pipeline_model_parallel_size", 1) <= 1:
        return
    for key, (on, what) in _PIPELINE_NOT_YET.items():
        if on(c.get(key)):
            c.error(f"not implemented yet: pipeline_model_parallel_size "
                    f"{c.get('pipeline_model_parallel_size')} with {c.where(key)} ({what})")
    if c.get("pipeline_model_parallel_layout") and c.get("mtp_num_layers"):
        from jaxtrain.parallel.stages import mtp_standalone
        try:
            rank = mtp_standalone(c.values, c.get("pipeline_model_parallel_size"))
        except ConfigError:
            rank = None   # the pipeline plan names the unparsable layout
        if bool(c.get("mtp_standalone")) != (rank is not None):   # Megatron: from the layout
            c.set("mtp_standalone", rank is not None)
        if rank is not None:
            c.warnings.append(f"{c.where('pipeline_model_parallel_layout')} places the MTP "
                              f"layers on pipeline rank {rank} (Megatron's mtp_standalone); "
                              f"jaxtrain runs them with the output layer on the last rank, the "
                              f"same computation placed with the loss")
    fsdp = [k for k in ("use_torch_fsdp2", "parallel.fsdp") if c.get(k)]
    if c.get("data_parallel_sharding_strategy") == "optim_grads_params" and (
            c.get("use_megatron_fsdp") or c.chosen("data_parallel_sharding_strategy")):
        fsdp.append("data_parallel_sharding_strategy")
    if c.get("tensor_model_parallel_size", 1) > 1 and fsdp:
        c.error(f"not implemented yet: pipeline_model_parallel_size "
                f"{c.get('pipeline_model_parallel_size')} with tensor_model_parallel_size "
                f"{c.get('tensor_model_parallel_size')} and {c.where(fsdp[0])} (XLA's partitioner "
                f"fails on the three together); drop one of them (ZeRO-1/2 work)")


RULES = (hybrid_layer_count, megatron_lm_required, enable_gpt_oss, *MAXTEXT_RULES, conventions,
         fla_data, softmax_type, positions, checkpoint_format, precision, tensor_parallel,
         pgs_context_parallel, context_and_experts, model_shape, learning_rate, iterations,
         batch, moe_router, flex_dispatcher, upcycling, pgs, evaluate_only, context_parallel,
         pipeline_parallel, deferred_wgrad, gated_delta_net, sparse_attention, hybrid_models,
         gemma4_global_layers, small_gemma4, multi_token_prediction, short_convolutions,
         hyper_connections, deepseek_v4, kimi_k3)


def apply(c: Context):
    for rule in RULES:
        rule(c)
