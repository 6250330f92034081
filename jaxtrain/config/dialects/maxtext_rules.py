"""MaxText's pyconfig rules: what its keys imply for the canonical knobs.

The mesh sizes (``ici_*`` x ``dcn_*``, one ``-1`` filled from the device count) become the
Megatron parallel sizes; MaxText's sentinels (``steps: -1``, ``eval_steps: -1``) and derived
values (``opt_type``, ``mu_dtype``, ``per_device_batch_size``) become canonical values; the model
keys are in ``maxtext_model``. Each rule reads a rules.Context ``c``.
"""
from __future__ import annotations

import math

from jaxtrain.config.dialects.maxtext_model import maxtext_model

_MESH_AXES = ("diloco", "data", "fsdp", "fsdp_transpose", "tensor", "tensor_sequence", "expert",
              "sequence", "context", "context_usp_ulysses", "context_autoregressive",
              "autoregressive", "pipeline")
# MaxText mesh axes jaxtrain does not build yet: axis -> (what it is, issue).
_PLANNED_AXES = {"sequence": ("sequence parallelism of activations", 23),
                 "context_autoregressive": ("context parallelism for decoding", 23),
                 "diloco": ("DiLoCo (local SGD between replicas)", None),
                 "autoregressive": ("the decoding mesh axis", None)}
# ici/dcn_pipeline_parallelism sizes the mesh axis MaxText names 'stage'.
_AXIS_NAME = {a: "stage" if a == "pipeline" else a for a in _MESH_AXES}
_DATA_AXES = ("diloco", "data", "fsdp", "fsdp_transpose")
_TENSOR_AXES = ("tensor", "tensor_sequence")
# MaxText logical axes that jaxtrain's table (parallel/sharding.py) splits over the tensor axis.
_TENSOR_NAMES = ("vocab", "heads", "q_heads", "kv_heads", "mlp", "mlp_moe", "mlp_no_fsdp",
                 "activation_heads", "activation_kv_heads", "activation_mlp",
                 "activation_mlp_moe", "activation_vocab", "activation_kv",
                 "activation_kv_head_dim", "cache_heads", "paged_kv_heads", "gdn_head")


def _mesh_sizes(c) -> dict | None:
    """MaxText axis sizes (ici x dcn, -1 filled), or None when a -1 needs the device count."""
    ici = {a: c.get(f"ici_{a}_parallelism", 1) for a in _MESH_AXES}
    dcn = {a: c.get(f"dcn_{a}_parallelism", 1) for a in _MESH_AXES}
    dcn = {a: 1 if v == -1 else v for a, v in dcn.items()}  # one GPU job is one slice
    fills = [a for a, v in ici.items() if v == -1]
    bad = [f"ici_{a}_parallelism = {v}" for a, v in ici.items() if v == 0 or v < -1] + [
        f"dcn_{a}_parallelism = {v}" for a, v in dcn.items() if v == 0 or v < -1]
    if bad:
        c.error(f"MaxText parallelism sizes must be positive or -1 (fill): {', '.join(bad)}")
        return None
    if len(fills) > 1:
        c.error("only one ici_*_parallelism may be -1 (fill the remaining devices): "
                + ", ".join(f"ici_{a}_parallelism" for a in fills))
        return None
    fixed = math.prod(v for v in ici.values() if v != -1) * math.prod(dcn.values())
    if fills:
        if c.world_size is None:
            return None
        if c.world_size % fixed:
            c.error(f"{c.world_size} devices cannot be filled on ici_{fills[0]}_parallelism: "
                    f"the other ici/dcn sizes multiply to {fixed}")
            return None
        ici[fills[0]] = c.world_size // fixed
    sizes = {a: ici[a] * dcn[a] for a in _MESH_AXES}
    total = math.prod(sizes.values())
    if c.world_size is not None and total != c.world_size:
        c.error(f"the MaxText mesh (ici x dcn sizes) has {total} devices, but the run has "
                f"{c.world_size}; set one ici_*_parallelism to -1 or fix the sizes")
        return None
    return sizes


