"""Issue 17, item 8: ``--dry-run`` means the run will start.

For every knob of the registry and each typical bad value of its type (negative, zero, the
wrong type, an unknown choice, a path that does not exist), one at a time on a tiny mock-data
config:

(a) the dry run (``load_config`` + ``preflight``, as ``jaxtrain.train._checked`` does) either
    accepts the value or raises one ConfigError whose text names the key (or an alias of it);
    no other exception escapes;
(b) a value the dry run accepts, of an honored or mapped knob, starts a short run on the CPU
    that finishes: no exception, neither the loop's BuildError (an "internal error") nor a
    ConfigError (the dry run should have raised it).

Knobs that act only with a feature on (MoE, multi-latent attention, fp16 loss scaling, FP8)
are tried a second time with their feature on. Part (a) covers the whole registry in seconds.
Part (b) compiles a step per value: the whole of it is marked slow, and the default run takes a
fixed sample. The files a run reads (tokenizer, data files and globs, checkpoints to restore)
are checked by the dry run only where the run reads them (a tokenizer beside mock data is not
read): :func:`test_data_paths_are_named` names a missing one in a config that reads it. A
subprocess test checks the CLI's exit status and stderr for a few representative mistakes,
with and without --dry-run.
"""
from __future__ import annotations

import functools
import re

import pytest

from jaxtrain.config import ConfigError, load_config, registry
from jaxtrain.config.knob import HONORED, MAPPED
from jaxtrain.config.ranges import EXISTING_PATHS, RANGES
from jaxtrain.preflight import preflight, smallest_job
from tests.conftest import run_module, write_hf_model
from tests.data.helpers import write_indexed

# The tiny mock-data run every value is tried on.
BASE = ("mock_data=true", "vocab_size=64", "num_layers=2", "hidden_size=32",
        "num_attention_heads=4", "seq_length=16", "max_position_embeddings=16",
        "micro_batch_size=2", "global_batch_size=4", "train_iters=1", "lr_warmup_iters=0",
        "hardware=cpu", "eval_iters=0", "bf16=false", "exp_name=run")

# area -> what turns its feature on: the area's knobs are tried with it on as well.
FEATURES = {
    "moe": ("num_experts=4", "moe_router_topk=2"),
    "mla": ("multi_latent_attention=true", "kv_lora_rank=16", "qk_head_dim=8",
            "qk_pos_emb_head_dim=8", "v_head_dim=8"),
    "precision": ("fp16=true",),
    "quant": ("fp8=e4m3",),
}

INTERNAL = "internal error"   # how preflight reports an exception that is a bug
MISSING = "<missing>"     # stands for a path that does not exist (see _written)
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
    if "list[int]" in parts or "list[float]" in parts:
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


def cases() -> list[tuple[str, str, object]]:
    """(feature, key, bad value) for every non-templated knob, in registry order; feature ""
    is the plain base config."""
    return [(feature, k.key, v) for k in registry() if not k.templated
            for feature in ("", *([k.area] if k.area in FEATURES else []))
            for v in bad_values(k)]


def _args(feature: str, key: str, value, missing: str) -> list[str]:
    return [*BASE, *FEATURES.get(feature, ()), _written(key, value, missing)]


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
    """(feature, key, value) -> ("accepted", None) | ("refused", message) | ("crash", text)."""
    out = {}
    for feature, key, value in cases():
        try:
            dry_run(_args(feature, key, value, missing))
            out[feature, key, value] = ("accepted", None)
        except ConfigError as e:   # preflight reports its own crashes as internal errors
            out[feature, key, value] = ("crash" if INTERNAL in str(e) else "refused", str(e))
        except Exception as e:  # noqa: BLE001 -- what the test is looking for
            out[feature, key, value] = ("crash", f"{type(e).__name__}: {e}")
    return out


def _shown(feature, key, value) -> str:
    return f"{key}={value!r}" + (f" (with {' '.join(FEATURES[feature])})" if feature else "")


@pytest.fixture(scope="module")
def missing(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("battery") / "no" / "such" / "path")


@pytest.mark.parametrize("feature", ["", *FEATURES])
def test_base_configs_are_accepted(feature):
    dry_run([*BASE, *FEATURES.get(feature, ())])


