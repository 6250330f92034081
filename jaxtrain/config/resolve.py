"""Merge layers into one validated Config.

Order: the registry's defaults for the file's dialect < the dialect's default layers (MaxText's
base.yml, Megatron-LM's argparse defaults, Primus's module presets) < model presets < base
configs < the file < the command line (MaxText's model file sits above the files, see
``dialects``). Only the value that wins is typed and judged: a value the command line overrides
is never checked. Every problem found is collected and raised together as one ConfigError, so
a user fixes a file in one pass.
"""
from __future__ import annotations

from collections.abc import Mapping

from jaxtrain.config import rules
from jaxtrain.config.dialects import DIALECTS, load_sources
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.knob import INERT, ISSUES, PLANNED, REJECTED, CoerceError, coerce
from jaxtrain.config.registry import registry
from jaxtrain.config.resolved import DEFAULT_ORIGIN, Config
from jaxtrain.config.sources import FLAG, Layer, Sources


def _typed(match, entry):
    """The entry's value converted from the alias's units and coerced to the knob's type."""
    knob, value = match.knob, entry.value
    if value is FLAG:
        if knob.type != "bool":
            raise CoerceError(f"needs a value (--{entry.key} VALUE)")
        value = True
    if match.alias and match.alias.to_canonical and value is not None:
        value = match.alias.to_canonical(value)
    return coerce(knob, value)


