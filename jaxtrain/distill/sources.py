"""Distillation prompt sources (pgs distill ``sources.<name>``): rows, dev split, drawing, grading.

- ``messages``: chat rows ``{"messages": [...], "answer"?: ...}`` whose last turn is the user's;
  a row with an ``answer`` is graded by the last number of the greedy completion.
- ``mcqa``: multiple-choice pool rows ``{"question", "options": [[letter, text], ...],
  "answer": letter, "category"?}`` rendered with a template and a shot regime (the benchmark's
  official shots, 1..k random pool shots, or none), graded by the first standalone letter.

The dev split is pgs's: rows keyed by the MD5 of their normalised text (the messages' JSON, or
an mcqa question), the ``dev_size`` smallest keys held out, every duplicate of a dev row left
out of training; ``dev_path`` names a held-out file instead. One ``random.Random(train.seed)``
draws every prompt: a source by weight, then a row uniformly.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import unicodedata

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import rows as row_files
from jaxtrain.distill.settings import Source

SYSTEM_MESSAGE = "You are a helpful assistant."
FAST_TEMPLATE = ("The following is a multiple-choice question about {topic}. Reply with the "
                 "letter of the correct option only ({merged_letters}), nothing else.\n\n"
                 "{question}\n\n{options}\n\nAnswer:")
COT_TEMPLATE = ("The following is a multiple-choice question. Think it through briefly, then "
                "end with a last line 'Answer: LETTER', LETTER one of {merged_letters}.\n\n"
                "{question}\n\n{options}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_NUMBER = re.compile(r"Answer:\s*\$?(-?\d+(?:\.\d+)?)")
_LETTER = re.compile(r"\b([A-J])\b")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One drawn prompt: its chat messages, the source and teacher it belongs to, its
    completion budget and what grades it (a number or a letter; None: not graded)."""

    source: str
    teacher: str
    messages: tuple
    max_new_tokens: int
    answer: str | None = None
    letters: str = ""        # mcqa: the row's option letters (answer is one of them)
    cot: bool = False


def norm_text(text: str) -> str:
    """Lowercase, accents removed, only letters and digits kept."""
    decomposed = unicodedata.normalize("NFKD", text.lower())
    return "".join(c for c in decomposed if not unicodedata.combining(c) and c.isalnum())


def row_key(text: str) -> str:
    return hashlib.md5(norm_text(text).encode()).hexdigest()


def extract_number(text: str) -> str | None:
    """The last number after 'Answer:', else the last number at all (commas dropped)."""
    text = text.replace(",", "")
    found = _ANSWER_NUMBER.findall(text) or _NUMBER.findall(text)
    return found[-1] if found else None


def same_number(predicted: str | None, answer) -> bool:
    try:
        return predicted is not None and abs(float(predicted)
                                             - float(str(answer).replace(",", ""))) < 1e-6
    except ValueError:
        return False


def extract_letter(text: str, last: bool = False) -> str | None:
    found = _LETTER.findall(text)
    return (found[-1] if last else found[0]) if found else None


def _read(path: str, key: str) -> list[tuple[str, dict]]:
    files = row_files.files(path, "train", key, key, any_split=True)
    return list(row_files.read(files, key))


class MessagesSource:
    """Chat rows; the dev rows are graded by number when they carry an answer."""

    def __init__(self, spec: Source):
        self.spec = spec
        rows = [self._checked(where, row) for where, row in _read(spec.path, f"{spec.key}.path")]
        rows = [r for r in rows if r is not None]
        if spec.dev_path:
            dev = [self._checked(w, r) for w, r in _read(spec.dev_path, f"{spec.key}.dev_path")]
            self.train, self.dev = rows, [r for r in dev if r is not None]
        else:
            keyed = {}
            for r in rows:
                keyed[row_key(json.dumps(r["messages"], ensure_ascii=False))] = r
            held = set(sorted(keyed)[:spec.dev_size])
            self.dev = [keyed[k] for k in sorted(held)]
            self.train = [r for r in rows
                          if row_key(json.dumps(r["messages"], ensure_ascii=False)) not in held]
        if not self.train:
            raise ConfigError(f"{spec.key}.path {spec.path}: no training rows left (every row "
                              f"is a dev row or ends with a non-user turn); lower "
                              f"{spec.key}.dev_size or add rows")

    def _checked(self, where: str, row: dict) -> dict | None:
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ConfigError(f"{where}: a {self.spec.key} row (format messages) needs a "
                              f"'messages' field, a list of {{role, content}} turns; this row "
                              f"has {sorted(row)}")
        return row if msgs[-1]["role"] == "user" else None

    def prompt(self, row: dict, teacher: str, rng: random.Random | None = None) -> Prompt:
        answer = row.get("answer")
        return Prompt(self.spec.name, teacher, tuple(row["messages"]), self.spec.max_new_tokens,
                      None if answer is None else str(answer))

    @staticmethod
    def correct(prompt: Prompt, text: str) -> bool:
        return same_number(extract_number(text), prompt.answer)


