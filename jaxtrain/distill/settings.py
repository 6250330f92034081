"""A pgs distill file's own sections read once: teachers, prompt sources, rollout and loss.

``teachers.<name>`` and ``sources.<name>`` are named mappings; a name's options that the file
leaves out take the knob's pgs-distill default. :func:`settings` checks what needs no file
(names that refer to each other, backend/loss pairs, templates) and raises one ConfigError
listing every problem, naming the key.
"""
from __future__ import annotations

import dataclasses
import string

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.registry import registry

DIALECT = "pgs-distill"
SHARED_ONLY = ("full_rkl", "topk_kl", "sampled_rkl", "rs_kd")   # losses needing one vocabulary
HF_ONLY = ("full_rkl", "rs_kd")                                  # need the full distribution
MCQA_PLACEHOLDERS = {"question", "options", "topic", "merged_letters"}


@dataclasses.dataclass(frozen=True)
class Teacher:
    name: str
    model: str
    tokenizer: str = ""
    backend: str = "hf"
    loss: str = ""            # "" until the tokenizers say which default applies
    device: str = ""
    offload: bool = False
    url: str = ""
    eos_map: dict = dataclasses.field(default_factory=dict)
    probe_texts: tuple = ()

    @property
    def key(self) -> str:
        return f"teachers.{self.name}"


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    path: str
    format: str = "messages"
    weight: float = 1.0
    teacher: str = ""
    topic_field: str = ""
    topic_teachers: dict = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 512
    dev_size: int = 200
    dev_path: str = ""
    messages_field: str = "messages"
    tools_field: str = "tools"
    branches_per_trace: int = 8
    max_context: int = 32768
    system_message: str = ""
    fast_template: str = ""
    cot_template: str = ""
    shots_path: str = ""
    p_reference_shots: float = 0.5
    p_pool_shots: float = 0.25
    pool_shots_max_k: int = 5
    cot_fraction: float = 0.0
    cot_max_new_tokens: int = 300

    @property
    def key(self) -> str:
        return f"sources.{self.name}"

    def teacher_of(self, topic) -> str:
        """The teacher scoring a row with ``topic`` (topic_teachers, else the source's)."""
        for teacher, topics in self.topic_teachers.items():
            if topic in topics:
                return teacher
        return self.teacher


@dataclasses.dataclass(frozen=True)
class Rollout:
    batch_prompts: int = 32
    group_size: int = 1
    temperature: float = 1.0
    max_staleness: int = 0
    micro_seqs: int = 64


@dataclasses.dataclass(frozen=True)
class Loss:
    top_k: int = 8
    beta: float = 1.0
    is_low: float = 0.5
    is_high: float = 2.0
    length_norm: bool = False
    xtok_spread: str = "chunk"
    xtok_dense_weight: float = 0.0
    mask_whitespace: bool = True
    trace_kd_weight: float = 0.0
    rs_rounds: int = 50
    rs_temperature: float = 1.0
    token_weighting: str = "none"
    sure_alpha: float = 1.0
    entropy_keep: float = 0.2


@dataclasses.dataclass(frozen=True)
class Settings:
    teachers: dict          # name -> Teacher, in the file's order (the first is the default)
    sources: dict           # name -> Source
    rollout: Rollout
    loss: Loss
    stop_tokens: tuple = ()
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    score_micro_seqs: int = 16
    eval_samples: int = 200

    @property
    def default_teacher(self) -> str:
        return next(iter(self.teachers))


def _named(cfg, section: str, cls) -> dict:
    """{name: cls(...)} for ``section.<name>.<field>`` keys, defaults from the registry."""
    names = list(dict.fromkeys(k.split(".")[1] for k in cfg if k.startswith(section + ".")))
    reg, out = registry(), {}
    for name in names:
        values = {}
        for field in dataclasses.fields(cls):
            if field.name == "name":
                continue
            key = f"{section}.{name}.{field.name}"
            knob = reg.knobs.get(f"{section}.<name>.{field.name}")
            value = cfg[key] if key in cfg else knob.default_for(DIALECT)
            values[field.name] = tuple(value) if isinstance(value, list) else value
        out[name] = cls(name=name, **values)
    return out


