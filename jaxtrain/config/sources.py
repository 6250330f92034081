"""Config sources as ordered layers of (key, value, origin) entries.

Every dialect turns its files and command line into layers here (see ``config/dialects``);
``resolve`` merges them, later layers winning. A layer's ``kind`` says what it stands for:

- ``defaults``: the default set of the file's own system (MaxText's base.yml, Megatron-LM's
  argparse defaults, Primus's module presets); its values are defaults, not choices;
- ``preset``: a model preset or a model's own config (Primus ``model:``, MaxText
  ``model_name``, a Hugging Face ``config.json``);
- ``file``: the config file and the files it extends;
- ``cli``: the command line.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.config.errors import ConfigError

PGS_SECTIONS = ("model", "data", "train", "parallel", "memory", "plugins", "preprocess", "dpo",
                "logging", "rollout", "loss")
NAMED_SECTIONS = ("teachers", "sources")  # pgs distill: sections of named mappings
FLAG = object()  # a bare ``--key`` on the command line: true for a bool knob, else an error
KINDS = ("defaults", "preset", "file", "cli")


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    value: Any
    origin: str


@dataclasses.dataclass
class Layer:
    """Entries that share one precedence level; two names for one knob in it must agree."""

    name: str
    kind: str
    entries: list[Entry] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer kind {self.kind!r} is not one of {KINDS}")

    def add(self, key, value, origin=None):
        self.entries.append(Entry(key, value, origin or self.name))

    def keys(self) -> set[str]:
        return {e.key for e in self.entries}


@dataclasses.dataclass
class Sources:
    """All layers of one run, lowest precedence first, and the dialect they are written in;
    ``problems`` and ``warnings`` found while reading them that resolving reports with its own
    (a model named by ``model.name_or_path`` that is not on this machine; a Primus preset
    chained with a key Primus no longer reads)."""

    layers: list[Layer]
    dialect: str
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


def flatten(mapping: dict, layer: Layer, origin: str):
    """Add a file's mapping to ``layer``; pgs sections become ``section.key`` entries."""
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
