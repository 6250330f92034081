"""Reading YAML config files: parse errors as ConfigError, ``${VAR:default}`` interpolation,
and the chains a file can declare (MaxText ``base_config``, Primus ``extends`` / ``bases`` /
``includes``).

A chain is returned as a list of (path, mapping) from the deepest base to the file itself, so
later entries take precedence. A reference is looked up next to the referring file, then in the
extra folders the caller names (a dialect's preset folders), then in jaxtrain's configs/.
"""
from __future__ import annotations

import os
import pathlib
import re

import yaml

from jaxtrain.config.errors import ConfigError

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
BUILTIN_BASES = {"base.yml", "base.yaml"}  # MaxText's base file: our registry defaults play it
CHAIN_KEYS = ("base_config", "extends", "bases", "includes")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def parse_scalar(text: str):
    """A command-line or environment value read as YAML (``4`` → 4, ``1e-5`` → 1e-05,
    ``true`` → True, ``[1, 2]`` → a list); anything else stays the string as written, YAML 1.1's
    base-60 numbers too (``8:4`` is a step_batch_size_schedule entry, not 484)."""
    if not text.strip():
        return text
    if _NUMBER.match(text.strip()):
        number = float(text)
        return int(number) if re.fullmatch(r"[-+]?\d+", text.strip()) else number
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, dict) and not text.strip().startswith("{"):
        return text
    if isinstance(value, (int, float)) and ":" in text:
        return text
    return value


def _interpolate(value, path):
    if isinstance(value, dict):
        return {k: _interpolate(v, path) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, path) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m):
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{path}: environment variable {name} is not set and "
                              f"'${{{name}}}' has no default; set it or write ${{{name}:value}}")
        return default

    whole = _VAR.fullmatch(value)
    text = _VAR.sub(sub, value)
    return parse_scalar(text) if whole else text


def read_yaml(path: pathlib.Path) -> dict:
    """One YAML file as a mapping; every failure is a ConfigError naming the file."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a directory, not a YAML file: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8 expected)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, "
                          f"not a {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{path}: keys must be strings; found {bad[0]!r}")
    return _interpolate(data, path)


def find_file(name: str, relative_to: pathlib.Path, subdir: str = "",
              extra=()) -> pathlib.Path | None:
    """Locate a referenced file: next to the referring file, in ``extra`` folders, then in
    configs/<subdir> and configs/."""
    for folder in (relative_to, *extra, CONFIGS_DIR / subdir, CONFIGS_DIR):
        candidate = (pathlib.Path(folder) / name).resolve()
        if candidate.is_file():
            return candidate
    return None


def read_chain(path: pathlib.Path, extra=(), _seen=()) -> list[tuple[pathlib.Path, dict]]:
    """The file and the files it extends, deepest base first; chain keys are removed.

    ``base_config: base.yml`` that names no file on disk stands for MaxText's base.yml; it is
    returned as (``BUILTIN_BASE``, {}) so the caller can put MaxText's pinned defaults there."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: base_config/extends chain loops back to this file")
    data = read_yaml(path)
    chain = []
    for key in CHAIN_KEYS:
        if key not in data:
            continue
        refs = data.pop(key)
        refs = [refs] if isinstance(refs, str) else refs
        if refs is None:
            continue
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise ConfigError(f"{path}: {key} must be a file name or a list of file names")
        for ref in refs:
            found = find_file(ref, path.parent, extra=extra)
            if found is None and ref in BUILTIN_BASES:
                chain.append((BUILTIN_BASE, {}))
                continue
            if found is None:
                searched = ", ".join(str(p) for p in (path.parent, *extra, CONFIGS_DIR))
                raise ConfigError(f"{path}: {key} names {ref!r}, which is not in any of: "
                                  f"{searched}")
            chain += read_chain(found, extra, _seen + (path,))
    return chain + [(path, data)]


BUILTIN_BASE = pathlib.Path("<MaxText base.yml>")
