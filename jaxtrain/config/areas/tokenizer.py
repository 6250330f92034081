"""Tokenizer and vocabulary: which tokenizer to load, from where, and its special tokens."""
from jaxtrain.config.knob import Alias, HONORED, INERT, K

# MaxText's spellings (its base.yml default is sentencepiece).
_MAXTEXT_TYPES = ("sentencepiece", "tiktoken", "huggingface")

# Megatron's own tokenizer classes plus the ones Primus adds (all HF-backed on the Primus side).
_TOKENIZER_TYPES = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
    "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
    "Llama3Tokenizer", "Llama4Tokenizer", "MixtralTokenizer", "DeepSeekV2Tokenizer",
    "DeepSeekV3Tokenizer", "DeepSeekV4Tokenizer", "Lfm2Tokenizer", "KimiK2Tokenizer",
)

_MULTIMODAL = ("builds the prompts of vision-language models (image tokens and chat formats); "
               "jaxtrain trains text-only decoder models: use the text tokenizer's own type "
               "(e.g. HuggingFaceTokenizer, or NullTokenizer for token-id data)")


def _none_if_empty(value):
    """MaxText writes an empty tokenizer_path for "not set"."""
    return None if value == "" else value


KNOBS = [
    # Which tokenizer, and where it comes from
    K("tokenizer_type", "str", None, "Which tokenizer implementation to build, e.g. "
      "GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer (MaxText: "
      "sentencepiece, tiktoken, huggingface).", ("megatron", "maxtext"),
      choices=_TOKENIZER_TYPES + _MAXTEXT_TYPES, status=HONORED,
      doc_defaults={"maxtext": "sentencepiece"},
      rejected_values={"MultimodalTokenizer": "MultimodalTokenizer " + _MULTIMODAL,
                       "NullMultimodalTokenizer": "NullMultimodalTokenizer " + _MULTIMODAL},
      # SFTTokenizer formats chat conversations by prompt format for SFT data (not built yet)
      planned_values={"SFTTokenizer": None}),
    K("tokenizer_model", "str", None, "Tokenizer file or Hugging Face id/directory to load the "
      "tokenizer from.", "megatron", status=HONORED,
      aliases=(Alias("tokenizer_path", "maxtext", to_canonical=_none_if_empty,
                     note="an empty string means unset"),)),
    K("vocab_file", "str", None, "Path to the vocabulary that BPE and WordPiece tokenizers load.",
      "megatron", status=HONORED),
    K("add_bos", "bool", True, "MaxText hf/grain text data: start every document with the "
      "tokenizer's BOS token (when it has one).", "maxtext", HONORED),
    K("add_eos", "bool", True, "MaxText hf/grain text data: end every document with the "
      "tokenizer's EOS (end-of-document) token.", "maxtext", HONORED),
    K("hf_access_token", "str", "", "Hugging Face Hub token for gated datasets and "
      "tokenizers.", "maxtext", INERT,
      "jaxtrain reads datasets and tokenizers from local files only and never contacts the "
      "Hub, so there is nothing to authenticate; download gated files beforehand"),
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
      "cannot report it (NullTokenizer).", ("megatron", "maxtext"), status=HONORED,
      doc_defaults={"maxtext": 32000}),
    K("vocab_extra_ids", "int", 0, "Number of <extra_id_N> sentinel tokens appended to the "
      "vocabulary (SentencePieceTokenizer and BertWordPiece* tokenizers).", "megatron",
      status=HONORED),

    # tiktoken settings
    K("tiktoken_pattern", "str", None, "Pre-tokenisation regex of a tiktoken tokenizer: v1 or v2.",
      "megatron", choices=("v1", "v2"), status=HONORED),
    K("tiktoken_num_special_tokens", "int", 1000, "Number of ids reserved for special tokens at "
      "the start of a tiktoken vocabulary.", "megatron", status=HONORED),
    K("tiktoken_special_tokens", "list[str]", None, "Special-token strings of a tiktoken "
      "tokenizer (must include <unk>, <s>, </s>, ...).", "megatron", status=HONORED),
]
