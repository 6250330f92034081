"""Multi-latent attention (DeepSeek-style low-rank query/key/value projections)."""
from jaxtrain.config.knob import HONORED, K

KNOBS = [
    # Switch
    K("multi_latent_attention", "bool", False, "Use multi-latent attention (MLA) in place of "
      "standard multi-head attention.", "megatron", status=HONORED),

    # Latent ranks and head widths
    K("q_lora_rank", "int", None, "Rank of the compressed query latent; null projects queries "
      "directly.", "megatron", status=HONORED),
    K("kv_lora_rank", "int", 32, "Rank of the shared compressed key/value latent.", "megatron",
      status=HONORED),
    K("qk_head_dim", "int", 128, "Per-head query/key width of the part without position "
      "encoding.", "megatron", status=HONORED),
    K("qk_pos_emb_head_dim", "int", 64, "Per-head query/key width of the RoPE part (keys share one "
      "such head).", "megatron", status=HONORED),
    K("v_head_dim", "int", 128, "Per-head value width.", "megatron", status=HONORED),

    # YaRN scaling inside MLA
    K("rotary_scaling_factor", "float", 1.0, "YaRN context-extension factor of the MLA rotary "
      "embedding.", "megatron", status=HONORED),
    K("mscale", "float", 1.0, "YaRN coefficient that scales MLA's rotary cos/sin "
      "(relative to mscale_all_dim).", "megatron", status=HONORED),
    K("mscale_all_dim", "float", 1.0, "YaRN coefficient whose mscale, squared, multiplies the MLA "
      "softmax scale.", "megatron", status=HONORED),
]
