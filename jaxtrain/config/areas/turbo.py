"""Primus-Turbo switches: ROCm kernel selectors, mapped to our own kernels where one exists."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_M = "megatron"

_REMOVED = "removed upstream: Primus asserts when this key is given; use {} instead"

KNOBS = [
    # Master switch
    K("enable_primus_turbo", "bool", False, "Gate for the Primus-Turbo features below; the "
      "use_turbo_* switches only take effect when it is on.", _M, HONORED),

    # Attention (turbo attention → our flash kernel) and learned sinks
    K("use_turbo_attention", "bool", False, "Run core attention with the Turbo flash-attention "
      "kernel; here, with jaxtrain's own flash-attention kernel.", _M, MAPPED,
      "Primus-Turbo's attention is a ROCm PyTorch kernel; with enable_primus_turbo also on, "
      "true selects jaxtrain's Pallas flash kernel (other attention knobs set must agree)"),
    K("enable_turbo_attention_float8", "bool", False, "Compute attention in FP8 inside the Turbo "
      "attention kernel.", _M, REJECTED, "Primus-Turbo's FP8 attention is a ROCm PyTorch "
      "kernel; jaxtrain's attention kernels compute in the compute dtype and have no FP8 path "
      "(FP8 covers the projections: fp8)"),
    K("use_sink_attention", "bool", False, "Add a learned per-head sink logit to the attention "
      "softmax (GPT-OSS style); switched off with a warning when CP > 1.", _M, HONORED,
      "an fp32 zero-initialised logit per head on the xla and flash paths, whichever attention "
      "knob picks the kernel (cuDNN is refused at config time); it stays on with CP > 1, where "
      "XLA partitions the same attention (Primus drops it only for want of a CP kernel)",
      aliases=(Alias("attention_sink", "maxtext", note="MaxText's learned per-head sink logit "
                     "of every attention layer"),)),
    K("sink_sliding_window", "int", 0, "Sliding-window length in tokens for sink attention layers; "
      "0 means full causal attention (GPT-OSS uses 128).", _M, HONORED,
      "read only with use_sink_attention, as in Primus; Primus hands flash-attn the window "
      "(W, 0), W keys back plus the query's own, so it becomes a W + 1-key sliding_window"),
    K("sink_window_even_layers_only", "bool", True, "Apply the sink sliding window only to even "
      "(0-based) layers, the others attending fully, as GPT-OSS alternates.", _M, HONORED,
      "a per-layer window pattern read by layer index inside the layer scan"),

    # Dense and grouped GEMMs (turbo grouped GEMM → our grouped expert matmul)
    K("use_turbo_gemm", "bool", False, "Run the dense linear layers' GEMMs with Turbo kernels.", _M,
      INERT, "dense matmuls are XLA dot_generals lowered to the platform BLAS library; there is "
      "no alternative GEMM kernel to select, and the math is unchanged"),
    K("use_turbo_grouped_gemm", "bool", False, "Compute MoE experts with the Turbo grouped GEMM; "
      "here, with jaxtrain's grouped expert matmul.", _M, MAPPED,
      "with enable_primus_turbo on, true selects jaxtrain's Pallas grouped GEMM for the experts, "
      "as moe_grouped_gemm does"),
    K("use_turbo_parallel_linear", "bool", None, "Former name of use_turbo_gemm.", _M, REJECTED,
      _REMOVED.format("use_turbo_gemm")),
    K("use_turbo_grouped_mlp", "bool", None, "Former name of use_turbo_grouped_gemm.", _M, REJECTED,
      _REMOVED.format("use_turbo_grouped_gemm")),

    # Fused MoE and norm kernels (same math; XLA fuses these itself)
    K("moe_use_fused_router_with_aux_score", "bool", False, "Compute router scores and the "
      "aux-loss scores in one fused Turbo kernel.", _M, INERT,
      "XLA fuses the router's score and aux-loss computations itself; the result is the same as "
      "the unfused router"),
    K("use_turbo_fused_act_with_probs", "bool", False, "Fuse the expert activation with the "
      "multiplication by routing weights in one Turbo kernel.", _M, INERT,
      "XLA fuses the activation and the routing-weight product itself; the math is unchanged"),
    K("use_turbo_rms_norm", "bool", False, "Take RMSNorm from the Turbo kernel library instead of "
      "the default.", _M, INERT,
      "XLA fuses RMSNorm into neighbouring ops itself; there is no separate kernel to select"),
    K("turbo_sync_free_moe_stage", "int", 0, "Primus preset 0-3 bundling Turbo MoE kernels "
      "(fused router, DeepEP, grouped GEMM) to avoid GPU-to-host syncs.", _M, INERT,
      "a jitted JAX MoE step has static shapes and never waits on the host for token counts, so it "
      "is always sync-free; the kernel bundles the stages switch on have no JAX counterpart"),

    # DeepEP
    K("use_turbo_deepep", "bool", False, "Dispatch MoE tokens with Turbo's DeepEP communication "
      "kernels; served by our own all-to-all expert dispatch.", _M, MAPPED,
      "with enable_primus_turbo on, true selects jaxtrain's all-to-all expert dispatch "
      "(moe_token_dispatcher_type alltoall); DeepEP's GPU kernels have no JAX counterpart"),
    K("turbo_deepep_num_cu", "int", 32, "GPU compute units DeepEP reserves for its communication "
      "kernels.", _M, INERT,
      "only tunes the DeepEP kernels, which jaxtrain never runs"),
    K("turbo_deepep_use_comm_stream", "bool", False, "Run DeepEP communication on its own GPU "
      "stream.", _M, INERT,
      "only tunes the DeepEP kernels, which jaxtrain never runs"),
]
