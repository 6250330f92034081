"""Generation engine limits, dynamic batching, decode kernels; CUDA graphs and BERT embedders."""
from jaxtrain.config.knob import INERT, REJECTED, Alias, K

_M = "megatron"
_CUDA_GRAPH = ("CUDA graphs do not exist in jaxtrain: XLA compiles each whole step once with jit "
               "and replays the compiled program, which is what graph capture buys in PyTorch")
_BERT = ("BERT embedders belong to the BERT encoder family; jaxtrain trains decoder-only language "
         "models")
_SCOPES = ("full", "attn", "full_iteration", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")

KNOBS = [
    # Request limits
    K("inference_max_requests", "int", 8, "Most requests the generation engine serves at once.",
      _M),
    K("inference_max_seq_length", "int", 2560, "Most tokens per request, prompt plus generated.",
      _M),
    K("max_tokens_to_oom", "int", 12000, "Token total (prompts plus generation) above which a "
      "request is refused instead of running out of memory.", _M),
    K("inference_batch_times_seqlen_threshold", "int", -1, "Batch x sequence length below which "
      "pipeline-parallel generation does not split the batch; -1 never splits.", _M),

    # Dynamic batching
    K("inference_dynamic_batching", "bool", False, "Batch requests dynamically over a shared, "
      "block-allocated KV cache.", _M),
    K("inference_dynamic_batching_buffer_size_gb", "float", 40.0, "Device memory for the dynamic "
      "KV cache, in GB.", _M),
    K("inference_dynamic_batching_buffer_guaranteed_fraction", "float", 0.2, "Share of the KV "
      "cache kept so that admitted requests can always finish.", _M),
    K("inference_dynamic_batching_buffer_overflow_factor", "float", None, "Factor over the buffer "
      "size used to derive the request and token limits.", _M),
    K("inference_dynamic_batching_max_requests_override", "int", None, "Fixed limit on requests in "
      "flight, replacing the derived one.", _M,
      aliases=(Alias("inference_dynamic_batching_max_requests", "megatron-lm",
                     note="Megatron-LM's current name"),)),
    K("inference_dynamic_batching_max_tokens_override", "int", None, "Fixed limit on tokens in "
      "flight, replacing the derived one.", _M,
      aliases=(Alias("inference_dynamic_batching_max_tokens", "megatron-lm",
                     note="Megatron-LM's current name"),)),

    # Decode kernel
    K("flash_decode", "bool", False, "Use a flash-decoding attention kernel for one-token decode "
      "steps.", _M),

    # CUDA graphs
    K("enable_cuda_graph", "bool", False, "Capture and replay CUDA graphs with Megatron's own "
      "implementation.", _M, INERT, _CUDA_GRAPH),
    K("external_cuda_graph", "bool", False, "Capture CUDA graphs with Transformer Engine's "
      "make_graphed_callables.", _M, INERT, _CUDA_GRAPH),
    K("cuda_graph_warmup_steps", "int", 3, "Eager steps run before CUDA graphs are captured.", _M,
      INERT, _CUDA_GRAPH),
    K("cuda_graph_scope", "str|list[str]", "full", "Part of the model captured in CUDA graphs "
      "(whole layer, attention, whole iteration, ...).", _M, INERT, _CUDA_GRAPH,
      choices=_SCOPES,
      aliases=(Alias("cuda_graph_scope_deprecated", "megatron-lm",
                     note="Megatron-LM's dest of the hidden --cuda-graph-scope flag"),)),

    # BERT embedders
    K("output_bert_embeddings", "bool", False, "Return mean-pooled BERT embeddings instead of the "
      "model's head output.", _M, REJECTED, _BERT),
    K("bert_embedder_type", "str", "megatron", "Which BERT implementation computes the embeddings.",
      _M, REJECTED, _BERT, choices=("megatron", "huggingface")),
]
