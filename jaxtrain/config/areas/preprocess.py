"""pgs offline data preparation (score, filter, select SFT samples) and training on its output."""
from jaxtrain.config.knob import K

_PGS = "pgs-train"
_FORMATS = ("parquet", "jsonl")
_STRATEGIES = ("random", "optimal", "curriculum", "balanced", "medium_focus", "hard_focus",
               "flow")
_FILTER_SCORES = ("response", "full")

KNOBS = [
    # Using the prepared output
    K("preprocess.enabled", "bool", False, "Train on the prepared samples in preprocess.output_dir "
      "instead of the raw dataset; errors if none exist.", _PGS, issue=19),
    K("preprocess.output_dir", "str", "./prepared", "Directory the preparation step writes its "
      "scored samples and metadata to, and training reads.", _PGS, issue=19),
    K("preprocess.format", "str", "parquet", "File format of the prepared samples: parquet (falls "
      "back to jsonl on schema clashes) or jsonl.", _PGS, choices=_FORMATS, issue=19),

    # Selection
    K("preprocess.max_samples", "int", 0, "Read at most this many raw samples before scoring; "
      "0 reads all.", _PGS, issue=19),
    K("preprocess.budget", "int", 0, "Cap on how many samples survive scoring and filtering; 0 "
      "means no cap.", _PGS, issue=19),
    K("preprocess.strategy", "str", "random", "How the budget is picked from the scored samples "
      "(random, curriculum order, difficulty mixes, ...).", _PGS, choices=_STRATEGIES, issue=19),
    K("preprocess.group_field", "str", "", "Sample column whose groups get per-group statistics "
      "in the metadata; empty for none.", _PGS, issue=19),
    K("preprocess.eval_holdout", "int", 0, "Random samples set aside as a held-out eval set, used "
      "when no eval dataset is given; 0 for none.", _PGS, issue=19),

    # Perplexity filters
    K("preprocess.min_ppl", "float", 1.5, "Samples scoring under this perplexity are removed as "
      "already learned.", _PGS, issue=19),
    K("preprocess.max_ppl", "float", 500.0, "Drop samples whose perplexity is above this (noise); "
      "<= 0 turns the filter off.", _PGS, issue=19),
    K("preprocess.filter_score", "str", "response", "Whether filtering looks at perplexity over "
      "just the response tokens or over the entire conversation.", _PGS, choices=_FILTER_SCORES,
      issue=19),

    # Scoring pass
    K("preprocess.batch_size", "int", 4, "Most samples per scoring forward pass (length-sorted, "
      "padded).", _PGS, issue=19),
    K("preprocess.max_batch_tokens", "int", 16384, "Most padded tokens per scoring forward pass; "
      "bounds the logits' memory.", _PGS, issue=19),
    K("preprocess.hes", "bool", False, "Additionally score reasoning quality by High-Entropy-Sum, "
      "at the cost of another forward pass.", _PGS, issue=19),
    K("preprocess.hes_top_k_pct", "float", 0.5, "HES adds up the entropies of this percentage of "
      "tokens, the most uncertain ones.", _PGS, issue=19),
]
