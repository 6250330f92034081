"""Multi-latent attention (DeepSeek-style low-rank query/key/value projections)."""
from jaxtrain.config.knob import Alias, CoerceError, HONORED, K

_MT = "maxtext"
_ATTENTION_TYPES = {"global": False, "mla": True, "compressed": False}
_NOT_BUILT = {
    "local_sliding": "a per-layer-type sliding window; for one window in every layer set "
                     "sliding_window_size with attention_type global",
    "chunk": "chunked (block-local) attention is not built in jaxtrain",
    "full": "bidirectional attention; jaxtrain trains causal decoders",
    "block_diffusion": "block-causal attention for diffusion is not built in jaxtrain",
}


def _attention_type(value):
    """MaxText attention_type: global (causal multi-head), mla, or compressed (DeepSeek-V4's,
    which decoder_block deepseek4 builds); others are refused."""
    if value in _ATTENTION_TYPES:
        return _ATTENTION_TYPES[value]
    why = _NOT_BUILT.get(value, "not a MaxText attention type")
    raise CoerceError(f"{value!r} is not supported: {why} (supported: global, mla, compressed)")

KNOBS = [
    # Switch
    K("multi_latent_attention", "bool", False, "Use multi-latent attention (MLA) in place of "
      "standard multi-head attention.", "megatron", status=HONORED,
      aliases=(Alias("attention_type", _MT, to_canonical=_attention_type,
                     note="global is ordinary causal attention, mla multi-latent attention, "
                     "compressed DeepSeek-V4's (its block, deepseek4, builds it); the other "
                     "MaxText types are refused"),)),

    # Latent ranks and head widths
    K("q_lora_rank", "int", None, "Rank of the compressed query latent; null (or MaxText's 0) "
      "projects queries directly.", ("megatron", _MT), status=HONORED, doc_defaults={_MT: 0}),
    K("kv_lora_rank", "int", 32, "Rank of the shared compressed key/value latent.",
      ("megatron", _MT), status=HONORED, doc_defaults={_MT: 512}),
    K("qk_head_dim", "int", 128, "Per-head query/key width of the part without position "
      "encoding.", "megatron", status=HONORED, aliases=(Alias("qk_nope_head_dim", _MT),)),
    K("qk_pos_emb_head_dim", "int", 64, "Per-head query/key width of the RoPE part (keys share one "
      "such head).", "megatron", status=HONORED, aliases=(Alias("qk_rope_head_dim", _MT),)),
    K("v_head_dim", "int", 128, "Per-head value width.", "megatron", status=HONORED),

    # YaRN scaling inside MLA
    K("rotary_scaling_factor", "float", 1.0, "YaRN context-extension factor of the MLA rotary "
      "embedding.", "megatron", status=HONORED),
    K("mscale", "float", 1.0, "YaRN coefficient that scales MLA's rotary cos/sin "
      "(relative to mscale_all_dim).", "megatron", status=HONORED),
    K("mscale_all_dim", "float", 1.0, "YaRN coefficient whose mscale, squared, multiplies the MLA "
      "softmax scale.", "megatron", status=HONORED),
]
