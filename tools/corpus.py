"""Real upstream config files, loaded the way a user would load them.

    python tools/corpus.py scan UPSTREAM > tests/data/upstream_corpus.json
    python tools/corpus.py run UPSTREAM [--manifest FILE] [--only primus|maxtext|megatron-lm|pgs]

UPSTREAM is a folder with checkouts of the public repositories: ``primus/`` (AMD-AGI/Primus),
``maxtext/`` (AI-Hypercomputer/maxtext), ``megatron-lm/`` (NVIDIA/Megatron-LM) and
``palingenesis/`` (mii-llm/palingenesis). ``scan`` lists the corpus: every Primus experiment,
MaxText's base.yml, each MaxText model file (as ``base.yml model_name=...``), MaxText's GPU model
files and the training command lines in MaxText's scripts and docs, the flag lists of
Megatron-LM's example training scripts, and pgs's config files. Paths are relative to UPSTREAM;
command lines are stored as argument lists (shell variables resolved from the script's own
assignments where it has them). ``run`` resolves each entry as ``python -m jaxtrain.train
--dry-run`` would and prints one line per entry (load, refused with the reason, or crash) and
the counts.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}?")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_MAXTEXT_TRAIN = re.compile(r"(maxtext\.trainers\.pre_train\.train|MaxText\.train|"
                            r"MaxText/train\.py|maxtext/train\.py)\b")


def _shell_vars(text: str) -> dict:
    """NAME=value assignments of a script, with ${NAME:-default} reduced to the default."""
    out = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if not m or m.group(2).startswith("("):
            continue
        value = m.group(2).split("#")[0].strip().strip('"').strip("'")
        d = _VAR.fullmatch(value)
        out[m.group(1)] = d.group(2) if d and d.group(2) is not None else value
    return out


def _expand(token: str, env: dict) -> str | None:
    """A token with its shell variables replaced; None when one has no known value."""
    missing = False

    def sub(m):
        nonlocal missing
        name, default = m.group(1), m.group(2)
        if name in env and "$" not in env[name]:
            return env[name]
        if default is not None:
            return default
        missing = True
        return m.group(0)

    text = _VAR.sub(sub, token)
    return None if missing else text


def _dummy(flag: str, i: int) -> str:
    """A stand-in for a shell variable the script leaves to its caller, of the flag's type."""
    from jaxtrain.config.dialects.megatron_lm import by_flag

    arg = by_flag().get(flag)
    kind = None
    if arg is not None:
        default = arg.default
        kind = type(default).__name__ if default is not None else None
    return {"int": "1", "float": "1.0"}.get(kind, f"/placeholder/{i}")


def _words(text: str) -> list[str]:
    text = re.sub(r"\\\n", " ", text)
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return []


_TRAINERS = ("pretrain_gpt.py", "pretrain_hybrid.py", "pretrain_mamba.py")


def megatron_lm_entries(root: pathlib.Path):
    """Flag lists of Megatron-LM's example scripts that train a GPT or hybrid model."""
    from jaxtrain.config.dialects.megatron_lm import by_flag

    for path in sorted((root / "examples").rglob("*.sh")):
        text = path.read_text(errors="replace")
        script = next((n for n in _TRAINERS if n in text), None)
        if script is None:
            continue
        env = _shell_vars(text)
        words = []
        for name, block in re.findall(r"^\s*([A-Z_]+)=\(\s*(.*?)\)", text, re.S | re.M):
            if not any(w in name for w in ("DISTRIBUTED", "TORCHRUN", "LAUNCH")):
                words += _words(block)
        code = "\n".join(line for line in text.splitlines()
                         if not line.lstrip().startswith("#"))
        for m in re.finditer(re.escape(script) + r"((?:[^\n]*\\\n)*[^\n]*)", code):
            words += [w for w in _words(m.group(1)) if not w.startswith("${")]
        args, i = [], 0
        while i < len(words):
            word = words[i]
            if not word.startswith("--"):
                i += 1
                continue
            values = []
            i += 1
            while i < len(words) and not words[i].startswith("--"):
                values.append(words[i])
                i += 1
            expanded = [_expand(v, env) for v in values]
            arg = by_flag().get(word)
            if arg is not None and arg.action != "store":   # a switch: what follows it is an
                expanded = [v for v in expanded if v is not None]   # unset optional variable
            args += [word] + [v if v is not None else _dummy(word, k)
                              for k, v in enumerate(expanded)]
        if args and ("--num-layers" in args or "--hybrid-layer-pattern" in args):
            yield {"id": f"megatron-lm:{path.relative_to(root.parent)}", "dialect": "megatron-lm",
                   "file": None, "args": args}