def _short(value, limit: int = 80) -> str:
    """A value's repr, cut short for messages (MaxText's axis tables run to kilobytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def _named(entry, key: str) -> str:
    """The key as written, with its canonical name when that differs."""
    return entry.key if entry.key == key else f"{entry.key} ({key})"


def _unset(match, entry) -> bool:
    """``null`` for a knob that takes no null means "not set here" (Primus writes it so)."""
    return entry.value is None and not match.knob.allows_none


def _layer_entries(layer: Layer, dialect: str, problems: list[str], warnings: list[str]) -> dict:
    """canonical key -> (match, entry) for one layer: names checked, two spellings compared."""
    reg, out = registry(), {}
    for entry in layer.entries:
        match = reg.lookup(entry.key, dialect)
        if match is None:
            if layer.kind == "defaults":
                warnings.append(f"{layer.name} sets {entry.key!r}, which jaxtrain does not know; "
                                f"its value is not used")
                continue
            hint = reg.suggest(entry.key)
            problems.append(f"unknown key {entry.key!r} in {entry.origin}"
                            + (f"; did you mean {', '.join(hint)}?" if hint else
                               "; see python -m jaxtrain.knobs for the known keys"))
            continue
        if _unset(match, entry):
            continue
        previous = out.get(match.key)
        if previous is not None and previous[1].key != entry.key:
            try:
                same = _typed(*previous) == _typed(match, entry)
            except CoerceError:
                same = True     # a bad value is reported if it wins
            if not same:
                problems.append(
                    f"{previous[1].key} and {entry.key} both set in {entry.origin} to different "
                    f"values ({previous[1].value!r} vs {entry.value!r}); they name the same "
                    f"setting ({match.key}): keep one")
                continue
        out[match.key] = (match, entry)
    return out


def _gate(key, knob, value, default, shown, problems, warnings):
    """Planned, rejected and inert knobs (or values) set away from their default."""
    if value == default or (knob.type == "bool" and default is None and value is False):
        return  # a null-defaulted switch written as false means the same as unset
    hashable = value if isinstance(value, (str, int, float, bool)) else None
    if hashable in knob.planned_values:
        issue = knob.planned_values[hashable]
        where = f"issue #{issue} ({ISSUES[issue]})" if issue else "a later issue"
        problems.append(f"not implemented yet: {shown}; this value is planned for {where}. "
                        f"Other values of {key} work.")
    elif hashable in knob.rejected_values:
        problems.append(f"{key} = {value!r} is not supported by jaxtrain: "
                        f"{knob.rejected_values[hashable]} ({shown}).")
    elif knob.status == PLANNED:
        where = (f"issue #{knob.issue} ({ISSUES[knob.issue]})" if knob.issue
                 else "a later issue")
        problems.append(f"not implemented yet: {key}; {shown} is planned for {where}. "
                        f"Remove it or set it back to {_short(default)}.")
    elif knob.status == REJECTED:
        problems.append(f"{key} is not supported by jaxtrain: {knob.reason}. ({shown}; "
                        f"remove it or set it back to {_short(default)}.)")
    elif knob.status == INERT:
        warnings.append(f"{key} has no effect under JAX/XLA: {knob.reason} ({shown})")


def _preset_clashes(layers, winners_by_layer, origins) -> list[str]:
    """With override_model_config false, a key a model preset sets may not be set again by a
    layer above it."""
    problems = []
    for i, layer in enumerate(layers):
        if layer.kind != "preset":
            continue
        above = set().union(*(winners_by_layer[j] for j in range(i + 1, len(layers))
                              if layers[j].kind in ("file", "cli")))
        for key in sorted(winners_by_layer[i] & above):
            problems.append(f"{key} is set by the model preset ({layer.name}) and again in "
                            f"{origins[key]}, and override_model_config is false; drop one or "
                            f"set override_model_config to true")
    return problems


def _default_set(sources: Sources, doc, problems, warnings) -> tuple[dict, dict, dict]:
    """(values, origins, replaced) of every knob before any choice: the registry's defaults
    for the document, under the dialect's default layers. A default layer's value jaxtrain
    cannot do (MaxText's hardware: tpu, its tfds data) was not the user's choice: jaxtrain's own
    default stays, and ``replaced`` holds the warning to give if nothing else sets the key."""
    reg = registry()
    base = {k.key: k.default_for(doc) for k in reg if not k.templated}
    values, origins, replaced = dict(base), {}, {}
    for layer in sources.layers:
        if layer.kind != "defaults":
            continue
        for key, (match, entry) in _layer_entries(layer, sources.dialect, problems,
                                                  warnings).items():
            try:
                value = _typed(match, entry)
            except CoerceError as e:
                warnings.append(f"{layer.name} sets {_named(entry, key)}, but {e}; that default "
                                f"is not used")
                continue
            refused = []
            _gate(key, match.knob, value, base.get(key),
                  f"{_named(entry, key)} = {_short(value)} (the default of {layer.name})",
                  refused, [])
            if refused:
                replaced[key] = (f"{refused[0]} jaxtrain uses {key} = {_short(base.get(key))}; "
                                 f"set {key} to choose.")
                values[key] = base.get(key)
                origins[key] = f"{DEFAULT_ORIGIN}: jaxtrain (not {layer.name}'s value)"
            else:
                values[key], origins[key] = value, f"{DEFAULT_ORIGIN}: {layer.name}"
                replaced.pop(key, None)
    return values, origins, replaced


def resolve(sources: Sources, world_size: int | None = None, enforce_status: bool = True
            ) -> Config:
    """Merge, type and check ``sources``. ``enforce_status=False`` skips the planned/rejected
    gate (for tools that inspect how files resolve); training never does."""
    problems, warnings = list(sources.problems), list(sources.warnings)
    dialect = DIALECTS[sources.dialect]
    defaults, origins, unsupported = _default_set(sources, dialect.doc, problems, warnings)
    values, winners, by_layer, written = dict(defaults), {}, [], {}
    for layer in sources.layers:
        if layer.kind == "defaults":
            by_layer.append(set())
            continue
        entries = _layer_entries(layer, sources.dialect, problems, warnings)
        by_layer.append(set(entries))
        for key, (match, entry) in entries.items():
            winners[key] = (match, entry, layer)
            written.setdefault(key, []).append(layer)
    for key, (match, entry, layer) in winners.items():
        try:
            values[key] = _typed(match, entry)
        except CoerceError as e:
            problems.append(f"{_named(entry, key)} (in {entry.origin}): {e}")
            continue
        origins[key] = entry.origin
        if enforce_status:
            _gate(key, match.knob, values[key], defaults.get(key),
                  f"{_named(entry, key)} = {_short(values[key])} (from {entry.origin})",
                  problems, warnings)
        overridden = [w for w in written[key][:-1] if w.kind == "file"]
        if layer.kind == "preset" and overridden:
            warnings.append(f"{key} from {overridden[-1].name} is replaced by {layer.name} (a "
                            f"model file wins over the config files, as in MaxText); set it on "
                            f"the command line to override the model file")
    warnings += [message for key, message in unsupported.items() if key not in winners]
    if values.get("override_model_config") is False:
        problems += _preset_clashes(sources.layers, by_layer, origins)
    derived = {}
    context = rules.Context(values, origins, derived, problems, warnings, world_size,
                            dialect=sources.dialect, defaults=defaults)
    rules.apply(context)
    if problems:
        raise ConfigError(problems)
    return Config(values, origins, derived, sources.dialect, warnings, context.adjusted,
                  defaults_about=dialect.about)


def complete(cfg) -> Mapping:
    """``cfg`` over every knob's registry default: what a subsystem's ``from_config`` reads when
    research code or a test hands it a partial mapping of canonical keys. A resolved Config is
    complete already and comes back as it is."""
    if isinstance(cfg, Config):
        return cfg
    return {**{k.key: k.default for k in registry() if not k.templated}, **cfg}


def load_config(path=None, overrides=(), world_size: int | None = None,
                enforce_status: bool = True, primus_path: str | None = None) -> Config:
    """Resolve a config file (any dialect; None for a command line alone) plus command-line
    overrides.

    ``world_size`` (number of devices) enables the checks and derived values that need it:
    data-parallel size, microbatches per step, batch divisibility. ``primus_path`` names a
    Primus checkout whose presets Primus experiments use (else ``PRIMUS_PATH``)."""
    sources = load_sources(path, overrides, primus_path)
    return resolve(sources, world_size, enforce_status)
