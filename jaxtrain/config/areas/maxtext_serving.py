"""MaxText serving and post-training keys: decoding, the inference server and its benchmarks,
KV-cache serving, LoRA adapters, vLLM, logit distillation, and the multimodal encoders.

Canonical keys are MaxText's own (configs/base.yml); defaults are its base.yml values.
"""
from jaxtrain.config.knob import HONORED, INERT, REJECTED, K

_MT = "maxtext"
_DISTILL = 22
_MM_DETAIL = ("MaxText reads it only when use_multimodal (or use_audio) is on, and jaxtrain rejects "
              "those: text-only model files that carry encoder settings (gemma3, llama4) train "
              "the text decoder alone, as MaxText does with use_multimodal false")
_MULTIMODAL = ("multimodal (vision/audio) models are outside jaxtrain, which trains text-only "
               "decoder language models; leave it at its default")
_CACHE_LAYOUT = ("a KV-cache or compute layout of MaxText's TPU serving engine; jaxtrain's sampler "
                 "keeps its own layout and decodes the same values")
_DISAGG = ("names TPU slices for MaxText's disaggregated (prefill/generate) serving under "
           "Pathways; jaxtrain serves from the processes of its own job")
_DECODE = "MaxText's decode.py / inference server, which jaxtrain does not have yet"

