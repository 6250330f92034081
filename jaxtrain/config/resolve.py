"""Merge layers into one validated Config.

Order: registry defaults (in the file's dialect) < module/model presets < base configs < the
file < the command line. Every problem found is collected and raised together as one
ConfigError, so a user fixes a file in one pass.
"""
from __future__ import annotations

import pathlib

from jaxtrain.config import rules
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.knob import INERT, ISSUES, PLANNED, REJECTED, CoerceError, coerce
from jaxtrain.config.areas.model import MAXTEXT_MODEL_KEYS
from jaxtrain.config.layers import FLAG, Layer, Sources, cli_layer, file_sources, preset_layers
from jaxtrain.config.registry import registry
from jaxtrain.config.resolved import Config


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


def _layer_values(layer: Layer, problems: list[str]) -> dict:
    """canonical key -> (value, origin) for one layer, checking names, types and aliases."""
    reg, out, written = registry(), {}, {}
    for entry in layer.entries:
        match = reg.lookup(entry.key)
        if match is None:
            hint = reg.suggest(entry.key)
            problems.append(f"unknown key {entry.key!r} in {entry.origin}"
                            + (f"; did you mean {', '.join(hint)}?" if hint else
                               "; see python -m jaxtrain.knobs for the known keys"))
            continue
        try:
            value = _typed(match, entry)
        except CoerceError as e:
            problems.append(f"{entry.key} (in {entry.origin}): {e}")
            continue
        previous = written.get(match.key)
        if previous not in (None, entry.key) and out[match.key][0] != value:
            problems.append(
                f"{previous} and {entry.key} both set in {entry.origin} to different values "
                f"({out[match.key][0]!r} vs {value!r}); they name the same setting "
                f"({match.key}): keep one")
            continue
        written[match.key] = entry.key
        out[match.key] = (value, entry.origin)
    return out


def _model_name_layers(layers: list[Layer], problems: list[str]) -> list[Layer]:
    """MaxText ``model_name`` loads a model preset below the files that set it."""
    name, origin = None, None
    for layer in layers:
        for entry in layer.entries:
            if entry.key == "model_name":
                name, origin = entry.value, entry.origin
    if not name or name == "default":
        return []
    here = pathlib.Path(origin).parent if origin != "command line" else pathlib.Path.cwd()
    try:
        return preset_layers(str(name), "models", here, "model preset")
    except ConfigError as e:
        problems.extend(f"model_name: {p}" for p in e.problems)
        return []


# MaxText keys that no other document writes. A flat file (or command line) without a dialect
# is a MaxText config, and takes MaxText's defaults, when every name in it is one MaxText uses
# and at least one is MaxText's alone (one of these, an ici_/dcn_ size, a MaxText model key, or
# MaxText's spelling of a shared knob: steps, learning_rate, base_emb_dim, ...). A name from
# another document (seq_length, num_layers, ...) keeps it a Megatron config.
MAXTEXT_MARKERS = ("per_device_batch_size", "opt_type", "lr_schedule_type",
                   "learning_rate_final_fraction", "adam_eps_root")


def _maxtext_spelling(layers: list[Layer]) -> bool:
    reg = registry()
    maxtext_only = False
    for layer in layers:
        for entry in layer.entries:
            match = reg.lookup(entry.key)
            if match is None:
                continue
            docs = match.alias.docs if match.alias is not None else match.knob.sources
            if "maxtext" not in docs:
                return False
            if entry.key in MAXTEXT_MARKERS or entry.key in MAXTEXT_MODEL_KEYS or \
                    entry.key.startswith(("ici_", "dcn_")) or tuple(docs) == ("maxtext",):
                maxtext_only = True
    return maxtext_only


def _status_problems(key, knob, value, default, origin, problems, warnings):
    if value == default or (knob.type == "bool" and default is None and value is False):
        return  # a null-defaulted switch written as false means the same as unset
    shown = f"{key} = {value!r} (from {origin})"
    hashable = value if isinstance(value, (str, int, float, bool)) else None
    if hashable in knob.planned_values:
        issue = knob.planned_values[hashable]
        where = f"issue #{issue} ({ISSUES[issue]})" if issue else "a later issue"
        problems.append(f"not implemented yet: {key} = {value!r} (from {origin}); this value is "
                        f"planned for {where}. Other values of {key} work.")
    elif hashable in knob.rejected_values:
        problems.append(f"{key} = {value!r} is not supported by jaxtrain: "
                        f"{knob.rejected_values[hashable]} (from {origin}).")
    elif knob.status == PLANNED:
        where = (f"issue #{knob.issue} ({ISSUES[knob.issue]})" if knob.issue
                 else "a later issue")
        problems.append(f"not implemented yet: {key}; {shown} is planned for {where}. "
                        f"Remove it or set it back to {default!r}.")
    elif knob.status == REJECTED:
        problems.append(f"{key} is not supported by jaxtrain: {knob.reason}. ({shown}; "
                        f"remove it or set it back to {default!r}.)")
    elif knob.status == INERT:
        warnings.append(f"{key} has no effect under JAX/XLA: {knob.reason} ({shown})")


def resolve(sources: Sources, world_size: int | None = None, enforce_status: bool = True
            ) -> Config:
    """Merge, type and check ``sources``. ``enforce_status=False`` skips the planned/rejected
    gate (for tools that inspect how files resolve); training never does."""
    reg, problems, warnings = registry(), [], []
    layers = list(sources.layers)
    layers[:0] = _model_name_layers(layers, problems)
    dialect = sources.dialect
    merged, origins, by_kind = {}, {}, {}
    for layer in layers:
        for key, (value, origin) in _layer_values(layer, problems).items():
            merged[key], origins[key] = value, origin
            by_kind.setdefault(layer.kind, set()).add(key)
    if merged.get("framework") == "maxtext" or (dialect is None and _maxtext_spelling(layers)):
        dialect = dialect or "maxtext"
    if merged.get("override_model_config") is False:
        clash = sorted(by_kind.get("preset", set()) & (by_kind.get("file", set())
                                                       | by_kind.get("cli", set())))
        problems += [f"{key} is set by the model preset and again in {origins[key]}, and "
                     f"override_model_config is false; drop one or set override_model_config "
                     f"to true" for key in clash]
    values = {}
    for knob in reg:
        if not knob.templated:
            values[knob.key] = knob.default_for(dialect)
    for key, value in merged.items():
        values[key] = value
    for key in merged if enforce_status else ():
        knob = reg.lookup(key).knob
        default = knob.default_for(dialect)
        _status_problems(key, knob, values[key], default, origins[key], problems, warnings)
    derived = {}
    context = rules.Context(values, origins, derived, problems, warnings, world_size,
                            dialect=dialect)
    rules.apply(context)
    if problems:
        raise ConfigError(problems)
    return Config(values, origins, derived, dialect, warnings, context.adjusted)


def load_config(path=None, overrides=(), world_size: int | None = None,
                enforce_status: bool = True) -> Config:
    """Resolve a config file (any dialect; None for defaults only) plus command-line overrides.

    ``world_size`` (number of devices) enables the checks and derived values that need it:
    data-parallel size, microbatches per step, batch divisibility.
    """
    sources = file_sources(path) if path is not None else Sources([], None)
    if overrides:
        sources.layers.append(cli_layer(list(overrides)))
    return resolve(sources, world_size, enforce_status)
