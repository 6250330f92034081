"""Check some area modules on their own: they load, and the given seed sections resolve.

    python tools/check_areas.py AREA [AREA ...] [--sections PREFIX ...]

A section PREFIX matches the start of a seed row's section (e.g. "10.1", "model", "Data").
"""
import argparse
import dataclasses
import importlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from jaxtrain.config.registry import Registry  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("areas", nargs="+")
    ap.add_argument("--sections", nargs="*", default=[])
    args = ap.parse_args()
    knobs = []
    for area in args.areas:
        module = importlib.import_module(f"jaxtrain.config.areas.{area}")
        knobs += [dataclasses.replace(k, area=area) for k in module.KNOBS]
    reg = Registry(knobs)
    rows = json.loads((ROOT / "tests" / "data" / "seed_keys.json").read_text())
    missing = [f"{r['doc']}:{r['key']}" for r in rows
               if any(r["section"].startswith(p) for p in args.sections) and not reg.lookup(r["key"])]
    counts = {}
    for k in reg:
        counts[k.status] = counts.get(k.status, 0) + 1
    print(f"{len(reg)} knobs, statuses {counts}")
    if missing:
        print("MISSING:", " ".join(missing))
        sys.exit(1)
    print("all keys of the given sections resolve")


if __name__ == "__main__":
    main()
