"""Subprocess for the layout tests: 8 CPU devices, each named layout trained for a few steps.

``python layout_worker.py WORKDIR train:NAME,NAME specs:NAME,... gathers:NAME`` prints one JSON
object: per layout, its mesh, the sharding spec and memory kind of every parameter and
optimizer-state leaf of its freshly built state, and the losses of its metrics rows
(``train:``), the number of all-gathers in its compiled step (``gathers:``), its gradient
reductions inside and outside the microbatch loop (``reductions:``), or the replica check
before and after one device's copy of a weight is corrupted (``replicas:``).
"""
import json
import pathlib
import re
import sys

import jax

from jaxtrain import loop
from jaxtrain.config import load_config

TINY = ["mock_data=true", "vocab_size=128", "make_vocab_size_divisible_by=32", "seq_length=8",
        "max_position_embeddings=8", "num_layers=2", "hidden_size=32", "num_attention_heads=4",
        "group_query_attention=true", "num_query_groups=2", "micro_batch_size=1",
        "global_batch_size=16", "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0",
        "attention_dropout=0", "log_interval=1", "exp_name=run", "train_iters=5",
        "use_distributed_optimizer=false"]

MOE = ["num_layers=1", "num_experts=8", "moe_router_topk=2", "moe_ffn_hidden_size=32",
       "moe_router_score_function=sigmoid", "moe_router_enable_expert_bias=true",
       "moe_aux_loss_coeff=0.01", "moe_z_loss_coeff=0.001",
       "moe_shared_expert_intermediate_size=16"]
MOE_MIXED = MOE + ["num_layers=2", "moe_layer_freq=[1,0]"]   # an MoE and a dense layer
GDN = ["experimental_attention_variant=gdn", "linear_attention_freq=2", "linear_num_key_heads=2",
       "linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=8",
       "linear_conv_kernel_dim=3", "attention_output_gate=true", "rotary_percent=0.5",
       "gdn_chunk_size=4"]
HYBRID = ["model_type=mamba", "num_layers=4", "hybrid_layer_pattern=M*-M", "mamba_num_heads=4",
          "mamba_head_dim=8", "mamba_num_groups=2", "mamba_state_dim=8", "mamba_chunk_size=4",
          "position_embedding_type=none"]
PRIMUS_KDA = ["model_type=mamba", "num_layers=4", "hybrid_layer_pattern=M*-M",
              "spec=[primus.backends.megatron.core.models.hybrid.hybrid_mamba_mla_layer_specs,"
              "kda_hybrid_stack_spec]", "linear_num_key_heads=2", "linear_num_value_heads=4",
              "linear_key_head_dim=8", "linear_value_head_dim=16", "linear_conv_kernel_dim=3",
              "gdn_chunk_size=4", "position_embedding_type=none"]
# Gemma 4 small: sliding/global layers (the global ones 16 wide), per-layer inputs, the last two
# layers sharing the first two's keys and values with MLPs twice as wide
SMALL_GEMMA4 = ["normalization=RMSNorm", "position_embedding_type=rope", "num_layers=4",
                "window_size=[3,0]", "window_attn_skip_freq=2", "global_kv_channels=16",
                "qk_layernorm=true",
                "v_norm=plain", "layer_scalar=true", "post_attention_norm=true",
                "post_mlp_norm=true", "hidden_size_per_layer_input=4", "num_kv_shared_layers=2",
                "use_double_wide_mlp=true", "swiglu=true", "ffn_hidden_size=32"]
MOE_CAPACITY = ["moe_expert_capacity_factor=1.0", "moe_pad_expert_input_to_capacity=true"]

