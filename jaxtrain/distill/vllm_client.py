"""A vLLM teacher reached over HTTP (pgs ``teachers.<name>.backend: vllm`` with ``url``).

An OpenAI-compatible server scores prompts by prefill only: ``POST {url}/v1/completions`` with
the token ids of teacher prompt + completion, ``max_tokens: 1`` and ``prompt_logprobs: k``.
Each prompt position comes back as ``{token id (a string): {"logprob", "rank", ...}}``, the
actual token included beside the top-k. :meth:`VLLMTeacher.scores` turns that into the arrays
the losses read: each completion token's log-prob and the top-k (ids, log-probs) at its
position. Requests are split over a few threads (one sequence each).
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import urllib.error
import urllib.request

import numpy as np

from jaxtrain.config.errors import ConfigError

FLOOR = -1e4          # log-probs below (and NaN) are clamped to this
PARALLEL = 4


class VLLMTeacher:
    def __init__(self, name: str, model: str, url: str, top_k: int, timeout: float = 600.0):
        self.name, self.model, self.url = name, model, url.rstrip("/")
        self.top_k, self.timeout = max(1, top_k), timeout

    def check(self, wait: float = 10.0) -> None:
        """ConfigError unless the server answers ``GET /health``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=wait) as r:
                if r.status == 200:
                    return
                why = f"status {r.status}"
        except (urllib.error.URLError, OSError) as e:
            why = str(getattr(e, "reason", e))
        raise ConfigError(f"teachers.{self.name}.url {self.url}: no vLLM server answers there "
                          f"({why}); start one (vllm serve {self.model} --max-logprobs "
                          f"{self.top_k + 1}) or fix the address")

    def _post(self, ids: list[int]) -> list:
        body = json.dumps({"model": self.model, "prompt": [ids], "max_tokens": 1,
                           "temperature": 1.0, "prompt_logprobs": self.top_k}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"teachers.{self.name}: the vLLM server refused a scoring request "
                               f"({e.code}: {e.read()[:300]!r})") from None
        choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
        return choices[0]["prompt_logprobs"]

    def scores(self, sequences: list[tuple[list[int], list[int]]]) -> dict:
        """{"token_lp" [N], "topk_ids" [N, k], "topk_lp" [N, k]} (float32 / int32) for every
        completion token of the (prompt, completion) pairs, in order."""
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
            replies = list(pool.map(lambda s: self._post(s[0] + s[1]), sequences))
        token_lp, ids, lps = [], [], []
        for (prompt, completion), entries in zip(sequences, replies):
            full = prompt + completion
            for pos in range(len(prompt), len(full)):
                entry = entries[pos] or {}
                actual = entry.get(str(full[pos]))
                if actual is None:
                    raise RuntimeError(f"teachers.{self.name}: the server gave no log-prob for "
                                       f"token {full[pos]} at position {pos} (is it serving "
                                       f"{self.model} with --max-logprobs >= {self.top_k}?)")
                token_lp.append(_clamp(actual["logprob"]))
                ranked = sorted(entry.items(), key=lambda kv: kv[1].get("rank", math.inf))
                top = [(int(t), _clamp(v["logprob"])) for t, v in ranked[:self.top_k]]
                top += [(0, -math.inf)] * (self.top_k - len(top))
                ids.append([t for t, _ in top])
                lps.append([v for _, v in top])
        return {"token_lp": np.asarray(token_lp, np.float32),
                "topk_ids": np.asarray(ids, np.int32).reshape(-1, self.top_k),
                "topk_lp": np.asarray(lps, np.float32).reshape(-1, self.top_k)}


def _clamp(x) -> float:
    x = float(x)
    return FLOOR if math.isnan(x) else max(x, FLOOR)
