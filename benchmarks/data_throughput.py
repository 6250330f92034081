"""Tokens/s of the data pipeline alone: Megatron indexed files -> GPT samples -> batches, or
ArrayRecord text documents (dataset_type grain) -> tokenized, packed samples -> batches.

    python benchmarks/data_throughput.py [--docs 20000] [--seq 2048] [--gbs 64] [--steps 50]
        [--workers 0,8] [--reset] [--source indexed|arrayrecord]

indexed: writes a synthetic indexed dataset (uint16, random document lengths) to a temporary
folder, builds the GPT sample/shuffle indices (timed), then draws global batches through
``global_batches`` as the loop does and prints tokens/s per ``num_workers`` setting.
arrayrecord: writes random-word documents as tf.train.Example records, trains a small
byte-level BPE locally, and times the start-up (read, tokenize, pack: the grain/hf text path
does it all before the first batch) and then the batches.
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile
import time
import types

import numpy as np

from jaxtrain.data.batches import TokenData, global_batches
from jaxtrain.data.gpt_dataset import GPTDataset
from jaxtrain.data.indexed import IndexedDataset, IndexedDatasetBuilder


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gbs", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--workers", default="0,8")
    p.add_argument("--reset", action="store_true", help="reset positions/attention at EOD")
    p.add_argument("--source", choices=("indexed", "arrayrecord"), default="indexed")
    a = p.parse_args()
    if a.source == "arrayrecord":
        return arrayrecord(a)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"{tmp}/bench"
        b = IndexedDatasetBuilder(prefix, np.uint16)
        for n in rng.integers(50, 2000, a.docs):
            b.add_document(np.append(rng.integers(1, 50000, n), 0))
        b.finalize()
        ds = IndexedDataset(prefix)
        t0 = time.perf_counter()
        gpt = GPTDataset(ds, np.arange(ds.num_documents), a.seq, a.steps * a.gbs * 2, seed=1)
        print(f"{ds.num_tokens / 1e6:.1f}M tokens in {ds.num_documents} documents; index build "
              f"{time.perf_counter() - t0:.2f}s for {len(gpt)} samples")
        for workers in (int(w) for w in a.workers.split(",")):
            data = TokenData(gpt, 50001, "bench", eod=0, reset_position_ids=a.reset,
                             reset_attention_mask=a.reset, eod_mask_loss=a.reset,
                             num_workers=workers)
            _time_batches(data, a, f"num_workers={workers}")


def _time_batches(data, a, label):
    tcfg = types.SimpleNamespace(micro_batch_size=a.gbs, data_parallel_size=1,
                                 global_batch_size=a.gbs)
    it = global_batches(data, tcfg, seed=1)
    next(it)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        next(it)
    dt = time.perf_counter() - t0
    print(f"{label}: {a.steps * a.gbs * a.seq / dt / 1e6:.2f}M tokens/s "
          f"({dt / a.steps * 1e3:.1f} ms per {a.gbs}x{a.seq} batch)")


def arrayrecord(a):
    from array_record.python.array_record_module import ArrayRecordWriter
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxtrain.config import load_config
    from jaxtrain.data.grain_files import make_example
    from jaxtrain.data.sources import training_data

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9)))
             for _ in range(2000)]
    docs = [" ".join(rng.choice(words, n)) for n in rng.integers(50, 1500, a.docs)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        w = ArrayRecordWriter(str(tmp / "docs.array_record"), "group_size:1")
        for d in docs:
            w.write(make_example({"text": d}))
        w.close()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(docs[:500], trainers.BpeTrainer(
            vocab_size=4000, special_tokens=["<eos>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(
            str(tmp / "tok"))
        cfg = load_config(None, [
            "dataset_type=grain", f"grain_train_files={tmp}/docs.array_record",
            f"tokenizer_model={tmp}/tok", f"seq_length={a.seq}", f"micro_batch_size={a.gbs}",
            f"global_batch_size={a.gbs}", f"train_iters={a.steps}", "lr_warmup_iters=0",
            "num_layers=1", "hidden_size=16", "num_attention_heads=2",
            f"max_position_embeddings={a.seq}"], world_size=1)
        t0 = time.perf_counter()
        data = training_data(cfg)
        dt = time.perf_counter() - t0
        tokens = int((data.samples.arrays["segment_ids"] > 0).sum())
        print(f"{len(docs)} documents, {tokens / 1e6:.1f}M tokens: start-up (read, tokenize, "
              f"pack) {dt:.2f}s = {tokens / dt / 1e6:.2f}M tokens/s")
        _time_batches(data, a, "batches")


if __name__ == "__main__":
    import sys

    from jaxtrain import cli

    sys.exit(cli.run(main))
