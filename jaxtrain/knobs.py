"""Command line: ``python -m jaxtrain.knobs`` lists the knob registry.

Filters: ``--doc megatron|maxtext|pgs-train|pgs-distill``, ``--status S``, ``--area A``,
``--key SUBSTRING``. Output: a text table (default), ``--json`` rows, or ``--markdown`` (the
content of docs/knobs.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from jaxtrain.config.knob import DOCS, ISSUES, STATUSES
from jaxtrain.config.registry import registry


def row(knob) -> dict:
    return {"key": knob.key, "status": knob.status, "sources": list(knob.sources),
            "default": knob.default, "type": knob.type, "meaning": knob.meaning,
            "aliases": [a.key for a in knob.aliases], "reason": knob.reason,
            "choices": list(knob.choices) if knob.choices else None, "area": knob.area,
            "issue": knob.issue, "doc_defaults": dict(knob.doc_defaults),
            "planned_values": {str(v): i for v, i in knob.planned_values.items()},
            "rejected_values": {str(v): r for v, r in knob.rejected_values.items()}}


def select(doc=None, status=None, area=None, key=None):
    for knob in registry():
        docs = set(knob.sources).union(*(a.docs for a in knob.aliases))
        if doc and doc not in docs:
            continue
        if status and knob.status != status:
            continue
        if area and knob.area != area:
            continue
        if key and key not in knob.key and not any(key in a.key for a in knob.aliases):
            continue
        yield knob


def _cell(value) -> str:
    text = "" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(knobs) -> str:
    knobs = list(knobs)
    counts = Counter(k.status for k in knobs)
    out = ["# jaxtrain knobs", "",
           "Generated from the registry by `python -m jaxtrain.knobs --markdown`; do not edit.",
           "", f"{len(knobs)} knobs: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES), "",
           "Statuses: **honored** implemented and tested; **mapped** served by the JAX/XLA "
           "mechanism named; **inert** accepted, cannot matter under XLA (warns); **rejected** "
           "a non-default value is an error; **planned** a non-default value stops with "
           "\"not implemented yet\" until the issue named builds it.", ""]
    areas = {}
    for knob in knobs:
        areas.setdefault(knob.area, []).append(knob)
    for area, group in areas.items():
        out += [f"## {area}", "", "| key | type | default | status | meaning | aliases | from |",
                "|---|---|---|---|---|---|---|"]
        for k in group:
            status = k.status + (f" (#{k.issue})" if k.status == "planned" and k.issue else "")
            meaning = k.meaning + (f" *{k.status}: {k.reason}*" if k.reason else "")
            if k.choices:
                meaning += " Choices: " + ", ".join(f"`{c}`" for c in k.choices) + "."
            if k.planned_values:
                meaning += " Not yet: " + ", ".join(
                    f"`{v}`" + (f" (#{i})" if i else "") for v, i in k.planned_values.items()) + "."
            if k.rejected_values:
                meaning += " Refused: " + "; ".join(
                    f"`{v}`: {why}" for v, why in k.rejected_values.items()) + "."
            aliases = ", ".join(f"`{a.key}`" + (f" ({a.note})" if a.note else "")
                                for a in k.aliases)
            out.append(f"| `{k.key}` | {k.type} | `{_cell(k.default)}` | {status} | "
                       f"{_cell(meaning)} | {aliases} | {', '.join(k.sources)} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtrain.knobs",
                                 description="List jaxtrain's configuration knobs.")
    ap.add_argument("--doc", choices=DOCS)
    ap.add_argument("--status", choices=STATUSES)
    ap.add_argument("--area")
    ap.add_argument("--key", help="substring of a key or alias")
    fmt = ap.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON list of rows")
    fmt.add_argument("--markdown", action="store_true", help="the docs/knobs.md page")
    args = ap.parse_args(argv)
    knobs = list(select(args.doc, args.status, args.area, args.key))
    if args.json:
        json.dump([row(k) for k in knobs], sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif args.markdown:
        sys.stdout.write(markdown(knobs) + "\n")
    else:
        width = max((len(k.key) for k in knobs), default=10)
        for k in knobs:
            issue = f" #{k.issue} {ISSUES[k.issue]}" if k.status == "planned" and k.issue else ""
            print(f"{k.key:<{width}}  {k.status:<8}  {k.meaning}{issue}")
        print(f"\n{len(knobs)} knobs: " + ", ".join(
            f"{n} {s}" for s, n in Counter(k.status for k in knobs).most_common()))
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
