"""pgs memory savers: chunked loss, gradient release, selective differentiation and SeCO/SpaCO."""
from jaxtrain.config.knob import HONORED, Alias, K

_PGS = "pgs-train"

KNOBS = [
    # --- chunked cross-entropy ---
    K("memory.chunked_loss", "bool", True, "Compute output-layer logits and cross-entropy chunk by "
      "chunk along the sequence so the full logits never exist at once.", _PGS, status=HONORED,
      aliases=(Alias("enable_fused_linear_ce", "primus",
                     note="Primus's chunked linear + cross-entropy switch"),)),
    K("memory.loss_num_chunks", "int", 8, "Number of sequence chunks memory.chunked_loss splits "
      "the loss into.", _PGS, status=HONORED,
      aliases=(Alias("num_vocab_tiling", "maxtext", note="MaxText tiles the output layer and "
                     "loss over batch x sequence; the loss is the same, only memory differs"),)),

    # --- gradient memory ---
    K("memory.gradient_release", "bool", False, "Update each parameter as soon as its gradient "
      "exists, keeping no gradient buffer; no accumulation, no Muon.",
      _PGS, issue=20),
    K("memory.selective_diff", "bool", True, "Skip saving activations needed only for frozen "
      "weights' gradients; meant for train.freeze_non_attention.", _PGS, issue=20),

    # --- SeCO / SpaCO chunked long-sequence training ---
    K("memory.seco", "bool", False, "Train long sequences chunk by chunk (KV-cache prefill, then "
      "reverse backward): activations scale with chunk size; exact.", _PGS, issue=20),
    K("memory.seco_chunk_size", "int", 4096, "Chunk length in tokens for SeCO.", _PGS, issue=20),
    K("memory.seco_kv_offload", "bool", False, "Keep SeCO's full-attention K/V in pinned host "
      "memory and stream it to the device block by block.", _PGS, issue=20),
    K("memory.spaco_budget", "int", 0, "How many randomly chosen chunks of each sequence SpaCO "
      "backpropagates (unbiased); 0 falls back to exact SeCO.", _PGS, issue=20),
]
