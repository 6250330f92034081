"""Student rollouts from jaxtrain's own sampler (:func:`jaxtrain.models.decode.generate`).

Prompts are rendered with the student's chat template, repeated ``group_size`` times and
generated ``micro_seqs`` rows per call: left-padded prompts (each row continues as it would
alone), temperature sampling, every stop id. Shapes come from buckets (rows a power of two up
to ``micro_seqs``, prompt length a multiple of :data:`LENGTH_STEP`, the source's completion
budget), so the sampler compiles once per bucket, not once per step. A completion ends at its
first stop id, which stays in it (stopping is trained too), and keeps each token's log-prob
under the temperature-scaled rollout policy (the importance ratio's denominator).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxtrain.distill.sources import Prompt
from jaxtrain.models.decode import generate

LENGTH_STEP = 32


@dataclasses.dataclass
class Rollout:
    prompt: Prompt
    ids: list[int]             # the student's prompt ids
    completion: list[int]      # through the first stop id (or the budget)
    logprobs: list[float]      # rollout log-probs of the completion's tokens
    stopped: bool
    recorded: bool = False     # agent_traces: the recorded turn (loss.trace_kd_weight)


def bucket(n: int, step: int = LENGTH_STEP) -> int:
    """``n`` rounded up to a multiple of ``step``, or of an eighth of its power of two when that
    is larger (about four buckets per doubling: at most 25% padding, few compiles)."""
    step = max(step, (1 << max(0, n - 1).bit_length()) // 8)
    return max(step, -(-n // step) * step)


def rows_bucket(n: int, most: int) -> int:
    return min(most, 1 << max(0, n - 1).bit_length())


def render(tok, messages, chat_template_kwargs: dict, tools=None, generation: bool = True
           ) -> list[int]:
    """A prompt's ids: the chat template (with the generation prompt, and ``tools``' schemas),
    BOS first when the tokenizer has one the template left out."""
    text = tok.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                   add_generation_prompt=generation, tokenize=False,
                                   **chat_template_kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    bos = tok.bos_token_id
    return [bos] + ids if bos is not None and (not ids or ids[0] != bos) else ids


def recorded(tok, prompt: Prompt, chat_template_kwargs: dict, stops) -> Rollout | None:
    """agent_traces: the recorded turn after ``prompt`` as a rollout (the template's render of
    the conversation with it, past the prompt's render, through the first stop id); None when
    the template renders the context differently once the turn follows it."""
    ids = render(tok, prompt.messages, chat_template_kwargs, prompt.tools)
    full = render(tok, [*prompt.messages, prompt.recorded], chat_template_kwargs, prompt.tools,
                  generation=False)
    if full[:len(ids)] != ids or len(full) == len(ids):
        return None
    rest = full[len(ids):]
    ends = [i for i, t in enumerate(rest) if t in stops]
    rest = rest[:ends[0] + 1] if ends else rest
    return Rollout(prompt, ids, rest, [0.0] * len(rest), bool(ends), recorded=True)


class Sampler:
    """Batched generation for one student model config."""

    def __init__(self, model_cfg, tok, stop_ids, micro_seqs: int, chat_template_kwargs: dict):
        self.cfg, self.tok, self.stops = model_cfg, tok, tuple(stop_ids)
        self.micro_seqs, self.kwargs = micro_seqs, chat_template_kwargs
        self.generated = 0          # tokens sampled so far (completion tokens kept)
        self.calls = 0              # generate() calls so far

    def render(self, prompt: Prompt) -> list[int]:
        return render(self.tok, prompt.messages, self.kwargs, prompt.tools)

    def length(self, messages, tools) -> int:
        return len(render(self.tok, messages, self.kwargs, tools))

    def run(self, params, prompts: list[Prompt], key, temperature: float,
            group_size: int = 1, max_new_tokens: int | None = None) -> list[Rollout]:
        """``group_size`` rollouts per prompt, in prompt order; temperature 0 is greedy;
        ``max_new_tokens`` overrides the prompts' own budgets."""
        rendered = [(p, self.render(p)) for p in prompts]
        jobs = [job for job in rendered for _ in range(group_size)]
        out: list[Rollout | None] = [None] * len(jobs)
        by_budget: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(jobs):
            by_budget.setdefault(max_new_tokens or p.max_new_tokens, []).append(i)
        call = 0
        for budget, idx in sorted(by_budget.items()):
            idx = sorted(idx, key=lambda i: len(jobs[i][1]))
            for start in range(0, len(idx), self.micro_seqs):
                part = idx[start:start + self.micro_seqs]
                for i, rollout in zip(part, self._call(params, [jobs[i] for i in part], budget,
                                                       jax.random.fold_in(key, call),
                                                       temperature)):
                    out[i] = rollout
                call += 1
        return out

    def _call(self, params, jobs, budget: int, key, temperature: float) -> list[Rollout]:
        self.calls += 1
        rows = rows_bucket(len(jobs), self.micro_seqs)
        prompts = [ids for _, ids in jobs] + [jobs[0][1]] * (rows - len(jobs))
        width = bucket(max(len(p) for p in prompts))
        ids = np.asarray([[0] * (width - len(p)) + p for p in prompts], np.int32)
        pad = np.asarray([width - len(p) for p in prompts], np.int32)
        tokens, logprobs = generate(params, self.cfg, ids, budget, temperature=temperature,
                                    key=key, eos_id=list(self.stops), pad=pad,
                                    return_logprobs=True)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        out = []
        for r, (prompt, ids_) in enumerate(jobs):
            row = tokens[r].tolist()
            ends = [i for i, t in enumerate(row) if t in self.stops]
            n = ends[0] + 1 if ends else len(row)
            self.generated += n
            out.append(Rollout(prompt, ids_, row[:n], logprobs[r, :n].tolist(), bool(ends)))
        return out
