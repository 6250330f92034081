"""Each pgs distill knob changes what the run does (flip it, the effect appears): prompt sources
(weights, teachers, topics, dev split, mcqa templates and shots), rollouts (batch, group,
micro-batches, budget, stops, chat-template arguments), scoring (micro-batch size leaves the
gradient unchanged) and the loss options, on tiny random models."""
import collections
import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from distill_helpers import number_task, prompt_rows, write_jsonl, write_pair

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.distill import plan as plan_mod
from jaxtrain.distill import scoring
from jaxtrain.distill.rollout import Rollout, render
from jaxtrain.distill.run import Distiller
from jaxtrain.distill.settings import Source, settings
from jaxtrain.distill.sources import McqaSource, Prompts
from jaxtrain.distill.vocab import bridge
from sft_helpers import pair_task, write_chat_model

POOL = [{"question": f"which colour is {w}?", "options": [["A", w], ["B", "none"], ["C", "all"]],
         "answer": "A", "category": c}
        for w in ("red", "blue", "green", "gold", "gray", "pink", "teal", "plum")
        for c in ("art", "sky")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_knobs")
    write_pair(root)
    write_chat_model(root / "other", family="qwen3", rows=pair_task(32), seed=3)
    rows = prompt_rows(number_task(32))
    for i, r in enumerate(rows):
        r["topic"] = "odd" if i % 2 else "even"
    write_jsonl(root / "train.jsonl", rows)
    write_jsonl(root / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"}]}
                                      for i in range(40)])
    write_jsonl(root / "pool.jsonl", POOL)
    write_jsonl(root / "shots.jsonl", [{"question": "which colour is ruby?",
                                        "options": [{"A": "ruby"}, {"B": "none"}],
                                        "answer": "A", "category": "art"}])
    return root


def _cfg(root, *overrides, teachers="main: {model: ROOT/teacher}",
         sources="s1: {path: ROOT/train.jsonl, dev_size: 4}"):
    file = root / "k.yaml"
    file.write_text(f"model: {{student: {root}/student}}\n"
                    f"teachers: {{{teachers.replace('ROOT', str(root))}}}\n"
                    f"sources: {{{sources.replace('ROOT', str(root))}}}\n"
                    f"rollout: {{batch_prompts: 4}}\n"
                    f"train: {{output_dir: {root}/out, steps: 2, warmup_steps: 1}}\n")
    return load_config(file, ["dtype=float32", *overrides], world_size=1)


def _distiller(root, *overrides, **kw):
    import logging

    d = Distiller(_cfg(root, *overrides, **kw), jax.devices(), logging.getLogger("test"))
    return d, d.from_hf(d.initial_state())


# ---------------------------------------------------------------- sources


def test_source_weights_teachers_and_topics(root):
    cfg = _cfg(root, teachers="main: {model: ROOT/teacher}, other: {model: ROOT/other}",
               sources="s1: {path: ROOT/train.jsonl, weight: 3, dev_size: 4, topic_field: "
                       "topic, topic_teachers: {other: [odd]}}, s2: {path: ROOT/chat.jsonl, "
                       "weight: 1, teacher: other, dev_size: 4}")
    s = settings(cfg)
    prompts = Prompts(s.sources, 0).draw(2000)
    counts = collections.Counter(p.source for p in prompts)
    assert abs(counts["s1"] / 2000 - 0.75) < 0.04      # sources.<name>.weight 3 : 1
    assert {p.teacher for p in prompts if p.source == "s2"} == {"other"}   # sources.s2.teacher
    by_topic = {(p.messages[-1]["content"], p.teacher) for p in prompts if p.source == "s1"}
    teachers = collections.defaultdict(set)
    for text, t in by_topic:
        teachers[text].add(t)
    # topic_teachers sends odd rows to 'other', the rest to the source's teacher (main)
    assert {frozenset(v) for v in teachers.values()} == {frozenset({"main"}),
                                                         frozenset({"other"})}


