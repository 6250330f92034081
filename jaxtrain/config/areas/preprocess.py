"""pgs offline data preparation (score, filter, select SFT samples) and training on its output."""
from jaxtrain.config.knob import HONORED, K

_PGS = "pgs-train"
_FORMATS = ("parquet", "jsonl")
_STRATEGIES = ("random", "optimal", "curriculum", "balanced", "medium_focus", "hard_focus",
               "flow")
_FILTER_SCORES = ("response", "full")
_CURRICULUM = ("curriculum is pgs's documented one: a seeded random sample of the budget, ordered "
               "by response perplexity (lowest first) and trained in that order; pgs's older "
               "code took the lowest-perplexity rows instead")
_BATCHING = ("rows are grouped shortest first and padded to a length bucket (a power of two up to "
             "256, then a multiple of 256) and a power-of-two row count, so the padded tokens "
             "counted are the bucketed ones")
_HES = ("computed from the scoring forward itself (no second pass), over the same encoded "
        "tokens training sees")
_HOLDOUT = ("more held-out rows than pass the filters is an error (pgs silently holds none "
            "out); a preparation without held-out rows removes an older eval_data file")

KNOBS = [
    # Using the prepared output
    K("preprocess.enabled", "bool", False, "Train on the prepared samples in preprocess.output_dir "
      "instead of the raw dataset; errors if none exist.", _PGS, HONORED),
    K("preprocess.output_dir", "str", "./prepared", "Directory the preparation step writes its "
      "scored samples and metadata to, and training reads.", _PGS, HONORED),
    K("preprocess.format", "str", "parquet", "File format of the prepared samples: parquet (falls "
      "back to jsonl on schema clashes) or jsonl.", _PGS, HONORED, choices=_FORMATS),

    # Selection
    K("preprocess.max_samples", "int", 0, "Read at most this many raw samples before scoring; "
      "0 reads all.", _PGS, HONORED),
    K("preprocess.budget", "int", 0, "Cap on how many samples survive scoring and filtering; 0 "
      "means no cap.", _PGS, HONORED),
    K("preprocess.strategy", "str", "random", "How the budget is picked from the scored samples "
      "(random, curriculum order, difficulty mixes, ...).", _PGS, HONORED, _CURRICULUM,
      choices=_STRATEGIES),
    K("preprocess.group_field", "str", "", "Sample column whose groups get per-group statistics "
      "in the metadata; empty for none.", _PGS, HONORED),
    K("preprocess.eval_holdout", "int", 0, "Random samples set aside as a held-out eval set, used "
      "when no eval dataset is given; 0 for none.", _PGS, HONORED, _HOLDOUT),

    # Perplexity filters
    K("preprocess.min_ppl", "float", 1.5, "Samples scoring under this perplexity are removed as "
      "already learned.", _PGS, HONORED),
    K("preprocess.max_ppl", "float", 500.0, "Drop samples whose perplexity is above this (noise); "
      "<= 0 turns the filter off.", _PGS, HONORED),
    K("preprocess.filter_score", "str", "response", "Whether filtering looks at perplexity over "
      "just the response tokens or over the entire conversation.", _PGS, HONORED,
      choices=_FILTER_SCORES),

    # Scoring pass
    K("preprocess.batch_size", "int", 4, "Most samples per scoring forward pass (length-sorted, "
      "padded).", _PGS, HONORED, _BATCHING),
    K("preprocess.max_batch_tokens", "int", 16384, "Most padded tokens per scoring forward pass; "
      "bounds the logits' memory.", _PGS, HONORED, _BATCHING),
    K("preprocess.hes", "bool", False, "Additionally score reasoning quality by High-Entropy-Sum, "
      "at the cost of another forward pass.", _PGS, HONORED, _HES),
    K("preprocess.hes_top_k_pct", "float", 0.5, "HES adds up the entropies of this percentage of "
      "tokens, the most uncertain ones.", _PGS, HONORED),
]
