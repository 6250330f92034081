"""Model-parallel layout: tensor, sequence, expert, pipeline and context parallel degrees."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")
_CP_ROTATE_METHODS = ("allgather", "alltoall")
_PP_COMM_BACKENDS = ("nccl", "ucc")

_ENCODER = ("encoder-decoder models are another model family; jaxtrain trains decoder-only "
            "language models")

KNOBS = [
    # Tensor, sequence and expert parallelism (Megatron)
    K("tensor_model_parallel_size", "int", 1, "Tensor-parallel degree: how many devices split each "
      "layer's weight matrices.", "megatron", status=HONORED,
      aliases=(Alias("model_parallel_size", "megatron",
                     note="deprecated Megatron spelling; Megatron now refuses it, jaxtrain reads "
                          "it as the tensor-parallel degree"),)),
    K("sequence_parallel", "bool", True, "With TP > 1, also shard norms/dropout activations along "
      "the sequence over the tensor axis; off when TP = 1.", "megatron", status=HONORED),
    K("expert_model_parallel_size", "int", 1, "Expert-parallel degree: how many devices the MoE "
      "experts are spread over.", "megatron", status=HONORED),
    K("expert_tensor_parallel_size", "int", None, "Tensor-parallel degree inside each expert; null "
      "means the same as tensor_model_parallel_size.", "megatron", status=HONORED),
    K("high_priority_stream_groups", "list[str]", [], "Communicator groups (e.g. ep, tp) whose "
      "collectives get high-priority CUDA streams.", "megatron", INERT,
      "CUDA stream priority of torch process groups; XLA issues its async collectives on its own "
      "streams (high priority by default), there are no per-group streams to rank"),

    # Encoder-decoder splits (Megatron)
    K("encoder_tensor_model_parallel_size", "int", 0, "Tensor-parallel degree of the encoder of an "
      "encoder-decoder model.", "megatron", REJECTED, _ENCODER),
    K("encoder_pipeline_model_parallel_size", "int", 0, "Pipeline stages given to the encoder of "
      "an encoder-decoder model.", "megatron", REJECTED, _ENCODER),
    K("pipeline_model_parallel_split_rank", "int", None, "Pipeline rank where the encoder ends and "
      "the decoder starts (deprecated in Megatron).", "megatron", REJECTED, _ENCODER),

    # Pipeline parallelism (Megatron); no issue builds it yet
    K("pipeline_model_parallel_size", "int", 1, "Pipeline-parallel degree: number of stages the "
      "layer stack is cut into.", "megatron", status=HONORED),
    K("pipeline_model_parallel_layout", "str", None, "Explicit layer-to-stage layout string (e.g. "
      "'Et*3|(tt|)*29,m|L'); overrides the even split.", "megatron", status=HONORED),
    K("pipeline_model_parallel_comm_backend", "str", None, "Library for pipeline send/recv "
      "(nccl or ucc); null uses the default backend.", "megatron", REJECTED,
      "JAX's runtime (jax.distributed.initialize) owns communication; XLA moves pipeline "
      "activations with its own NCCL/RCCL collectives and cannot use UCC",
      choices=_PP_COMM_BACKENDS),
    K("decoder_first_pipeline_num_layers", "int", None, "Layers on the first pipeline stage for an "
      "uneven split; null splits evenly.", "megatron", status=HONORED),
    K("decoder_last_pipeline_num_layers", "int", None, "Layers on the last pipeline stage for an "
      "uneven split; null splits evenly.", "megatron", status=HONORED),
    K("virtual_pipeline_model_parallel_size", "int", None, "Interleaved pipeline: model chunks "
      "(virtual stages) held by each pipeline rank.", "megatron", status=HONORED),
    K("num_layers_per_virtual_pipeline_stage", "int", None, "Interleaved pipeline: layers in each "
      "virtual stage (another way to set the chunk count).", "megatron", status=HONORED),
    K("num_virtual_stages_per_pipeline_rank", "int", None, "Interleaved pipeline: virtual stages "
      "per pipeline rank (another way to set the chunk count).", "megatron", status=HONORED),
    K("microbatch_group_size_per_vp_stage", "int", None, "Interleaved pipeline: consecutive "
      "microbatches run per virtual stage; null means the PP degree.", "megatron",
      status=HONORED),

    # Context parallelism (Megatron; issue #23 builds the rest)
    K("context_parallel_size", "int", 1, "Context-parallel degree: devices the sequence of each "
      "sample is split across inside attention.", "megatron", status=HONORED),
    K("cp_comm_type", "str|list[str]", "p2p", "How context-parallel attention exchanges K/V (ring "
      "p2p, all-gather, all-to-all, both); may be a per-layer list.", "megatron",
      choices=_CP_COMM_TYPES, value_aliases={"all_gather": "allgather"}, status=HONORED),
    K("hierarchical_context_parallel_sizes", "list[int]", None, "Group sizes of the levels of "
      "hierarchical CP (a2a+p2p): the all-to-all level, then the ring; their product is the CP "
      "degree.", "megatron", status=HONORED),

    # pgs-train parallel section
    K("parallel.fsdp", "bool", False, "Shard parameters, gradients and optimizer state over the "
      "data-parallel devices (FSDP; on by default in pgs files); off on one device.",
      "pgs-train", status=HONORED, doc_defaults={"pgs-train": True, "pgs-distill": True}),
    K("parallel.cpu_offload", "bool", False, "Keep the sharded parameters in host memory between "
      "uses (large memory saving, much slower).", "pgs-train", status=HONORED,
      aliases=(Alias("parameter_memory_host_offload", "maxtext",
                     note="MaxText's switch for parameters kept in host memory"),)),
    K("parallel.reshard_after_forward", "bool", True, "Free gathered parameters after the forward "
      "pass and gather again for backward; false keeps them.", "pgs-train", status=HONORED,
      aliases=(Alias("torch_fsdp2_reshard_after_forward", ("megatron-lm", "primus"),
                     note="Megatron-LM's dest of --torch-fsdp2-no-reshard-after-forward"),)),
    K("parallel.context_parallel", "bool", False, "Ring attention: split each sequence over the "
      "devices for very long contexts (min(world, 8) of them, or all).", "pgs-train",
      status=HONORED),
    K("parallel.cp_rotate_method", "str", "allgather", "Collective that ring attention rotates "
      "K/V with; alltoall saves memory, allgather is the simpler one.", "pgs-train",
      choices=_CP_ROTATE_METHODS, value_aliases={"all_gather": "allgather",
                                                 "all_to_all": "alltoall"}, status=HONORED),

    # MaxText
    K("shardy", "bool", False, "Partition the program with the Shardy partitioner "
      "(jax_use_shardy_partitioner) instead of GSPMD.", "maxtext", MAPPED,
      "sets jax_use_shardy_partitioner to this value for the run (false: GSPMD), as MaxText "
      "does"),
]


# MaxText mesh axes: ici_<axis>_parallelism (inside a slice) x dcn_<axis>_parallelism (across
# slices) is the axis's size; -1 fills the devices left over (rules.maxtext_mesh). One GPU job is
# one slice, so a dcn -1 is 1. The axes map onto jaxtrain's mesh knobs:
MAXTEXT_MESH = {
    "diloco": "DiLoCo replicas (refused above 1: no DiLoCo trainer)",
    "data": "data-parallel replicas (parameters replicated)",
    "fsdp": "data-parallel replicas that shard parameters, gradients and optimizer state",
    "fsdp_transpose": "a second FSDP axis (sharding the MLP dimension)",
    "tensor": "tensor parallelism",
    "tensor_sequence": "tensor parallelism with the sequence sharded between blocks",
    "expert": "expert parallelism (MoE experts spread over it; batch for the dense layers)",
    "sequence": "sequence parallelism of activations",
    "context": "context parallelism",
    "context_usp_ulysses": "the Ulysses part of context parallelism",
    "context_autoregressive": "context parallelism for decoding",
    "autoregressive": "the decoding axis",
    "pipeline": "pipeline stages",
}
_MESH_MAPPED = ("sets jaxtrain's mesh (config/dialects/maxtext_rules.py): data x fsdp x "
                "fsdp_transpose x expert is the data-parallel size (FSDP sharding when fsdp or "
                "fsdp_transpose > 1), tensor x tensor_sequence is tensor_model_parallel_size "
                "(tensor_sequence > 1 turns sequence_parallel on), expert is "
                "expert_model_parallel_size, context x context_usp_ulysses is "
                "context_parallel_size (the Ulysses axis the all-to-all level of a2a+p2p); the "
                "sequence, pipeline, DiLoCo and decoding axes are refused above 1 until built")


def _mesh_knobs():
    knobs = []
    for level, where, fill in (("ici", "within a slice (node)", "fsdp"),
                               ("dcn", "across slices", "data")):
        for axis, what in MAXTEXT_MESH.items():
            knobs.append(K(f"{level}_{axis}_parallelism", "int", 1,
                           f"MaxText: devices {where} on the {axis} axis ({what}); -1 fills.",
                           "maxtext", MAPPED, _MESH_MAPPED,
                           doc_defaults={"maxtext": -1} if axis == fill else None))
    return knobs


_HINT = ("at MaxText's default, jaxtrain lays tensors out with its own logical-axis table "
         "(jaxtrain/parallel/sharding.py), which places them the same way; a changed value is "
         "checked by the MaxText dialect rules (config/dialects/maxtext_rules.py) and refused by "
         "name where it asks for a placement the table does not make")


KNOBS += _mesh_knobs() + [
    K("mesh_axes", "list[str]", None, "MaxText: names and order of the device-mesh axes.",
      "maxtext", MAPPED, _HINT),
    K("logical_axis_rules", "list", None, "MaxText: table mapping logical tensor axes to mesh "
      "axes.", "maxtext", MAPPED, _HINT),
]