def maxtext_mesh(c):
    """ici_*/dcn_* sizes onto the mesh knobs (see config/areas/parallel.py)."""
    if c.dialect != "maxtext" and not any(
            c.explicit(f"{lvl}_{a}_parallelism") for lvl in ("ici", "dcn") for a in _MESH_AXES):
        return
    sizes = _mesh_sizes(c)
    if sizes is not None:
        c.derived["maxtext_mesh"] = {a: n for a, n in sizes.items() if n > 1}
    guess = _sizes_or_guess(c)
    for axis, (what, issue) in _PLANNED_AXES.items():
        if guess[axis] > 1:
            where = f"issue #{issue}" if issue else "a later issue"
            size = sizes[axis] if sizes else "-1 (fill)" if -1 in (
                c.get(f"ici_{axis}_parallelism"), c.get(f"dcn_{axis}_parallelism")) else guess[axis]
            keys = [f"{lvl}_{axis}_parallelism" for lvl in ("ici", "dcn")
                    if c.get(f"{lvl}_{axis}_parallelism", 1) != 1]
            c.error(f"not implemented yet: {axis} parallelism of {size} "
                    f"({', '.join(c.where(k) for k in keys)}) is {what}, planned for {where}; "
                    f"set {' and '.join(keys)} to 1")
    if sizes is None:
        return
    c.adopt("tensor_model_parallel_size", sizes["tensor"] * sizes["tensor_sequence"],
            "ici/dcn_tensor_parallelism x ici/dcn_tensor_sequence_parallelism")
    if sizes["tensor_sequence"] > 1:   # MaxText's tensor_sequence axis: TP plus sequence sharding
        c.adopt("sequence_parallel", True, "ici/dcn_tensor_sequence_parallelism > 1")
    c.adopt("expert_model_parallel_size", sizes["expert"], "ici/dcn_expert_parallelism")
    c.adopt("pipeline_model_parallel_size", sizes["pipeline"], "ici/dcn_pipeline_parallelism")
    _pipeline(c, sizes["pipeline"])
    _context(c, sizes["context"], sizes["context_usp_ulysses"])
    if sizes["fsdp"] * sizes["fsdp_transpose"] > 1:
        c.adopt("data_parallel_sharding_strategy", "optim_grads_params",
               "ici/dcn_fsdp_parallelism > 1")


def _pipeline(c, stages: int):
    """MaxText's pipeline onto jaxtrain's executor: stages x num_layers_per_pipeline_stage x
    num_pipeline_repeats layers (repeats > 1: that many virtual stages per rank), and
    num_pipeline_microbatches splitting each micro-step's rows (-1: the stage count, twice it
    with pipeline_delay_activation_forwarding; see per_device_batch)."""
    if stages <= 1:
        return
    layers, per_stage = c.get("num_layers"), c.get("num_layers_per_pipeline_stage", 1)
    if c.get("pipeline_parallel_layers", -1) not in (-1, layers):
        c.error(f"not implemented yet: {c.where('pipeline_parallel_layers')} pipelines only "
                f"some of the {layers} layers; use -1 (all)")
        return
    repeats = c.get("num_pipeline_repeats", -1)
    if repeats == -1 and layers % (stages * per_stage) == 0:
        repeats = layers // (stages * per_stage)
    if stages * per_stage * repeats != layers:
        c.error(f"{stages} pipeline stages x num_layers_per_pipeline_stage {per_stage} x "
                f"num_pipeline_repeats {c.get('num_pipeline_repeats', -1)} must give the "
                f"{layers} decoder layers (MaxText's rule)")
        return
    if repeats > 1:
        c.adopt("virtual_pipeline_model_parallel_size", repeats,
                "num_pipeline_repeats (circular pipeline)")
    micro = c.get("num_pipeline_microbatches", -1)
    if micro == -1:
        micro = stages * (2 if c.get("pipeline_delay_activation_forwarding") else 1)
    if micro % stages:
        c.error(f"{c.where('num_pipeline_microbatches')} must be a multiple of the {stages} "
                f"pipeline stages (MaxText's rule)")
        return
    c.derived["maxtext_pipeline_microbatches"] = micro


