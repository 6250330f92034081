"""A vLLM teacher (teachers.<name>.backend: vllm, url) against a local stub server that answers
as vLLM's OpenAI-compatible server does (prompt_logprobs: the top-k plus the actual token, ids
as strings, ranks), computed by transformers from the tiny teacher: the client's scores match
the in-process JAX teacher's, and a run trains with topk_kl from them."""
import http.server
import json
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from distill_helpers import number_task, prompt_rows, write_jsonl, write_pair

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.distill.run import Distiller
from jaxtrain.distill.vllm_client import VLLMTeacher


def _server(model_dir, served_name):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            if body["model"] != served_name:
                return self._send(404, {"error": f"model {body['model']} not served"})
            choices = []
            for index, ids in enumerate(body["prompt"]):
                with torch.no_grad():
                    lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
                entries = [None]
                for pos in range(1, len(ids)):
                    row = lsm[pos - 1]
                    order = torch.argsort(row, descending=True).tolist()
                    entry = {str(t): {"logprob": float(row[t]), "rank": r + 1,
                                      "decoded_token": "x"}
                             for r, t in enumerate(order[:body["prompt_logprobs"]])}
                    actual = ids[pos]
                    entry.setdefault(str(actual), {"logprob": float(row[actual]),
                                                   "rank": order.index(actual) + 1})
                    entries.append(entry)
                choices.append({"index": index, "text": "", "prompt_logprobs": entries})
            self._send(200, {"choices": choices})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    teacher, _ = write_pair(root)
    write_jsonl(root / "train.jsonl", prompt_rows(number_task(32)))
    server, requests = _server(teacher, str(teacher))   # served under the teacher's name
    yield root, f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()


def _distiller(root, backend_opts):
    import logging

    file = root / "v.yaml"
    file.write_text(f"model: {{student: {root}/student}}\n"
                    f"teachers: {{main: {{model: {root}/teacher{backend_opts}}}}}\n"
                    f"sources: {{s1: {{path: {root}/train.jsonl, dev_size: 4, "
                    f"max_new_tokens: 6}}}}\n"
                    f"rollout: {{batch_prompts: 4}}\n"
                    f"loss: {{top_k: 5}}\n"
                    f"train: {{output_dir: {root}/out, steps: 2, warmup_steps: 1}}\n")
    cfg = load_config(file, ["dtype=float32"], world_size=1)
    d = Distiller(cfg, jax.devices(), logging.getLogger("test"))
    return d, d.from_hf(d.initial_state())


def test_client_parses_prompt_logprobs(setup):
    root, url, requests = setup
    client = VLLMTeacher("main", str(root / "teacher"), url, top_k=3)
    client.check()
    got = client.scores([([1, 5, 9], [11, 12]), ([4], [7, 8, 2])])
    assert got["token_lp"].shape == (5,) and got["topk_ids"].shape == (5, 3)
    body = requests[-1]
    assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 3
    assert body["temperature"] == 1.0 and len(body["prompt"]) == 1
    assert np.all(got["topk_lp"][:, :-1] >= got["topk_lp"][:, 1:])   # by rank
    with pytest.raises(ConfigError, match="teachers.main.url http://127.0.0.1:9: no vLLM"):
        VLLMTeacher("main", "m", "http://127.0.0.1:9", 3).check(wait=2)


@pytest.mark.slow
def test_server_scores_match_the_jax_teacher_and_train(setup):
    root, url, _ = setup
    hf, state = _distiller(root, ", loss: topk_kl")
    server, _ = _distiller(root, f", backend: vllm, url: '{url}'")
    assert server.plan.teachers["main"].loss == "topk_kl"    # a vllm teacher's default
    a, b = hf.produce(1, state.params, 0), server.produce(1, state.params, 0)
    for (_, fa, items), (_, fb, _) in zip(a.parts["main"], b.parts["main"]):
        n = sum(len(it.completion) for it in items)
        for k in ("token_lp", "support_lp"):
            np.testing.assert_allclose(np.asarray(fb[k])[:n], np.asarray(fa[k])[:n],
                                       rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(fb["support"])[:n],
                                      np.asarray(fa["support"])[:n])
    state2, m = server.train_step(state, b)
    assert math.isfinite(m["loss"]) and m["loss"] > 0
    moved = max(float(jnp.abs(x - y).max()) for x, y in zip(
        jax.tree.leaves(state2.params), jax.tree.leaves(hf.from_hf(hf.initial_state()).params)))
    assert moved > 0
