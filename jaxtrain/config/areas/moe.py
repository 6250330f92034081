"""Mixture-of-experts layers: expert shapes, the top-k router, load balancing and token dispatch."""
from jaxtrain.config.knob import Alias, HONORED, INERT, MAPPED, REJECTED, K

_M = "megatron"
_MT = "maxtext"
# Megatron HEAD's Literal/argparse choices; alltoall_seq is Primus's pinned Megatron only.
_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing",
              "none")
_DISPATCHERS = ("allgather", "alltoall", "flex", "alltoall_seq")
_DROP_POLICIES = ("probs", "position")
_ROUTER_DTYPES = ("fp32", "fp64")


def _fp32_if_true(value):
    """MaxText float32_gate_logits: true -> fp32 router, false -> the compute dtype (None)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if isinstance(value, bool):
        return "fp32" if value else None
    return value
_FORCE_BALANCING = ("even", "uniform")

KNOBS = [
    # Expert layout
    K("num_experts", "int", None, "Size of each MoE layer's routed-expert pool; null means no MoE "
      "(dense; in MaxText files also 1).", (_M, _MT), status=HONORED),
    K("moe_layer_freq", "int|list[int]|str", 1, "Which layers are MoE: every Nth for an int, or a "
      "0/1 per-layer list, as a list or an expression like \"[1]*3+[0]\".", _M, status=HONORED),
    K("moe_ffn_hidden_size", "int", None, "Hidden width of each routed expert's FFN; null uses "
      "ffn_hidden_size.", _M, status=HONORED),
    K("moe_shared_expert_intermediate_size", "int", None, "Hidden width of the always-on shared "
      "expert FFN (all shared experts together); null means no shared expert.", _M,
      status=HONORED),
    K("moe_shared_expert_overlap", "bool", False, "Run the shared expert concurrently with the "
      "token dispatch communication; needs the alltoall or flex dispatcher.", _M, MAPPED,
      "the shared expert does not depend on the routed experts' dispatch in the traced step, so "
      "XLA's scheduler is free to run it while the dispatch collectives are in flight; there is "
      "no separate stream to request, and the result is the same"),
    K("moe_use_upcycling", "bool", False, "Build the MoE model by copying a dense checkpoint's FFN "
      "into every expert, then save the converted model.", _M, status=HONORED),

    # Expert GEMM implementation
    K("moe_grouped_gemm", "bool", False, "Compute all local experts with one grouped matmul "
      "instead of a loop over experts.", _M, MAPPED,
      "true runs the experts with jaxtrain's Pallas grouped GEMM (kernels.grouped_gemm) on a "
      "GPU; false computes the same grouped matmul with XLA's ragged_dot (there is no "
      "per-expert loop); on a CPU, where Pallas only interprets, either is a batched matmul "
      "over row tiles of one expert each (jaxtrain.ops.tiled_grouped_matmul)"),
    K("moe_use_legacy_grouped_gemm", "bool", False, "Pick Megatron's older grouped-GEMM module "
      "over the Transformer Engine one.", _M, INERT,
      "chooses between two PyTorch grouped-GEMM modules that compute the same thing; jaxtrain has "
      "one grouped expert matmul"),
    K("moe_permute_fusion", "bool", False, "Use fused kernels to sort tokens by expert and restore "
      "their order afterwards.", _M, INERT,
      "XLA fuses the token gather/scatter of the permutation itself; there is no separate fused "
      "kernel to turn on, and the result is the same"),

    # Router scores and top-k
    K("moe_router_topk", "int", 2, "Number of experts each token is sent to.", _M,
      status=HONORED, aliases=(Alias("num_experts_per_tok", _MT),), doc_defaults={_MT: 1}),
    K("moe_router_score_function", "str", "softmax", "How router logits become expert scores: "
      "softmax, sigmoid, or the square root of softplus.", _M, choices=_SCORE_FUNCTIONS,
      status=HONORED),
    K("moe_router_pre_softmax", "bool", False, "With softmax scores, normalise over all experts "
      "before picking the top k (default: softmax over the k chosen).", _M, status=HONORED),
    K("moe_router_dtype", "str", None, "Precision of the router matmul and scores (fp32 or fp64); "
      "null keeps the model's compute dtype.", _M, choices=_ROUTER_DTYPES, status=HONORED,
      aliases=(Alias("float32_gate_logits", _MT, to_canonical=_fp32_if_true,
                     note="MaxText's switch: true computes the gate logits in float32 (fp32), "
                          "false in the compute dtype (null)"),),
      rejected_values={"fp64": "JAX computes in float64 only with jax_enable_x64, which the "
                       "trainer keeps off (it would change every default dtype); use fp32"}),
    K("moe_router_topk_scaling_factor", "float", None, "Multiplier applied to the selected "
      "experts' routing weights; null means 1.", _M, status=HONORED),
    K("moe_router_num_groups", "int", None, "Split experts into this many groups for group-limited "
      "routing (DeepSeek-V3 style); null disables it.", _M, status=HONORED),
    K("moe_router_group_topk", "int", None, "Groups kept per token in group-limited routing before "
      "the ordinary top-k inside them.", _M, status=HONORED),
    K("moe_input_jitter_eps", "float", None, "Multiply router inputs by uniform noise in "
      "[1-eps, 1+eps] during training; null disables.", _M, status=HONORED),

    # Load balancing
    K("moe_router_load_balancing_type", "str|list[str]", "aux_loss", "Balancing method, or a list "
      "of methods (one aux coefficient each): aux losses, sinkhorn, quantile bias, or none.", _M,
      choices=_BALANCING, status=HONORED),
    K("moe_aux_loss_coeff", "float|list[float]", 0.0, "Weight of the load-balancing auxiliary "
      "loss; a list gives one weight per balancing type.", _M, status=HONORED),
    K("moe_z_loss_coeff", "float", None, "Weight of the router z-loss (mean squared logsumexp of "
      "the logits); null disables.", _M, status=HONORED),
    K("moe_router_enable_expert_bias", "bool", False, "Aux-loss-free balancing: a per-expert bias "
      "added for selection only, nudged toward even load; sigmoid/sqrtsoftplus only.", _M,
      status=HONORED),
    K("moe_router_bias_update_rate", "float", 1.0e-3, "Step size of the expert-bias update made "
      "once per global batch.", _M, status=HONORED),
    K("moe_router_force_load_balancing", "bool", False, "Benchmark aid: ignore the learned routing "
      "and spread tokens evenly over experts.", _M, status=HONORED),
    K("moe_router_force_load_balancing_type", "str", "even", "How forced balancing spreads tokens: "
      "even = fixed round-robin slots, uniform = random router logits.", _M,
      choices=_FORCE_BALANCING, status=HONORED),

    # Capacity and token dropping
    K("moe_expert_capacity_factor", "float", None, "Per-expert token capacity as a multiple of the "
      "even share; extra tokens are dropped. Null (or negative) means dropless.", _M,
      status=HONORED),
    K("moe_branch_norms", "bool", False, "Gemma 4's MoE layer: the routed experts take their "
      "own RMS norm of the residual stream, and the shared expert's and the experts' outputs "
      "are each normed before they are summed.", "jaxtrain", HONORED),
    K("moe_router_input_norm", "bool", False, "Gemma 4's router: it reads the residual stream "
      "RMS-normalised without a scale, times a learned per-channel scale and "
      "hidden_size^-0.5 (needs moe_branch_norms).", "jaxtrain", HONORED),
    K("moe_per_expert_scale", "bool", False, "Gemma 4's router: a learned scale per expert "
      "multiplies the routing weights of the tokens it takes.", "jaxtrain", HONORED),
    K("moe_capacity_per_sequence", "bool", False, "Count the capacity per sequence as MaxText "
      "does (int(max(ceil(T x k / E) x factor, factor)) tokens per expert and sequence) instead "
      "of over the rank's tokens.", "jaxtrain", HONORED),
    K("moe_pad_expert_input_to_capacity", "bool", False, "Pad every expert's batch up to its "
      "capacity so shapes are fixed; needs a capacity factor.", _M, status=HONORED),
    K("moe_token_drop_policy", "str", "probs", "Which tokens an over-full expert keeps: those with "
      "the highest routing weight, or the earliest in the sequence.", _M, choices=_DROP_POLICIES,
      status=HONORED),

    # Token dispatch and expert parallelism
    K("moe_token_dispatcher_type", "str", "allgather", "How tokens reach experts across "
      "expert-parallel ranks: all-gather, all-to-all, or flex (Megatron's DeepEP/HybridEP "
      "exchange; jaxtrain runs it as its all-to-all dispatch).", _M, choices=_DISPATCHERS,
      status=HONORED),
    K("moe_enable_deepep", "bool", False, "Former switch of the flex dispatcher's DeepEP backend "
      "(needs moe_token_dispatcher_type flex).", _M, MAPPED,
      "DeepEP is the CUDA transport behind Megatron's flex dispatcher; jaxtrain runs flex as its "
      "own all-to-all expert dispatch, which XLA compiles; Megatron's checks hold (flex needed, "
      "no moe_pad_expert_input_to_capacity)"),
    K("moe_extended_tp", "bool", False, "Shard each expert's weights over the "
      "tensor-parallel group too, instead of giving whole experts to ranks.", _M, REJECTED,
      "removed from Megatron in favour of expert_tensor_parallel_size; jaxtrain splits every "
      "expert's FFN over the tensor axis when that equals tensor_model_parallel_size (the "
      "default)"),

    # Diagnostics and Primus implementation switches
    K("moe_per_layer_logging", "bool", False, "Log the auxiliary losses of every MoE layer "
      "separately, not only their average.", _M, status=HONORED),
    K("disable_primus_topk_router", "bool", False, "Primus debug switch: use Megatron's own "
      "top-k router class instead of Primus's patched one.", _M, REJECTED,
      "a debugging switch between two PyTorch router classes; jaxtrain has a single router. To "
      "drop Primus's router additions, unset router_logit_softcapping and "
      "moe_router_force_load_balancing"),
    K("use_deprecated_20241209_moe_layer", "bool", False, "Primus debug switch: run a frozen "
      "2024-12-09 copy of Megatron's MoE layer for comparisons.", _M, REJECTED,
      "selects a deprecated PyTorch MoE layer kept for Primus-internal comparisons; jaxtrain has "
      "one MoE layer, so leave this false"),
]
