"""Samples/s of the pgs chat (SFT) data pipeline on this CPU: render + tokenize + mask
(:func:`jaxtrain.data.chat.encode`), then pack or pad (:func:`jaxtrain.data.sft.assemble`).

    python benchmarks/chat_pipeline.py [--rows 4000] [--turns 1,3] [--seq 2048]
        [--template chatml|qwen3|llama31]

The conversations are random-word chats (system, then 1-3 user/assistant turns of 20-200
words; every other assistant turn carries a reasoning block), the tokenizer a byte-level BPE
trained here on them with the template's special tokens (nothing downloaded). The qwen3 and
llama31 templates are the real ones kept in tests/data/chat_templates. In one process, then ``--workers`` encoding processes (sources of 2,048 rows or more are encoded that
way): the pipeline encodes every row once at start-up, so this is its start-up cost per row.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import time

from jaxtrain.data import chat, sft

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}")
SPECIALS = {"chatml": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
            "qwen3": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                      "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
            "llama31": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]}


def conversations(n: int, turns: tuple[int, int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text(5, 20)}]
        for t in range(rng.randint(*turns)):
            msgs.append({"role": "user", "content": text(20, 200)})
            answer = {"role": "assistant", "content": text(20, 200)}
            if t % 2:
                answer["reasoning_content"] = text(10, 60)
            msgs.append(answer)
        rows.append({"messages": msgs})
    return rows


def tokenizer(template: str, rows):
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = SPECIALS[template]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((m["content"] for r in rows[:500] for m in r["messages"]), trainer)
    source = CHATML if template == "chatml" else (TEMPLATES / f"{template}.jinja").read_text()
    end = "<|eot_id|>" if template == "llama31" else "<|im_end|>"
    bos = "<|begin_of_text|>" if template == "llama31" else None
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=end,
                                                bos_token=bos, chat_template=source)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--turns", default="1,3")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--template", choices=tuple(SPECIALS), default="qwen3")
    p.add_argument("--workers", default="0,2", help="encoding processes (num_workers) to time")
    a = p.parse_args()
    rows = conversations(a.rows, tuple(int(x) for x in a.turns.split(",")))
    tok = tokenizer(a.template, rows)
    opts = chat.ChatOptions(max_seq_length=a.seq)
    chat.check_template(tok, opts)
    source = sft.Source("bench", "-", "train")
    for workers in (int(w) for w in a.workers.split(",")):
        t0 = time.perf_counter()
        results = sft._encoded(((f"row {i}", r) for i, r in enumerate(rows)), tok, opts, source,
                               workers, None)
        encoded = [e for _, e in results if isinstance(e, chat.Encoded)]
        t1 = time.perf_counter()
        tokens = sum(len(e.ids) for e in encoded)
        print(f"{a.template}, num_workers {workers}: {len(encoded)} of {len(rows)} "
              f"conversations, {tokens} tokens ({tokens / max(1, len(encoded)):.0f} each)")
        print(f"  render+tokenize+mask : {len(rows) / (t1 - t0):8.0f} samples/s "
              f"{tokens / (t1 - t0):10.0f} tokens/s")
    for packing in (True, False):
        t2 = time.perf_counter()
        arrays = sft.assemble(encoded, a.seq, packing)
        t3 = time.perf_counter()
        print(f"  {'pack' if packing else 'pad '} into {a.seq:5d}     : "
              f"{len(encoded) / (t3 - t2):8.0f} samples/s -> {len(arrays['tokens'])} rows, "
              f"{sft.describe(arrays)}")
        total = (t1 - t0) + (t3 - t2)
        print(f"  end to end ({'packed' if packing else 'padded'})  : "
              f"{len(rows) / total:8.0f} samples/s")


if __name__ == "__main__":
    main()
