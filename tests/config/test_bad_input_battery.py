"""Issue 17, item 8: ``--dry-run`` means the run will start.

For every knob of the registry and each typical bad value of its type (negative, zero, the
wrong type, an unknown choice, a path that does not exist), one at a time on a tiny mock-data
config:

(a) the dry run (``load_config`` + ``preflight``, as ``jaxtrain.train._checked`` does) either
    accepts the value or raises one ConfigError whose text names the key (or an alias of it);
    no other exception escapes;
(b) a value the dry run accepts, of an honored or mapped knob, starts a one-step run on the CPU
    that finishes or stops with a ConfigError naming the key: never a traceback, never the
    loop's BuildError ("internal error").

Part (a) covers the whole registry in seconds. Part (b) compiles a step per value: the whole of
it is marked slow; the default run takes a fixed sample. A subprocess test checks the exit
status and stderr of the CLI for a few representative mistakes, with and without --dry-run.
"""
from __future__ import annotations

import functools
import re

import pytest

from jaxtrain.config import ConfigError, load_config, registry
from jaxtrain.config.knob import HONORED, MAPPED
from jaxtrain.config.ranges import EXISTING_PATHS
from jaxtrain.preflight import preflight, smallest_job

# The tiny mock-data run every value is tried on.
BASE = ("mock_data=true", "vocab_size=64", "num_layers=2", "hidden_size=32",
        "num_attention_heads=4", "seq_length=16", "max_position_embeddings=16",
        "micro_batch_size=2", "global_batch_size=4", "train_iters=1", "lr_warmup_iters=0",
        "hardware=cpu", "eval_iters=0", "bf16=false", "exp_name=run")

MISSING = "<missing>"     # replaced by a path that does not exist (see _written)
_PATHLIKE = re.compile(r"path|dir|file|model|tokenizer|prefix|load")


def bad_values(knob) -> list:
    """Typical mistakes for the knob's type: negative and zero numbers, a value of the wrong
    type, an unknown choice, a path that does not exist."""
    parts = knob.type.split("|")
    bases = {p.split("[")[0] for p in parts}
    values: list = []
    if "int" in bases:
        values += [-1, 0]
    elif "float" in bases:
        values += [-1.0, 0.0]
    for part in parts:
        if part in ("list[int]", "list[float]"):
            values.append("[-1]")
    if not bases & {"str", "any"}:
        values.append("maybe" if bases == {"bool"} else "abc")
    elif bases == {"str"}:
        values.append("[1, 2]")
    if knob.choices and bases & {"str", "list"}:
        values.append("no_such_choice_xyz")
    if bases & {"str", "list"} and (knob.key in EXISTING_PATHS or _PATHLIKE.search(knob.key)):
        values.append(MISSING)
    return values


def cases() -> list[tuple[str, object]]:
    """(key, bad value) for every non-templated knob, in registry order."""
    return [(k.key, v) for k in registry() if not k.templated for v in bad_values(k)]


def _written(key, value, missing: str) -> str:
    return f"{key}={missing if value == MISSING else value}"


def names(key: str) -> tuple[str, ...]:
    """The spellings a message may use for the knob: its key and its aliases."""
    knob = registry().knobs[key]
    return (knob.key, *(a.key for a in knob.aliases))


def named(text: str, key: str) -> bool:
    """Whether ``text`` names the knob as a whole word (``seed`` is not named by data.seed)."""
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", text) for n in names(key))


def dry_run(args):
    """What ``jaxtrain.train._checked`` does for a dry run; returns the config."""
    cfg = load_config(None, args)
    world = smallest_job(cfg)
    cfg = load_config(None, args, world_size=world)
    preflight(cfg, world)
    return cfg


@functools.lru_cache(maxsize=None)
def outcomes(missing: str) -> dict:
    """(key, value) -> ("accepted", None) | ("refused", message) | ("crash", description)."""
    out = {}
    for key, value in cases():
        try:
            dry_run([*BASE, _written(key, value, missing)])
            out[key, value] = ("accepted", None)
        except ConfigError as e:
            out[key, value] = ("refused", str(e))
        except Exception as e:  # noqa: BLE001 -- what the test is looking for
            out[key, value] = ("crash", f"{type(e).__name__}: {e}")
    return out


@pytest.fixture(scope="module")
def missing(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("battery") / "no" / "such" / "path")


def test_base_config_is_accepted():
    dry_run(list(BASE))


def test_every_bad_value_is_accepted_or_refused_by_name(missing):
    crashes, unnamed = [], []
    for (key, value), (kind, text) in outcomes(missing).items():
        if kind == "crash":
            crashes.append(f"{key}={value!r}: {text}")
        elif kind == "refused" and not named(text, key):
            unnamed.append(f"{key}={value!r}: {text[:300]}")
    assert not crashes, "the dry run crashed:\n" + "\n".join(crashes)
    assert not unnamed, "refusals that do not name the key:\n" + "\n".join(unnamed)


def accepted(missing) -> list[tuple[str, object]]:
    """The (key, value) pairs of honored and mapped knobs the dry run accepts."""
    reg = registry()
    return [(key, value) for (key, value), (kind, _) in outcomes(missing).items()
            if kind == "accepted" and reg.knobs[key].status in (HONORED, MAPPED)]


def one_step(key, value, tmp_path) -> str | None:
    """Resolve, preflight and run one step of the base config with ``key`` set to ``value``;
    None when it finished or a ConfigError named the key, else what went wrong."""
    from jaxtrain import loop
    from jaxtrain.parallel import xla_flags

    args = [*BASE, f"workspace={tmp_path}", _written(key, value, str(tmp_path / "no/such"))]
    try:
        cfg = load_config(None, args, world_size=1)
        preflight(cfg, 1)
        platform = xla_flags.platform_kind(cfg)   # what the CLI computes before the backend
        xla_flags.xla_flags(cfg, platform)
        xla_flags.runtime_options(cfg)
        loop.train(cfg)
    except ConfigError as e:
        return None if named(str(e), key) else f"refused without naming it: {e}"
    except Exception as e:  # noqa: BLE001 -- what the test is looking for
        return f"{type(e).__name__}: {e}"
    return None


def _sample(pairs, n=10):
    """n pairs spread evenly over the list (deterministic)."""
    if len(pairs) <= n:
        return pairs
    return [pairs[i * len(pairs) // n] for i in range(n)]


def _one_step_failures(pairs, tmp_path_factory):
    failures = []
    for key, value in pairs:
        problem = one_step(key, value, tmp_path_factory.mktemp("run"))
        if problem:
            failures.append(f"{key}={value!r}: {problem[:400]}")
    return failures


def test_accepted_values_start_a_one_step_run_sample(missing, tmp_path_factory):
    failures = _one_step_failures(_sample(accepted(missing)), tmp_path_factory)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_accepted_values_start_a_one_step_run(missing, tmp_path_factory):
    failures = _one_step_failures(accepted(missing), tmp_path_factory)
    assert not failures, "\n".join(failures)
