"""Architecture fields that no Megatron-LM, Primus, MaxText or pgs knob spells.

A Hugging Face config.json (pgs ``model.name_or_path``, see config/dialects/hf.py) or a MaxText
file is translated into canonical knobs; these are jaxtrain's own knobs for what the other
systems fix in code: Llama 3's frequency band of the RoPE scaling, transformers' DeepSeek-V3
group score and MaxText's learned score bias (a rule on its model names).
"""
from jaxtrain.config.knob import HONORED, K

_J = "jaxtrain"

KNOBS = [
    K("rope_low_freq_factor", "float", 1.0, "Llama-3.1 RoPE scaling: wavelengths above "
      "original_max_position_embeddings / this are divided by rope_scaling_factor.", _J, HONORED,
      "Megatron-LM and MaxText fix it at 1 (Llama 3.x's value); a Hugging Face llama3 "
      "rope_parameters.low_freq_factor sets it"),
    K("rope_high_freq_factor", "float", 4.0, "Llama-3.1 RoPE scaling: wavelengths below "
      "original_max_position_embeddings / this are kept; between the two bands they blend.", _J,
      HONORED, "Megatron-LM and MaxText fix it at 4 (Llama 3.x's value); a Hugging Face llama3 "
      "rope_parameters.high_freq_factor sets it"),
    K("moe_router_group_score_topk", "int", None, "Group-limited routing: a group's score is the "
      "sum of its best this-many expert scores; null is Megatron's top-k / group top-k.", _J,
      HONORED, "transformers' DeepSeek-V3/Kimi routers sum each group's top 2 whatever the top-k "
      "(a config.json with n_group sets 2); Megatron-LM and MaxText have no such argument"),
    K("moe_router_score_bias", "bool", False, "A learned per-expert bias added to the sigmoid "
      "or sqrtsoftplus router scores, which then both pick and weigh the experts.", _J, HONORED,
      "MaxText's DeepSeek block with routed_bias true under a model name other than "
      "deepseek3*/deepseek4* (kimi-k2) adds its learned gate bias to the scores it weighs the "
      "experts by; the MaxText dialect sets this knob for such files"),
]
