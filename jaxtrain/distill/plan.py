"""What a distillation run is made of, built without a device: the dry run's checks and the
run's first step.

:func:`plan` reads the distill sections (:mod:`jaxtrain.distill.settings`), the prompt files
(:mod:`jaxtrain.distill.sources`), the student's and every teacher's tokenizer and config.json,
picks each teacher's loss (empty: ``full_rkl`` for an hf teacher sharing the student's
vocabulary, ``topk_kl`` for a vLLM one, ``xtok`` across tokenizers) and builds what maps a
student completion into the teacher's tokens: a shared-vocabulary :class:`Bridge` (checked on
probe texts, refused naming the teacher's key) or xtok's :class:`ByteChunks`.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

from jaxtrain.config.dialects import hf as hf_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.distill.align import ByteChunks
from jaxtrain.distill.settings import SHARED_ONLY, Settings, Teacher, settings
from jaxtrain.distill.sources import Prompts
from jaxtrain.distill.vocab import PROBE_TEXTS, Bridge, bridge
from jaxtrain.models.hf import safetensors_files

log = logging.getLogger("jaxtrain.distill")


@dataclasses.dataclass
class TeacherPlan:
    spec: Teacher
    loss: str                       # the loss this teacher's samples train with
    tokenizer: Any                  # transformers tokenizer (renders the teacher's prompts)
    path: pathlib.Path | None       # hf backend: the model directory
    config: dict | None             # hf backend: its config.json
    bridge: Bridge | None = None    # shared vocabulary
    chunks: ByteChunks | None = None   # xtok
    to_student: Any = None          # xtok's dense term: teacher id -> student id (-1: none)

    @property
    def shared(self) -> bool:
        return self.bridge is not None

    def clean(self, ids) -> list[int]:
        """A sampled completion cut for this teacher (through the first stop id)."""
        return self.bridge.clean(ids) if self.bridge is not None else self.chunks.clean(ids)


@dataclasses.dataclass
class Plan:
    settings: Settings
    prompts: Prompts
    tokenizer: Any                  # the student's
    stop_ids: tuple[int, ...]       # ids that end a student completion
    teachers: dict                  # name -> TeacherPlan


def _tokenizer(name: str, key: str):
    """The Hugging Face tokenizer of a local directory (or one in the Hugging Face cache)."""
    import transformers

    path = pathlib.Path(name)
    if not path.is_dir():
        try:
            path = hf_config.locate(name)
        except ConfigError:
            raise ConfigError(f"{key} {name}: no local directory of that name and no copy in the "
                              f"Hugging Face cache; jaxtrain never downloads: fetch it first "
                              f"(hf download {name} --local-dir DIR) and name DIR") from None
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key} {name}: no tokenizer could be loaded from it ({e}); point it "
                          f"at a directory holding tokenizer files") from None


def end_of_turn_id(tok) -> int | None:
    """The chat template's end-of-turn token: the first special token its render puts after
    an assistant message's text."""
    if not getattr(tok, "chat_template", None):
        return None
    marker = "zq9 marker"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": marker}], tokenize=False)
    if marker not in text:
        return None
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items()
                                          if t.special}
    for i in tok.encode(text.split(marker, 1)[1], add_special_tokens=False):
        if i in special:
            return int(i)
    return None


def generation_eos(path: pathlib.Path | None) -> list[int]:
    """generation_config.json's eos_token_id(s), if the directory has one."""
    import json

    file = path / "generation_config.json" if path is not None else None
    if file is None or not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    return [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]


def student_stops(tok, path, stop_tokens) -> tuple[int, ...]:
    """pgs's stop set: end of turn, the tokenizer's eos, the generation config's, then
    model.stop_tokens (token strings, each in the vocabulary)."""
    out = [end_of_turn_id(tok), tok.eos_token_id, *generation_eos(path)]
    for name in stop_tokens:
        i = tok.convert_tokens_to_ids(name)
        if i is None or (i == tok.unk_token_id and name != tok.unk_token):
            raise ConfigError(f"model.stop_tokens: {name!r} is not a token of the student's "
                              "tokenizer")
        out.append(i)
    return tuple(dict.fromkeys(int(i) for i in out if i is not None))