def megatron_lm_test_entries(root: pathlib.Path):
    """MODEL_ARGS of Megatron-LM's functional tests for GPT and MoE models (flag: value)."""
    import yaml

    from jaxtrain.config.dialects.megatron_lm import by_flag

    cases = root / "tests" / "functional_tests" / "test_cases"
    for path in sorted(cases.glob("*/*/model_config.yaml")):
        if path.parts[-3] not in ("gpt", "moe", "mixtral", "hybrid") or (
                "inference" in path.parent.name):
            continue
        try:
            case = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            continue
        if "inference" in str(case.get("TEST_TYPE", "")) or "inference" in str(
                case.get("MODE", "")):
            continue   # generation servers take extra flags of their own scripts
        model_args = case.get("MODEL_ARGS") or {}
        args = []
        for flag, value in model_args.items():
            if value is False or value is None:
                continue
            args.append(flag)
            if value is not True:
                text = str(value)
                arg = by_flag().get(flag)
                many = arg is not None and (arg.nargs in ("+", "*") or isinstance(arg.nargs, int))
                words = text.split() if many else [text]
                if isinstance(value, list):
                    words = [str(v) for v in value]
                elif re.fullmatch(r"\[[^]]+\]", text.strip()):
                    # the test harness (_run_training.sh) passes "[a b]" as the words a b
                    words = text.strip()[1:-1].split()
                args += [_expand(w, {}) or _dummy(flag, i) for i, w in enumerate(words)]
        yield {"id": f"megatron-lm:{path.parent.relative_to(root.parent)}",
               "dialect": "megatron-lm", "file": None, "args": args}


def maxtext_entries(root: pathlib.Path):
    configs = root / "src" / "maxtext" / "configs"
    yield {"id": "maxtext:base.yml", "dialect": "maxtext",
           "file": str((configs / "base.yml").relative_to(root.parent)), "args": []}
    for path in sorted((configs / "models").glob("*.yml")):
        yield {"id": f"maxtext:model_name={path.stem}", "dialect": "maxtext",
               "file": str((configs / "base.yml").relative_to(root.parent)),
               "args": [f"model_name={path.stem}", "run_name=corpus"]}
    for path in sorted((configs / "gpu").rglob("*.yml")):
        yield {"id": f"maxtext:{path.relative_to(root.parent)}", "dialect": "maxtext",
               "file": str(path.relative_to(root.parent)), "args": []}
    for path in sorted(list(root.rglob("*.sh")) + list(root.rglob("*.md"))):
        text = path.read_text(errors="replace")
        env = _shell_vars(text)
        for m in _MAXTEXT_TRAIN.finditer(text):
            line = text[m.end():].split("\n\n")[0]
            line = re.split(r"(?<!\\)\n", line)[0]
            words = _words(line)
            file, args = None, []
            for word in words:
                if word in ("|", "&&", ";", ">", "2>&1", "&"):
                    break
                expanded = _expand(word, env)
                if expanded is None:
                    continue
                if file is None and expanded.endswith(".yml") and "=" not in expanded:
                    file = expanded
                elif "=" in expanded and not expanded.startswith("-"):
                    args.append(expanded)
            where = file or "src/maxtext/configs/base.yml"
            for prefix in ("MaxText/configs/", "maxtext/configs/", "configs/"):
                if where.startswith(prefix):
                    where = "src/maxtext/configs/" + where[len(prefix):]
            where = re.sub(r"^.*src/maxtext/configs/", "src/maxtext/configs/", where)
            if not (root / where).is_file():
                continue
            yield {"id": f"maxtext:{path.relative_to(root.parent)}:{m.start()}",
                   "dialect": "maxtext", "file": f"{root.name}/{where}", "args": args}


def primus_entries(root: pathlib.Path):
    import yaml

    for path in sorted((root / "examples").rglob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and ("modules" in data or "extends" in data):
            yield {"id": f"primus:{path.relative_to(root.parent)}", "dialect": "primus",
                   "file": str(path.relative_to(root.parent)), "args": []}


def pgs_entries(root: pathlib.Path):
    for path in sorted((root / "configs").rglob("*.yaml")):
        yield {"id": f"pgs:{path.relative_to(root.parent)}", "dialect": "pgs",
               "file": str(path.relative_to(root.parent)), "args": []}


SCANNERS = (("primus", primus_entries), ("maxtext", maxtext_entries),
            ("megatron-lm", megatron_lm_entries), ("megatron-lm", megatron_lm_test_entries),
            ("palingenesis", pgs_entries))


def scan(upstream: pathlib.Path) -> list[dict]:
    entries, seen = [], set()
    for name, scanner in SCANNERS:
        if not (upstream / name).is_dir():
            continue
        for entry in scanner(upstream / name):
            key = (entry["file"], tuple(entry["args"]))
            if key not in seen:
                seen.add(key)
                entries.append(entry)
    return entries


def run_entry(entry: dict, upstream: pathlib.Path) -> tuple[str, str]:
    """("load" | "refused" | "crash", message) for one corpus entry."""
    from jaxtrain.config import ConfigError, load_config

    file = str(upstream / entry["file"]) if entry["file"] else None
    try:
        load_config(file, entry["args"], primus_path=str(upstream / "primus"))
        return "load", ""
    except ConfigError as e:
        return "refused", " | ".join(e.problems)
    except Exception as e:  # noqa: BLE001 - the point is to find these
        return "crash", f"{type(e).__name__}: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("scan", "run"))
    ap.add_argument("upstream", type=pathlib.Path)
    ap.add_argument("--manifest", type=pathlib.Path)
    ap.add_argument("--only")
    args = ap.parse_args(argv)
    if args.command == "scan":
        json.dump(scan(args.upstream), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    entries = (json.loads(args.manifest.read_text()) if args.manifest
               else scan(args.upstream))
    counts = collections.Counter()
    for entry in entries:
        if args.only and entry["dialect"] != args.only:
            continue
        outcome, message = run_entry(entry, args.upstream)
        counts[(entry["dialect"], outcome)] += 1
        print(f"{outcome:8s} {entry['id']}  {message[:300]}")
    for (dialect, outcome), n in sorted(counts.items()):
        print(f"# {dialect:12s} {outcome:8s} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
