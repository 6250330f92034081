"""Rollout and scoring tokens/s of distillation, and whole steps with and without overlap.

    python benchmarks/distill_throughput.py [--layers 4] [--hidden 256] [--vocab 4096]
        [--prompts 32] [--new 64] [--top-k 8] [--rounds 50] [--steps 12]

Rollouts: :func:`jaxtrain.models.decode.generate` on ragged prompts (lengths 16..64,
left-padded), temperature 1, random weights; tokens/s counts the generated tokens (prompts x
``--new``), after one compile. Scoring: a teacher of the same shape scores every completion
token (:func:`jaxtrain.distill.teacher.score`: token log-probs, top-k, rs_kd's draws) from
its hidden states; tokens/s counts the scored tokens. Both are timed after a warm-up call, best
of three.

Steps: a whole pgs distill run (``jaxtrain.distill.run.train``) of ``--steps`` steps between a
random teacher and a random student of these sizes (Hugging Face directories written to a
temporary folder, a byte-level tokenizer), full_rkl, ``--prompts`` prompts of ``--new``
tokens each per step, with ``rollout.max_staleness`` 0 (each batch sampled from the weights it
trains) and 1 (a producer thread builds the next batch while the step trains). Reported: the
mean step time and rollout tokens/s over the steps after the first two (compilation).
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
    ap.add_argument("--steps", type=int, default=12)
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
    for staleness in (0, 1):
        step_s, tok_s = steps(a, staleness)
        print(f"distill steps, max_staleness {staleness}: {step_s * 1e3:.0f} ms/step, "
              f"{tok_s:,.0f} rollout tokens/s over the run")


def _tokenizer(path, vocab: int):
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [f"word{i} " * 3 for i in range(vocab)]
    tok.train_from_iterator(words, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=template)
    fast.save_pretrained(path)
    return len(fast)


def _model(path, a, vocab: int, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=a.hidden // 8, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=2, pad_token_id=0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)


def steps(a, staleness: int) -> tuple[float, float]:
    """(mean step seconds, rollout tokens/s) of a distill run, after two warm-up steps."""
    import json
    import pathlib
    import tempfile

    from jaxtrain.config import load_config
    from jaxtrain.distill import run

    root = pathlib.Path(tempfile.mkdtemp(prefix="distill_bench_"))
    for name, seed in (("teacher", 1), ("student", 2)):
        vocab = _tokenizer(root / name, a.vocab)
        _model(root / name, a, vocab, seed)
    rng = np.random.default_rng(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(256):
            text = " ".join(f"word{w}" for w in rng.integers(0, a.vocab, size=rng.integers(8, 40)))
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    (root / "d.yaml").write_text(
        f"model: {{student: {root}/student}}\nteachers: {{t: {{model: {root}/teacher}}}}\n"
        f"sources: {{s: {{path: {root}/prompts.jsonl, dev_size: 0, "
        f"max_new_tokens: {a.new}}}}}\n"
        f"rollout: {{batch_prompts: {a.prompts}, max_staleness: {staleness}}}\n"
        f"train: {{output_dir: {root}/out, steps: {a.steps}, eval_every: 0, "
        f"learning_rate: 1.0e-4}}\nlogging: {{log_every: 1}}\n")
    run.train(load_config(root / "d.yaml", [], world_size=len(jax.devices())))
    rows = [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][2:]
    elapsed = rows[-1]["elapsed"] - rows[0]["elapsed"] + rows[0]["step_time_s"]
    return elapsed / len(rows), sum(r["rollout_tokens"] for r in rows) / elapsed


if __name__ == "__main__":
    main()
