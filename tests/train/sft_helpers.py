"""A tiny local Hugging Face chat model and chat data for the SFT tests (nothing downloaded).

:func:`write_chat_model` writes a model directory as ``save_pretrained`` leaves it: a random
tiny Llama or Qwen3 (config.json + safetensors, transformers' own init), a byte-level BPE
tokenizer trained here on the task's text, with ChatML special tokens and a ChatML chat
template, and a generation config. :func:`pair_task` is a chat task a tiny model learns in a
few hundred steps: each question has one fixed answer.
"""
from __future__ import annotations

import json
import pathlib
import random

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["red", "blue", "green", "gold", "gray", "pink", "teal", "plum", "sand", "jade",
         "rose", "mint", "navy", "rust", "lime", "ruby"]


def pair_task(n: int = 64, seed: int = 0) -> list[dict]:
    """Conversations 'what follows X?' -> 'Y' over a fixed random pairing of WORDS."""
    rng = random.Random(seed)
    answers = WORDS[:]
    rng.shuffle(answers)
    pairs = dict(zip(WORDS, answers))
    rows = []
    for i in range(n):
        q = WORDS[i % len(WORDS)]
        rows.append({"messages": [
            {"role": "system", "content": "You answer with one word."},
            {"role": "user", "content": f"what follows {q}?"},
            {"role": "assistant", "content": pairs[q]}]})
    return rows


def write_jsonl(path, rows) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokenizer(corpus: list[str]):
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML)


def write_chat_model(path, family: str = "llama", rows=None, seed: int = 0, **config
                     ) -> pathlib.Path:
    """A tiny random ``family`` (llama | qwen3 | qwen3_5 | gemma3 | olmo3) chat model directory with its
    tokenizer."""
    import torch
    import transformers

    path = pathlib.Path(path)
    rows = rows if rows is not None else pair_task()
    hf_tok = _tokenizer([m["content"] for r in rows for m in r["messages"]] + ["user assistant system"])
    common = dict(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
                  bos_token_id=None)
    common.update(config)
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=16, sliding_window=8,
                                            **{**common, "tie_word_embeddings": True})
        model = transformers.Gemma3ForCausalLM(cfg)
    elif family == "olmo3":
        cfg = transformers.Olmo3Config(sliding_window=8, **common)
        model = transformers.Olmo3ForCausalLM(cfg)
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
            **common)
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    hf_tok.save_pretrained(path)
    return path