def test_every_bad_value_is_accepted_or_refused_by_name(missing):
    crashes, unnamed = [], []
    for (feature, key, value), (kind, text) in outcomes(missing).items():
        if kind == "crash":
            crashes.append(f"{_shown(feature, key, value)}: {text}")
        elif kind == "refused" and not named(text, key):
            unnamed.append(f"{_shown(feature, key, value)}: {text[:300]}")
    assert not crashes, "the dry run crashed:\n" + "\n".join(crashes)
    assert not unnamed, "refusals that do not name the key:\n" + "\n".join(unnamed)


def test_range_table_names_known_knobs():
    reg = registry()
    for key, (low, high) in RANGES.items():
        knob = reg.knobs.get(key)
        assert knob is not None, f"RANGES names {key!r}, which is not a knob"
        assert any(p.split("[")[-1].rstrip("]") in ("int", "float")
                   for p in knob.type.split("|")), f"{key}: {knob.type} holds no number"
        assert low is None or high is None or low <= high, key
    for key in EXISTING_PATHS:
        assert key in reg.knobs and "str" in reg.knobs[key].type, key


# --- (b) accepted values start a run --------------------------------------------------------

def accepted(missing) -> list[tuple[str, str, object]]:
    """The (feature, key, value) cases of honored and mapped knobs the dry run accepts."""
    reg = registry()
    return [case for case, (kind, _) in outcomes(missing).items()
            if kind == "accepted" and reg.knobs[case[1]].status in (HONORED, MAPPED)]


def short_run(feature, key, value, tmp_path) -> str | None:
    """Resolve and preflight the base config with ``key`` set to ``value`` and run it for two
    steps (so that per-step intervals are taken past step 1) on one CPU device; None when it
    finished (or the dry run, repeated here, refused it by name), else what went wrong."""
    from jaxtrain import loop
    from jaxtrain.parallel import xla_flags

    args = [*_args(feature, key, value, str(tmp_path / "no" / "such")), "train_iters=2",
            f"workspace={tmp_path}"]
    try:
        cfg = load_config(None, args, world_size=1)
        preflight(cfg, 1)
    except ConfigError as e:   # accepted for the smallest job, refused for one device
        return None if named(str(e), key) and INTERNAL not in str(e) else str(e)
    try:
        platform = xla_flags.platform_kind(cfg)   # what the CLI reads before the backend
        xla_flags.xla_flags(cfg, platform)
        xla_flags.runtime_options(cfg)
        loop.train(cfg)
    except ConfigError as e:   # the dry run should have raised it: the run was to start
        return f"the dry run accepted it, the run refused it: {e}"
    except Exception as e:  # noqa: BLE001 -- what the test is looking for
        return f"{type(e).__name__}: {e}"
    return None


def _sample(items, n=10):
    """n items spread evenly over the list (deterministic)."""
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def _run_failures(cases_, tmp_path_factory):
    failures = []
    for feature, key, value in cases_:
        problem = short_run(feature, key, value, tmp_path_factory.mktemp("run"))
        if problem:
            failures.append(f"{_shown(feature, key, value)}: {problem[:400]}")
    return failures


@pytest.mark.usefixtures("persistent_compilation_cache")   # most values compile the same step
@pytest.mark.slow
def test_accepted_values_start_a_run_sample(missing, tmp_path_factory):
    failures = _run_failures(_sample(accepted(missing)), tmp_path_factory)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.usefixtures("persistent_compilation_cache")
def test_accepted_values_start_a_run(missing, tmp_path_factory):
    failures = _run_failures(accepted(missing), tmp_path_factory)
    assert not failures, "\n".join(failures)


# --- data paths, where the config reads them -----------------------------------------------

TEXT = ("mock_data=false", "tokenizer_type=NullTokenizer")   # (a case may set mock_data back)


