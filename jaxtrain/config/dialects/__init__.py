"""The systems a config can come from, and everything that depends on which one it is.

Each dialect is one module here: how its files are found and chained, its default set and its
spellings. ``load_sources`` reads a config file (or none) plus the command line into layers and
names the dialect; nothing below ``jaxtrain/config`` asks which system a config came from.

| dialect       | written as                                         | defaults                       |
|---------------|----------------------------------------------------|--------------------------------|
| megatron      | a flat YAML of Megatron keys                        | the Megatron reference (Primus)|
| primus        | a Primus experiment (``modules:``)                  | the Primus module presets      |
| megatron-lm   | a command line of Megatron-LM flags, no file        | Megatron-LM's argparse defaults|
| maxtext       | MaxText ``base.yml`` chains, ``framework: maxtext`` | MaxText's base.yml             |
| pgs-train     | pgs sections (``train:``, ``data:`` ...)            | pgs's defaults                 |
| pgs-distill   | pgs distill sections (``teachers:``, ``rollout:``)  | pgs distill's defaults         |
"""
from __future__ import annotations

import dataclasses
import pathlib

from jaxtrain.config.dialects import maxtext, megatron_lm, pgs, primus
from jaxtrain.config.files import BUILTIN_BASE, BUILTIN_BASES, read_chain
from jaxtrain.config.registry import registry
from jaxtrain.config.sources import Layer, Sources


@dataclasses.dataclass(frozen=True)
class Dialect:
    name: str
    doc: str | None     # the document whose per-document defaults (Knob.doc_defaults) apply
    about: str          # the default set, in words


def _dialects() -> dict[str, Dialect]:
    mlm_commit, mt_commit = megatron_lm.table()[0], maxtext.pinned_base()[0]
    return {d.name: d for d in (
        Dialect("megatron", None, "the Megatron reference's defaults (Primus's presets)"),
        Dialect("primus", None, "Primus's module presets over the Megatron reference's defaults"),
        Dialect("megatron-lm", "megatron-lm",
                f"Megatron-LM's argparse defaults (arguments.py at {mlm_commit})"),
        Dialect("maxtext", "maxtext", f"MaxText's base.yml (pinned at {mt_commit} unless the "
                                      f"config names a base.yml file)"),
        Dialect("pgs-train", "pgs-train", "pgs's defaults (palingenesis train)"),
        Dialect("pgs-distill", "pgs-distill", "pgs distill's defaults (palingenesis distill)"),
    )}


DIALECTS = _dialects()

# MaxText keys that no other document writes. A flat file (or command line) is a MaxText config
# when every name in it is one MaxText uses and at least one is MaxText's alone (one of these, an
# ici_/dcn_ size, or a knob only MaxText documents); a name from another document (seq_length,
# num_layers, ...) keeps it a Megatron config.
MAXTEXT_MARKERS = ("per_device_batch_size", "opt_type", "lr_schedule_type",
                   "learning_rate_final_fraction", "adam_eps_root")


def _maxtext_spelling(layers: list[Layer]) -> bool:
    reg = registry()
    maxtext_only = False
    for layer in layers:
        for entry in layer.entries:
            match = reg.lookup(entry.key, "maxtext")
            if match is None:
                continue
            docs = match.alias.docs if match.alias is not None else match.knob.sources
            if "maxtext" not in docs:
                return False
            if entry.key in MAXTEXT_MARKERS or entry.key.startswith(("ici_", "dcn_")) \
                    or tuple(docs) == ("maxtext",):
                maxtext_only = True
    return maxtext_only


def _chain_of(path: pathlib.Path):
    if path.name in BUILTIN_BASES and not path.exists():
        return [(BUILTIN_BASE, {})]
    return read_chain(path, extra=maxtext.base_search(path))


def load_sources(path, overrides=(), primus_path: str | None = None) -> Sources:
    """The layers of a run (lowest precedence first) and its dialect; the Hugging Face model
    that ``model.name_or_path`` names gives the architecture (:func:`pgs.with_hf_model`)."""
    sources = _sources(path, overrides, primus_path)
    return pgs.with_hf_model(sources, DIALECTS[sources.dialect].doc)


def _sources(path, overrides, primus_path) -> Sources:
    args = list(overrides)
    cli = megatron_lm.parse_command_line(args)
    if path is None:
        if megatron_lm.speaks_megatron_lm(args):
            return Sources([megatron_lm.defaults_layer(), cli], "megatron-lm")
        if _maxtext_spelling([cli]) or any(e.key == "framework" and e.value == "maxtext"
                                            for e in cli.entries):
            layers = [maxtext.base_layer(BUILTIN_BASE, {}), cli]
            return Sources(_with_model(layers, None, [], len(layers) - 1), "maxtext")
        return Sources(_with_model([cli], None, [], 0), "megatron")
    path = pathlib.Path(path)
    chain = _chain_of(path)
    main_path = chain[-1][0]
    if any(primus.is_experiment(data) for _, data in chain):
        data = primus.merge_experiments(chain)
        layers, framework, warnings = primus.experiment_layers(main_path, data, primus_path)
        dialect = "maxtext" if framework == "maxtext" else "primus"
        # Primus hands all its settings to MaxText as overrides: the model file sits just
        # above the module presets.
        return Sources(_with_model(layers + [cli], main_path, chain, _defaults_count(layers)),
                       dialect, warnings=warnings)
    layers = maxtext.chain_layers(chain, _file_name(main_path), "file")
    # A base_config chain is MaxText's, even when it holds a dpo block as pgs files do.
    dialect = pgs.dialect_of(chain[-1][1]) if len(chain) == 1 else None
    if dialect == "pgs-distill":
        pgs.refuse_old_distill(chain[-1][1], str(main_path))
    if dialect is None:
        writes_maxtext = _defaults_count(layers) > 0 or any(
            data.get("framework") == "maxtext" for _, data in chain)
        if writes_maxtext or _maxtext_spelling(layers + [cli]):
            dialect = "maxtext"
            if not _defaults_count(layers):
                layers.insert(0, maxtext.base_layer(BUILTIN_BASE, {}))
        else:
            dialect = "megatron"
    layers.append(cli)
    # MaxText merges the model file over the config files, under the command line; elsewhere
    # model_name is a preset under the files.
    at = len(layers) - 1 if dialect == "maxtext" else _defaults_count(layers)
    return Sources(_with_model(layers, main_path, chain, at), dialect)


def _defaults_count(layers: list[Layer]) -> int:
    """How many layers are a default set (they come first)."""
    return sum(1 for layer in layers if layer.kind == "defaults")


def _file_name(main: pathlib.Path):
    return lambda p: str(p) if p == main else f"base config {p.name}"


def _with_model(layers: list[Layer], file, chain, at: int) -> list[Layer]:
    """Insert ``model_name``'s model file at position ``at``."""
    name, origin = maxtext.model_name_of(layers)
    if not name or name == "default":
        return layers
    model = maxtext.model_layers(str(name), file, chain, origin)
    return layers[:at] + model + layers[at:]