LAYOUTS = {
    "one": (1, []),
    "dp": (8, []),
    "zero1": (8, ["use_distributed_optimizer=true"]),
    "zero2": (8, ["use_megatron_fsdp=true", "data_parallel_sharding_strategy=optim_grads"]),
    "fsdp": (8, ["use_megatron_fsdp=true",
                 "data_parallel_sharding_strategy=optim_grads_params"]),
    "torch_fsdp2": (8, ["use_torch_fsdp2=true"]),
    "pgs_fsdp": (8, ["parallel.fsdp=true"]),
    "tp": (8, ["tensor_model_parallel_size=2", "sequence_parallel=false"]),
    "tp_sp": (8, ["tensor_model_parallel_size=2", "sequence_parallel=true"]),
    "tp_fsdp": (8, ["tensor_model_parallel_size=2", "use_torch_fsdp2=true",
                    "parallel.reshard_after_forward=false"]),
    "instances": (8, ["use_distributed_optimizer=true", "num_distributed_optimizer_instances=2"]),
    "offload": (8, ["use_torch_fsdp2=true", "parallel.cpu_offload=true",
                    "optimizer_cpu_offload=true", "optimizer_offload_fraction=0.5"]),
    "unpinned": (8, ["optimizer_cpu_offload=true", "pin_cpu_params=false"]),
    "fsdp_keep": (8, ["use_torch_fsdp2=true", "parallel.reshard_after_forward=false"]),
    "tp_recompute": (8, ["tensor_model_parallel_size=2", "sequence_parallel=false",
                         "recompute_granularity=full", "recompute_method=uniform",
                         "recompute_num_layers=1"]),
    "tp_distribute": (8, ["tensor_model_parallel_size=2", "sequence_parallel=false",
                          "recompute_granularity=full", "recompute_method=uniform",
                          "recompute_num_layers=1", "distribute_saved_activations=true"]),
    "tp_pp_dp": (8, ["tensor_model_parallel_size=2", "use_tp_pp_dp_mapping=true"]),
    # 4 microbatches per step: the gradient reduced once per step (jaxtrain.parallel.accumulate)
    "one_ga4": (1, ["global_batch_size=32"]),
    "zero1_ga4": (8, ["global_batch_size=32", "use_distributed_optimizer=true"]),
    "zero2_ga4": (8, ["global_batch_size=32", "use_megatron_fsdp=true",
                      "data_parallel_sharding_strategy=optim_grads"]),
    "fsdp_ga4": (8, ["global_batch_size=32", "use_torch_fsdp2=true"]),
    # context parallelism (jaxtrain.parallel.context) must not change the losses
    "cp4": (8, ["context_parallel_size=4"]),
    "cp2_allgather": (8, ["context_parallel_size=2", "cp_comm_type=all_gather"]),
    "cp2_a2a": (8, ["context_parallel_size=2", "cp_comm_type=a2a"]),
    "cp2_tp2": (8, ["context_parallel_size=2", "tensor_model_parallel_size=2",
                    "sequence_parallel=false"]),
    "cp2_fsdp": (8, ["context_parallel_size=2", "use_torch_fsdp2=true"]),
    # Gated DeltaNet hybrid (one linear and one gated-attention layer): heads split by TP
    "gdn": (1, GDN),
    "gdn_tp_sp_fsdp": (8, GDN + ["tensor_model_parallel_size=2", "sequence_parallel=true",
                                 "use_torch_fsdp2=true"]),
    # Kimi Delta Attention in the same places: per-channel decays split with their heads
    "kda": (1, GDN + ["linear_attention_kind=kda", "linear_num_value_heads=2"]),
    "kda_tp_sp_fsdp": (8, GDN + ["linear_attention_kind=kda", "linear_num_value_heads=2",
                                 "tensor_model_parallel_size=2", "sequence_parallel=true",
                                 "use_torch_fsdp2=true"]),
    # Primus's hybrid KDA stack (FLA's KDA: twice the value heads, value-wide decay bottleneck,
    # gate bias)
    "kda_primus": (1, PRIMUS_KDA),
    "kda_primus_tp_sp_fsdp": (8, PRIMUS_KDA + ["tensor_model_parallel_size=2",
                                               "sequence_parallel=true", "use_torch_fsdp2=true"]),
    # Megatron's hybrid stack (Mamba, attention, MLP, Mamba): heads and groups split by TP
    "hybrid": (1, HYBRID),
    "hybrid_tp_sp_fsdp": (8, HYBRID + ["tensor_model_parallel_size=2", "sequence_parallel=true",
                                       "use_torch_fsdp2=true"]),
    "small_gemma4": (1, SMALL_GEMMA4),
    "small_gemma4_tp_sp_fsdp": (8, SMALL_GEMMA4 + [
        "tensor_model_parallel_size=2", "sequence_parallel=true", "use_torch_fsdp2=true",
        "recompute_granularity=full", "recompute_method=uniform", "recompute_num_layers=1"]),
    # MoE: expert parallelism must not change the losses
    "moe": (8, MOE),
    "moe_ep2": (8, MOE + ["expert_model_parallel_size=2"]),
    "moe_ep4": (8, MOE + ["expert_model_parallel_size=4", "moe_token_dispatcher_type=alltoall"]),
    "moe_capacity": (8, MOE + MOE_CAPACITY),
    "moe_ep4_capacity": (8, MOE + MOE_CAPACITY + ["expert_model_parallel_size=4"]),
    "moe_ep2_a2a_capacity": (8, MOE + MOE_CAPACITY + ["expert_model_parallel_size=2",
                                                      "moe_token_dispatcher_type=alltoall"]),
    "moe_tp": (8, MOE + ["tensor_model_parallel_size=2"]),
    "moe_ep2_tp": (8, MOE + ["tensor_model_parallel_size=2", "expert_model_parallel_size=2"]),
    "moe_ep2_fsdp": (8, MOE + ["expert_model_parallel_size=2", "use_torch_fsdp2=true"]),
    "moe_mixed": (8, MOE_MIXED),
    "moe_mixed_ep4_recompute": (8, MOE_MIXED + ["expert_model_parallel_size=4",
                                                "recompute_granularity=full",
                                                "recompute_method=uniform",
                                                "recompute_num_layers=2"]),
}


