"""MaxText files: ``base.yml`` as the default set, ``base_config`` chains, and ``model_name``.

MaxText's defaults are its ``configs/base.yml``. When a config's chain reaches a real base.yml
(a MaxText checkout), that file is the default layer; otherwise jaxtrain's pinned copy of its
values (``maxtext_base.json``, MaxText at the commit it names) is. ``base_config`` is looked up
next to the file, then in MaxText's configs folder (the checkout the file lives in, or
``MAXTEXT_PATH``). ``model_name`` loads ``models/<name>.yml`` where MaxText looks for it — next to
the config, one folder up, in MaxText's configs folder — then jaxtrain's copies of MaxText's model
files (``configs/models/maxtext``) and its own ``configs/models``.
As in MaxText, the model file overrides the config file and yields only to the command line
(``override_model_config: false`` makes a key set by both an error).
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import re

from jaxtrain.config.areas.maxtext_model import BUILT_BLOCKS, PLANNED_BLOCKS
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.files import BUILTIN_BASE, BUILTIN_BASES, CONFIGS_DIR, read_chain
from jaxtrain.config.sources import Layer, flatten

_PINNED = pathlib.Path(__file__).with_name("maxtext_base.json")


@functools.lru_cache(maxsize=None)
def pinned_base() -> tuple[str, dict]:
    """(MaxText commit, base.yml's values) of jaxtrain's pinned copy."""
    data = json.loads(_PINNED.read_text())
    return data["commit"], data["values"]


def base_layer(path: pathlib.Path, data: dict) -> Layer:
    """MaxText's defaults: a real base.yml file, or the pinned values for ``BUILTIN_BASE``."""
    if path == BUILTIN_BASE:
        commit, values = pinned_base()
        layer = Layer(f"MaxText base.yml at {commit}", "defaults")
        data = values
    else:
        layer = Layer(f"MaxText base.yml {path}", "defaults")
    flatten(data, layer, layer.name)
    return layer


def chain_layers(chain, name_of, kind: str) -> list[Layer]:
    """One layer per file of a chain; MaxText's base.yml (real or pinned) is the default layer."""
    layers = []
    for path, data in chain:
        if path == BUILTIN_BASE or (path.name in BUILTIN_BASES and path == chain[0][0]):
            layers.append(base_layer(path, data))
            continue
        layer = Layer(name_of(path), kind)
        flatten(data, layer, layer.name)
        layers.append(layer)
    return layers


def configs_dirs(file: pathlib.Path | None, chain) -> list[pathlib.Path]:
    """MaxText configs folders: the one holding a real base.yml of the chain, the folder above
    the file that holds a base.yml (a MaxText checkout), and ``MAXTEXT_PATH``'s."""
    dirs = [p.parent for p, _ in chain if p != BUILTIN_BASE and p.name in BUILTIN_BASES]
    if file is not None:
        for parent in list(file.resolve().parents)[:4]:
            if (parent / "base.yml").is_file():
                dirs.append(parent)
                break
    given = os.environ.get("MAXTEXT_PATH")
    if given:
        root = pathlib.Path(given).expanduser()
        for candidate in (root / "src" / "maxtext" / "configs", root / "src" / "MaxText" /
                          "configs", root / "MaxText" / "configs", root / "configs", root):
            if (candidate / "base.yml").is_file() or (candidate / "models").is_dir():
                dirs.append(candidate)
                break
    return list(dict.fromkeys(d.resolve() for d in dirs))


def base_search(file: pathlib.Path) -> list[pathlib.Path]:
    """Where ``base_config`` is looked up after the referring file's folder."""
    return configs_dirs(file, [])


def _normalised(folder: pathlib.Path, stem: str) -> pathlib.Path | None:
    """A preset in jaxtrain's configs whose name matches ignoring case and -._ (llama3-8b is
    llama3_8B.yaml)."""
    norm = lambda text: re.sub(r"[-._]", "", text.lower())  # noqa: E731
    for path in sorted(folder.glob("*.y*ml")) if folder.is_dir() else ():
        if norm(path.stem) == norm(stem):
            return path
    return None


def model_layers(name: str, file: pathlib.Path | None, chain, origin: str) -> list[Layer]:
    """The layers of ``model_name``'s model file (and the presets it extends)."""
    stem = name.replace("-Instruct", "")
    here = file.resolve().parent if file is not None else pathlib.Path.cwd()
    folders = [here / "models", here.parent / "models"]
    folders += [d / "models" for d in configs_dirs(file, chain)]
    # MaxText's model files copied for the families jaxtrain builds (tools/maxtext_presets.py),
    # for configs that name one without a MaxText checkout (a Primus framework: maxtext run).
    folders += [CONFIGS_DIR / "models" / "maxtext", CONFIGS_DIR / "models", here]
    found = None
    for folder in dict.fromkeys(folders):
        for candidate in (f"{stem}.yml", f"{stem}.yaml", stem):
            if (folder / candidate).is_file():
                found = folder / candidate
                break
        if found:
            break
    found = found or _normalised(CONFIGS_DIR / "models", stem)
    if found is None:
        raise ConfigError(_no_model_file(name, stem, origin))
    return chain_layers(read_chain(found), lambda p: f"model_name {name}: {p}", "preset")


def _no_model_file(name: str, stem: str, origin: str) -> str:
    """Why model_name has no file: a MaxText model of a family jaxtrain does not build (named
    by configs/models/maxtext/families.json), or an unknown name."""
    index = CONFIGS_DIR / "models" / "maxtext" / "families.json"
    families = json.loads(index.read_text()) if index.is_file() else {}
    block = families.get("decoder_block", {}).get(stem)
    if block is not None and block not in BUILT_BLOCKS:
        plan = ("planned for issue #25 (model families)" if block in PLANNED_BLOCKS
                else "not supported")
        return (f"model_name {name!r} (from {origin}) is MaxText's {block} model (decoder_block "
                f"{block}), which jaxtrain does not build: {plan}; jaxtrain keeps copies of "
                f"MaxText's model files only for the blocks it builds ({', '.join(BUILT_BLOCKS)})")
    known = sorted(p.stem for p in (CONFIGS_DIR / "models").glob("*.y*ml"))
    return (f"model_name {name!r} (from {origin}): no models/{stem}.yml next to the config, in "
            f"MaxText's configs folder (set MAXTEXT_PATH to a MaxText checkout) or in "
            f"{CONFIGS_DIR / 'models'} (known there: {', '.join(known) or 'none'}, and in "
            f"models/maxtext MaxText's model files of the decoder blocks jaxtrain builds: "
            f"{', '.join(BUILT_BLOCKS)})")


def model_name_of(layers: list[Layer]) -> tuple[str | None, str | None]:
    """The last ``model_name`` any layer sets, and where."""
    name = origin = None
    for layer in layers:
        for entry in layer.entries:
            if entry.key == "model_name":
                name, origin = entry.value, entry.origin
    return name, origin
