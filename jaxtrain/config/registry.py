"""The knob registry: every area module's knobs, looked up by canonical key or alias.

Templated keys (``teachers.<name>.model``) match any single name in place of ``<name>``.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import re

from jaxtrain.config.areas import AREAS
from jaxtrain.config.knob import Alias, Knob
from jaxtrain.config.ranges import bounds


@dataclasses.dataclass(frozen=True)
class Match:
    """A user-written key resolved to its knob; ``key`` is the canonical spelling."""

    knob: Knob
    key: str
    alias: Alias | None = None


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"<[^>]+>", template)
    return re.compile("^" + r"([^.]+)".join(re.escape(p) for p in parts) + "$")


class Registry:
    def __init__(self, knobs: list[Knob]):
        self.knobs: dict[str, Knob] = {}
        # name -> [(knob, alias)]: one entry valid everywhere, plus any limited to dialects.
        self._names: dict[str, list[tuple[Knob, Alias | None]]] = {}
        self._templates: list[tuple[re.Pattern, Knob, Alias | None]] = []
        for knob in knobs:
            if knob.key in self.knobs:
                raise ValueError(f"knob {knob.key!r} declared twice")
            self.knobs[knob.key] = knob
            for name, alias in [(knob.key, None)] + [(a.key, a) for a in knob.aliases]:
                scope = set(alias.only_in) if alias else set()
                for other, other_alias in self._names.get(name, []):
                    other_scope = set(other_alias.only_in) if other_alias else set()
                    if (not scope and not other_scope) or scope & other_scope:
                        raise ValueError(f"name {name!r} used by {other.key!r} and {knob.key!r}")
                self._names.setdefault(name, []).append((knob, alias))
                if "<" in name:
                    self._templates.append((_template_regex(name), knob, alias))

    def lookup(self, key: str, dialect: str | None = None) -> Match | None:
        """Resolve a written key to its knob, or None when no knob has that name.

        A spelling limited to some dialects (``Alias.only_in``) wins in those dialects; the
        unlimited one serves everywhere else."""
        hits = self._names.get(key)
        if hits:
            scoped = [h for h in hits if h[1] is not None and dialect in h[1].only_in]
            plain = [h for h in hits if h[1] is None or not h[1].only_in]
            knob, alias = (scoped or plain or hits)[0]
            return Match(knob, knob.key, alias)
        for regex, knob, alias in self._templates:
            m = regex.match(key)
            if m:
                canonical = knob.key
                for name in m.groups():
                    canonical = re.sub(r"<[^>]+>", name, canonical, count=1)
                return Match(knob, canonical, alias)
        return None

    def suggest(self, key: str, n: int = 3) -> list[str]:
        """The closest known names to a mistyped key."""
        names = list(self._names)
        found = difflib.get_close_matches(key, names, n=n, cutoff=0.6)
        if not found and "." in key:
            found = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=n, cutoff=0.6)
        return found

    def __iter__(self):
        return iter(self.knobs.values())

    def __len__(self):
        return len(self.knobs)


@functools.lru_cache(maxsize=None)
def registry() -> Registry:
    knobs = []
    for area in AREAS:
        module = importlib.import_module(f"jaxtrain.config.areas.{area}")
        knobs += [dataclasses.replace(k, area=area, **bounds(k.key)) for k in module.KNOBS]
    return Registry(knobs)
