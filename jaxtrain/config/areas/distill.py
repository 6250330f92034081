"""pgs on-policy distillation (pgs distill): teachers, prompt sources, rollouts, losses, scoring."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, K

_OPD = "pgs-distill"
_TEACHER_BACKENDS = ("hf", "vllm")
_TEACHER_LOSSES = ("", "full_rkl", "topk_kl", "sampled_rkl", "xtok", "rs_kd")
_SOURCE_FORMATS = ("messages", "mcqa", "agent_traces")
_ROLLOUT_BACKENDS = ("hf", "vllm", "vllm_server")
_XTOK_SPREADS = ("chunk", "proportional")
# "none" (pgs's default spelling) reads as null: coerce() treats the string none as null.
_TOKEN_WEIGHTINGS = ("none", "sure", "entropy")

_VLLM_ROLLOUT = ("every value samples from the student being trained with jaxtrain's own batched "
                 "JAX sampler (KV cache, ragged prompts, the same temperature and stop ids): a "
                 "vLLM engine or server fed the weights over CUDA IPC needs PyTorch tensors, which "
                 "a JAX trainer does not have, and the policy sampled is the same; "
                 "rollout.max_staleness overlaps generation with training for every value")
_VLLM_ROLLOUT_ONLY = ("configures only a vLLM rollout engine, which jaxtrain never runs: its own "
                      "JAX sampler generates the rollouts for every rollout.backend")

_TREE = ("shapes how pgs batches a trace's shared context (trunk passes over chunks of it); "
         "jaxtrain scores each regenerated turn with its whole context as one sequence, which "
         "gives the same numbers (and re-reads the context per turn)")

KNOBS = [
    # Teachers (one block per named teacher)
    K("teachers.<name>.model", "str", None, "Teacher model (HF id or path); required.", _OPD,
      status=HONORED),
    K("teachers.<name>.tokenizer", "str", "", "Override for the teacher's tokenizer used to "
      "render and score; empty keeps its own.", _OPD, status=HONORED),
    K("teachers.<name>.backend", "str", "hf", "How the teacher scores: hf (in-process frozen "
      "model, full distribution) or vllm (server, top-k log-probs).", _OPD,
      choices=_TEACHER_BACKENDS, status=HONORED),
    K("teachers.<name>.loss", "str", "", "Distillation loss for this teacher; empty picks by "
      "backend and vocabulary (full_rkl, topk_kl or xtok).", _OPD, choices=_TEACHER_LOSSES,
      status=HONORED),
    K("teachers.<name>.device", "str", "", "hf backend: device holding the teacher; empty shares "
      "the student's.", _OPD, REJECTED, "jaxtrain shards an hf teacher over the student's "
      "device mesh, every device holding a slice, so there is no separate teacher device; "
      "leave it empty (teachers.<name>.offload keeps the teacher in host memory between "
      "scoring calls)"),
    K("teachers.<name>.offload", "bool", False, "hf backend: between scoring calls the teacher "
      "sits in host memory; its output head is not moved off the device.", _OPD, status=HONORED),
    K("teachers.<name>.url", "str", "", "vllm backend: address of an already running scoring "
      "server; empty launches one.", _OPD, status=HONORED),
    K("teachers.<name>.gpu_memory_utilization", "float", 0.15, "vllm backend: fraction of GPU "
      "memory given to a server the trainer launches.", _OPD, INERT, "sizes a vLLM server "
      "the trainer launches; jaxtrain reaches a running one at teachers.<name>.url and never "
      "launches one, so nothing reads it"),
    K("teachers.<name>.eos_map", "dict", {}, "Shared vocabulary: student end-of-turn token -> "
      "teacher's; empty maps eos automatically.", _OPD, status=HONORED),
    K("teachers.<name>.probe_texts", "list[str]", [], "Additional strings student and teacher "
      "must split into identical tokens before the vocabulary counts as shared.", _OPD, status=HONORED),

    # Prompt sources (one block per named source): common fields
    K("sources.<name>.format", "str", "messages", "Prompt file kind: messages (chat JSONL), mcqa "
      "(multiple choice) or agent_traces (recorded agent runs).", _OPD, choices=_SOURCE_FORMATS,
      status=HONORED),
    K("sources.<name>.path", "str", None, "Prompt file of this source; required.", _OPD,
      status=HONORED),
    K("sources.<name>.weight", "float", 1.0, "Relative sampling weight of this source among all "
      "sources.", _OPD, status=HONORED),
    K("sources.<name>.teacher", "str", "", "Which teacher scores prompts from this source; "
      "defaults to the first one listed.", _OPD, status=HONORED),
    K("sources.<name>.topic_field", "str", "", "Column holding each row's topic, which "
      "topic_teachers uses to pick a teacher.", _OPD, status=HONORED),
    K("sources.<name>.topic_teachers", "dict", {}, "Map teacher -> topics: rows with a listed "
      "topic go to that teacher, others to the source's teacher.", _OPD, status=HONORED),
    K("sources.<name>.max_new_tokens", "int", 512, "Completion length budget in tokens for this "
      "source's rollouts.", _OPD, status=HONORED),
    K("sources.<name>.dev_size", "int", 200, "Rows held out of path for dev evaluation "
      "(deterministic hash ranking).", _OPD, status=HONORED),
    K("sources.<name>.dev_path", "str", "", "Separate dev file instead of rows held out of path; "
      "empty for none.", _OPD, status=HONORED),

    # Prompt sources: agent_traces
    K("sources.<name>.messages_field", "str", "messages", "agent_traces: column holding the "
      "conversation.", _OPD, status=HONORED),
    K("sources.<name>.tools_field", "str", "tools", "agent_traces: column holding the tool "
      "schemas.", _OPD, status=HONORED),
    K("sources.<name>.branches_per_trace", "int", 8, "agent_traces: for each trace drawn, this "
      "many of its assistant turns are resampled; 0 resamples every one.", _OPD, status=HONORED),
    K("sources.<name>.max_context", "int", 32768, "agent_traces: turns whose preceding context "
      "exceeds this many tokens are not regenerated.", _OPD, status=HONORED),

    # Prompt sources: mcqa
    K("sources.<name>.system_message", "str", "", "mcqa: system message; empty uses the built-in "
      "one.", _OPD, status=HONORED),
    K("sources.<name>.fast_template", "str", "", "mcqa: direct-answer prompt template with "
      "{question}/{options} placeholders.", _OPD, status=HONORED),
    K("sources.<name>.cot_template", "str", "", "mcqa: chain-of-thought prompt template with "
      "{question}/{options} placeholders.", _OPD, status=HONORED),
    K("sources.<name>.shots_path", "str", "", "mcqa: path to the official few-shot examples "
      "published with the benchmark.", _OPD, status=HONORED),
    K("sources.<name>.p_reference_shots", "float", 0.5, "mcqa: probability a prompt gets the "
      "official few-shot examples.", _OPD, status=HONORED),
    K("sources.<name>.p_pool_shots", "float", 0.25, "mcqa: share of prompts given 1..k shots "
      "drawn at random from the pool; leftover prompts get no shots.", _OPD, status=HONORED),
    K("sources.<name>.pool_shots_max_k", "int", 5, "mcqa: most random pool shots in one prompt.",
      _OPD, status=HONORED),
    K("sources.<name>.cot_fraction", "float", 0.0, "mcqa: probability that a prompt asks for "
      "step-by-step reasoning (CoT template).", _OPD, status=HONORED),
    K("sources.<name>.cot_max_new_tokens", "int", 300, "mcqa: most tokens a chain-of-thought "
      "prompt may generate.", _OPD, status=HONORED),

    # Rollouts (student generation)
    K("rollout.backend", "str", "hf", "Student generation engine: hf (the trainer's own "
      "sampler), vllm (in-process engine) or vllm_server.", _OPD, MAPPED, _VLLM_ROLLOUT,
      choices=_ROLLOUT_BACKENDS),
    K("rollout.batch_prompts", "int", 32, "Number of prompts drawn to build each optimizer step's "
      "batch.", _OPD, status=HONORED),
    K("rollout.group_size", "int", 1, "Completions generated per prompt.", _OPD, status=HONORED),
    K("rollout.temperature", "float", 1.0, "Temperature for rollout sampling; losses score the "
      "teacher against the student scaled by it.", _OPD, status=HONORED),
    K("rollout.max_staleness", "int", 0, "Policy versions a batch may lag the trained weights; 0 "
      "is strictly on-policy.", _OPD, status=HONORED),
    K("rollout.micro_seqs", "int", 64, "Sequences per generation call of the trainer's own "
      "sampler.", _OPD, status=HONORED),
    K("rollout.gpu_memory_utilization", "float", 0.3, "vLLM rollout engine: share of GPU memory "
      "it may take for weights plus KV cache.", _OPD, INERT, _VLLM_ROLLOUT_ONLY),
    K("rollout.max_model_len", "int", 4096, "vLLM rollout engine: prompt plus completion token "
      "limit.", _OPD, INERT, _VLLM_ROLLOUT_ONLY),
    K("rollout.prefix_caching", "bool", False, "vLLM rollout engine: automatic prefix caching.",
      _OPD, INERT, _VLLM_ROLLOUT_ONLY),
    K("rollout.enforce_eager", "bool", False, "vLLM rollout engine: run without CUDA graphs.",
      _OPD, INERT, _VLLM_ROLLOUT_ONLY),
    K("rollout.sleep", "bool", True, "vLLM rollout engine: free its weights and KV cache while the "
      "trainer trains.", _OPD, INERT, _VLLM_ROLLOUT_ONLY),
    K("rollout.url", "str", "", "vllm_server rollouts: address of the running server.", _OPD,
      INERT, _VLLM_ROLLOUT_ONLY),

    # Losses
    K("loss.top_k", "int", 8, "k of the teacher's highest-probability tokens, as read by topk_kl "
      "and xtok's dense term.", _OPD, status=HONORED),
    K("loss.beta", "float", 1.0, "topk_kl and xtok dense term: reverse-KL share of the mix, "
      "forward KL getting 1 - beta.", _OPD, status=HONORED),
    K("loss.is_low", "float", 0.5, "sampled_rkl/xtok: lower importance-ratio bound; tokens under "
      "it are excluded from the gradient.", _OPD, status=HONORED),
    K("loss.is_high", "float", 2.0, "sampled_rkl/xtok: upper importance-ratio bound; tokens over "
      "it are excluded from the gradient.", _OPD, status=HONORED),
    K("loss.length_norm", "bool", False, "Give each sequence equal weight (token mean inside "
      "each, then mean of those) rather than each batch token.", _OPD, status=HONORED),
    K("loss.xtok_spread", "str", "chunk", "xtok: give each token its chunk's advantage, or a share "
      "proportional to its log-prob.", _OPD, choices=_XTOK_SPREADS, status=HONORED),
    K("loss.xtok_dense_weight", "float", 0.0, "xtok: weight of the top-k KL applied where both "
      "student and teacher chunks are single tokens.", _OPD, status=HONORED),
    K("loss.mask_whitespace", "bool", True, "xtok: no loss on chunks made only of whitespace.",
      _OPD, status=HONORED),
    K("loss.trace_kd_weight", "float", 0.0, "agent_traces: weight of off-policy distillation on "
      "the recorded assistant turns.", _OPD, status=HONORED),
    K("loss.rs_rounds", "int", 50, "rs_kd: teacher samples drawn per position.", _OPD, status=HONORED),
    K("loss.rs_temperature", "float", 1.0, "rs_kd: power applied to the teacher distribution for "
      "proposals, corrected by importance weights.", _OPD, status=HONORED),
    K("loss.token_weighting", "str", "none", "Per-token loss weights: none (uniform), sure (by "
      "student uncertainty) or entropy (keep high-entropy tokens).", _OPD,
      choices=_TOKEN_WEIGHTINGS, status=HONORED),
    K("loss.sure_alpha", "float", 1.0, "Strength of sure weighting, w = 1 + alpha*(1 - p); 0 "
      "disables it.", _OPD, status=HONORED),
    K("loss.entropy_keep", "float", 0.2, "entropy weighting: fraction of highest-entropy tokens "
      "kept per scoring micro-batch.", _OPD, status=HONORED),

    # Scoring, evaluation and agent-trace batching (train section)
    K("train.score_micro_seqs", "int", 16, "Scoring forward batch size in sequences, for both "
      "student and teacher; accumulation makes results independent of it.", _OPD, status=HONORED),
    K("train.eval_samples", "int", 200, "Each evaluation draws this many dev prompts from every "
      "source.", _OPD, status=HONORED),
    K("train.tree_chunk_size", "int", 8192, "agent_traces: a trace's common prefix is processed "
      "this many tokens at a time, which caps activation memory.", _OPD, INERT, _TREE),
    K("train.tree_branch_tokens", "int", 8192, "agent_traces: regenerated turns are batched into "
      "forwards of up to this many padded tokens; 0 runs them singly.", _OPD, INERT, _TREE),
    K("train.tree_min_gap", "int", 1024, "agent_traces: least tokens between context cuts; turns "
      "in between re-read the gap.", _OPD, INERT, _TREE),
]
