"""Tokenizer and vocabulary: which tokenizer to load, from where, and its special tokens."""
from jaxtrain.config.knob import Alias, HONORED, INERT, K, REJECTED

# Megatron's own tokenizer classes plus the ones Primus adds (all HF-backed on the Primus side).
_TOKENIZER_TYPES = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
    "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
    "Llama3Tokenizer", "Llama4Tokenizer", "MixtralTokenizer", "DeepSeekV2Tokenizer",
    "DeepSeekV3Tokenizer", "DeepSeekV4Tokenizer", "Lfm2Tokenizer", "KimiK2Tokenizer",
)

_BUILT = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "TikTokenizer")


def _none_if_empty(value):
    """MaxText writes an empty tokenizer_path for "not set"."""
    return None if value == "" else value


KNOBS = [
    # Which tokenizer, and where it comes from
    K("tokenizer_type", "str", None, "Which tokenizer implementation to build, e.g. "
      "GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer or NullTokenizer.", "megatron",
      choices=_TOKENIZER_TYPES, status=HONORED,
      planned_values={t: 6 for t in _TOKENIZER_TYPES if t not in _BUILT}),
    K("tokenizer_model", "str", None, "Tokenizer file or Hugging Face id/directory to load the "
      "tokenizer from.", "megatron", status=HONORED,
      aliases=(Alias("tokenizer_path", "maxtext", to_canonical=_none_if_empty,
                     note="an empty string means unset"),)),
    K("vocab_file", "str", None, "Path to the vocabulary that BPE and WordPiece tokenizers load.",
      "megatron", status=HONORED),
    K("trust_remote_code", "bool", False, "Allow a Hugging Face tokenizer or model config to run "
      "the Python code shipped with it.", "megatron", status=HONORED,
      doc_defaults={"pgs-train": True},
      aliases=(Alias("model.trust_remote_code", "pgs-train"),)),
    K("legacy_tokenizer", "bool", False, "Use Megatron's older tokenizer classes instead of the "
      "megatron.core ones.", "megatron", INERT,
      "chooses between two PyTorch-side implementations of the same tokenizers, and Primus's "
      "pinned Megatron has only one; jaxtrain has a single tokenizer loader"),

    # Vocabulary size and extra tokens
    K("vocab_size", "int", None, "Vocabulary size before padding; needed when the tokenizer "
      "cannot report it (NullTokenizer).", "megatron", status=HONORED),
    K("vocab_extra_ids", "int", 0, "Number of <extra_id_N> sentinel tokens appended to the "
      "vocabulary.", "megatron", REJECTED,
      "the sentinels serve T5-style span-corruption pretraining of encoder-decoder models, "
      "which jaxtrain does not train; add tokens to the tokenizer itself instead"),

    # tiktoken settings
    K("tiktoken_pattern", "str", None, "Pre-tokenisation regex of a tiktoken tokenizer: v1 or v2.",
      "megatron", choices=("v1", "v2"), status=HONORED),
    K("tiktoken_num_special_tokens", "int", 1000, "Number of ids reserved for special tokens at "
      "the start of a tiktoken vocabulary.", "megatron", status=HONORED),
    K("tiktoken_special_tokens", "list[str]", None, "Special-token strings of a tiktoken "
      "tokenizer (must include <unk>, <s>, </s>, ...).", "megatron", status=HONORED),
]
