"""Tokens/s of the data pipeline alone: Megatron indexed files -> GPT samples -> batches.

    python benchmarks/data_throughput.py [--docs 20000] [--seq 2048] [--gbs 64] [--steps 50]
        [--workers 0,8] [--reset]

Writes a synthetic indexed dataset (uint16, random document lengths) to a temporary folder,
builds the GPT sample/shuffle indices (timed), then draws global batches through
``global_batches`` as the loop does and prints tokens/s per ``num_workers`` setting.
"""
from __future__ import annotations

import argparse
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
    a = p.parse_args()
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
        tcfg = types.SimpleNamespace(micro_batch_size=a.gbs, data_parallel_size=1,
                                     global_batch_size=a.gbs)
        for workers in (int(w) for w in a.workers.split(",")):
            data = TokenData(gpt, 50001, "bench", eod=0, reset_position_ids=a.reset,
                             reset_attention_mask=a.reset, eod_mask_loss=a.reset,
                             num_workers=workers)
            it = global_batches(data, tcfg, seed=1)
            next(it)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                next(it)
            dt = time.perf_counter() - t0
            print(f"num_workers={workers}: {a.steps * a.gbs * a.seq / dt / 1e6:.2f}M tokens/s "
                  f"({dt / a.steps * 1e3:.1f} ms per {a.gbs}x{a.seq} batch)")


if __name__ == "__main__":
    main()