def _shares_vocab(student_tok, teacher_tok, probe_texts) -> bool:
    if len(student_tok) < len(teacher_tok):
        return False
    return all(student_tok.encode(t, add_special_tokens=False)
               == teacher_tok.encode(t, add_special_tokens=False)
               for t in PROBE_TEXTS + tuple(probe_texts))


def _teacher(spec: Teacher, student_tok, stops, s: Settings) -> TeacherPlan:
    path = config = None
    if spec.backend == "hf":
        try:
            path = hf_config.locate(spec.model)
        except ConfigError as e:
            raise ConfigError([f"{spec.key}.model: {p}" for p in e.problems]) from None
        config = hf_config.read(path)
        if config.get("model_type") not in hf_config.FAMILIES:
            raise ConfigError(f"{spec.key}.model {path}: {hf_config.unsupported(config)}")
        try:
            safetensors_files.shapes(path)
        except safetensors_files.CheckpointError as e:
            raise ConfigError(f"{spec.key}.model {path}: {e}") from None
    tok = _tokenizer(spec.tokenizer or (str(path) if path else spec.model),
                     f"{spec.key}.tokenizer" if spec.tokenizer else f"{spec.key}.model")
    if config is not None and len(tok) > int(config.get("vocab_size") or len(tok)):
        raise ConfigError(f"{spec.key}: its tokenizer has {len(tok)} tokens but the model embeds "
                          f"{config['vocab_size']}; use the model's own tokenizer "
                          f"({spec.key}.tokenizer)")
    loss = spec.loss
    if not loss:
        shared = _shares_vocab(student_tok, tok, spec.probe_texts)
        loss = ("full_rkl" if spec.backend == "hf" else "topk_kl") if shared else "xtok"
    plan = TeacherPlan(spec, loss, tok, path, config)
    if loss in SHARED_ONLY:
        plan.bridge = bridge(student_tok, tok, teacher=spec.name, eos_map=spec.eos_map,
                             extra_stop_ids=stops, probe_texts=spec.probe_texts)
    else:
        eot = end_of_turn_id(tok)
        eot = eot if eot is not None else tok.eos_token_id
        if eot is None:
            raise ConfigError(f"{spec.key}: the teacher's tokenizer has no end-of-turn or eos "
                              "token to score the student's stop with")
        plan.chunks = ByteChunks(student_tok, tok, stops, eot, s.loss.mask_whitespace)
        if s.loss.xtok_dense_weight > 0:
            plan.to_student = plan.chunks.teacher_to_student(stops[0])
    log.info("%s: loss %s (%s backend)", spec.key, loss, spec.backend)
    return plan


def plan(cfg) -> Plan:
    """The run's distillation plan; one ConfigError lists every problem found."""
    s = settings(cfg)
    name = cfg.get(hf_config.KEY)
    if not name:
        raise ConfigError("model.student: name the student model (a Hugging Face model "
                          "directory with its tokenizer)")
    path = hf_config.locate(str(name))
    student_tok = _tokenizer(str(path), "model.student")
    problems, teachers = [], {}
    try:
        stops = student_stops(student_tok, path, s.stop_tokens)
    except ConfigError as e:
        problems += e.problems
        stops = ()
    if not stops and not problems:
        problems.append("model.stop_tokens: the student's tokenizer names no end-of-turn or eos "
                        "token, so completions would never end; list one in model.stop_tokens")
    for spec in s.teachers.values():
        try:
            teachers[spec.name] = _teacher(spec, student_tok, stops, s)
        except ConfigError as e:
            problems += e.problems
    try:
        prompts = Prompts(s.sources, int(cfg.get("seed") or 0))
    except ConfigError as e:
        problems += e.problems
        prompts = None
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return Plan(s, prompts, student_tok, stops, teachers)
