"""The distillation sampler (jaxtrain.distill.rollout.Sampler): chat prompts of different
lengths, bucketed and split into calls of micro_seqs rows, greedy-decode as transformers'
generate does, stop at the first stop id (kept), and carry each token's log-prob under the
temperature-scaled policy."""
import jax
import numpy as np
import pytest
import torch
import transformers
from distill_helpers import number_task, write_pair

from jaxtrain.distill.rollout import Sampler, bucket, render, rows_bucket
from jaxtrain.distill.sources import Prompt
from jaxtrain.models import forward, from_hf


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    _, path = write_pair(tmp_path_factory.mktemp("rollout"))
    cfg, params = from_hf(path)
    return path, cfg, params, transformers.AutoTokenizer.from_pretrained(path)


def _prompts(n):
    rows = number_task(n)
    out = []
    for i, r in enumerate(rows):   # ragged: some with a system turn, some without
        msgs = r["messages"][:-1]
        if i % 2:
            msgs = [{"role": "system", "content": "answer " * (i + 1)}] + msgs
        out.append(Prompt("s", "t", tuple(msgs), 7))
    return out


@pytest.mark.slow
def test_greedy_matches_transformers_generate(student):
    path, cfg, params, tok = student
    sampler = Sampler(cfg, tok, [tok.eos_token_id], micro_seqs=2, chat_template_kwargs={})
    prompts = _prompts(4)
    got = sampler.run(params, prompts, jax.random.key(0), 0.0)
    assert sampler.calls == 2                         # 4 rows, 2 per call
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, r in zip(prompts, got):
        ids = render(tok, p.messages, {})
        assert r.ids == ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=7, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        want = ref[0, len(ids):].tolist()
        assert r.completion == want[:len(r.completion)]
        assert r.stopped == (tok.eos_token_id in want)
        if r.stopped:
            assert r.completion[-1] == tok.eos_token_id and len(r.completion) <= 7
        # log-probs: the model's log-softmax at each picked token (greedy: temperature 1)
        logits = np.asarray(forward(params, np.asarray([ids + r.completion]), cfg))[0]
        lsm = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
        want_lp = [lsm[len(ids) - 1 + j, t] for j, t in enumerate(r.completion)]
        np.testing.assert_allclose(r.logprobs, want_lp, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sampled_log_probs_are_temperature_scaled(student):
    _, cfg, params, tok = student
    sampler = Sampler(cfg, tok, [tok.eos_token_id], micro_seqs=8, chat_template_kwargs={})
    r = sampler.run(params, _prompts(1), jax.random.key(1), 0.6, group_size=3)
    assert len(r) == 3 and len({tuple(x.completion) for x in r}) > 1
    ids = r[0].ids
    logits = np.asarray(forward(params, np.asarray([ids + r[0].completion]), cfg))[0] / 0.6
    lsm = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
    want = [lsm[len(ids) - 1 + j, t] for j, t in enumerate(r[0].completion)]
    np.testing.assert_allclose(r[0].logprobs, want, rtol=1e-4, atol=1e-5)


def test_buckets():
    assert [bucket(n) for n in (1, 32, 33, 100, 257, 300, 600)] == [32, 32, 64, 128, 320, 320,
                                                                    640]
    assert len({bucket(n) for n in range(1, 4097)}) == 24       # about 4 per doubling
    assert [rows_bucket(n, 64) for n in (1, 3, 4, 50, 64)] == [1, 4, 4, 64, 64]
    assert rows_bucket(50, 16) == 16