def _section(cfg, prefix: str, cls):
    return cls(**{f.name: cfg.get(f"{prefix}.{f.name}", f.default)
                  for f in dataclasses.fields(cls)})


def settings(cfg) -> Settings:
    """The distill sections of a resolved pgs-distill config, checked (one ConfigError)."""
    teachers = _named(cfg, "teachers", Teacher)
    sources = _named(cfg, "sources", Source)
    problems = []
    if not teachers:
        problems.append("a pgs distill file needs a teacher: teachers: {NAME: {model: ...}}")
    if not sources:
        problems.append("a pgs distill file needs a prompt source: sources: {NAME: {path: ...}}")
    for t in teachers.values():
        problems += _teacher_problems(t)
    first = next(iter(teachers), "")
    fixed = {}
    for s in sources.values():
        s = dataclasses.replace(s, teacher=s.teacher or first)
        problems += _source_problems(s, teachers)
        fixed[s.name] = s
    rollout, loss = _section(cfg, "rollout", Rollout), _section(cfg, "loss", Loss)
    problems += _rollout_loss_problems(rollout, loss)
    problems += _traces_problems(fixed, teachers, loss)
    if problems:
        raise ConfigError(problems)
    return Settings(teachers, fixed, rollout, loss,
                    tuple(cfg.get("model.stop_tokens") or ()),
                    dict(cfg.get("model.chat_template_kwargs") or {}),
                    int(cfg.get("train.score_micro_seqs") or 16),
                    int(cfg.get("train.eval_samples") or 0))


def _teacher_problems(t: Teacher) -> list[str]:
    out = []
    if not t.model:
        out.append(f"{t.key}.model: name the teacher model (a Hugging Face model directory)")
    if t.backend == "vllm" and not t.url:
        out.append(f"{t.key}.backend vllm without {t.key}.url would launch a vLLM server on the "
                   f"student's GPU, which jaxtrain does not do: start one yourself (vllm serve "
                   f"{t.model or 'MODEL'}) and set {t.key}.url to its address, or use backend: "
                   f"hf (a frozen JAX copy of the teacher, full distribution)")
    if t.backend == "vllm" and t.loss in HF_ONLY:
        out.append(f"{t.key}.loss {t.loss} needs the teacher's full distribution, which only "
                   f"backend hf gives (a vLLM server returns top-k log-probs): use topk_kl, "
                   f"sampled_rkl or xtok, or backend: hf")
    if t.backend != "hf" and (t.offload or t.device):
        out.append(f"{t.key}: offload and device are options of backend hf")
    return out


def _source_problems(s: Source, teachers: dict) -> list[str]:
    out = []
    if not s.path:
        out.append(f"{s.key}.path: name the source's prompt file")
    if s.weight <= 0:
        out.append(f"{s.key}.weight must be > 0, got {s.weight}")
    if teachers and s.teacher not in teachers:
        out.append(f"{s.key}.teacher {s.teacher!r} is not one of the teachers "
                   f"({', '.join(teachers)})")
    seen = {}
    for teacher, topics in (s.topic_teachers or {}).items():
        if teachers and teacher not in teachers:
            out.append(f"{s.key}.topic_teachers: {teacher!r} is not one of the teachers "
                       f"({', '.join(teachers)})")
        for topic in topics if isinstance(topics, list | tuple) else [topics]:
            if topic in seen:
                out.append(f"{s.key}.topic_teachers: topic {topic!r} is listed under both "
                           f"{seen[topic]} and {teacher}; a topic goes to one teacher")
            seen[topic] = teacher
    if s.topic_teachers and not s.topic_field:
        out.append(f"{s.key}.topic_teachers needs {s.key}.topic_field (the row field holding "
                   "the topic)")
    if s.dev_size < 0 or s.max_new_tokens < 1:
        out.append(f"{s.key}: dev_size must be >= 0 and max_new_tokens >= 1")
    if s.format == "mcqa":
        for field in ("fast_template", "cot_template"):
            out += _template_problems(f"{s.key}.{field}", getattr(s, field))
        for field in ("p_reference_shots", "p_pool_shots", "cot_fraction"):
            if not 0.0 <= getattr(s, field) <= 1.0:
                out.append(f"{s.key}.{field} is a probability; got {getattr(s, field)}")
        if s.p_reference_shots + s.p_pool_shots > 1.0:
            out.append(f"{s.key}: p_reference_shots + p_pool_shots = "
                       f"{s.p_reference_shots + s.p_pool_shots} exceeds 1")
        if s.pool_shots_max_k < 1:
            out.append(f"{s.key}.pool_shots_max_k must be >= 1")
    return out