@pytest.mark.parametrize("key, extra", [
    ("data_path", ()),
    ("train_data_path", ()),
    ("valid_data_path", ("train_data_path=<train>", "eval_iters=1")),
    ("data_args_path", ()),
    ("per_split_data_args_path", ()),
    ("hf_train_files", ("dataset_type=hf",)),
    ("hf_train_files", ("dataset_type=hf", "hf_train_files=<jsonl_dir>/*.parquet")),
    ("hf_path", ("dataset_type=hf",)),
    ("hf_eval_files", ("dataset_type=hf", "hf_train_files=<jsonl>", "eval_iters=1")),
    ("grain_train_files", ("dataset_type=grain",)),
    ("grain_eval_files", ("dataset_type=grain", "grain_train_files=<jsonl>",
                          "grain_file_type=parquet", "eval_iters=1")),
    ("grain_train_mixture_config_path", ("dataset_type=grain",)),
    ("olmo_index_path", ("dataset_type=olmo_grain",)),
    ("tokenizer_model", ("dataset_type=hf", "hf_train_files=<jsonl>",
                         "tokenizer_type=HuggingFaceTokenizer")),
    ("vocab_file", ("dataset_type=hf", "hf_train_files=<jsonl>",
                    "tokenizer_type=GPT2BPETokenizer")),
    ("merge_file", ("dataset_type=hf", "hf_train_files=<jsonl>",
                    "tokenizer_type=GPT2BPETokenizer", "vocab_file=<jsonl>")),
    ("pretrained_checkpoint", ("mock_data=true",)),
    ("load", ("mock_data=true", "exit_on_missing_checkpoint=true")),
    ("train.resume_from", ("mock_data=true",)),
    ("data.dataset", ()),
    ("data.eval_dataset", ("data.dataset=<jsonl>", "eval_iters=1")),
])
def test_data_paths_are_named(key, extra, tmp_path):
    """A missing input the run would read stops the dry run with its key named."""
    (tmp_path / "docs").mkdir()
    jsonl = tmp_path / "docs" / "train.jsonl"
    jsonl.write_text('{"text": "1 2 3 4"}\n' * 8)
    write_indexed(tmp_path / "train", [[1, 2, 3, 4] * 8] * 4)
    subst = {"<jsonl>": str(jsonl), "<jsonl_dir>": str(tmp_path / "docs"),
             "<train>": str(tmp_path / "train")}
    written = [re.sub("|".join(map(re.escape, subst)), lambda m: subst[m.group(0)], a)
               for a in extra]
    if not any(a.startswith(f"{key}=") for a in written):
        written.append(f"{key}={tmp_path / 'no' / 'such'}")
    with pytest.raises(ConfigError) as info:
        dry_run([*BASE, *TEXT, *written])
    assert named(str(info.value), key) and INTERNAL not in str(info.value), str(info.value)


# --- the command line ---------------------------------------------------------------------

def _flat(args) -> str:
    return "".join(f"{a.split('=', 1)[0]}: {a.split('=', 1)[1]}\n" for a in args)


CLI_CASES = {
    "negative micro batch": ("", ["micro_batch_size=-1"], "micro_batch_size"),
    "batch not divisible": ("", ["global_batch_size=5", "micro_batch_size=2"],
                            "global_batch_size"),
    "mock data without a vocabulary": ("", ["vocab_size=null"], "vocab_size"),
    # two systems' optimizer (LR schedule) knobs in one file, each away from its default
    "two optimizers": ("optimizer: sgd\ntrain:\n  optimizer: muon\n", [], "train.optimizer"),
    "two LR schedules": ("lr_decay_style: linear\ntrain:\n  lr_scheduler: linear\n", [],
                         "train.lr_scheduler"),
}


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", list(CLI_CASES))
@pytest.mark.slow
def test_cli_refuses_with_exit_2_and_the_key(case, dry, tmp_path):
    head, overrides, key = CLI_CASES[case]
    text = head + _flat(a for a in BASE if not head or a != "train_iters=1")
    if head:   # a pgs file: its model is a local Hugging Face folder, its length max_steps
        text = text.replace("train:\n", "train:\n  max_steps: 1\n", 1)
        text += f"model:\n  name_or_path: {write_hf_model(tmp_path / 'hf')}\n"
    path = tmp_path / "run.yml"
    path.write_text(text)
    result = run_module("jaxtrain.train", path, *overrides, f"workspace={tmp_path}",
                        *(["--dry-run"] if dry else []), env={"JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and INTERNAL not in result.stderr, result.stderr
    assert named(result.stderr, key), result.stderr
