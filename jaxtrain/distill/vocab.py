"""A student and a teacher that share a base vocabulary (pgs distill's shared-vocabulary losses:
``full_rkl``, ``topk_kl``, ``sampled_rkl``, ``rs_kd``).

Ids below ``shared`` (the teacher's vocabulary size) are the same token in both tokenizers;
the student may extend it with template or tool tokens the teacher cannot embed. The student's
end-of-turn token and the teacher's mean the same thing, so ``swap`` maps the one onto the
other: the teacher scores the student's terminator as its own, and the student's mass on it
counts in the teacher's slot (:class:`jaxtrain.distill.losses.SharedVocab`). A completion is cut
at its first stop token (kept: stopping is supervised too) or before any other token outside
the shared vocabulary (the teacher has nothing to score it with).

:func:`bridge` builds this from the two Hugging Face tokenizers and refuses, with a
:class:`ConfigError` naming the teacher's option, a pair whose tokenizers disagree on shared
text (the probe texts) or whose mapping cannot work.
"""
from __future__ import annotations

import dataclasses
import logging

from jaxtrain.config.errors import ConfigError
from jaxtrain.distill.losses import SharedVocab

log = logging.getLogger("jaxtrain.distill")

# Texts both tokenizers must split identically: prose with digits and punctuation, accented
# letters in several languages, quotes, code.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. 12,345.67!",
    "Perché città, così — l'aquila d'oro? È già: 'sì', naïve café.",
    "Wo wäre die größte Straße? ¿Dónde está la número três?",
    "x = [n**2 for n in range(10)]  # note: \"answer: A\"",
)


@dataclasses.dataclass(frozen=True)
class Bridge:
    shared: int                                  # ids below are the same token in both
    swap: tuple[tuple[int, int], ...] = ()       # (student id, teacher id)
    stop_ids: tuple[int, ...] = ()               # student ids that end a completion

    @property
    def vocab(self) -> SharedVocab:
        return SharedVocab(self.shared, self.swap)

    def clean(self, ids) -> list[int]:
        """A sampled completion cut for scoring: through its first stop id, or before its
        first other token outside the shared vocabulary."""
        swap, out = dict(self.swap), []
        for t in map(int, ids):
            if t in self.stop_ids:
                out.append(t)
                break
            if t >= self.shared and t not in swap:
                break
            out.append(t)
        return out

    def to_teacher(self, ids) -> list[int]:
        swap = dict(self.swap)
        return [swap.get(int(t), int(t)) for t in ids]


def _id(tok, name: str, key: str) -> int:
    i = tok.convert_tokens_to_ids(name)
    if i is None or i == tok.unk_token_id and name != tok.unk_token:
        raise ConfigError(f"{key}: token {name!r} is not in {tok.name_or_path or 'the'} "
                          "tokenizer's vocabulary")
    return int(i)


def bridge(student_tok, teacher_tok, *, teacher: str, eos_map: dict | None = None,
           stop_tokens=(), extra_stop_ids=(), probe_texts=()) -> Bridge:
    """The :class:`Bridge` of two tokenizers. ``teacher`` names the teacher in errors
    (``teachers.<teacher>.eos_map`` ...); ``eos_map`` {student token: teacher token} (empty:
    the student's eos onto the teacher's when the student's lies outside the shared
    vocabulary); ``stop_tokens`` (pgs ``model.stop_tokens``) and ``extra_stop_ids`` (e.g. the
    chat template's end of turn, the generation config's eos) end completions too."""
    key = f"teachers.{teacher}"
    shared = len(teacher_tok)
    if len(student_tok) < shared:
        raise ConfigError(f"{key}: the student's vocabulary ({len(student_tok)}) is smaller than "
                          f"the teacher's ({shared}); a shared-vocabulary loss needs the "
                          "teacher's to be a prefix of the student's (use loss: xtok)")
    swap = {}
    if eos_map:
        for s_name, t_name in eos_map.items():
            swap[_id(student_tok, s_name, f"{key}.eos_map")] = _id(teacher_tok, t_name,
                                                                 f"{key}.eos_map")
    elif student_tok.eos_token_id is not None and teacher_tok.eos_token_id is not None \
            and student_tok.eos_token_id >= shared:
        swap[student_tok.eos_token_id] = teacher_tok.eos_token_id
    for s_id, t_id in swap.items():
        if s_id < shared:
            raise ConfigError(f"{key}.eos_map: student id {s_id} is inside the shared "
                              f"vocabulary ({shared}); mapping a shared token would corrupt "
                              "the teacher's targets")
        if not 0 <= t_id < shared:
            raise ConfigError(f"{key}.eos_map: teacher id {t_id} is outside its vocabulary")
    for text in PROBE_TEXTS + tuple(probe_texts):
        s_ids = student_tok.encode(text, add_special_tokens=False)
        t_ids = teacher_tok.encode(text, add_special_tokens=False)
        if s_ids != t_ids:
            raise ConfigError(f"{key}: the student's and the teacher's tokenizers split {text!r} "
                              f"differently ({s_ids[:8]}... vs {t_ids[:8]}...), so they share no "
                              "vocabulary; use loss: xtok for a cross-tokenizer pair (or fix "
                              f"{key}.tokenizer)")
    stops = list(swap)
    for i in [student_tok.eos_token_id, *extra_stop_ids,
              *(_id(student_tok, n, "model.stop_tokens") for n in stop_tokens)]:
        if i is not None and int(i) not in stops:
            stops.append(int(i))
    if not stops:
        raise ConfigError(f"{key}: no stop token resolved, so completions would never end; set "
                          f"{key}.eos_map or model.stop_tokens")
    log.info("%s: shared vocabulary of %d ids, swap %s, stop ids %s", key, shared, swap or "{}",
             stops)
    return Bridge(shared, tuple(sorted(swap.items())), tuple(stops))
