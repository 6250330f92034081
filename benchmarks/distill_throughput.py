"""Rollout and scoring tokens/s of the distillation pieces built so far, on this machine.

    python benchmarks/distill_throughput.py [--layers 4] [--hidden 256] [--vocab 4096]
        [--prompts 32] [--new 64] [--top-k 8] [--rounds 50]

Rollouts: :func:`jaxtrain.models.decode.generate` on ragged prompts (lengths 16..64,
left-padded), temperature 1, random weights; tokens/s counts the generated tokens (prompts x
``--new``), after one compile. Scoring: a teacher of the same shape scores every completion
token (:func:`jaxtrain.distill.teacher.score`: token log-probs, top-k, rs_kd's draws) from
its hidden states; tokens/s counts the scored tokens. Both are timed after a warm-up call, best
of three.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.distill import teacher
from jaxtrain.models import ModelConfig, init
from jaxtrain.models.decode import generate, left_pad
from jaxtrain.models.transformer import hidden_states


def best_of(fn, n=3) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50)
    a = ap.parse_args(argv)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=8,
                      num_query_groups=2, ffn_hidden_size=4 * a.hidden, vocab_size=a.vocab,
                      max_position_embeddings=256)
    params = init(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, a.vocab, size=rng.integers(16, 65)) for _ in range(a.prompts)]
    ids, pad = left_pad(prompts)
    key = jax.random.key(1)
    rollout_s = best_of(lambda: generate(params, cfg, ids, a.new, temperature=1.0, key=key,
                                         pad=pad))
    n_gen = a.prompts * a.new
    print(f"rollout: {a.prompts} ragged prompts x {a.new} new tokens: {rollout_s:.3f} s, "
          f"{n_gen / rollout_s:,.0f} generated tokens/s")

    completions = np.asarray(generate(params, cfg, ids, a.new, temperature=1.0, key=key,
                                      pad=pad))
    seqs = jnp.concatenate([ids, jnp.asarray(completions)], 1)
    rows = a.prompts * a.new

    @jax.jit
    def scores(p, seqs):
        h = hidden_states(p, seqs[:, :-1], cfg)[:, -a.new:]       # completion positions
        return teacher.score(p, h.reshape(rows, -1), seqs[:, -a.new:].reshape(rows), cfg,
                             top_k=a.top_k, rounds=a.rounds, key=key, num_slices=4)

    score_s = best_of(lambda: scores(params, seqs))
    print(f"scoring: {rows} completion tokens (prompt + completion forward, top-{a.top_k}, "
          f"{a.rounds} rs_kd draws): {score_s:.3f} s, {rows / score_s:,.0f} scored tokens/s")
    print(f"device: {jax.devices()[0].platform} x {len(jax.devices())}; model "
          f"{a.layers}x{a.hidden}, vocab {a.vocab}")


if __name__ == "__main__":
    main()
