"""MaxText's own configs/base.yml loads: each of its keys (pinned in
jaxtrain/config/dialects/maxtext_base.json) is a knob in MaxText files, and MaxText files default
to base.yml's values."""
import json
import pathlib

import pytest

from tests.conftest import ROOT
from jaxtrain.config import registry
from jaxtrain.config.knob import HONORED, CoerceError, coerce

BASE = json.loads((ROOT / "jaxtrain" / "config" / "dialects" / "maxtext_base.json")
                  .read_text())["values"]
MAXTEXT_AREAS = ("maxtext_model", "maxtext_train", "maxtext_runtime", "maxtext_serving")

# base.yml names that are Megatron-LM/Primus arguments as well; the areas of those documents
# register them (megatron_lm, primus).
SHARED = ("chat_template", "compress_ratios", "mrope_section", "mtp_loss_scaling_factor",
          "mtp_num_layers", "o_groups", "o_lora_rank", "qk_clip_threshold")

# Knobs declared before base.yml was pinned whose default in MaxText files is not base.yml's
# value. Left for the dialect's owner to decide; a new difference fails the test.
KNOWN_DIFFERENCES = {
    # the same meaning, another spelling of "unset" (a rule or the knob reads both alike)
    "num_experts": "1 (dense) vs null",
    "sliding_window_size": "0 vs null (no window either way)",
    "eval_interval": "-1 vs null (no periodic evaluation; rules.maxtext converts)",
    "gradient_accumulation_steps": "1 vs null (derived from the batch)",
    # other values
    "override_model_config": "base.yml false, jaxtrain true",
    "weight_dtype": "base.yml float32, jaxtrain bfloat16",
    "attention": "base.yml autoselected, jaxtrain cudnn_flash_te (both auto here)",
    "hardware": "base.yml tpu (not offered), jaxtrain gpu",
    "mesh_axes": "base.yml's axis list, jaxtrain null (the knob is rejected)",
    "logical_axis_rules": "base.yml's table, jaxtrain null (the knob is rejected)",
    "dataset_type": "base.yml tfds (refused), jaxtrain hf",
    "hf_path": "base.yml empty, jaxtrain allenai/c4",
    "hf_data_dir": "base.yml empty, jaxtrain en",
    "profiler": "base.yml empty (off), jaxtrain xplane",
    "skip_first_n_steps_for_profiler": "base.yml 1, jaxtrain 3",
    "profiler_steps": "base.yml 5, jaxtrain 1",
    "muon_weight_decay": "base.yml 0, Primus's knob 0.01",
    "max_position_embeddings": "base.yml 163840, jaxtrain null",
    "original_max_position_embeddings": "base.yml 4096, jaxtrain null",
    "shardy": "base.yml true, jaxtrain false",
    # MaxText spellings of existing knobs whose MaxText default is the knob's own
    "wandb_project_name": "base.yml maxtext, wandb_project null",
    "matmul_precision": "base.yml default (medium), memory.float32_matmul_precision high",
    "num_vocab_tiling": "base.yml 1, memory.loss_num_chunks 8",
    "jax_distributed_initialization_timeout": "base.yml 300 s (5 min), "
                                              "distributed_timeout_minutes 60",
}


def _own(key):
    return key not in SHARED


def test_base_file_is_the_pinned_one():
    assert len(BASE) == 696


def test_every_base_key_is_a_knob_in_maxtext_files():
    missing = [k for k in BASE if _own(k) and registry().lookup(k, "maxtext") is None]
    assert not missing, missing


@pytest.mark.parametrize("key", SHARED)
def test_keys_shared_with_megatron_lm_resolve(key):
    if registry().lookup(key, "maxtext") is None:
        pytest.skip(f"{key} is registered by the Megatron-LM/Primus areas (not there yet)")


def _default_problem(key):
    """None when MaxText files default the key's knob to base.yml's value, else a description."""
    match = registry().lookup(key, "maxtext")
    knob, value = match.knob, BASE[key]
    try:
        if match.alias is not None and match.alias.to_canonical and value is not None:
            value = match.alias.to_canonical(value)
        wanted = coerce(knob, value)
    except CoerceError as e:
        return f"base.yml value {BASE[key]!r} does not fit {knob.key}: {e}"
    default = knob.default_for("maxtext")
    default = None if default is None else coerce(knob, default)
    if wanted != default:
        return f"{knob.key} defaults to {default!r} in MaxText files, base.yml has {wanted!r}"
    return None


def test_maxtext_files_default_to_base_yml():
    problems = {k: p for k in BASE if _own(k) and (p := _default_problem(k))}
    new = {k: p for k, p in problems.items() if k not in KNOWN_DIFFERENCES}
    assert not new, new


def test_new_maxtext_knobs_take_base_yml_defaults_exactly():
    for key in filter(_own, BASE):
        match = registry().lookup(key, "maxtext")
        if match.knob.area in MAXTEXT_AREAS:
            assert key not in KNOWN_DIFFERENCES and _default_problem(key) is None, key


def test_maxtext_areas_declare_maxtext_knobs_and_honor_only_tested_ones():
    """A MaxText key is honored only with a test that names it."""
    tested = "".join(p.read_text() for p in pathlib.Path(__file__).parents[1].rglob("*.py"))
    for knob in registry():
        if knob.area in MAXTEXT_AREAS:
            assert knob.sources == ("maxtext",), knob.key
            assert knob.status != HONORED or knob.key in tested, knob.key


@pytest.mark.parametrize("name, maxtext_knob, other_knob", [
    ("data_sharding", "data_sharding_axes", "data_sharding"),
    ("mscale", "yarn_softmax_mscale", "mscale"),
])
def test_names_with_another_meaning_in_maxtext_files(name, maxtext_knob, other_knob):
    assert registry().lookup(name, "maxtext").knob.key == maxtext_knob
    assert registry().lookup(name).knob.key == other_knob
    assert registry().lookup(name, "megatron").knob.key == other_knob
