"""Megatron-LM's command line: its flag spellings and actions, and its argparse defaults.

``megatron_lm_args.json`` holds, as facts, every argument of Megatron-LM's ``arguments.py`` at
a pinned commit: the flags that spell it (``--disable-bias-linear``, ``--no-rope-fusion``,
``--fp8-format``), the attribute it sets (its dest: ``add_bias_linear``, ``apply_rope_fusion``,
``fp8``), the action (store, store_true, store_false, ``--x/--no-x``), how many values it takes,
and its default. Command lines are parsed with it, whatever the config file's dialect; a
command line with no config file is a Megatron-LM run and takes Megatron-LM's defaults.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.files import parse_scalar
from jaxtrain.config.sources import FLAG, Layer

_TABLE = pathlib.Path(__file__).with_name("megatron_lm_args.json")
_BOOL_WORDS = ("true", "false")


@dataclasses.dataclass(frozen=True)
class Argument:
    flags: tuple[str, ...]
    dest: str
    action: str          # store | store_true | store_false | boolean_optional
    nargs: str | int | None
    default: object


@functools.lru_cache(maxsize=None)
def table() -> tuple[str, tuple[Argument, ...]]:
    """(Megatron-LM commit, every argument)."""
    data = json.loads(_TABLE.read_text())
    args = tuple(Argument(tuple(r["flags"]), r["dest"], r["action"], r.get("nargs"),
                          r.get("default")) for r in data["arguments"])
    return data["commit"], args


@functools.lru_cache(maxsize=None)
def by_flag() -> dict[str, Argument]:
    flags = {}
    for arg in table()[1]:
        for flag in arg.flags:
            flags[flag] = arg
        if arg.action == "boolean_optional":
            for flag in arg.flags:
                if flag.startswith("--") and not flag.startswith("--no-"):
                    flags["--no-" + flag[2:]] = arg
    return flags


def is_flag(token: str) -> bool:
    """A Megatron-LM flag spelling (``--micro-batch-size``, ``--no-rope-fusion``)."""
    return token.split("=", 1)[0] in by_flag()


def _values_until_next_flag(args: list[str], i: int) -> list[str]:
    out = []
    while i < len(args) and not (args[i].startswith("--") or "=" in args[i] and not
                                 args[i].startswith("-")):
        out.append(args[i])
        i += 1
    return out


def _flag_value(arg: Argument, flag: str, inline: str | None, args: list[str], i: int):
    """(value, tokens consumed after the flag) for one Megatron-LM flag."""
    if arg.action in ("store_true", "store_false", "boolean_optional"):
        value = arg.action != "store_false"
        if arg.action == "boolean_optional" and flag.startswith("--no-"):
            value = False
        if inline is not None:
            if inline.lower() not in _BOOL_WORDS:
                raise ConfigError(f"command line: {flag} is a switch and takes no value "
                                  f"(got {inline!r})")
            return value == (inline.lower() == "true"), 0
        if i < len(args) and args[i].lower() in _BOOL_WORDS:   # --bf16 true (YAML style)
            return value == (args[i].lower() == "true"), 1
        return value, 0
    if inline is not None:
        values = [inline]
    elif arg.nargs in ("+", "*") or isinstance(arg.nargs, int):
        values = _values_until_next_flag(args, i)
    else:
        values = args[i:i + 1] if i < len(args) and not args[i].startswith("--") else []
    if arg.nargs in (None, "?"):
        if not values:
            if arg.nargs == "?":
                return FLAG, 0
            raise ConfigError(f"command line: {flag} needs a value ({flag} VALUE)")
        return parse_scalar(values[0]), 1 if inline is None else 0
    if arg.nargs == "+" and not values:
        raise ConfigError(f"command line: {flag} needs one or more values")
    if isinstance(arg.nargs, int) and len(values) != arg.nargs:
        raise ConfigError(f"command line: {flag} takes {arg.nargs} values, got {len(values)}")
    consumed = 0 if inline is not None else len(values)
    return [parse_scalar(v) for v in values], consumed


def parse_command_line(args: list[str]) -> Layer:
    """Command-line overrides: Megatron-LM flags by their table, and jaxtrain's forms
    ``key=value``, ``--key value``, ``--key=value``, ``--section.key value``."""
    layer = Layer("command line", "cli")
    flags, i = by_flag(), 0
    while i < len(args):
        token = args[i]
        i += 1
        if token.startswith("--"):
            name, inline = token.split("=", 1) if "=" in token else (token, None)
            arg = flags.get(name)
            if arg is not None:
                value, used = _flag_value(arg, name, inline, args, i)
                i += used
                layer.add(arg.dest, value, f"command line ({name})")
                continue
            key = name[2:]
            if inline is not None:
                text = inline
            elif i < len(args) and not args[i].startswith("--"):
                text, i = args[i], i + 1
            else:
                text = FLAG
            if "." not in key:
                key = key.replace("-", "_")
        elif "=" in token:
            key, text = token.split("=", 1)
        else:
            raise ConfigError(f"command line: {token!r} is not an override; write key=value "
                              f"(or --section.key value)")
        key = key.strip()
        if not key:
            raise ConfigError(f"command line: {token!r} has no key before '='")
        layer.add(key, text if text is FLAG else parse_scalar(text))
    return layer


def speaks_megatron_lm(args: list[str]) -> bool:
    """A command line in Megatron-LM's spelling: some ``--flag`` is one Megatron-LM defines."""
    return any(is_flag(a) for a in args if a.startswith("--"))


def defaults_layer() -> Layer:
    """Megatron-LM's argparse default of every argument, as the lowest layer of its runs."""
    commit, args = table()
    layer = Layer(f"Megatron-LM arguments.py at {commit}", "defaults")
    for arg in args:
        layer.add(arg.dest, arg.default)
    return layer