def _traces_problems(sources: dict, teachers: dict, loss: Loss) -> list[str]:
    """agent_traces: alone among the sources, scored by hf teachers with full_rkl (pgs)."""
    traces = [s for s in sources.values() if s.format == "agent_traces"]
    if not traces:
        return ([] if loss.trace_kd_weight == 0 else [
            "loss.trace_kd_weight distils the recorded turns of agent_traces sources, and "
            "this run has none"])
    out = []
    if len(traces) != len(sources):
        out.append("agent_traces sources cannot be mixed with other formats (pgs): "
                   f"{', '.join(s.key for s in sources.values() if s.format != 'agent_traces')}"
                   " are not agent_traces")
    for s in traces:
        names = {s.teacher, *s.topic_teachers}
        for name in names & set(teachers):
            t = teachers[name]
            if t.backend != "hf" or t.loss not in ("", "full_rkl"):
                out.append(f"{s.key}: agent_traces are scored with full_rkl by hf teachers; "
                           f"{t.key} is backend {t.backend}, loss {t.loss or 'default'}")
    return out


def _template_problems(key: str, template: str) -> list[str]:
    if not template:
        return []
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        return [f"{key}: not a valid template ({e}); write placeholders as {{question}}, "
                f"literal braces as {{{{ and }}}}"]
    out = [f"{key} has no {{{need}}} placeholder; put the benchmark's template there with "
           f"{{question}} and {{options}} where they go" for need in ("question", "options")
           if need not in fields]
    unknown = sorted(fields - MCQA_PLACEHOLDERS)
    if unknown:
        out.append(f"{key}: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                   f"the template may use {{question}}, {{options}}, {{topic}} and "
                   f"{{merged_letters}}")
    return out


def _rollout_loss_problems(r: Rollout, loss: Loss) -> list[str]:
    out = []
    for key, value in (("rollout.batch_prompts", r.batch_prompts),
                       ("rollout.group_size", r.group_size),
                       ("rollout.micro_seqs", r.micro_seqs)):
        if value < 1:
            out.append(f"{key} must be >= 1, got {value}")
    if r.temperature <= 0:
        out.append(f"rollout.temperature must be > 0 (the losses compare the teacher with the "
                   f"temperature-scaled student), got {r.temperature}")
    if r.max_staleness < 0:
        out.append(f"rollout.max_staleness must be >= 0, got {r.max_staleness}")
    if not 0 < loss.is_low <= 1 <= loss.is_high:
        out.append(f"loss.is_low/is_high must satisfy 0 < is_low <= 1 <= is_high, got "
                   f"{loss.is_low}/{loss.is_high}")
    if not 0.0 <= loss.beta <= 1.0:
        out.append(f"loss.beta mixes reverse and forward KL; it must lie in [0, 1], got "
                   f"{loss.beta}")
    if loss.top_k < 1 or loss.rs_rounds < 1 or loss.rs_temperature <= 0:
        out.append("loss.top_k and loss.rs_rounds must be >= 1, loss.rs_temperature > 0")
    if not 0.0 < loss.entropy_keep <= 1.0:
        out.append(f"loss.entropy_keep is a fraction in (0, 1], got {loss.entropy_keep}")
    return out
