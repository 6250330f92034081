"""Copy the documented key list from ../shared/knobs/seed_knobs.json into tests/data/.

The tests read tests/data/seed_keys.json so that a clone without ../shared still checks that
every documented key resolves. Run this when the shared list changes.
"""
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT.parent / "shared" / "knobs" / "seed_knobs.json"
TARGET = ROOT / "tests" / "data" / "seed_keys.json"


def main():
    rows = json.loads(SOURCE.read_text())
    keep = [{k: r[k] for k in ("doc", "section", "key", "default")} for r in rows]
    TARGET.write_text(json.dumps(keep, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(keep)} keys to {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
