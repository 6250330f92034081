"""pgs memory savers: chunked loss, gradient release, selective differentiation and SeCO/SpaCO."""
from jaxtrain.config.knob import HONORED, INERT, Alias, K

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
      _PGS, status=HONORED,
      reason="The step runs the backward layer by layer inside the jitted step (a reverse scan "
      "that recomputes each layer and applies the optimizer to that layer's parameter and "
      "state slices at once), so one layer's gradient is live at a time. Exact for "
      "element-wise optimizers (adamw/adam, sgd, lion, the 8-bit variants). As in pgs, "
      "global clipping (clip_grad / train.max_grad_norm) is turned off with a warning and "
      "grad_norm is the root of the per-tensor squared norms summed during the backward. "
      "Refused, naming both keys: accumulation > 1, ga_ramp, Muon, spike detection, "
      "AdaGC, MONA, llrd_decay, hyperball, schedule-free, pre_rl, fp16, MoE, pipeline, "
      "scan_layers false."),
    K("memory.selective_diff", "bool", True, "Skip saving activations needed only for frozen "
      "weights' gradients; meant for train.freeze_non_attention.", _PGS, INERT,
      "it acts on frozen layers only, and until the hybrid families (issue #25) "
      "train.freeze_non_attention freezes none"),

    # --- SeCO / SpaCO chunked long-sequence training ---
    K("memory.seco", "bool", False, "Train long sequences chunk by chunk (KV-cache prefill, then "
      "reverse backward): activations scale with chunk size; exact.", _PGS, status=HONORED,
      reason="jaxtrain.seco: a no-gradient prefill scan collects every layer's K/V of every "
      "chunk; a reverse scan recomputes each chunk under jax.vjp against that buffer, relaying "
      "the K/V cotangent to the earlier chunks. Equals the plain gradient (fp32 tests: loss "
      "and gradients to 1e-6). Positions are absolute; each chunk attends over the whole "
      "buffer with a causal mask at its offset (one compiled chunk body, about twice the "
      "triangular attention FLOPs; always the xla attention). A length not divisible by the "
      "chunk is padded with loss weight 0. Refused, naming both keys: micro_batch_size > 1, "
      "world size > 1, packing, DPO, data.turn_scaling (as pgs), gradient_release, sym_noise, "
      "cadft, info_sft, pre_rl, MoE; the step also refuses FP8 delayed scaling. Gradient "
      "accumulation works (one sequence per microbatch)."),
    K("memory.seco_chunk_size", "int", 4096, "Chunk length in tokens for SeCO.", _PGS,
      status=HONORED, reason="The chunk length of jaxtrain.seco's scans; activation memory "
      "per chunk is O(C) plus O(C·T) attention scores; the last chunk may be shorter (padded)."),
    K("memory.seco_kv_offload", "bool", False, "Keep SeCO's full-attention K/V in pinned host "
      "memory and stream it to the device block by block.", _PGS, status=HONORED,
      reason="jaxtrain.seco keeps the K/V buffer in host memory through both passes; each "
      "layer copies its own slice to the device when it attends (rematerialized under "
      "differentiation, so no copy stays as a residual) and each chunk's own K/V goes straight "
      "to the host: the device holds one layer's keys and values at a time plus, as in pgs, "
      "the K/V gradient. pgs also streams a layer's keys in sequence blocks; jaxtrain attends "
      "over the layer's slice at once. Exact (fp32 tests: gradients to 1e-6)."),
    K("memory.spaco_budget", "int", 0, "How many randomly chosen chunks of each sequence SpaCO "
      "backpropagates (unbiased); 0 falls back to exact SeCO.", _PGS, status=HONORED,
      reason="As pgs: t of the k chunks, drawn without replacement from the step rng (none "
      "always included), are recomputed and backpropagated; the K/V cotangent each relays is "
      "scaled by min(k/t, 2), per hop, the chunk's own loss gradient is not (so, as in pgs, "
      "the estimate is not unbiased: own-loss terms enter with probability t/k). t >= k or 0 "
      "is exact SeCO. The logged loss is the whole sequence's (from the prefill), where pgs "
      "logs the selected chunks' sum."),
]
