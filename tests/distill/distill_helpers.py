"""A synthetic distillation task and tiny local models for the distillation tests.

:func:`number_task` is 'what follows X?' -> a fixed number per word (so pgs's greedy-accuracy
grading, the last number of the answer, applies). :func:`write_pair` writes a teacher and a
smaller student sharing one tokenizer, as Hugging Face model directories.
"""
from __future__ import annotations

import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))

from sft_helpers import WORDS, write_chat_model, write_jsonl  # noqa: E402

__all__ = ["WORDS", "number_task", "prompt_rows", "train_teacher", "write_pair", "write_jsonl"]


def number_task(n: int = 64, seed: int = 0) -> list[dict]:
    """Chat rows 'what follows X?' -> its number (two digits), a fixed random pairing."""
    rng = random.Random(seed)
    numbers = [str(10 + i) for i in range(len(WORDS))]
    rng.shuffle(numbers)
    pairs = dict(zip(WORDS, numbers))
    return [{"messages": [{"role": "user", "content": f"what follows {WORDS[i % 16]}?"},
                          {"role": "assistant", "content": pairs[WORDS[i % 16]]}]}
            for i in range(n)]


def prompt_rows(rows: list[dict]) -> list[dict]:
    """pgs distill's messages rows: the conversation up to the user turn, and the answer."""
    return [{"messages": r["messages"][:-1], "answer": r["messages"][-1]["content"]}
            for r in rows]


def write_pair(root, teacher: str = "teacher", student: str = "student", family: str = "qwen3"
               ) -> tuple[pathlib.Path, pathlib.Path]:
    """(teacher, student) model directories: the student has half the width."""
    root = pathlib.Path(root)
    rows = number_task()
    t = write_chat_model(root / teacher, family=family, rows=rows, seed=1)
    s = write_chat_model(root / student, family=family, rows=rows, seed=2, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1)
    return t, s


SFT = """\
model: {{name_or_path: {model}, torch_dtype: float32}}
data: {{dataset: {data}, max_seq_length: 32, packing: false}}
train: {{output_dir: {out}, max_steps: {steps}, per_device_batch_size: 16,
        gradient_accumulation_steps: 1, learning_rate: 3.0e-3, min_learning_rate: 3.0e-4,
        warmup_ratio: 0.05, save_steps: 1000, bf16: false, gradient_checkpointing: none,
        logging_steps: 50}}
logging: {{use_wandb: false, use_trackio: false}}
"""


def train_teacher(root, model, steps: int = 150) -> pathlib.Path:
    """``model`` fine-tuned on :func:`number_task` with jaxtrain's SFT; returns its final/."""
    from jaxtrain import train

    root = pathlib.Path(root)
    write_jsonl(root / "teacher_sft.jsonl", number_task(64))
    (root / "teacher_sft.yml").write_text(SFT.format(model=model, data=root / "teacher_sft.jsonl",
                                                     out=root / "teacher_sft", steps=steps))
    assert train.main([str(root / "teacher_sft.yml")]) == 0
    return root / "teacher_sft" / "final"