def test_named_options_reach_the_settings(root):
    """Every sources.<name>.* and teachers.<name>.* option set on the command line lands in the
    settings the sources and teachers are built from (their effects: the tests here)."""
    cfg = _cfg(root, "--sources.s1.topic_field=topic", "--sources.s1.topic_teachers={main: [odd]}",
               f"--sources.s1.dev_path={root}/train.jsonl", "--sources.s1.tools_field=schemas",
               "--sources.s1.system_message=Be brief.",
               "--sources.s1.cot_template=Q {question} {options}",
               f"--sources.s1.shots_path={root}/shots.jsonl",
               "--sources.s1.p_reference_shots=0.1", "--sources.s1.p_pool_shots=0.2",
               "--sources.s1.pool_shots_max_k=3", "--sources.s1.cot_fraction=0.3",
               "--sources.s1.cot_max_new_tokens=99", "--sources.s1.max_context=64",
               "--teachers.main.backend=vllm",
               "--teachers.main.url=http://127.0.0.1:1", "--sources.s1.format=mcqa")
    s = settings(cfg).sources["s1"]
    assert s.format == "mcqa" and s.max_context == 64
    assert (s.topic_field, s.topic_teachers, s.dev_path, s.tools_field) == (
        "topic", {"main": ["odd"]}, f"{root}/train.jsonl", "schemas")
    assert (s.system_message, s.cot_template, s.shots_path) == (
        "Be brief.", "Q {question} {options}", f"{root}/shots.jsonl")
    assert (s.p_reference_shots, s.p_pool_shots, s.pool_shots_max_k, s.cot_fraction,
            s.cot_max_new_tokens) == (0.1, 0.2, 3, 0.3, 99)
    t = settings(cfg).teachers["main"]
    assert (t.backend, t.url) == ("vllm", "http://127.0.0.1:1")


def test_dev_split_and_dev_path(root):
    rows = prompt_rows(number_task(32))   # 16 distinct questions, each twice
    spec = Source("s", str(root / "train.jsonl"), dev_size=3)
    src = Prompts({"s": spec}, 0).sources["s"]
    assert len(src.dev) == 3
    dev_texts = {r["messages"][-1]["content"] for r in src.dev}
    # every copy of a dev row is out of training (sources.<name>.dev_size)
    assert not dev_texts & {r["messages"][-1]["content"] for r in src.train}
    assert len(src.train) == 32 - 6
    write_jsonl(root / "dev.jsonl", rows[:5])
    spec = dataclasses.replace(spec, dev_path=str(root / "dev.jsonl"))
    src = Prompts({"s": spec}, 0).sources["s"]
    assert len(src.dev) == 5 and len(src.train) == 32           # sources.<name>.dev_path


def _mcqa(root, **kw):
    spec = Source("m", str(root / "pool.jsonl"), format="mcqa", dev_size=2, **kw)
    return McqaSource(spec)


def test_mcqa_templates_system_message_and_letters(root):
    src = _mcqa(root, fast_template="Q {question}\n{options}\nA ({merged_letters}, {topic}):",
                system_message="Be brief.", p_reference_shots=0.0, p_pool_shots=0.0)
    p = src.prompt(src.train[0], "t", random.Random(0))
    assert p.messages[0] == {"role": "system", "content": "Be brief."}
    assert p.messages[-1]["content"].startswith("Q which colour") and "(ABC, " in \
        p.messages[-1]["content"] and p.max_new_tokens == 512 and p.letters == "ABC"
    assert src.correct(p, "A") and not src.correct(p, "B because")