# MaxText context_parallel_strategy -> Megatron cp_comm_type
_CP_STRATEGY = {"all_gather": "allgather", "ring": "p2p", "ulysses": "a2a", "usp": "a2a+p2p"}


def _context(c, ring: int, ulysses: int):
    """The context and context_usp_ulysses axes as context parallelism: their product is the
    degree, context_parallel_strategy the exchange; usp runs the all-to-all inside groups of
    the Ulysses axis's size and a ring across them (Megatron's a2a+p2p)."""
    cp = ring * ulysses
    c.adopt("context_parallel_size", cp, "ici/dcn_context(_usp_ulysses)_parallelism")
    if cp <= 1:
        return
    strategy = c.get("context_parallel_strategy", "all_gather")
    if ulysses > 1 and strategy != "usp":
        c.error(f"ici/dcn_context_usp_ulysses_parallelism = {ulysses} is the all-to-all axis of "
                f"context_parallel_strategy usp, but {c.where('context_parallel_strategy')}; "
                f"set the strategy to usp or the axis to 1")
        return
    c.adopt("cp_comm_type", _CP_STRATEGY[strategy], "context_parallel_strategy")
    if strategy == "usp":
        c.adopt("hierarchical_context_parallel_sizes", [ulysses, ring],
                "ici/dcn_context_usp_ulysses_parallelism x ici/dcn_context_parallelism")


def maxtext(c):
    """MaxText's sentinels and derived values (its pyconfig): steps -1, eval -1, opt_type,
    mu_dtype, the two load paths, and per_device_batch_size."""
    if c.get("train_iters") == -1:
        horizon = c.get("lr_decay_iters")
        if horizon is None:
            c.error("steps = -1 takes the run length from learning_rate_schedule_steps, which "
                    "is -1 too; set one of them")
        else:
            c.set("train_iters", horizon)
    if c.dialect == "maxtext" and (c.get("eval_interval") or 0) <= 0 and \
            c.values.get("eval_interval") is not None:
        c.set("eval_interval", None)  # MaxText: eval_interval <= 0 means no evaluation
    iters = c.values.get("eval_iters")
    if isinstance(iters, int) and iters < 0:
        c.set("eval_iters", 0)  # MaxText eval_steps -1: the whole validation split
        if c.get("eval_interval"):
            c.set("full_validation", True)
    opt = c.values.get("opt_type")
    if opt in ("adamw", "adam_pax", "sgd") and (c.dialect == "maxtext" or c.explicit("opt_type")):
        c.adopt("optimizer", {"sgd": "sgd"}.get(opt, "adam"), f"opt_type {opt}")
        if opt == "sgd" and c.get("weight_decay") and not c.explicit("weight_decay"):
            c.set("weight_decay", 0.0)  # adam_weight_decay is Adam's; MaxText's SGD has none
    if c.dialect == "maxtext":
        mu = c.get("exp_avg_dtype")
        if not c.chosen("exp_avg_dtype") and c.get("weight_dtype") == "bfloat16":
            mu = "bf16"  # mu_dtype unset inherits weight_dtype
            c.set("exp_avg_dtype", mu)
        grads = c.get("main_grads_dtype")   # grad_dtype
        if (mu != "fp32" or grads not in (None, "fp32")) and \
                not c.get("use_precision_aware_optimizer"):
            c.set("use_precision_aware_optimizer", True)
    if c.get("pretrained_checkpoint") and c.get("train.resume_from") and c.explicit(
            "pretrained_checkpoint") and c.explicit("train.resume_from"):
        c.error(f"load_parameters_path (weights only) and load_full_state_path (full state) "
                f"are exclusive, as in MaxText: {c.where('pretrained_checkpoint')}, "
                f"{c.where('train.resume_from')}; keep one")
    per_device_batch(c)


