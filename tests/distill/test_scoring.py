"""A distillation micro-batch scored end to end (jaxtrain.distill.scoring) against transformers:
the student and the teacher run in PyTorch on the same prompts and completions, and the losses
are computed from their logits with NumPy (fp32, 1e-5): full_rkl's value, residual mass, k1
and the gradient of the student's embedding; sampled_rkl; topk_kl; the rollout temperature
scaling the student."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from distill_helpers import number_task, write_pair

from jaxtrain.distill import plan as plan_mod
from jaxtrain.distill import scoring
from jaxtrain.distill.losses import SharedVocab
from jaxtrain.distill.rollout import Rollout, render
from jaxtrain.distill.settings import Loss
from jaxtrain.distill.sources import Prompt
from jaxtrain.distill.vocab import bridge
from jaxtrain.models import from_hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    teacher, student = write_pair(tmp_path_factory.mktemp("scoring"))
    tok = transformers.AutoTokenizer.from_pretrained(student)
    return teacher, student, tok


def _rollouts(tok, n=3, seed=0):
    """Prompts of the task with random completions; the first ends with the stop token."""
    rng = np.random.default_rng(seed)
    out = []
    for i, row in enumerate(number_task(n)):
        prompt = Prompt("src", "t", tuple(row["messages"][:-1]), 8)
        ids = render(tok, prompt.messages, {})
        completion = rng.integers(5, len(tok) - 1, size=3 + 2 * i).tolist()
        if i == 0:
            completion[-1] = tok.eos_token_id
        out.append(Rollout(prompt, ids, completion, [0.0] * len(completion), i == 0))
    return out


def _logits(path, seqs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [model(torch.tensor([s])).logits[0].detach().numpy().astype(np.float64)
            for s in seqs]


def _lsm(x):
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def _setup(pair, kind, temperature=1.0):
    teacher_dir, student_dir, tok = pair
    b = bridge(tok, tok, teacher="t")
    tp = plan_mod.TeacherPlan(None, kind, tok, teacher_dir, None, bridge=b)
    items = [scoring.prepare(r, tp, r.ids) for r in _rollouts(tok)]
    total = sum(len(it.completion) for it in items)
    weights = [[1.0 / total] * len(it.completion) for it in items]
    batch = jax.tree.map(jnp.asarray, scoring.micro_batch(items, weights, 4, xtok=False))
    s_cfg, s_params = from_hf(student_dir)
    t_cfg, t_params = from_hf(teacher_dir)
    # reference: per completion token, student (temperature-scaled) and teacher log-probs
    seqs = [it.rollout.ids + it.completion for it in items]
    lq = np.concatenate([_lsm(x[len(it.rollout.ids) - 1:-1] / temperature)
                         for x, it in zip(_logits(student_dir, seqs), items)])
    lp = np.concatenate([_lsm(x[len(it.rollout.ids) - 1:-1])
                         for x, it in zip(_logits(teacher_dir, seqs), items)])
    y = np.concatenate([it.completion for it in items])
    return dict(items=items, batch=batch, s=(s_cfg, s_params), t=(t_cfg, t_params), lq=lq,
                lp=lp, y=y, total=total, vocab=b.vocab)


def _loss(env, kind, loss=Loss(), temperature=1.0, feats_extra=None, grad=False):
    s_cfg, s_params = env["s"]
    t_cfg, t_params = env["t"]
    feats = scoring.features(t_params, env["batch"], jax.random.key(0), cfg=t_cfg, kind=kind,
                             top_k=loss.top_k, shared=env["vocab"].size)
    if feats_extra:
        feats = {**feats, **feats_extra}

    def fn(params):
        return scoring.student_loss(params, env["batch"], feats, t_params, cfg=s_cfg, kind=kind,
                                    loss=loss, temperature=temperature, vocab=env["vocab"],
                                    teacher_cfg=t_cfg)
    if grad:
        return jax.value_and_grad(fn, has_aux=True)(s_params)
    return fn(s_params)


@pytest.mark.parametrize("temperature", [pytest.param(1.0, marks=pytest.mark.slow), 0.7])
@pytest.mark.slow
def test_full_rkl_matches_transformers(pair, temperature):
    env = _setup(pair, "full_rkl", temperature)
    (value, stats), grads = _loss(env, "full_rkl", temperature=temperature, grad=True)
    q = np.exp(env["lq"])
    kl = np.sum(q * (env["lq"] - env["lp"]), -1)
    n = len(env["y"])
    np.testing.assert_allclose(value, kl.sum() / env["total"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats["kl"], kl.sum(), rtol=1e-5)
    np.testing.assert_allclose(stats["residual"], np.sum(1 - q.sum(-1)), atol=1e-5)
    k1 = env["lq"][np.arange(n), env["y"]] - env["lp"][np.arange(n), env["y"]]
    np.testing.assert_allclose(stats["k1"], k1.sum(), rtol=1e-5, atol=1e-6)
    assert float(stats["tokens"]) == n
    # the gradient of the student's embedding against PyTorch autograd of the same loss
    _, student_dir, _ = pair
    model = transformers.AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    lp = torch.tensor(env["lp"])
    total = torch.zeros(())
    for it, offset in zip(env["items"], np.cumsum([0] + [len(i.completion) for i in env["items"]])):
        logits = model(torch.tensor([it.rollout.ids + it.completion])).logits[0]
        tq = torch.log_softmax(logits[len(it.rollout.ids) - 1:-1].double() / temperature, -1)
        rows = lp[offset:offset + len(it.completion)]
        total = total + (tq.exp() * (tq - rows)).sum() / env["total"]
    total.backward()
    theirs = model.model.embed_tokens.weight.grad.numpy()
    np.testing.assert_allclose(np.asarray(grads["embedding"]), theirs, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_sampled_rkl_is_reinforce_on_the_teacher_gap(pair):
    env = _setup(pair, "sampled_rkl")
    n = len(env["y"])
    lq, lp = env["lq"][np.arange(n), env["y"]], env["lp"][np.arange(n), env["y"]]
    value, stats = _loss(env, "sampled_rkl")
    # without behaviour log-probs (zeros here: ratio exp(lq) < is_low for most) tokens drop
    ratio = np.exp(lq)
    kept = (ratio >= 0.5) & (ratio <= 2.0)
    np.testing.assert_allclose(value, np.sum(-ratio * (lp - lq) * kept) / env["total"],
                               rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(stats["k1"], np.sum(lq - lp), rtol=1e-5)
    np.testing.assert_allclose(stats["is_dropped"], np.sum(~kept))
    # on-policy behaviour (the student's own log-probs): the ratio is 1, nothing dropped
    batch = dict(env["batch"])
    batch["behaviour"] = batch["behaviour"].at[:n].set(jnp.asarray(lq, jnp.float32))
    value, stats = _loss({**env, "batch": batch}, "sampled_rkl")
    np.testing.assert_allclose(value, np.sum(-(lp - lq)) / env["total"], rtol=1e-5, atol=1e-7)
    assert float(stats["is_dropped"]) == 0


@pytest.mark.slow
def test_topk_kl_matches_numpy(pair):
    env = _setup(pair, "topk_kl")
    loss = dataclasses.replace(Loss(), top_k=4, beta=0.3)
    value, _ = _loss(env, "topk_kl", loss=loss)
    n = len(env["y"])
    want = 0.0
    for r in range(n):
        lq, lp, y = env["lq"][r], env["lp"][r], env["y"][r]
        top = list(np.argsort(-lp)[:4])
        support = top + ([y] if y not in top else [])
        q = np.exp(lq[support])
        p = np.exp(lp[support])
        q = np.append(q, max(1 - q.sum(), 1e-6))
        p = np.append(p, max(1 - p.sum(), 1e-6))
        rev, fwd = np.sum(q * np.log(q / p)), np.sum(p * np.log(p / q))
        want += (0.3 * rev + 0.7 * fwd) / env["total"]
    np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-7)
    assert SharedVocab(env["vocab"].size) == env["vocab"]