def test_mcqa_shot_regimes_and_cot(root):
    kw = dict(shots_path=str(root / "shots.jsonl"), cot_template="Think: {question} {options}",
              cot_max_new_tokens=77, pool_shots_max_k=2)
    src = _mcqa(root, p_reference_shots=1.0, p_pool_shots=0.0, **kw)
    p = src.prompt(src.train[0], "t", random.Random(0))
    assert "ruby" in p.messages[1]["content"] and p.messages[2]["content"] == "A"  # official
    src = _mcqa(root, p_reference_shots=0.0, p_pool_shots=1.0, **kw)
    sizes = {(len(src.prompt(src.train[0], "t", random.Random(i)).messages) - 2) // 2
             for i in range(40)}
    assert sizes == {1, 2}                                       # pool shots, 1..max_k
    src = _mcqa(root, p_reference_shots=0.0, p_pool_shots=0.0, **kw)
    assert len(src.prompt(src.train[0], "t", random.Random(0)).messages) == 2   # zero-shot
    src = _mcqa(root, cot_fraction=1.0, p_reference_shots=0.0, p_pool_shots=0.0, **kw)
    p = src.prompt(src.train[0], "t", random.Random(0))
    assert p.cot and p.max_new_tokens == 77 and p.messages[-1]["content"].startswith("Think:")
    assert src.correct(p, "B at first, but Answer: A")           # CoT: the last letter
    mixed = _mcqa(root, cot_fraction=0.5, **kw)
    share = np.mean([mixed.prompt(mixed.train[0], "t", random.Random(i)).cot for i in range(400)])
    assert 0.4 < share < 0.6


# ---------------------------------------------------------------- teachers and vocabularies


def test_teacher_tokenizer_loss_and_probe_texts(root, monkeypatch):
    p = plan_mod.plan(_cfg(root))
    assert p.teachers["main"].loss == "full_rkl"
    # teachers.<name>.tokenizer: the other model's tokenizer makes it a cross-tokenizer pair
    p = plan_mod.plan(_cfg(root, f"--teachers.main.tokenizer={root}/other"))
    assert p.teachers["main"].loss == "xtok" and p.teachers["main"].chunks is not None
    p = plan_mod.plan(_cfg(root, "--teachers.main.loss=sampled_rkl"))
    assert p.teachers["main"].loss == "sampled_rkl"
    # teachers.<name>.probe_texts: a text the two split differently refuses the pair
    student = transformers.AutoTokenizer.from_pretrained(root / "student")
    teacher = transformers.AutoTokenizer.from_pretrained(root / "student")
    student.add_tokens(["qq!"])
    assert bridge(student, teacher, teacher="t").shared == len(teacher)
    with pytest.raises(ConfigError, match="split 'qq!' differently"):
        bridge(student, teacher, teacher="t", probe_texts=["qq!"])
    seen = {}
    real = plan_mod.bridge
    monkeypatch.setattr(plan_mod, "bridge", lambda *a, **k: seen.update(k) or real(*a, **k))
    plan_mod.plan(_cfg(root, "--teachers.main.probe_texts=[abc]"))
    assert seen["probe_texts"] == ("abc",)


def test_eos_map_and_stop_tokens(root):
    with pytest.raises(ConfigError, match="teachers.main.eos_map: student id .* inside the "):
        plan_mod.plan(_cfg(root, "--teachers.main.eos_map={'<|im_end|>': '<|endoftext|>'}"))
    p = plan_mod.plan(_cfg(root))
    assert 0 not in p.stop_ids
    p = plan_mod.plan(_cfg(root, "--model.stop_tokens=['<|endoftext|>']"))
    assert 0 in p.stop_ids          # model.stop_tokens end completions too
    with pytest.raises(ConfigError, match="model.stop_tokens: 'nope'"):
        plan_mod.plan(_cfg(root, "--model.stop_tokens=[nope]"))


@pytest.mark.slow
def test_chat_template_kwargs_reach_every_render(root):
    tok = transformers.AutoTokenizer.from_pretrained(root / "student")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} quiet"
                         "{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    assert render(tok, msgs, {}) != render(tok, msgs, {"enable_thinking": False})
    d, _ = _distiller(root, "--model.chat_template_kwargs={enable_thinking: false}")
    assert d.sampler.kwargs == {"enable_thinking": False}
    assert d.settings.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.slow
def test_offload_keeps_the_teacher_on_the_host_and_scores_alike(root):
    d, state = _distiller(root)
    o, _ = _distiller(root, "--teachers.main.offload=true")
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(d.teachers["main"].params))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(o.teachers["main"].params))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(o.teachers["main"].head))
    a = d.produce(1, state.params, 0)
    b = o.produce(1, state.params, 0)
    for (_, fa, _), (_, fb, _) in zip(a.parts["main"], b.parts["main"]):
        np.testing.assert_allclose(fa["t_h"], fb["t_h"], rtol=1e-6)


