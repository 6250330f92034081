"""pgs (palingenesis) files: ``section: {key: value}`` for training and distillation runs.

A file with pgs sections (``train:``, ``data:``, ``model:`` ...) is a pgs file and takes pgs's
defaults; one with distillation's sections (``teachers:``, ``sources:``, ``rollout:``, ``loss:``)
or a ``model.student`` is a ``pgs distill`` file. Its model is the Hugging Face model that
``model.name_or_path`` names: :func:`with_hf_model` reads that model's config.json
(config/dialects/hf.py) into the architecture knobs.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.config.dialects import hf
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.registry import registry
from jaxtrain.config.sources import FLAG, NAMED_SECTIONS, PGS_SECTIONS, Layer, Sources

DISTILL_MARKERS = ("teachers", "sources", "rollout", "loss")


# pgs distill's first config format (OPDConfig: model.teacher, bridge, data, sampling,
# train.loss_fn) -> where each option lives now; pgs refuses such a file saying so.
_SRC, _TEACHER = "sources.<name>.", "teachers.<name>."
OLD_DISTILL_MOVES = {
    "model.teacher": _TEACHER + "model", "model.teacher_device": _TEACHER + "device",
    "bridge.eos_map": _TEACHER + "eos_map", "bridge.probe_texts": _TEACHER + "probe_texts",
    "bridge.extra_stop_tokens": "model.stop_tokens",
    "data.prompts_path": _SRC + "path (format: mcqa for the pool-row schema)",
    **{f"data.{k}": _SRC + k for k in ("shots_path", "dev_size", "p_reference_shots",
                                       "p_pool_shots", "pool_shots_max_k", "system_message")},
    **{f"sampling.{k}": "rollout." + k for k in ("batch_prompts", "group_size", "temperature")},
    "sampling.gen_micro_seqs": "rollout.micro_seqs",
    **{f"sampling.{k}": _SRC + k for k in ("max_new_tokens", "cot_fraction",
                                           "cot_max_new_tokens")},
    "train.loss_fn": _TEACHER + "loss (full_kl is now full_rkl)",
    "train.eval_dev_samples": "train.eval_samples",
}
_OLD_MARKERS = ("model.teacher", "model.teacher_device", "train.loss_fn", "data.prompts_path")


def refuse_old_distill(mapping: dict, origin: str) -> None:
    """A ConfigError naming where each option of a first-format pgs distill file moved, for a
    file with ``bridge:``/``sampling:`` sections or the old ``model.teacher``-style keys."""
    flat = {f"{k}.{sub}" for k, v in mapping.items() if isinstance(v, dict) for sub in v}
    if not ({"bridge", "sampling"} & set(mapping) or flat & set(_OLD_MARKERS)):
        return
    moved = [f"{k} is now {OLD_DISTILL_MOVES[k]}" for k in sorted(flat) if k in OLD_DISTILL_MOVES]
    raise ConfigError([f"{origin} is in pgs distill's first config format, which pgs no "
                       "longer reads; move its options (teachers and sources are named "
                       "mappings, e.g. teachers: {main: {model: ...}}):"] + moved)


def dialect_of(mapping: dict) -> str | None:
    """"pgs-train", "pgs-distill", or None for a file without pgs sections."""
    sections = {k for k, v in mapping.items() if isinstance(v, dict)
                and k in PGS_SECTIONS + NAMED_SECTIONS + ("bridge", "sampling")}
    if not sections:
        return None
    if sections & set(DISTILL_MARKERS + ("bridge", "sampling")) or "student" in (
            mapping.get("model") or {}):
        return "pgs-distill"
    return "pgs-train"


def with_hf_model(sources: Sources, doc: str | None) -> Sources:
    """``sources`` with the architecture of the Hugging Face model that ``model.name_or_path``
    (pgs-distill: ``model.student``) names, as a preset layer at the bottom of the non-default
    layers: pgs has no architecture knobs of its own, so the model's config.json says what the
    model is, and an architecture knob the file or command line sets wins over it. pgs files
    take pgs's default name when they set none; other dialects only look when a layer names a
    model. A directory that holds the model's tokenizer is the tokenizer's default too
    (tokenizer_type HuggingFaceTokenizer, tokenizer_model that directory), as in pgs. A name
    with no config.json on this machine, or a family jaxtrain does not build, is a problem
    reported with the others (resolve); an explicit null builds the model from the
    architecture knobs alone."""
    name, where = _model_name(sources), None
    if name is _UNSET:
        if sources.dialect not in ("pgs-train", "pgs-distill"):
            return sources
        name = registry().knobs[hf.KEY].default_for(doc)
        where = f"pgs's default {hf.KEY}"
        if name is None:
            sources.problems.append(
                f"a pgs distill file names its student model (model.student, a Hugging Face "
                f"model directory); set it, or set {hf.KEY}: null to build the student from "
                f"the architecture knobs alone")
            return sources
    if name is None or name == "":
        return sources
    try:
        path, values = hf.model_knobs(str(name))
    except ConfigError as e:
        sources.problems.extend(f"{p} ({where})" if where else p for p in e.problems)
        return sources
    layer = Layer(f"{hf.KEY} {path / 'config.json'}", "preset")
    for key, value in values.items():
        layer.add(key, value)
    if hf.has_tokenizer(path):
        origin = f"{hf.KEY} {path} (the model's tokenizer)"
        layer.add("tokenizer_type", "HuggingFaceTokenizer", origin)
        layer.add("tokenizer_model", str(path), origin)
    at = sum(1 for layer_ in sources.layers if layer_.kind == "defaults")
    return dataclasses.replace(sources, layers=sources.layers[:at] + [layer]
                               + sources.layers[at:])


_UNSET = object()


def _model_name(sources: Sources):
    """The model name the non-default layers give (the last one wins), or _UNSET."""
    reg, name = registry(), _UNSET
    for layer in sources.layers:
        if layer.kind == "defaults":
            continue
        for entry in layer.entries:
            match = reg.lookup(entry.key, sources.dialect)
            if match is not None and match.key == hf.KEY and entry.value is not FLAG:
                name = entry.value
    return name
