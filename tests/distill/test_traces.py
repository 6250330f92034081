"""agent_traces sources: recorded conversations whose assistant turns the student regenerates
(branches_per_trace of them, contexts within max_context tokens), the recorded turns distilled
off-policy with loss.trace_kd_weight, the dev split, and what pgs refuses with them."""
import json
import random

import jax
import numpy as np
import pytest
from distill_helpers import write_jsonl, write_pair

from jaxtrain import train
from jaxtrain.config import load_config
from jaxtrain.distill.rollout import recorded, render
from jaxtrain.distill.settings import Source
from jaxtrain.distill.sources import Prompts, TracesSource


def _trace(i, turns=4):
    msgs = [{"role": "system", "content": "you are an agent"}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"step {t} of task {i}"},
                 {"role": "assistant", "content": f"done {t} " * (1 + t)}]
    msgs.append({"role": "assistant", "content": "", "loss": False})   # nothing to train
    return msgs


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    write_pair(root)
    rows = [{"messages": _trace(i) if i % 2 else json.dumps(_trace(i)), "id": i}
            for i in range(12)]
    write_jsonl(root / "traces.jsonl", rows)
    write_jsonl(root / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    write_jsonl(root / "bad.jsonl", [{"conversation": _trace(0)}])
    return root


def _file(root, source="path: ROOT/traces.jsonl, format: agent_traces, dev_size: 2",
          extra_sources="", teacher="", loss=""):
    file = root / "t.yaml"
    file.write_text(
        f"model: {{student: {root}/student}}\n"
        f"teachers: {{main: {{model: {root}/teacher{teacher}}}}}\n"
        f"sources: {{tr: {{{source.replace('ROOT', str(root))}}}{extra_sources}}}\n"
        f"rollout: {{batch_prompts: 3}}\n"
        + (f"loss: {{{loss}}}\n" if loss else "")
        + f"train: {{output_dir: {root}/out, steps: 2, warmup_steps: 1, eval_every: 1, "
        f"eval_samples: 1}}\n")
    return file


def test_branches_per_trace_and_dev_split(root):
    spec = Source("tr", str(root / "traces.jsonl"), format="agent_traces", dev_size=2,
                  branches_per_trace=2)
    src = TracesSource(spec)
    assert len(src.dev) == 2 and len(src.train) == 10 and src.train[0]["turns"] == [2, 4, 6, 8]
    branches = src.prompts(src.train[0], "main", random.Random(0))
    assert len(branches) == 2
    for b in branches:   # each context ends before a recorded assistant turn
        assert b.messages[-1]["role"] == "user" and b.recorded["role"] == "assistant"
    all_turns = TracesSource(Source("tr", spec.path, format="agent_traces", dev_size=2,
                                    branches_per_trace=0))
    assert len(all_turns.prompts(all_turns.train[0], "main", random.Random(0))) == 4
    capped = TracesSource(Source("tr", spec.path, format="agent_traces", dev_size=2,
                                 branches_per_trace=0, max_context=30))
    capped.length = lambda messages, tools: 10 * len(messages)
    got = capped.prompts(capped.train[0], "main", random.Random(0))
    assert [len(p.messages) for p in got] == [2]         # only the turn with 2 messages before
    prompts = Prompts({"tr": spec}, 0).draw(3)
    assert len(prompts) == 6                               # 3 traces x 2 branches


def test_recorded_turn_ids(root):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(root / "student")
    src = TracesSource(Source("tr", str(root / "traces.jsonl"), format="agent_traces",
                              dev_size=0, branches_per_trace=0))
    p = src.prompts(src.train[0], "main", random.Random(0))[1]
    r = recorded(tok, p, {}, [tok.eos_token_id])
    assert r.recorded and r.stopped and r.completion[-1] == tok.eos_token_id
    assert tok.decode(r.completion, skip_special_tokens=True) == p.recorded["content"]
    assert render(tok, [*p.messages, p.recorded], {}, generation=False)[:len(r.ids)] == r.ids


@pytest.mark.slow
def test_a_run_with_recorded_turns(root, capsys):
    import logging

    from jaxtrain.distill.run import Distiller

    file = _file(root, loss="trace_kd_weight: 0.5")
    assert train.main([str(file), "--dry-run"]) == 0, capsys.readouterr().err
    cfg = load_config(file, ["dtype=float32", "--sources.tr.branches_per_trace=2",
                             "--sources.tr.max_new_tokens=4"], world_size=1)
    d = Distiller(cfg, jax.devices(), logging.getLogger("t"))
    state = d.from_hf(d.initial_state())
    b = d.produce(1, state.params, 0)
    items = [(it, arrays["weights"][:]) for arrays, _, micro in b.parts["main"]
             for it in micro]
    kd = [it for it, _ in items if it.rollout.recorded]
    assert b.samples == 6 and len(kd) == 6
    weights = np.concatenate([arrays["weights"] for arrays, _, _ in b.parts["main"]])
    np.testing.assert_allclose(weights.sum(), 1.0 + 0.5, rtol=1e-5)   # branches 1, recorded 0.5
    _, m = d.train_step(state, b)
    assert np.isfinite(m["loss"])
    row = d.evaluate(d.from_hf(d.initial_state()).params, 0)
    assert set(row) == {"dev_kl/tr", "dev_len/tr", "dev_kl_full/tr", "dev_stop_rate/tr"}


def test_what_pgs_refuses_with_traces(root, capsys):
    def dry(file):
        code = train.main([str(file), "--dry-run"])
        return code, capsys.readouterr().err

    code, err = dry(_file(root, extra_sources=f", ch: {{path: {root}/chat.jsonl}}"))
    assert code == 2 and "cannot be mixed" in err
    code, err = dry(_file(root, teacher=", loss: sampled_rkl"))
    assert code == 2 and "full_rkl by hf teachers" in err
    code, err = dry(_file(root, source="path: ROOT/bad.jsonl, format: agent_traces"))
    assert code == 2 and "sources.tr.messages_field = 'messages'" in err and "bad.jsonl:1" in err
    code, err = dry(_file(root, source="path: ROOT/bad.jsonl, format: agent_traces, "
                                       "messages_field: conversation, dev_size: 0"))
    assert code == 0, err
    file = _file(root, source="path: ROOT/chat.jsonl, dev_size: 0", loss="trace_kd_weight: 1")
    code, err = dry(file)
    assert code == 2 and "loss.trace_kd_weight" in err