# ---------------------------------------------------------------- rollouts and scoring


@pytest.mark.slow
def test_batch_group_micro_seqs_and_budget(root):
    d, state = _distiller(root, "--rollout.batch_prompts=3", "--rollout.group_size=4",
                          "--rollout.micro_seqs=4", "--sources.s1.max_new_tokens=5")
    b = d.produce(1, state.params, 0)
    items = [it for micro in b.parts["main"] for it in micro[2]]
    assert b.samples == 12 and d.sampler.calls == 3            # 12 rollouts, 4 per call
    per_prompt = collections.Counter(id(it.rollout.prompt) for it in items)
    assert sorted(per_prompt.values()) == [4, 4, 4]
    assert max(len(it.completion) for it in items) <= 5


@pytest.mark.slow
def test_score_micro_seqs_splits_without_changing_the_step(root):
    d16, state = _distiller(root, "--train.score_micro_seqs=16")
    d3, _ = _distiller(root, "--train.score_micro_seqs=3")
    b16, b3 = d16.produce(1, state.params, 0), d3.produce(1, state.params, 0)
    assert len(b16.parts["main"]) == 1 and len(b3.parts["main"]) == 2
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    s16, m16 = d16.train_step(jax.tree.map(copy, state), b16)
    s3, m3 = d3.train_step(state, b3)
    np.testing.assert_allclose(m16["loss"], m3["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s16.params), jax.tree.leaves(s3.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_length_norm_weights(root):
    items = []
    for n in (2, 6):
        r = Rollout(None, [1, 2], list(range(5, 5 + n)), [0.0] * n, False)
        items.append(scoring.Item(r, r.completion, r.logprobs, [1, 2], r.completion))
    for weights in ([[1 / 8] * 2, [1 / 8] * 6], [[1 / 4] * 2, [1 / 12] * 6]):
        arrays = scoring.micro_batch(items, weights, 2, False)
        np.testing.assert_allclose(arrays["weights"][:8], sum(weights, []))
        assert not arrays["valid"][8:].any() and not arrays["weights"][8:].any()
    dl, state = _distiller(root, "--loss.length_norm=true")
    b = dl.produce(1, state.params, 0)
    arrays, _, micro = b.parts["main"][0]
    n = [len(it.completion) for it in micro]
    np.testing.assert_allclose(arrays["weights"][:n[0]], 1.0 / (n[0] * len(n)), rtol=1e-6)


@pytest.mark.slow
def test_loss_knobs_reach_the_loss(root):
    s = settings(_cfg(root, "--loss.is_low=0.25", "--loss.is_high=4", "--loss.rs_rounds=7",
                      "--loss.rs_temperature=0.5", "--loss.xtok_spread=proportional",
                      "--loss.mask_whitespace=false", "--loss.token_weighting=sure",
                      "--loss.sure_alpha=0.3", "--loss.entropy_keep=0.5"))
    assert (s.loss.is_low, s.loss.is_high, s.loss.rs_rounds, s.loss.rs_temperature) == (
        0.25, 4.0, 7, 0.5)
    assert (s.loss.xtok_spread, s.loss.mask_whitespace, s.loss.token_weighting,
            s.loss.sure_alpha, s.loss.entropy_keep) == ("proportional", False, "sure", 0.3, 0.5)
    p = plan_mod.plan(_cfg(root, f"--teachers.main.tokenizer={root}/other",
                           "--loss.mask_whitespace=false"))
    assert p.teachers["main"].chunks.mask_whitespace is False
    # rs_kd's draws: loss.rs_rounds per position
    d, state = _distiller(root, "--teachers.main.loss=rs_kd", "--loss.rs_rounds=7")
    b = d.produce(1, state.params, 0)
    assert b.parts["main"][0][1]["sample_ids"].shape[1] == 7
    _, m = d.train_step(state, b)
    assert np.isfinite(m["loss"])


@pytest.fixture(scope="module")
def scored(root):
    """A sampled_rkl micro-batch of sampled completions, and an xtok one of real text (random
    models sample byte soup, which has no valid text to align)."""
    d, state = _distiller(root, "--teachers.main.loss=sampled_rkl")
    arrays, feats, _ = d.produce(1, state.params, 0).parts["main"][0]
    out = {"sampled_rkl": (d, state, jax.tree.map(jnp.asarray, arrays), feats)}
    d, state = _distiller(root, "--teachers.main.loss=xtok",
                          f"--teachers.main.tokenizer={root}/other")
    tp, tok = d.plan.teachers["main"], d.plan.tokenizer
    items = []
    for text in ("what follows blue? 12", "green is the answer, 17 of them"):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        prompt = render(tok, [{"role": "user", "content": "hi"}], {})
        r = Rollout(None, prompt, ids, [-1.0] * len(ids), True)
        items.append(scoring.prepare(r, tp, render(tp.tokenizer, [{"role": "user",
                                                                   "content": "hi"}], {})))
    n = sum(len(it.completion) for it in items)
    arrays = scoring.micro_batch(items, [[1 / n] * len(it.completion) for it in items], 2, True)
    feats = d.teachers["main"].features([arrays], jax.random.key(0))[0]
    out["xtok"] = (d, state, jax.tree.map(jnp.asarray, arrays), feats)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("knob, values", [
    ("is_low", (0.5, 0.999)), ("is_high", (2.0, 1.0001)),
    ("token_weighting", ("none", "entropy")), ("sure_alpha", (0.0, 5.0)),
    ("entropy_keep", (0.2, 0.9)), ("xtok_spread", ("chunk", "proportional"))])
def test_loss_values_change_with_the_knob(scored, knob, values):
    """The same micro-batch scored under two values of loss.<knob> gives two losses."""
    kind = "xtok" if knob == "xtok_spread" else "sampled_rkl"
    d, state, arrays, feats = scored[kind]
    base = dict(sure_alpha={"token_weighting": "sure"}, entropy_keep={"token_weighting": "entropy"},
                xtok_spread={"is_low": 1e-9, "is_high": 1e9}).get(knob, {})
    if knob.startswith("is_"):   # an off-policy behaviour: ratios below (is_low) or above 1
        arrays = {**arrays, "behaviour": arrays["behaviour"] * (0.98 if knob == "is_low"
                                                                else 1.02)}
    got = []
    for v in values:
        loss = dataclasses.replace(d.settings.loss, **base, **{knob: v})
        fn = functools.partial(scoring.student_loss, cfg=d.model_cfg, kind=kind, loss=loss,
                               temperature=1.0, vocab=None, teacher_cfg=None)
        got.append(float(jax.jit(fn)(state.params, arrays, feats, None)[0]))
    assert abs(got[0] - got[1]) > 1e-6 * max(1.0, abs(got[0])), (knob, got)


@pytest.mark.slow
def test_xtok_dense_weight_adds_a_top_k_kl_at_one_to_one_chunks(root):
    """loss.xtok_dense_weight: the teacher's top-k at chunks of one token on each side, mapped
    to the student ids spelling the same bytes, against the student's log-probs (NumPy)."""
    from jaxtrain.distill.losses import TAIL_FLOOR
    from jaxtrain.models import forward

    d, state = _distiller(root, "--teachers.main.loss=xtok", "--loss.xtok_dense_weight=0.5",
                          f"--teachers.main.tokenizer={root}/other", "--loss.beta=0.5")
    tp, tok = d.plan.teachers["main"], d.plan.tokenizer
    t_tok = tp.tokenizer
    assert tp.to_student[t_tok.convert_tokens_to_ids("what")] == tok.convert_tokens_to_ids("what")
    prompt = render(tok, [{"role": "user", "content": "hi"}], {})
    ids = tok.encode("what follows blue? 12", add_special_tokens=False) + [tok.eos_token_id]
    item = scoring.prepare(Rollout(None, prompt, ids, [0.0] * len(ids), True), tp,
                           render(t_tok, [{"role": "user", "content": "hi"}], {}))
    n = len(item.completion)
    arrays = scoring.micro_batch([item], [[1 / n] * n], 1, True)
    feats = d.teachers["main"].features([arrays], jax.random.key(0))[0]
    batch = jax.tree.map(jnp.asarray, arrays)
    on = np.asarray(jnp.any(feats["dense_valid"], -1))
    assert on[:n].sum() == len(item.chunks.one_to_one) > 0
    logits = np.asarray(forward(state.params, np.asarray([prompt + ids[:-1]]), d.model_cfg))[0]
    lq = logits[len(prompt) - 1:] - np.logaddexp.reduce(logits[len(prompt) - 1:], -1,
                                                        keepdims=True)
    want = 0.0
    for r in np.flatnonzero(on[:n]):
        v = np.asarray(feats["dense_valid"][r])
        q = np.exp(lq[r][np.asarray(feats["dense_ids"][r])[v]])
        p = np.exp(np.asarray(feats["dense_lp"][r])[v])
        q = np.append(q, max(1 - q.sum(), TAIL_FLOOR))
        p = np.append(p, max(1 - p.sum(), TAIL_FLOOR))
        want += (0.5 * np.sum(q * np.log(q / p)) + 0.5 * np.sum(p * np.log(p / q))) / n
    loss = d.settings.loss
    fn = functools.partial(scoring.student_loss, cfg=d.model_cfg, kind="xtok", temperature=1.0,
                           vocab=None, teacher_cfg=None)
    with_dense = float(fn(state.params, batch, feats, None, loss=loss)[0])
    without = float(fn(state.params, batch, {k: v for k, v in feats.items()
                                             if not k.startswith("dense")}, None, loss=loss)[0])
    np.testing.assert_allclose(with_dense - without, 0.5 * want, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_eval_samples_and_metrics(root):
    d, state = _distiller(root, "--train.eval_samples=2")
    row = d.evaluate(state.params, 0)
    assert set(row) == {"dev_kl/s1", "dev_len/s1", "dev_kl_full/s1", "dev_acc/s1"}
    calls = d.sampler.calls
    assert calls == 2          # one sampled and one greedy call for two dev prompts
    d4, _ = _distiller(root, "--train.eval_samples=4", "--rollout.micro_seqs=2")
    d4.evaluate(state.params, 0)
    assert d4.sampler.calls == 4


@pytest.mark.slow
def test_mcqa_dev_letter_accuracy(root):
    """An mcqa source's dev metric is the greedy letter accuracy (8 new tokens, the official
    shots, the fast template), beside the sampled reverse KL."""
    d, state = _distiller(root, sources="m: {path: ROOT/pool.jsonl, format: mcqa, dev_size: 4, "
                                        "max_new_tokens: 3, shots_path: ROOT/shots.jsonl, "
                                        "cot_fraction: 0.5, cot_max_new_tokens: 5}")
    row = d.evaluate(state.params, 0)
    assert {"dev_kl/m", "dev_acc/m", "dev_acc_cot/m"} <= set(row)
    assert 0.0 <= row["dev_acc/m"] <= 1.0
    b = d.produce(1, state.params, 0)
    fast = [it.rollout for micro in b.parts["main"] for it in micro[2]
            if not it.rollout.prompt.cot]
    texts = [d.plan.tokenizer.decode(r.completion, skip_special_tokens=True) for r in fast]
    assert b.sources["format_ok/m"] == np.mean([
        McqaSource.format_ok(r.prompt, t) for r, t in zip(fast, texts)])
    prompts = d.plan.prompts.dev("m", 4)
    assert len(prompts) == 4 and all("ruby" in p.messages[1]["content"] for p in prompts)
    right = [p for p in prompts if p.answer == "A"]
    assert len(right) == 4
    greedy = d.sampler.run(state.params, prompts, jax.random.key(0), 0.0, max_new_tokens=8)
    texts = [d.plan.tokenizer.decode(g.completion, skip_special_tokens=True) for g in greedy]
    want = np.mean([d.plan.prompts.correct(p, t) for p, t in zip(prompts, texts)])
    assert row["dev_acc/m"] == want
