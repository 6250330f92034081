"""The resolved configuration: an immutable mapping of canonical keys to typed values."""
from __future__ import annotations

import types
from collections.abc import Mapping

import yaml

DEFAULT_ORIGIN = "default"


def is_default(origin: str) -> bool:
    """An origin that names a default (the registry's, or a dialect's default layer)."""
    return origin == DEFAULT_ORIGIN or origin.startswith(DEFAULT_ORIGIN + ":")


def _flow(key, value) -> str:
    """``key: value`` on one line of YAML."""
    text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000,
                          sort_keys=False).strip()
    return text[1:-1] if text.startswith("{") and text.endswith("}") else text


class Config(Mapping):
    """Every knob's value under its canonical key, where each value came from, and the values
    derived from them once (``derived``). Subsystems read it and build their own small configs.
    """

    def __init__(self, values: dict, origins: dict, derived: dict, dialect: str,
                 warnings: list[str], adjusted: dict | None = None, defaults_about: str = ""):
        self._values = types.MappingProxyType(dict(values))
        self._adjusted = dict(adjusted or {})
        self._origins = types.MappingProxyType(dict(origins))
        self.derived = types.MappingProxyType(dict(derived))
        self.dialect = dialect
        self.defaults_about = defaults_about
        self.warnings = tuple(warnings)

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        changed = {k: v for k, v in self._values.items() if self.is_set(k)}
        return f"Config({changed!r})"

    def origin(self, key: str) -> str:
        """Where the value came from: a file, the command line, a preset, 'derived', or
        'default: <the default set>' (MaxText's base.yml, Megatron-LM's arguments, ...)."""
        return self._origins.get(key, f"{DEFAULT_ORIGIN}: {self.defaults_about}"
                                 if self.defaults_about else DEFAULT_ORIGIN)

    def is_set(self, key: str) -> bool:
        """True when something other than a default chose this value."""
        return not is_default(self.origin(key))

    def to_yaml(self, areas: dict[str, list[str]]) -> str:
        """Flat YAML of every value, grouped by registry area, noting non-default origins."""
        lines = [f"# resolved by jaxtrain; dialect: {self.dialect}",
                 f"# defaults: {self.defaults_about}"]
        for area, keys in areas.items():
            keys = [k for k in keys if k in self._values]
            if not keys:
                continue
            lines.append(f"\n# --- {area}")
            for key in keys:
                if key in self._adjusted:  # print what was given; the rule re-derives the rest
                    lines.append(f"{_flow(key, self._adjusted[key])}  # derived: "
                                 f"{_flow(key, self._values[key]).split(': ', 1)[1]}")
                    continue
                text = _flow(key, self._values[key])
                if self.is_set(key):
                    text += f"  # {self.origin(key)}"
                lines.append(text)
        if self.derived:
            lines.append("\n# --- derived (computed from the values above; not settable)")
            lines += [f"# {k}: {v}" for k, v in self.derived.items()]
        return "\n".join(lines) + "\n"
