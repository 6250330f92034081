"""Megatron reinforcement learning: GRPO loss, rollouts, and memory handling between phases."""
from jaxtrain.config.knob import INERT, Alias, K

_M = "megatron"
_SERVERS = ("inplace_megatron", "inplace_megatron_chat")

KNOBS = [
    # RL step and evaluation
    K("perform_rl_step", "bool", False, "Train with the RL (GRPO) step instead of next-token loss.",
      _M),
    K("rl_prompts_per_eval", "int", 32, "Each RL evaluation samples this many prompts per task.",
      _M),
    K("langrl_env_config", "str", None, "YAML file describing the RL environments (tasks, "
      "rewards).", _M),

    # GRPO sampling and loss
    K("grpo_prompts_per_step", "int", 32, "Number of prompt groups drawn for each RL training "
      "step.", _M),
    K("grpo_group_size", "int", 2, "Completions sampled per prompt; rewards are normalised within "
      "the group.", _M),
    K("grpo_iterations", "int", 2, "Optimizer passes over each batch of rollouts.", _M),
    K("grpo_clamp_eps_lower", "float", 0.01, "Lower clip margin of the policy ratio (1 - eps).",
      _M),
    K("grpo_clamp_eps_upper", "float", 0.01, "Upper clip margin of the policy ratio (1 + eps); "
      "equal to the lower one in plain GRPO.", _M),
    K("grpo_kl_beta", "float", 0.001, "Coefficient on the KL term that keeps the policy near the "
      "reference.", _M),
    K("grpo_entropy_term_weight", "float", 0.0, "Weight of the entropy bonus in the GRPO loss.",
      _M),
    K("grpo_filter_groups_with_same_reward", "bool", False, "Drop groups whose completions all got "
      "the same reward (zero advantage).", _M),
    K("rl_inference_logprobs_is_correction", "bool", False, "Use the sampler's log-probs for an "
      "importance-sampling correction of the loss.", _M),
    K("rl_importance_sampling_truncation_coef", "float", None, "Cap on the importance-sampling "
      "ratio of that correction; null leaves it uncapped.", _M),
    K("rl_calculate_intra_group_similarity", "bool", False, "Log how similar the completions "
      "within a group are.", _M),

    # Rollout generation
    K("grpo_default_temperature", "float", 1.0, "Temperature applied when the policy generates "
      "rollout samples.", _M,
      aliases=(Alias("rl_default_temperature", "megatron-lm",
                     note="Megatron-LM's current name"),)),
    K("grpo_default_top_p", "float", 0.0, "Nucleus-sampling threshold of rollouts; 0 turns top-p "
      "off.", _M,
      aliases=(Alias("rl_default_top_p", "megatron-lm",
                     note="Megatron-LM's current name"),)),
    K("langrl_inference_server_type", "str", "inplace_megatron", "How rollouts are served: by the "
      "trained model in place, plain or with a chat template.", _M, choices=_SERVERS),
    K("langrl_inference_server_conversation_template", "str", None, "Chat template (tokenizer name "
      "or path) for the chat rollout server.", _M),
    K("rl_partial_rollouts", "bool", False, "Let unfinished rollouts carry over into the next "
      "step.", _M),

    # Memory between rollout and training phases
    K("rl_offload_optimizer_during_inference", "bool", False, "Move optimizer state to host memory "
      "while rollouts are generated.", _M),
    K("rl_offload_kv_cache_during_training", "bool", False, "Move the rollout KV cache to host "
      "memory while training runs.", _M),
    K("rl_remove_kv_cache_during_training", "bool", False, "Free the rollout KV cache during "
      "training and rebuild it for the next rollout.", _M),
    K("rl_reset_cuda_graphs", "bool", False, "Drop and recapture CUDA graphs when switching "
      "between rollout and training.", _M, INERT,
      "jaxtrain captures no CUDA graphs (XLA compiles each step whole), so there is nothing to "
      "reset"),
]
