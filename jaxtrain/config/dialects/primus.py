"""Primus experiment files: ``modules.<name>`` with a module preset (``config:``), a model
preset (``model:``) and ``overrides``; ``models.<name>.overrides``; presets chained with
``extends`` (or the older ``bases`` / ``includes``).

Presets are found where Primus keeps them: ``primus/configs/modules/<framework>/`` and
``primus/configs/models/<framework>/`` of a Primus checkout. The checkout is the one given by
``--primus-path`` / the ``PRIMUS_PATH`` environment variable, else the one the experiment lives
in (found by walking up from it), else jaxtrain's own ``configs/modules`` and ``configs/models``.
A module preset (``pre_trainer.yaml`` and what it extends) is Primus's default set: its values
are defaults, not choices. A model preset is a choice of model, like the experiment's overrides.
"""
from __future__ import annotations

import os
import pathlib

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.files import CONFIGS_DIR, find_file, read_chain, read_yaml
from jaxtrain.config.dialects.maxtext import chain_layers
from jaxtrain.config.sources import Layer, flatten

MODULE_FIELDS = ("framework", "config", "model", "overrides", "trainer_class")
# Frameworks whose key names jaxtrain reads; the others are other trainers' vocabularies.
FRAMEWORKS = ("megatron", "maxtext")
_OTHER_FRAMEWORKS = {
    "torchtitan": "TorchTitan's configuration (its own key names and model builders)",
    "megatron_bridge": "Megatron-Bridge/NeMo recipes (their own key names)",
    "nemo_automodel": "NeMo AutoModel recipes",
    "diffusion": "diffusion models", "maxdiffusion": "MaxDiffusion (diffusion models)",
    "hummingbirdxt": "HummingbirdXT (diffusion models)",
}
# module -> what is still missing for it (None: built)
_MODULES = {"pre_trainer": None,
            "post_trainer": "Primus's SFT trainer (stage sft: its conversation formats, LoRA)"}


def is_experiment(data: dict) -> bool:
    return isinstance(data, dict) and "modules" in data


def merge_experiments(chain) -> dict:
    """An experiment and the experiments it ``extends``, merged key by key (Primus's deep
    merge: mappings merge, anything else is replaced by the later file)."""
    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v) if k in a else v
            return out
        return b
    merged = {}
    for _, data in chain:
        merged = merge(merged, data)
    return merged


def checkouts(experiment: pathlib.Path, primus_path: str | None = None) -> list[pathlib.Path]:
    """Primus ``configs`` folders to search, most specific first."""
    roots = []
    given = primus_path or os.environ.get("PRIMUS_PATH")
    if given:
        root = pathlib.Path(given).expanduser()
        for candidate in (root / "primus" / "configs", root / "configs", root):
            if (candidate / "models").is_dir() or (candidate / "modules").is_dir():
                roots.append(candidate.resolve())
                break
        else:
            raise ConfigError(f"--primus-path / PRIMUS_PATH {given!r} is not a Primus checkout "
                              f"(no primus/configs/models or primus/configs/modules in it)")
    for parent in experiment.resolve().parents:
        candidate = parent / "primus" / "configs"
        if (candidate / "models").is_dir() and candidate.resolve() not in roots:
            roots.append(candidate.resolve())
            break
    return roots


def _preset(name: str, kind: str, framework: str, experiment: pathlib.Path,
            roots: list[pathlib.Path], what: str) -> list[tuple[pathlib.Path, dict]]:
    """A preset file and its chain, looked up next to the experiment, in the Primus
    checkouts' ``<kind>/<framework>/``, then in jaxtrain's ``configs/<kind>/``."""
    folders = [root / kind / framework for root in roots]
    stem = name[:-5] if name.endswith(".yaml") else name[:-4] if name.endswith(".yml") else name
    for candidate in dict.fromkeys((name, stem + ".yaml", stem + ".yml")):
        found = find_file(candidate, experiment.parent, kind, extra=folders)
        if found:
            return read_chain(found, extra=folders + [CONFIGS_DIR / kind])
    searched = [str(f) for f in folders] + [str(CONFIGS_DIR / kind)]
    raise ConfigError(f"{experiment}: {what} {name!r} not found next to the experiment or in "
                      f"{', '.join(searched)}; point --primus-path (or PRIMUS_PATH) at a Primus "
                      f"checkout")


