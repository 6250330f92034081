"""Activation recomputation (remat) and the scan over layers."""
from jaxtrain.config.knob import HONORED, Alias, K

def _id_list(value):
    """Primus writes layer ids as a list or as a string "0,1,2"."""
    if isinstance(value, str):
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    return value


# MaxText's policies (layers/decoders.py get_remat_policy); "none" keeps every activation.
_REMAT_POLICIES = (
    "none", "full", "minimal", "minimal_with_context", "minimal_with_quantization",
    "minimal_with_context_and_quantization", "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj",
    "qkv_proj_offloaded", "minimal_offloaded", "custom",
)


def _full_if_true(value):
    """pgs-distill's boolean: true recomputes each student layer whole, false keeps everything."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if isinstance(value, bool) or value in (0, 1):
        return "full" if value else "none"
    return value


_TENSOR_MODES = ("remat", "device", "offload")

KNOBS = [
    # Megatron recompute scheme
    K("recompute_granularity", "str", None, "What to recompute in the backward pass: whole layers "
      "(full) or only attention internals (selective).", "megatron",
      choices=("full", "selective"), status=HONORED),
    K("recompute_method", "str", None, "With full granularity: checkpoint every group of "
      "recompute_num_layers (uniform) or only the first ones (block).", "megatron",
      choices=("uniform", "block"), status=HONORED),
    K("recompute_num_layers", "int", None, "Layers per checkpointed group (uniform) or number of "
      "checkpointed layers per stage (block).", "megatron", status=HONORED),
    K("recompute_layer_ids", "list[int]", None, "Global indices of the layers to recompute whole "
      "(Primus; needs full granularity and no method); a comma-separated string also works.",
      "megatron", status=HONORED, parse=_id_list),
    K("recompute_activations", "bool", False, "Legacy switch: true means recompute_granularity "
      "selective.", "megatron", status=HONORED),
    K("checkpoint_activations", "bool", False, "Legacy switch (current Megatron refuses it): "
      "true means its old meaning, full recompute of every layer (full, uniform, 1 layer).",
      "megatron", status=HONORED),
    K("distribute_saved_activations", "bool", False, "Split the saved checkpoint inputs across "
      "tensor-parallel ranks instead of replicating them.", "megatron", status=HONORED),
    K("moe_layer_recompute", "bool", False, "Recompute the MoE block of each layer in the "
      "backward pass.", "megatron", status=HONORED),

    # MaxText remat and scan
    K("remat_policy", "str", "none", "Which named activations each layer keeps for the backward "
      "pass; full keeps none, none keeps all.", "maxtext", choices=_REMAT_POLICIES,
      value_aliases={"minimal_flash": "minimal_with_context"}, nullable=True,
      doc_defaults={"maxtext": "full"}, status=HONORED),
    K("scan_layers", "bool", True, "Stack identical layers and run them with one scan, so the "
      "layer is compiled once.", "maxtext", status=HONORED),
    K("param_scan_axis", "int", 1, "Position of the stacked-layer axis inside each scanned "
      "parameter.", "maxtext", choices=(0, 1), status=HONORED),

    # pgs gradient checkpointing
    K("train.gradient_checkpointing", "str", "none", "Per-layer checkpointing: full "
      "recomputes the layer, selective keeps attention and half the matmuls, none keeps all.",
      "pgs-train", choices=("full", "selective", "none"),
      doc_defaults={"pgs-train": "selective", "pgs-distill": "none"},
      aliases=(Alias("model.gradient_checkpointing", "pgs-distill", to_canonical=_full_if_true,
                     note="a boolean: true is full, false is none"),), status=HONORED,
      reason="when remat_policy and Megatron's recompute knobs leave the layer alone: full is "
             "remat_policy full (nothing saved), selective is save_dot_with_context_except_mlp "
             "(q/k/v, the attention output and the out projection kept, the MLP recomputed), "
             "none keeps everything"),

    # MaxText remat_policy 'custom': what happens to each named activation in the backward pass
    K("decoder_layer_input", "str", "device", "remat_policy custom: each layer's input is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("query_proj", "str", "remat", "remat_policy custom: the query projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("key_proj", "str", "remat", "remat_policy custom: the key projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("value_proj", "str", "remat", "remat_policy custom: the value projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("qkv_proj", "str", "remat", "remat_policy custom: MaxText's fused QKV projection; kept or offloaded, "
      "it keeps or offloads the query, key and value projections.", "maxtext", HONORED,
      choices=_TENSOR_MODES),
    K("context", "str", "remat", "remat_policy custom: the attention output before out_proj is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("out_proj", "str", "remat", "remat_policy custom: the attention output projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("mlpwi", "str", "remat", "remat_policy custom: the MLP input projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("mlpwi_0", "str", "remat", "remat_policy custom: the gated MLP's first input projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("mlpwi_1", "str", "remat", "remat_policy custom: the gated MLP's second input projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
    K("mlpwo", "str", "remat", "remat_policy custom: the MLP output projection is recomputed (remat), kept on "
      "the device, or offloaded to host memory.", "maxtext", HONORED, choices=_TENSOR_MODES),
]
