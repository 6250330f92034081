"""Config sources as ordered layers of (key, value, origin) entries.

Each dialect — flat MaxText/Megatron files, Primus experiment files, pgs sectioned files and
command-line overrides — becomes layers here; ``resolve`` merges them, later layers winning.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.files import (BUILTIN_BASES, CONFIGS_DIR, find_file, parse_scalar,
                                   read_chain, read_yaml)

PGS_SECTIONS = ("model", "data", "train", "parallel", "memory", "plugins", "preprocess", "dpo",
                "logging", "rollout", "loss")
NAMED_SECTIONS = ("teachers", "sources")  # pgs distill: sections of named mappings
DISTILL_MARKERS = ("teachers", "sources", "rollout", "loss")
PRIMUS_MODULE_FIELDS = ("framework", "config", "model", "overrides")
FLAG = object()  # a bare ``--key`` on the command line: true for a bool knob, else an error


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    value: Any
    origin: str


@dataclasses.dataclass
class Layer:
    """Entries that share one precedence level; two names for one knob in it must agree."""

    name: str
    kind: str  # "preset" | "file" | "cli"
    entries: list[Entry] = dataclasses.field(default_factory=list)

    def add(self, key, value, origin=None):
        self.entries.append(Entry(key, value, origin or self.name))


@dataclasses.dataclass
class Sources:
    """All layers of one run, lowest precedence first, plus the dialect the file is written in."""

    layers: list[Layer]
    dialect: str | None  # None (Megatron/Primus), "maxtext", "pgs-train" or "pgs-distill"


def _flatten(mapping: dict, layer: Layer, origin: str):
    for key, value in mapping.items():
        if key in PGS_SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                layer.add(f"{key}.{sub}", v, origin)
        elif key in NAMED_SECTIONS and isinstance(value, dict):
            for name, options in value.items():
                if not isinstance(options, dict):
                    raise ConfigError(f"{origin}: {key}.{name} must be a mapping of options "
                                      f"(e.g. {key}: {{{name}: {{...}}}})")
                if "." in str(name):
                    raise ConfigError(f"{origin}: {key} name {name!r} must not contain a dot")
                for sub, v in options.items():
                    layer.add(f"{key}.{name}.{sub}", v, origin)
        else:
            layer.add(key, value, origin)


def _pgs_dialect(mapping: dict) -> str | None:
    sections = {k for k, v in mapping.items() if isinstance(v, dict)
                and k in PGS_SECTIONS + NAMED_SECTIONS}
    if not sections:
        return None
    if sections & set(DISTILL_MARKERS) or "student" in (mapping.get("model") or {}):
        return "pgs-distill"
    return "pgs-train"


def preset_path(name: str, subdir: str, relative_to: pathlib.Path, what: str) -> pathlib.Path:
    """A preset named in a config (``llama3_8B``, ``llama3_8B.yaml``, MaxText's ``llama3-8b``)."""
    base = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    for candidate in (name, base + ".yaml", base + ".yml"):
        found = find_file(candidate, relative_to, subdir)
        if found:
            return found
    folder = CONFIGS_DIR / subdir
    norm = lambda s: re.sub(r"[-._]", "", s.lower())  # noqa: E731
    if folder.is_dir():
        for path in sorted(folder.glob("*.y*ml")):
            if norm(path.stem) == norm(base):
                return path
    known = sorted(p.stem for p in folder.glob("*.y*ml")) if folder.is_dir() else []
    raise ConfigError(f"{what} {name!r} not found next to the config or in {folder}; "
                      f"known: {', '.join(known) or 'none'}")


def preset_layers(name: str, subdir: str, relative_to: pathlib.Path, what: str) -> list[Layer]:
    """A preset and its bases, one layer per file (a preset may override its base)."""
    layers = []
    for file, data in read_chain(preset_path(name, subdir, relative_to, what)):
        layer = Layer(f"{what} {file.name}", "preset")
        _flatten(data, layer, layer.name)
        layers.append(layer)
    return layers


def _primus_layers(path: pathlib.Path, data: dict) -> tuple[list[Layer], str | None]:
    presets, models, modules = [], Layer(f"{path} (models overrides)", "file"), Layer(
        str(path), "file")
    framework = data.get("framework")
    if not isinstance(data["modules"], dict):
        raise ConfigError(f"{path}: 'modules' must map module names to their settings")
    for name, module in data["modules"].items():
        where = f"{path}: modules.{name}"
        if not isinstance(module, dict):
            raise ConfigError(f"{where} must be a mapping with framework/config/model/overrides")
        unknown = sorted(set(module) - set(PRIMUS_MODULE_FIELDS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown module field; a Primus module takes "
                              f"{', '.join(PRIMUS_MODULE_FIELDS)} (knobs go under overrides)")
        if module.get("framework"):
            if framework and module["framework"] != framework:
                raise ConfigError(f"{where}.framework is {module['framework']!r} but another "
                                  f"part of the file says {framework!r}")
            framework = module["framework"]
        if module.get("config"):
            presets += preset_layers(module["config"], "modules", path.parent, "module config")
        if module.get("model"):
            presets += preset_layers(module["model"], "models", path.parent, "model preset")
        overrides = module.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}.overrides must be a mapping of keys to values")
        _flatten(overrides, modules, f"{path} (modules.{name}.overrides)")
    for name, model in (data.get("models") or {}).items():
        overrides = (model or {}).get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{path}: models.{name}.overrides must be a mapping")
        _flatten(overrides, models, f"{path} (models.{name}.overrides)")
    rest = {k: v for k, v in data.items() if k not in ("modules", "models")}
    _flatten(rest, modules, str(path))
    if framework is not None:
        modules.add("framework", framework, str(path))
    return presets + [models, modules], ("maxtext" if framework == "maxtext" else None)


def file_sources(path: str | pathlib.Path) -> Sources:
    """Layers from one config file of any dialect, with its base chain."""
    path = pathlib.Path(path)
    if path.name in BUILTIN_BASES and not path.exists():
        return Sources([], "maxtext")  # MaxText's own base.yml: the registry's MaxText defaults
    chain = read_chain(path)
    main_path, main = chain[-1]
    layers = []
    for base_path, base in chain[:-1]:
        layer = Layer(f"base config {base_path.name}", "file")
        _flatten(base, layer, layer.name)
        layers.append(layer)
    if "modules" in main:
        primus, dialect = _primus_layers(main_path, main)
        return Sources(layers + primus, dialect)
    layer = Layer(str(path), "file")
    _flatten(main, layer, str(path))
    dialect = _pgs_dialect(main)
    for file, data in chain:
        if data.get("framework") == "maxtext" or _extends_maxtext_base(file):
            dialect = dialect or "maxtext"
    return Sources(layers + [layer], dialect)


def _extends_maxtext_base(file: pathlib.Path) -> bool:
    """A file whose base_config is MaxText's base.yml (played by the registry's defaults)."""
    base = read_yaml(file).get("base_config")
    return isinstance(base, str) and base in BUILTIN_BASES and not find_file(base, file.parent)


def cli_layer(args: list[str]) -> Layer:
    """Command-line overrides: ``key=value``, ``--key value``, ``--key=value``, ``--a.b value``."""
    layer = Layer("command line", "cli")
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            body = arg[2:]
            if "=" in body:
                key, text = body.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                key, text = body, args[i + 1]
                i += 1
            else:
                key, text = body, FLAG
            if "." not in key:
                key = key.replace("-", "_")  # Megatron's argparse spelling: --micro-batch-size
        elif "=" in arg:
            key, text = arg.split("=", 1)
        else:
            raise ConfigError(f"command line: {arg!r} is not an override; write key=value "
                              f"(or --section.key value)")
        key = key.strip()
        if not key:
            raise ConfigError(f"command line: {arg!r} has no key before '='")
        layer.add(key, text if text is FLAG else parse_scalar(text))
        i += 1
    return layer