# Chain keys Primus's loader stopped reading when it moved to ``extends`` (Nov 2025)
_RETIRED = ("bases", "includes")


def retired_chain_keys(chain) -> list[str]:
    """Warnings for the preset files of ``chain`` that still chain with a retired key: jaxtrain
    follows them, Primus now ignores them (its run takes Megatron's defaults instead)."""
    out = []
    for path, _ in chain:
        raw = read_yaml(path) if path.is_file() else {}
        for key in _RETIRED:
            if isinstance(raw, dict) and key in raw:
                out.append(f"{path.name} chains its presets with {key!r}, which Primus's loader "
                           "no longer reads (it reads 'extends'): jaxtrain applies them, so "
                           "their settings hold here where a Primus run takes Megatron's "
                           "defaults for them")
    return out


def _framework(path: pathlib.Path, data: dict) -> str:
    framework = data.get("framework")
    for name, module in data["modules"].items():
        if not isinstance(module, dict):
            raise ConfigError(f"{path}: modules.{name} must be a mapping with "
                              f"framework/config/model/overrides")
        chosen = module.get("framework")
        if chosen and framework and chosen != framework:
            raise ConfigError(f"{path}: modules.{name}.framework is {chosen!r} but another part "
                              f"of the file says {framework!r}")
        framework = chosen or framework
    framework = framework or "megatron"
    if framework in _OTHER_FRAMEWORKS:
        raise ConfigError(f"{path}: framework {framework!r} is {_OTHER_FRAMEWORKS[framework]}, "
                          f"which jaxtrain does not read; jaxtrain runs Primus experiments of "
                          f"the megatron and maxtext frameworks")
    if framework not in FRAMEWORKS:
        raise ConfigError(f"{path}: unknown framework {framework!r}; jaxtrain runs Primus "
                          f"experiments of the megatron and maxtext frameworks")
    return framework


def experiment_layers(path: pathlib.Path, data: dict,
                      primus_path: str | None = None) -> tuple[list[Layer], str]:
    """(layers, framework, warnings) of one experiment (``data``: the experiment merged with
    the experiments it extends)."""
    if not isinstance(data["modules"], dict):
        raise ConfigError(f"{path}: 'modules' must map module names to their settings")
    framework = _framework(path, data)
    roots = checkouts(path, primus_path)
    defaults, presets, warnings = [], [], []
    overrides = Layer(str(path), "file")
    models = Layer(f"{path} (models overrides)", "file")
    for name, module in data["modules"].items():
        where = f"{path}: modules.{name}"
        unknown = sorted(set(module) - set(MODULE_FIELDS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown module field; a Primus module takes "
                              f"{', '.join(MODULE_FIELDS)} (knobs go under overrides)")
        if name in _MODULES and _MODULES[name] is not None:
            raise ConfigError(f"{where}: not implemented yet: the Primus {name} module "
                              f"(post-training: {_MODULES[name]}) is planned for a later "
                              "issue; jaxtrain's SFT runs pgs files and MaxText use_sft files")
        if module.get("config"):
            chain = _preset(module["config"], "modules", framework, path, roots,
                            "module config")
            defaults += chain_layers(chain, lambda p: f"Primus module preset {p.name}",
                                     "defaults")
        if module.get("model"):
            chain = _preset(module["model"], "models", framework, path, roots, "model preset")
            presets += chain_layers(chain, lambda p: f"model preset {p.name}", "preset")
            warnings += retired_chain_keys(chain)
        section = module.get("overrides") or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{where}.overrides must be a mapping of keys to values")
        flatten(section, overrides, f"{path} (modules.{name}.overrides)")
    for name, model in (data.get("models") or {}).items():
        section = (model or {}).get("overrides") or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: models.{name}.overrides must be a mapping")
        flatten(section, models, f"{path} (models.{name}.overrides)")
    rest = {k: v for k, v in data.items() if k not in ("modules", "models")}
    flatten(rest, overrides, str(path))
    overrides.add("framework", framework, str(path))
    return defaults + presets + [models, overrides], framework, warnings