def _spec(x):
    spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _leaves(tree):
    return {jax.tree_util.keystr(path): {"spec": _spec(x), "memory": x.sharding.memory_kind}
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def all_gathers(run) -> int:
    """All-gather ops in the compiled train step of ``run`` (a loop.Setup)."""
    from jaxtrain.data.batches import global_batches

    batch = run.put_batch(next(global_batches(run.data, run.tcfg, seed=0)))
    text = run.step_fn.lower(run.state, batch).compile().as_text()
    return len(re.findall(r"= \S+ all-gather(?:-start)?\(", text))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_CALLED = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.-]+)")
_REDUCTION = re.compile(r"\s(?:all-reduce|reduce-scatter)(?:-start)?\(")


def reductions(run, microbatches: int) -> dict:
    """Gradient reductions (all-reduce, reduce-scatter ops) of the compiled train step: inside
    the loop over the microbatches after the first (trip count M - 1), and in all."""
    from jaxtrain.data.batches import global_batches

    batch = run.put_batch(next(global_batches(run.data, run.tcfg, seed=0)))
    text = run.step_fn.lower(run.state, batch).compile().as_text()
    calls, count, current, loop = {}, {}, None, None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            calls[current], count[current] = [], 0
            continue
        if current is None:
            continue
        calls[current] += _CALLED.findall(line)
        count[current] += bool(_REDUCTION.search(line))
        if " while(" in line and f'"n":"{microbatches - 1}"' in line:
            loop = re.search(r"body=%([\w.-]+)", line).group(1)
    inside, todo = set(), [loop] if loop else []
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo += calls.get(name, [])
    return {"in_loop": sum(count.get(c, 0) for c in inside), "total": sum(count.values()),
            "loop_found": loop is not None}


def replica_check(run) -> dict:
    """Mismatched replicas found before and after corrupting one device's copy of a weight."""
    import numpy as np

    from jaxtrain.parallel.replicas import replica_mismatches

    before = replica_mismatches(run.state.params)
    wq = run.state.params["layers"]["attn"]["wq"]
    shards = [np.asarray(s.data) for s in wq.addressable_shards]
    shards[-1] = shards[-1] + 1.0
    bad = jax.make_array_from_single_device_arrays(
        wq.shape, wq.sharding,
        [jax.device_put(x, s.device) for x, s in zip(shards, wq.addressable_shards)])
    after = replica_mismatches({**run.state.params, "wq": bad})
    return {"before": before, "after": after}


def main(workdir: str, names: list[str], mode: str = "train") -> dict:
    out = {}
    for name in names:
        count, extra = LAYOUTS[name]
        cfg = load_config(None, [*TINY, f"workspace={workdir}/{name}", *extra],
                          world_size=count)
        devices = jax.devices()[:count]
        run = loop.build(cfg, devices)
        out[name] = {"params": _leaves(run.state.params), "opt_state": _leaves(run.state.opt_state),
                     "mesh": dict(run.layout.mesh.shape),
                     "devices": [d.id for d in run.layout.mesh.devices.flat]}
        if mode == "replicas":
            out[name]["replicas"] = replica_check(run)
        if mode == "gathers":
            out[name]["all_gathers"] = all_gathers(run)
        if mode == "reductions":
            out[name]["reductions"] = reductions(run, run.tcfg.num_microbatches)
        if mode == "train":
            loop.train(cfg, devices=devices)
            rows = (pathlib.Path(workdir) / name / "run" / "metrics.jsonl").read_text()
            out[name]["losses"] = [json.loads(r)["loss"] for r in rows.splitlines()]
            out[name]["moe_aux_loss"] = [json.loads(r).get("moe_aux_loss")
                                         for r in rows.splitlines()]
    return out


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    result = {}
    for arg in sys.argv[2:]:
        mode, names = arg.split(":")
        for name, got in main(sys.argv[1], names.split(","), mode).items():
            result.setdefault(name, {}).update(got)
    print(json.dumps(result))