class McqaSource:
    """Multiple-choice pool rows rendered in the benchmark's prompt format."""

    def __init__(self, spec: Source):
        self.spec = spec
        rows = [self._checked(w, r) for w, r in _read(spec.path, f"{spec.key}.path")]
        self.shots = ([self._checked(w, r) for w, r in _read(spec.shots_path,
                                                              f"{spec.key}.shots_path")]
                      if spec.shots_path else [])
        if spec.dev_path:
            dev = [self._checked(w, r) for w, r in _read(spec.dev_path, f"{spec.key}.dev_path")]
            self.train, self.dev = rows, dev
        else:
            first = {}
            for r in rows:
                first.setdefault(row_key(r["question"]), r)
            held = set(sorted(first)[:spec.dev_size])
            self.dev = [first[k] for k in sorted(held)]
            self.train = [r for r in rows if row_key(r["question"]) not in held]
        if not self.train:
            raise ConfigError(f"{spec.key}.path {spec.path}: no training rows left after the "
                              f"dev split; lower {spec.key}.dev_size or add rows")

    def _checked(self, where: str, row: dict) -> dict:
        options = row.get("options")
        if isinstance(options, list) and options and all(isinstance(o, dict) and len(o) == 1
                                                          for o in options):
            options = [next(iter(o.items())) for o in options]   # [{"A": text}, ...]
        if not isinstance(row.get("question"), str) or not isinstance(options, list) or not (
                2 <= len(options) <= 10) or not all(
                isinstance(o, list | tuple) and len(o) == 2 for o in options):
            raise ConfigError(f"{where}: a {self.spec.key} row (format mcqa) needs 'question' "
                              f"(text), 'options' (2-10 [letter, text] pairs) and 'answer' (a "
                              f"letter); this row has {sorted(row)}")
        letters = "".join(str(o[0]) for o in options)
        if str(row.get("answer", "")) not in letters:
            raise ConfigError(f"{where}: answer {row.get('answer')!r} is not one of the row's "
                              f"option letters {letters}")
        return {**row, "options": [(str(a), str(b)) for a, b in options]}

    def render(self, row: dict, cot: bool) -> str:
        template = (self.spec.cot_template or COT_TEMPLATE) if cot else (
            self.spec.fast_template or FAST_TEMPLATE)
        return template.format(
            question=row["question"], topic=row.get("category", ""),
            options="\n".join(f"{a}) {b}" for a, b in row["options"]),
            merged_letters="".join(a for a, _ in row["options"]))

    def messages(self, row: dict, shots: list[dict], cot: bool) -> tuple:
        out = [{"role": "system", "content": self.spec.system_message or SYSTEM_MESSAGE}]
        for shot in shots:
            out += [{"role": "user", "content": self.render(shot, cot)},
                    {"role": "assistant", "content": str(shot["answer"])}]
        return tuple(out + [{"role": "user", "content": self.render(row, cot)}])

    def prompt(self, row: dict, teacher: str, rng: random.Random | None = None) -> Prompt:
        """A training prompt (``rng``: CoT or fast, then the shot regime) or, without ``rng``,
        an evaluation prompt: fast, with every official shot."""
        s = self.spec
        if rng is None:
            cot, shots = False, self.shots
        else:
            cot = rng.random() < s.cot_fraction
            u = rng.random()
            if u < s.p_reference_shots and self.shots:
                shots = self.shots
            elif u < s.p_reference_shots + s.p_pool_shots:   # (no shots file: pool, as pgs)
                k = rng.randint(1, s.pool_shots_max_k)
                pool = [r for r in rng.sample(self.train, min(k + 1, len(self.train)))
                        if r is not row]
                shots = pool[:k]
            else:
                shots = []
        letters = "".join(a for a, _ in row["options"])
        return Prompt(s.name, teacher, self.messages(row, shots, cot),
                      s.cot_max_new_tokens if cot else s.max_new_tokens, str(row["answer"]),
                      letters, cot)

    @staticmethod
    def correct(prompt: Prompt, text: str) -> bool:
        return extract_letter(text, last=prompt.cot) == prompt.answer


FORMATS = {"messages": MessagesSource, "mcqa": McqaSource}


class Prompts:
    """Every source of a run; draws training prompts and lists dev prompts."""

    def __init__(self, sources: dict, seed: int):
        self.sources = {name: FORMATS[spec.format](spec) for name, spec in sources.items()}
        self.rng = random.Random(seed)

    def _teacher(self, source, row) -> str:
        spec = source.spec
        return spec.teacher_of(row.get(spec.topic_field)) if spec.topic_field else spec.teacher

    def draw(self, n: int) -> list[Prompt]:
        names = list(self.sources)
        weights = [self.sources[k].spec.weight for k in names]
        out = []
        for _ in range(n):
            source = self.sources[self.rng.choices(names, weights, k=1)[0]]
            row = self.rng.choice(source.train)
            out.append(source.prompt(row, self._teacher(source, row), self.rng))
        return out

    def dev(self, source: str, n: int) -> list[Prompt]:
        s = self.sources[source]
        return [s.prompt(row, self._teacher(s, row)) for row in s.dev[:n]]

    def correct(self, prompt: Prompt, text: str) -> bool:
        return self.sources[prompt.source].correct(prompt, text)

    def state(self) -> list:
        """The drawing RNG's state, JSON-able (checkpoints keep it)."""
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def restore(self, state) -> None:
        version, internal, gauss = state
        self.rng.setstate((version, tuple(internal), gauss))