def maxtext_dpo(c):
    """MaxText's use_dpo as jaxtrain's DPO: the label-smoothed sigmoid (cdpo) on pairs from its
    hf files, with MaxText's own refusals (use_sft, packing, ORPO here) and its prompt budget
    (dpo.max_prompt_length, half of max_target_length by default)."""
    if not c.get("use_dpo"):
        return
    if c.get("use_sft"):
        c.error("use_sft and use_dpo: only one of them can be true (MaxText)")
    if c.get("dpo.algo") == "orpo":
        c.error("dpo.algo orpo: MaxText's reference-free ORPO is not built in jaxtrain; use "
                "dpo.algo dpo (DPO against the starting weights)")
    if c.get("dataset_type") != "hf":
        c.error(f"use_dpo with dataset_type {c.get('dataset_type')}: jaxtrain reads MaxText's "
                "preference pairs from dataset_type hf files (hf_path / hf_train_files)")
    if c.get("packing") and c.explicit("packing"):
        c.error("use_dpo: packing is not supported with DPO; set packing: false (MaxText)")
    c.set("packing", False)
    for key in ("train_data_columns", "eval_data_columns"):
        columns = c.get(key)
        columns = [columns] if isinstance(columns, str) else list(columns or ())
        if len(columns) not in (2, 3):
            c.error(f"use_dpo reads [prompt, chosen, rejected] or [chosen, rejected] columns; "
                    f"{c.where(key)} names {len(columns)}")
    target = c.get("seq_length")
    prompt = c.get("dpo.max_prompt_length")
    if prompt is None and target:
        c.set("dpo.max_prompt_length", target // 2)
    elif target and not 0 < prompt < target:
        c.error(f"dpo.max_prompt_length ({prompt}) must be positive and less than "
                f"max_target_length ({target})")
    c.set("dpo.enabled", True)
    c.set("dpo.loss_type", "cdpo")


def per_device_batch(c):
    """MaxText's batch: per_device_batch_size x devices x gradient_accumulation_steps sequences
    per step, run as micro-batches of per_device_batch_size x devices rows."""
    pdbs = c.values.get("per_device_batch_size")
    if pdbs is None:
        return
    if not c.chosen("per_device_batch_size") and any(
            c.chosen(k) for k in ("micro_batch_size", "global_batch_size")):
        return  # a Megatron batch written in a MaxText file: the MaxText default yields
    if pdbs <= 0:
        c.error(f"per_device_batch_size must be positive, got {pdbs}")
        return
    accum = c.get("train.gradient_accumulation_steps") or 1
    if c.world_size is None:
        if pdbs == int(pdbs):  # without the device count: the per-replica batch of pure DP
            c.adopt("micro_batch_size", int(pdbs), "per_device_batch_size")
        return
    rows = pdbs * c.world_size
    model_parallel = (c.get("tensor_model_parallel_size", 1)
                      * c.get("pipeline_model_parallel_size", 1)
                      * c.get("context_parallel_size", 1))
    dp = c.world_size // model_parallel if c.world_size % model_parallel == 0 else None
    if dp is None:
        return  # batch() reports the layout
    # a pipelined micro-step runs as num_pipeline_microbatches microbatches
    split = c.derived.get("maxtext_pipeline_microbatches", 1)
    if split > 1:
        if rows != int(rows) or int(rows) % (dp * split):
            c.error(f"per_device_batch_size {pdbs} x {c.world_size} devices = {rows:g} "
                    f"sequences per micro-step cannot be split into {split} pipeline "
                    f"microbatches (num_pipeline_microbatches) over {dp} data-parallel "
                    f"replicas; make it a multiple of {dp * split}")
            return
        c.adopt("micro_batch_size", int(rows) // (dp * split),
                "per_device_batch_size x devices / num_pipeline_microbatches")
        # jaxtrain's accumulation counts every pipeline microbatch of the step
        c.set("train.gradient_accumulation_steps", accum * split)
        c.adopt("global_batch_size", int(rows) * accum,
                "per_device_batch_size x devices x gradient_accumulation_steps")
        return
    if rows != int(rows) or int(rows) % dp:
        c.error(f"per_device_batch_size {pdbs} x {c.world_size} devices = {rows:g} sequences "
                f"per micro-step, which the {dp} data-parallel replicas cannot share evenly; "
                f"choose per_device_batch_size so that it x devices is a multiple of {dp}")
        return
    c.adopt("micro_batch_size", int(rows) // dp, "per_device_batch_size")
    c.adopt("train.gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    c.adopt("global_batch_size", int(rows) * accum,
           "per_device_batch_size x devices x gradient_accumulation_steps")


def _sizes_or_guess(c) -> dict:
    """Axis sizes; before the device count is known, an axis set to -1 counts as 2 (> 1)."""
    mesh = c.derived.get("maxtext_mesh")
    if mesh is not None:
        return {a: mesh.get(a, 1) for a in _MESH_AXES}
    guess = {}
    for a in _MESH_AXES:
        values = [c.get(f"{level}_{a}_parallelism", 1) for level in ("ici", "dcn")]
        guess[a] = math.prod(2 if v == -1 else max(v, 1) for v in values)
    return guess


def sharding_hints(c):
    """MaxText's sharding hints (mesh_axes, data_sharding, logical_axis_rules) against what
    jaxtrain's own logical-axis table does: placements it also makes (batch and parameters over
    the data-parallel axes and experts, heads/MLP/vocab over tensor) are accepted; a placement it
    cannot make is refused by naming the entry. Sharding never changes the numbers in JAX, only
    where they live, so accepting a hint means "jaxtrain lays it out its own, equivalent way"."""
    if c.dialect != "maxtext":
        return
    sizes = _sizes_or_guess(c)
    for key in ("mesh_axes", "data_sharding_axes", "logical_axis_rules"):
        value = c.values.get(key)
        if value is None or value == c.defaults.get(key) or not c.explicit(key):
            continue
        if key == "mesh_axes":
            names = tuple(_AXIS_NAME.values())
            unknown = [a for a in value if a not in names]
            if unknown:
                c.error(f"mesh_axes names {unknown}, which are not MaxText mesh axes "
                        f"({', '.join(names)})")
            used = [_AXIS_NAME[a] for a in _MESH_AXES
                    if sizes.get(a, 1) > 1 and _AXIS_NAME[a] not in value]
            if used:
                c.error(f"mesh_axes leaves out {used}, whose ici/dcn sizes are > 1")
        elif key == "data_sharding_axes":
            axes = {a for group in value for a in ([group] if isinstance(group, str) else group)}
            tensor = [a for a in axes if a in _TENSOR_AXES and sizes.get(a, 1) > 1]
            if tensor:
                c.error(f"data_sharding shards the batch over {tensor}; jaxtrain shards it over "
                        f"the data-parallel and expert axes only (tensor ranks share a batch)")
        else:
            for rule in value:
                _check_rule(c, rule, sizes)


def _check_rule(c, rule, sizes):
    if not isinstance(rule, (list, tuple)) or len(rule) != 2:
        c.error(f"logical_axis_rules entry {rule!r} is not [logical_axis, mesh_axes]")
        return
    name, axes = rule
    axes = [axes] if isinstance(axes, str) else list(axes or [])
    live = [a for a in axes if sizes.get("pipeline" if a == "stage" else a, 1) > 1]
    tensor = [a for a in live if a in _TENSOR_AXES]
    other = [a for a in live if a not in _TENSOR_AXES + _DATA_AXES + ("expert",)]
    if other:
        return   # context/pipeline axes > 1 are refused by maxtext_mesh already
    if tensor and name not in _TENSOR_NAMES:
        c.error(f"logical_axis_rules entry [{name!r}, {axes}] splits {name} over {tensor}, "
                f"which jaxtrain's logical-axis table does not do (it splits heads, MLP and "
                f"vocabulary over tensor); drop the entry")


MAXTEXT_RULES = (maxtext_mesh, sharding_hints, maxtext, maxtext_model, maxtext_dpo)
