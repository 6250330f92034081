"""One configuration knob: its declaration, its type, and how raw values become typed values.

Area modules under ``jaxtrain.config.areas`` declare knobs with :func:`K`; the registry
collects them. A knob is declared once, under its canonical key; other documents' spellings
of the same concept are :class:`Alias` entries on it.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping

HONORED, MAPPED, INERT, REJECTED, PLANNED = "honored", "mapped", "inert", "rejected", "planned"
STATUSES = (HONORED, MAPPED, INERT, REJECTED, PLANNED)

# The documents a knob can come from. "primus" covers Primus experiment-file and preset fields
# that the three reference documents do not list, "megatron-lm" Megatron-LM arguments beyond
# them (its arguments.py), "maxtext" MaxText's base.yml as well as the reference document;
# "jaxtrain" covers knobs of our own.
DOCS = ("megatron", "maxtext", "pgs-train", "pgs-distill", "primus", "megatron-lm", "jaxtrain")

# Issues that build the planned knobs; a planned knob names one (or None: no issue filed yet).
ISSUES = {
    2: "foundation", 3: "dense models", 4: "training", 5: "parallelism", 6: "data",
    7: "checkpointing", 8: "flash attention", 9: "MoE/MLA/sinks", 10: "observability",
    11: "quantization", 16: "real config files", 17: "fidelity", 18: "structure", 19: "SFT",
    20: "pgs training extras", 21: "preference optimisation", 22: "distillation",
    23: "context parallelism", 24: "pipeline parallelism", 25: "model families",
    26: "performance",
}

_BASIC = {"int", "float", "bool", "str", "list", "dict", "any"}


@dataclasses.dataclass(frozen=True)
class Alias:
    """Another document's name for a knob.

    ``to_canonical`` converts a value written under this name into the canonical knob's
    value (units, sentinels such as pgs's ``-1`` for "unset"); ``note`` says so in words.
    ``only_in`` limits the spelling to files of those dialects, for a name two systems give
    different meanings (MaxText's ``data_sharding`` is a list of mesh axes, Megatron's a switch).
    """

    key: str
    doc: str | tuple[str, ...]
    to_canonical: Callable[[Any], Any] | None = None
    note: str = ""
    only_in: tuple[str, ...] = ()

    @property
    def docs(self) -> tuple[str, ...]:
        """The documents using this spelling (an alias may be shared, e.g. by both pgs docs)."""
        return (self.doc,) if isinstance(self.doc, str) else tuple(self.doc)


@dataclasses.dataclass(frozen=True)
class Knob:
    key: str
    type: str
    default: Any
    meaning: str
    sources: tuple[str, ...]
    status: str = PLANNED
    reason: str = ""
    choices: tuple | None = None
    aliases: tuple[Alias, ...] = ()
    doc_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    value_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    planned_values: Mapping[Any, int | None] = dataclasses.field(default_factory=dict)
    rejected_values: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    nullable: bool = False
    issue: int | None = None
    area: str = ""
    parse: Callable[[Any], Any] | None = None   # a written form beyond the type's (e.g. "0,1,2")
    low: float | None = None       # smallest valid number (inclusive); config/ranges.py sets it
    high: float | None = None      # largest valid number (inclusive)
    existing_path: bool = False    # a non-empty value must name an existing file or folder

    def __post_init__(self):
        where = f"knob {self.key!r}"
        for part in self.type.split("|"):
            base = part.split("[")[0]
            if base not in _BASIC:
                raise ValueError(f"{where}: unknown type {self.type!r}")
        if self.status not in STATUSES:
            raise ValueError(f"{where}: unknown status {self.status!r}")
        if self.status in (MAPPED, INERT, REJECTED) and not self.reason:
            raise ValueError(f"{where}: status {self.status} needs a reason")
        if not self.meaning or len(self.meaning) > 200:
            raise ValueError(f"{where}: meaning must be one line of at most 200 characters")
        for doc in self.sources + sum((a.docs for a in self.aliases), ()) + tuple(self.doc_defaults):
            if doc not in DOCS:
                raise ValueError(f"{where}: unknown document {doc!r}")
        for issue in (self.issue, *self.planned_values.values()):
            if issue is not None and issue not in ISSUES:
                raise ValueError(f"{where}: unknown issue {issue}")
        if (self.planned_values or self.rejected_values) and self.status == PLANNED:
            raise ValueError(f"{where}: per-value statuses need the knob itself built")
        for value in (self.default, *self.doc_defaults.values()):
            if value is not None:
                coerce(self, value)

    @property
    def allows_none(self) -> bool:
        return self.nullable or self.default is None or any(
            v is None for v in self.doc_defaults.values())

    @property
    def templated(self) -> bool:
        return "<" in self.key

    def default_for(self, doc: str | None) -> Any:
        return self.doc_defaults.get(doc, self.default) if doc else self.default


def K(key: str, type: str, default: Any, meaning: str, sources: str | tuple[str, ...],
      status: str = PLANNED, reason: str = "", *, choices=None, aliases=(), doc_defaults=None,
      value_aliases=None, planned_values=None, rejected_values=None, nullable: bool = False,
      issue: int | None = None, parse=None) -> Knob:
    """Declare a knob. ``sources`` is one document name or a tuple of them.

    For a knob that is built but not for every value, ``planned_values`` maps the values still
    to come to their issue (or None) and ``rejected_values`` maps values refused for good to the
    reason; either stops a run that sets them, like a planned or rejected knob.
    """
    if isinstance(sources, str):
        sources = (sources,)
    return Knob(key=key, type=type, default=default, meaning=meaning, sources=tuple(sources),
                status=status, reason=reason, choices=tuple(choices) if choices else None,
                aliases=tuple(aliases), doc_defaults=dict(doc_defaults or {}),
                value_aliases=dict(value_aliases or {}), planned_values=dict(planned_values or {}),
                rejected_values=dict(rejected_values or {}), nullable=nullable, issue=issue,
                parse=parse)


class CoerceError(ValueError):
    """A value that does not fit a knob's type or choices; the message names what is allowed."""


def _as_float(value):
    if isinstance(value, bool):
        raise CoerceError("expected a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise CoerceError("expected a number")


def _as_int(value):
    if isinstance(value, bool):
        raise CoerceError("expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, (float, str)):
        try:
            number = float(value)
        except ValueError:
            raise CoerceError("expected an integer") from None
        if math.isfinite(number) and number == int(number):
            return int(number)
    raise CoerceError("expected an integer")


def _as_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise CoerceError("expected true or false")


def _as_str(value):
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise CoerceError("expected a string")


def _as_list(value, elem):
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise CoerceError("expected a list")
    if elem is None:
        return value
    return [_coerce_one(elem, v) for v in value]


def _as_dict(value):
    if isinstance(value, Mapping):
        return dict(value)
    raise CoerceError("expected a mapping")


def _coerce_one(type_: str, value):
    base, _, rest = type_.partition("[")
    if base == "int":
        return _as_int(value)
    if base == "float":
        return _as_float(value)
    if base == "bool":
        return _as_bool(value)
    if base == "str":
        return _as_str(value)
    if base == "list":
        return _as_list(value, rest[:-1] if rest else None)
    if base == "dict":
        return _as_dict(value)
    return value


def _describe(type_: str) -> str:
    words = {"int": "an integer", "float": "a number", "bool": "true or false",
             "str": "a string", "list": "a list", "dict": "a mapping", "any": "any value"}
    return " or ".join(words.get(p.split("[")[0], p) for p in type_.split("|"))


def _check_range(knob: Knob, value) -> None:
    """Bounds and path existence (config/ranges.py); lists are checked item by item."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        if knob.low is not None and item < knob.low or knob.high is not None and item > knob.high:
            if knob.high is None:
                bound = f"at least {knob.low:g}"
            elif knob.low is None:
                bound = f"at most {knob.high:g}"
            else:
                bound = f"between {knob.low:g} and {knob.high:g}"
            raise CoerceError(f"{item!r} is out of range: it must be {bound}")
    if knob.existing_path and isinstance(value, str) and value and "://" not in value:
        if not os.path.exists(os.path.expanduser(value)):
            raise CoerceError(f"{value!r} does not exist (a file or folder is expected)")


def coerce(knob: Knob, value: Any) -> Any:
    """Return ``value`` as the knob's type, or raise :class:`CoerceError` saying what fits."""
    if knob.parse is not None and value is not None:
        try:
            value = knob.parse(value)
        except (TypeError, ValueError) as e:
            raise CoerceError(f"cannot read {value!r}: {e}") from None
    if value is None or (isinstance(value, str) and value.strip() in ("null", "Null", "None", "~")):
        if knob.allows_none:
            return None
        raise CoerceError(f"must not be null; expected {_describe(knob.type)}")
    parts = knob.type.split("|")
    # For unions, a string that looks like a number is read as the first type that fits.
    result, ok = None, False
    for part in parts:
        try:
            result, ok = _coerce_one(part, value), True
            break
        except CoerceError:
            continue
    if not ok:
        raise CoerceError(f"expected {_describe(knob.type)}, got {value!r}")
    if isinstance(result, str):
        result = knob.value_aliases.get(result, result)
    elif isinstance(result, list) and knob.value_aliases:
        result = [knob.value_aliases.get(v, v) if isinstance(v, str) else v for v in result]
    _check_range(knob, result)
    if knob.choices is not None and not isinstance(result, (bool, dict)):
        for item in result if isinstance(result, list) else [result]:
            if item not in knob.choices:
                allowed = ", ".join(str(c) for c in knob.choices)
                raise CoerceError(f"{item!r} is not one of: {allowed}")
    return result