KNOBS = [
    # --- decoding (decode.py) ---
    K("max_prefill_predict_length", "int", 64, "Longest prompt prefill when decoding, in "
      "tokens.", _MT, issue=None, reason=f"read by {_DECODE}"),
    K("prompt", "str", "I love to", "Prompt that decode.py samples a continuation of.", _MT,
      issue=None, reason=f"read by {_DECODE}"),
    K("load_from_prefill_dir", "bool", False, "decode.py: read the prefill result from "
      "prefill_cache_dir instead of computing it.", _MT, issue=None),
    K("prefill_cache_dir", "str", "", "Directory decode.py writes the prefill result to (and "
      "reads it from with load_from_prefill_dir).", _MT, issue=None),
    K("autoregressive_decode_assert", "str", "", "Test aid: text the decoded output must "
      "match.", _MT, issue=None),
    K("decode_sampling_strategy", "str", "greedy", "Token choice when decoding: greedy, weighted "
      "(temperature), nucleus, topk, or composite (top-k then top-p then temperature).", _MT,
      issue=None, choices=("greedy", "weighted", "nucleus", "topk", "composite")),
    K("decode_sampling_nucleus_p", "float", -1, "Nucleus sampling: keep the smallest token set "
      "whose probability reaches p; -1 disables.", _MT, issue=None),
    K("decode_sampling_top_k", "int", 0, "Top-k sampling: draw from the k likeliest tokens; 0 "
      "disables.", _MT, issue=None),
    K("decode_sampling_temperature", "float", 1.0, "Temperature dividing the logits before "
      "sampling.", _MT, issue=None),
    K("use_chunked_prefill", "bool", False, "Prefill long prompts in chunks of "
      "prefill_chunk_size tokens.", _MT, issue=None),
    K("prefill_chunk_size", "int", 256, "Chunked prefill: tokens per chunk.", _MT, issue=None),
    K("use_ragged_attention", "bool", False, "Decode with ragged (per-request length) attention "
      "kernels.", _MT, INERT, "a TPU decode kernel for the same attention; the values are the "
      "same"),
    K("ragged_block_size", "int", 256, "Ragged attention: block size.", _MT, INERT,
      "tunes a TPU decode kernel jaxtrain does not run; the values are the same"),
    K("mla_naive_kvcache", "bool", True, "MLA decoding: cache full keys/values instead of the "
      "compressed latent.", _MT, INERT, _CACHE_LAYOUT),

    # --- inference server and benchmarks ---
    K("inference_server", "str", "MaxtextInterleavedServer", "Which MaxText inference server "
      "to start.", _MT, issue=None, reason=f"read by {_DECODE}"),
    K("inference_metadata_file", "str", "", "JSON file of inference metadata for the server.",
      _MT, issue=None),
    K("prefill_slice", "str", "v5e-16", "Disaggregated serving: TPU slice that runs prefill.",
      _MT, REJECTED, _DISAGG),
    K("generate_slice", "str", "v5e-16", "Disaggregated serving: TPU slice that runs "
      "generation.", _MT, REJECTED, _DISAGG),
    K("inference_benchmark_test", "bool", False, "Mark the run as an inference benchmark test.",
      _MT, issue=None),
    K("enable_model_warmup", "bool", False, "Warm the server up (compile shapes) before serving.",
      _MT, issue=None),
    K("enable_llm_inference_pool", "bool", False, "Start the server with the APIs of the LLM "
      "inference gateway.", _MT, issue=None),
    K("multi_sampling", "bool", False, "Allow several sampling settings in one serving batch.",
      _MT, issue=None),
    K("return_log_prob", "bool", False, "Return the log-probabilities of the generated tokens.",
      _MT, issue=None),
    K("stack_prefill_result_cache", "bool", False, "Stack the prefill KV cache of all layers into "
      "one array to cut Python overhead.", _MT, INERT, _CACHE_LAYOUT),
    K("prefill_cache_axis_order", "str", "1,2,0,3", "Axis order of the prefill KV cache (batch, "
      "sequence, heads, head dim).", _MT, INERT, _CACHE_LAYOUT),
    K("ar_cache_axis_order", "str", "1,2,0,3", "Axis order of the decode KV cache (batch, "
      "sequence, heads, head dim).", _MT, INERT, _CACHE_LAYOUT),
    K("compute_axis_order", "str", "0,1,2,3", "Axis order of attention compute during decode "
      "(0,1,2,3 or 0,2,1,3).", _MT, INERT, _CACHE_LAYOUT),
    K("reshape_q", "bool", False, "Decode attention: reshape the queries for the kernel.", _MT,
      INERT, _CACHE_LAYOUT),
    K("prometheus_port", "int", 0, "Port of the inference server's Prometheus metrics; 0 "
      "disables them.", _MT, issue=None),
    K("enable_jax_profiler", "bool", False, "Start the JAX profiler server inside the inference "
      "server.", _MT, issue=None, reason="read only by MaxText's inference server; for "
      "training, run_workload_inspector_server starts jaxtrain's profiler server"),
    K("jax_profiler_port", "int", 9999, "Port of the inference server's JAX profiler server.",
      _MT, issue=None),
    K("enable_prefix_caching", "bool", False, "Reuse the KV cache of prompt prefixes seen "
      "before.", _MT, issue=None),
    K("prefix_caching_hbm_byte", "int", 10_000_000_000, "Prefix caching: device memory for "
      "cached prefixes, bytes.", _MT, issue=None),
    K("prefix_caching_dram_byte", "int", 100_000_000_000, "Prefix caching: host memory for "
      "cached prefixes, bytes.", _MT, issue=None),
    K("enable_padding_causal_mask", "bool", True, "Temporary TransformerEngine switch for its "
      "padding causal mask.", _MT, INERT,
      "a TransformerEngine workaround; jaxtrain does not use TransformerEngine"),
    K("model_call_mode", "str", "", "Call the model for serving ('inference': fused and "
      "quantized expert weights) instead of training ('').", _MT, issue=None),
    *[K(f"inference_microbenchmark_{name}", type_, default, f"Inference microbenchmark: {what}.",
        _MT, issue=None)
      for name, type_, default, what in (
          ("prefill_lengths", "str", "64,128,256,512,1024", "prompt lengths to time"),
          ("stages", "str", "prefill,generate", "stages to time"),
          ("loop_iters", "int", 10, "iterations of each timing loop"),
          ("log_file_path", "str", "", "file the results are written to"),
          ("num_samples", "list[int]", [1, 2, 3, 4, 5], "sample counts to time"))],

    # --- adapters and vLLM ---
    K("lora_input_adapters_path", "str", "", "Directory whose subdirectories (one per id) hold "
      "LoRA adapters for the server or the parameter-only checkpoint tool.", _MT, issue=None),
    K("vllm_hf_config_path", "str", "", "Hugging Face-style config directory of MaxText's vLLM "
      "adapter.", _MT, issue=None),
    K("vllm_hf_overrides", "dict", {}, "Overrides applied to that Hugging Face config for "
      "vLLM.", _MT, issue=None),
    K("sharding_strategy", "str", None, "Sharding strategy handed to MaxText's vLLM "
      "(tpu-inference) engine; 'experimental' in some inference configs.", _MT, issue=None,
      choices=("experimental",)),
    K("vllm_additional_config", "dict", {}, "Extra configuration handed to the vLLM model.", _MT,
      issue=None),

    # --- logit distillation ---
    K("distill_alpha", "float", 0.5, "Distillation: weight of the teacher (soft-target) loss "
      "against the hard-label loss.", _MT, issue=_DISTILL),
    K("distill_temperature", "float", 1.0, "Distillation: temperature softening teacher and "
      "student logits.", _MT, issue=_DISTILL),
    K("distill_beta", "float", 0.0, "Distillation: weight of the feature loss between teacher "
      "and student attention outputs; 0 disables.", _MT, issue=_DISTILL),
    K("distill_feature_loss_type", "str", "cosine", "Distillation: feature loss, cosine "
      "similarity or l2.", _MT, issue=_DISTILL, choices=("cosine", "l2")),
    K("distill_layer_indices", "list", None, "Distillation: layers whose features enter the "
      "feature loss; null means all.", _MT, issue=_DISTILL),
    *[K(f"distill_{w}_end", "float", None, f"Distillation: {w} at the end of training; null "
        f"keeps {w} fixed.", _MT, issue=_DISTILL) for w in ("alpha", "temperature", "beta")],
    *[K(f"distill_{w}_schedule", "str", "constant", f"Distillation: how {w} moves to its end "
        "value (constant, linear or cosine).", _MT, issue=_DISTILL,
        choices=("constant", "linear", "cosine")) for w in ("alpha", "temperature", "beta")],

    # --- multimodal ---
    K("use_multimodal", "bool", False, "Build the model with its vision encoder (image-text "
      "models).", _MT, REJECTED, _MULTIMODAL),
    K("vision_encoder_block", "str", "none", "Vision encoder family of a multimodal model "
      "(gemma3, llama4, qwen3_omni, gemma4, qwen3_5, qwen3_vl); none for text-only.", _MT,
      INERT, _MM_DETAIL,
      choices=("none", "gemma3", "llama4", "qwen3_omni", "gemma4", "qwen3_5", "qwen3_vl")),
    K("use_audio", "bool", False, "Build the model with its audio encoder.", _MT, REJECTED,
      _MULTIMODAL),
    K("freeze_vision_encoder_params", "bool", True, "Keep the vision encoder's weights frozen.",
      _MT, INERT, _MM_DETAIL),
    K("freeze_audio_encoder_params", "bool", True, "Keep the audio encoder's weights frozen.",
      _MT, INERT, _MM_DETAIL),
    K("dtype_mm", "str", "float32", "Compute dtype of the vision encoder.", _MT, INERT,
      _MM_DETAIL),
    K("remat_policy_for_vit", "str", "minimal", "remat_policy of the vision encoder.", _MT,
      INERT, _MM_DETAIL, nullable=True),
    K("image_size_for_vit", "int|list[int]", 896, "Input image size of the vision encoder.", _MT,
      INERT, _MM_DETAIL, nullable=True),
    K("train_image_column", "str|list[str]", "image", "Data column(s) holding training images.",
      _MT, INERT, _MM_DETAIL),
    K("eval_image_column", "str|list[str]", "image", "Data column(s) holding validation images.",
      _MT, INERT, _MM_DETAIL),
    *[K(f"{m}_path", "str", "", f"Local {m} file(s), comma-separated, for multimodal decoding.",
        _MT, INERT, _MM_DETAIL) for m in ("image", "video", "audio")],
    *[K(f"{m}_placeholder", "str", f"<|{m}|>", f"Text placeholder marking where a {m} goes in a "
        "prompt.", _MT, INERT, _MM_DETAIL) for m in ("image", "video", "audio")],
    K("use_audio_in_video", "bool", False, "Also feed the audio track of videos.", _MT, INERT,
      _MM_DETAIL),
    *[K(f"video_max_grid_{a}", "int", None, f"Qwen3-Omni/3.5 video: most patches along {what} "
        "before spatial merging.", _MT, INERT, _MM_DETAIL)
      for a, what in (("t", "time"), ("h", "height"), ("w", "width"))],
    K("posemb_type_for_vit", "str", "learn", "Position embedding of the vision encoder.", _MT,
      INERT, _MM_DETAIL),
    K("max_num_images_per_example", "int", -1, "Most images per training example; -1 pads to "
      "what the sequence allows.", _MT, INERT, _MM_DETAIL),
    K("vision_output_length", "int", -1, "Soft tokens the vision encoder emits per image "
      "(Gemma 4).", _MT, INERT, _MM_DETAIL),
    *[K(f"{name}_for_vit", type_, default, f"Vision encoder: {what}.", _MT, INERT, _MM_DETAIL)
      for name, type_, default, what in (
          ("hidden_size", "int", 1408, "hidden width"),
          ("intermediate_size", "int", 5632, "MLP width"),
          ("num_attention_heads", "int", 16, "attention heads"),
          ("num_channels", "int", 3, "input channels per pixel"),
          ("tile_size", "int", 336, "image tile size"),
          ("patch_size", "int", 14, "patch size"),
          ("conv_stride", "int", 14, "stride of the patch convolution"),
          ("num_hidden_layers", "int", 34, "layer count"),
          ("projector_input_dim", "int", 4096, "input width of the projector"),
          ("projector_output_dim", "int", 4096, "output width of the projector"),
          ("rope_theta", "int", 10000, "RoPE base period"),
          ("vision_output_dim", "int", 4096, "width of the vision-to-text projection"),
          ("pixel_shuffle_ratio", "float", 0.5, "pixel-shuffle ratio"),
          ("projector_dropout", "float", 0.0, "projector dropout"),
          ("spatial_merge_size", "int", 2, "patches merged per side"),
          ("out_hidden_size", "int", 512, "output width"),
          ("temporal_patch_size", "int", 2, "frames per video patch"),
          ("num_position_embeddings", "int", 1024, "position-embedding table size"),
          ("deepstack_visual_indexes", "list[int]", [], "layers whose features are passed on"))],
    *[K(f"{name}_for_audio", type_, default, f"Audio encoder: {what}.", _MT, INERT,
        _MM_DETAIL)
      for name, type_, default, what in (
          ("d_model", "int", 256, "model width"),
          ("encoder_attention_heads", "int", 4, "attention heads"),
          ("encoder_ffn_dim", "int", 512, "MLP width"),
          ("encoder_layers", "int", 2, "layer count"),
          ("attention_dropout", "float", 0.0, "attention dropout"),
          ("activation_dropout", "float", 0.0, "activation dropout"),
          ("activation_function", "str", "gelu", "activation function"),
          ("num_mel_bins", "int", 128, "mel-spectrogram bins"),
          ("max_source_positions", "int", 1500, "longest input in frames"),
          ("scale_embedding", "bool", True, "scale embeddings by sqrt(width)"),
          ("n_window", "int", 50, "window size in training"),
          ("n_window_infer", "int", 800, "window size in inference"),
          ("conv_chunksize", "int", 500, "chunk size of the convolutions"),
          ("downsample_hidden_size", "int", 256, "width of the downsampling stage"),
          ("output_dim", "int", 512, "output width"),
          ("num_conv_layers", "int", 3, "convolution layers"),
          ("max_timescale", "float", 10000.0, "largest timescale of its position encoding"),
          ("max_sample_len", "int", 10000, "longest input sample"))],
    K("use_mrope", "bool", False, "Multi-dimensional RoPE (time, height, width) of Qwen3-Omni's "
      "multimodal inputs.", _MT, HONORED, "decoder_block qwen3_5: on text the three positions "
      "of a token are equal, which makes it plain RoPE (config/dialects/maxtext_model.py); "
      "other blocks refuse it: " + _MULTIMODAL),
    K("position_id_per_seconds", "int", 25, "Multi-dimensional RoPE: position ids per second of "
      "video/audio.", _MT, REJECTED, _MULTIMODAL),
]
