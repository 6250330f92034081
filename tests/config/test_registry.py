"""The registry covers every documented key, and its statuses and docs are consistent."""
import json
from collections import Counter

import pytest

from tests.conftest import ROOT, run_module
from jaxtrain import knobs as knobs_cli
from jaxtrain.config import ConfigError, load_config, registry
from jaxtrain.config.knob import HONORED, INERT, MAPPED, PLANNED, REJECTED

SEED_KEYS = json.loads((ROOT / "tests" / "data" / "seed_keys.json").read_text())


def test_seed_list_is_complete():
    assert len(SEED_KEYS) == 846
    shared = ROOT.parent / "shared" / "knobs" / "seed_knobs.json"
    if shared.exists():
        assert [r["key"] for r in json.loads(shared.read_text())] == [r["key"] for r in SEED_KEYS]


def test_every_documented_key_resolves():
    missing = [f"{r['doc']}:{r['key']}" for r in SEED_KEYS if registry().lookup(r["key"]) is None]
    assert not missing, missing


def test_every_documented_key_lists_its_document():
    for r in SEED_KEYS:
        match = registry().lookup(r["key"])
        docs = set(match.alias.docs) if match.alias else set(match.knob.sources)
        assert r["doc"] in docs, (r["key"], r["doc"], docs)


def test_statuses_carry_reasons():
    for knob in registry():
        if knob.status in (MAPPED, INERT, REJECTED):
            assert len(knob.reason) > 15, knob.key


def test_templated_keys_resolve_to_instances():
    match = registry().lookup("teachers.big.model")
    assert match.knob.key == "teachers.<name>.model" and match.key == "teachers.big.model"
    assert registry().lookup("teachers.a.b.model") is None


def test_docs_page_is_current():
    page = (ROOT / "docs" / "knobs.md").read_text()
    assert page == knobs_cli.markdown(registry()) + "\n", (
        "docs/knobs.md is stale: python -m jaxtrain.knobs --markdown > docs/knobs.md")


def test_knobs_cli_json_rows():
    result = run_module("jaxtrain.knobs", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == len(registry())
    for field in ("key", "status", "sources", "default", "type", "meaning", "aliases"):
        assert all(field in r for r in rows), field
    filtered = json.loads(run_module("jaxtrain.knobs", "--json", "--doc", "maxtext",
                                     "--status", HONORED).stdout)
    assert filtered and all(r["status"] == HONORED for r in filtered)
    for r in filtered:
        knob = registry().knobs[r["key"]]
        assert "maxtext" in knob.sources + sum((a.docs for a in knob.aliases), ())


def _non_default(knob):
    """A valid value different from the knob's default."""
    if knob.choices:
        return next(c for c in knob.choices if c != knob.default and c is not None)
    first = next((t for t in knob.type.split("|") if type(knob.default).__name__ in (t, "NoneType")),
                 knob.type.split("|")[0])
    base = first.split("[")[0]
    if base == "bool":
        return not knob.default
    if base == "int":
        return (knob.default or 0) + 3
    if base == "float":
        return (knob.default or 0.0) + 0.25
    if base == "list":
        return [2] if first == "list[int]" else ["x"] if first == "list[str]" else [1]
    if base == "dict":
        return {"a": 1}
    return "something-else"


# what a knob needs beside it to be valid at all (the upstream's own checks)
_COMPANIONS = {"defer_embedding_wgrad_compute": ["pipeline_model_parallel_size=2"]}


def _set(key, value):
    text = json.dumps(value) if not isinstance(value, str) else value
    return load_config(None, [*_COMPANIONS.get(key, []), f"{key}={text}"])


@pytest.mark.parametrize("status", [PLANNED, REJECTED])
def test_non_default_values_stop_planned_and_rejected_knobs(status):
    checked = 0
    for knob in registry():
        if knob.status != status or knob.templated:
            continue
        with pytest.raises(ConfigError) as err:
            _set(knob.key, _non_default(knob))
        message = str(err.value)
        expected = f"not implemented yet: {knob.key}" if status == PLANNED else (
            f"{knob.key} is not supported by jaxtrain: {knob.reason}")
        assert expected in message, (knob.key, message)
        checked += 1
    assert checked > 20


def test_templated_knob_errors_name_the_written_key():
    with pytest.raises(ConfigError, match=r"teachers\.big\.device is not supported"):
        load_config(None, ["--teachers.big.device", "cuda:1"])


def test_inert_knobs_warn_and_run():
    inert = [k for k in registry() if k.status == INERT and not k.templated]
    assert inert
    for knob in inert:
        cfg = _set(knob.key, _non_default(knob))
        assert any(knob.key in w and "no effect" in w for w in cfg.warnings), knob.key


def test_default_values_of_planned_knobs_pass():
    cfg = load_config(None, ["lr=2.0e-5", "train_iters=1000", "bf16=true"])
    assert cfg["lr"] == 2e-5 and not cfg.warnings


def test_status_counts_are_reported():
    counts = Counter(k.status for k in registry())
    assert sum(counts.values()) == len(registry()) >= 800
    assert counts[HONORED] >= 10


def _test_sources() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))


def _exercised(name: str, text: str) -> bool:
    """The key appears in some test as written (key=value, "key", a YAML key), or a dotted
    pgs key appears as its section's YAML entry (``section: {key: ...}``)."""
    import re

    if "<name>" in name:   # a templated key, written with some name in its place
        pattern = re.escape(name).replace(re.escape("<name>"), r"[A-Za-z0-9_]+")
        if re.search(r"(?<![A-Za-z0-9_.])" + pattern + r"(?![A-Za-z0-9_])", text):
            return True
        section, leaf = name.split(".")[0], name.split(".")[-1]   # YAML: teachers: {x: {leaf:
        return bool(re.search(rf"\b{re.escape(section)}:.*\b{re.escape(leaf)}:", text))
    if re.search(r"(?<![A-Za-z0-9_.])" + re.escape(name) + r"(?![A-Za-z0-9_])", text):
        return True
    if "." in name:
        section, leaf = name.split(".", 1)
        return bool(re.search(rf"\b{re.escape(section)}:.*\b{re.escape(leaf)}:", text, re.S))
    return False


def test_every_honored_knob_is_exercised_by_a_test():
    """`honored` promises a test that fails if the knob were ignored: at the least, some test
    must name the knob (or one of its aliases)."""
    text = _test_sources()
    missing = [k.key for k in registry() if k.status == HONORED
               and not any(_exercised(n, text) for n in [k.key, *(a.key for a in k.aliases)])]
    assert not missing, f"honored knobs no test names: {missing}"
