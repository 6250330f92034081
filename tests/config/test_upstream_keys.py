"""Every Megatron-LM argument and every key Primus presets and experiments set is a knob.

The Megatron-LM side reads jaxtrain/config/dialects/megatron_lm_args.json (all argparse dests);
the Primus side reads tests/data/primus_keys.json, written by tools/primus_keys.py from a Primus
checkout, so neither test needs the upstream repositories.
"""
import json

import pytest

from tests.conftest import ROOT
from jaxtrain.config import load_config, registry
from jaxtrain.config.knob import HONORED, INERT, MAPPED, PLANNED, REJECTED, Knob, coerce

ARGS = json.loads((ROOT / "jaxtrain" / "config" / "dialects" / "megatron_lm_args.json")
                  .read_text())["arguments"]
PRIMUS = json.loads((ROOT / "tests" / "data" / "primus_keys.json").read_text())
UPSTREAM_AREAS = ("megatron_lm", "megatron_lm_train", "megatron_lm_infer", "primus",
                  "primus_models")


def test_fixtures_are_the_pinned_ones():
    assert len(ARGS) == 860 and len({a["dest"] for a in ARGS}) == 859   # + ModelOpt's 22
    assert PRIMUS["commit"].startswith("fd1eeabb")
    for group in ("presets", "experiments"):
        names = PRIMUS[group]
        assert names == sorted(set(names)) and all(isinstance(n, str) for n in names)
    assert len(PRIMUS["presets"]) > 700 and len(PRIMUS["experiments"]) > 300


def test_every_megatron_lm_dest_resolves():
    missing = sorted({a["dest"] for a in ARGS if registry().lookup(a["dest"]) is None})
    assert not missing, missing


@pytest.mark.parametrize("group", ["presets", "experiments"])
def test_every_primus_key_resolves(group):
    missing = [k for k in PRIMUS[group] if registry().lookup(k) is None]
    assert not missing, missing


def test_megatron_lm_knobs_take_the_argparse_values():
    """A knob of an upstream area accepts its argparse default and every listed choice."""
    for arg in ARGS:
        match = registry().lookup(arg["dest"])
        knob = match.knob
        if knob.area not in UPSTREAM_AREAS:
            continue
        assert "megatron-lm" in knob.sources, knob.key
        if arg["action"] in ("store_true", "store_false", "boolean_optional"):
            assert knob.type == "bool", knob.key
        if arg.get("nargs") in ("+", "*"):
            assert "list" in knob.type, knob.key
        values = [arg.get("default")] + list(arg.get("choices") or [])
        for value in values:
            if value is None:
                assert knob.allows_none, knob.key
            else:
                coerce(knob, [value] if knob.type.startswith("list") and
                       not isinstance(value, list) else value)


def test_upstream_areas_are_honest():
    """Mapped, inert and rejected knobs say why; planned ones name an open issue or none (an
    honored one carries a test: test_registry.test_every_honored_knob_is_exercised_by_a_test)."""
    knobs = [k for k in registry() if k.area in UPSTREAM_AREAS]
    assert len(knobs) > 500
    for knob in knobs:
        assert knob.status in (PLANNED, HONORED) or len(knob.reason) > 15, knob.key
        assert knob.issue in (None, 19, 20, 21, 22, 23, 24, 25, 26), knob.key
        assert set(knob.sources) <= {"megatron-lm", "primus", "maxtext"}, knob.key
        assert set(knob.sources) & {"megatron-lm", "primus"}, knob.key


def test_aliases_onto_existing_knobs():
    """Renamed Megatron-LM dests and Primus spellings land on the knob of the same setting."""
    expected = {
        "layernorm_epsilon": "norm_epsilon",
        "layernorm_zero_centered_gamma": "apply_layernorm_1p",
        "yarn_original_max_position_embeddings": "original_max_position_embeddings",
        "use_gloo_process_groups": "enable_gloo_process_groups",
        "pytorch_profiler_collect_shapes": "torch_profiler_record_shapes",
        "pytorch_profiler_collect_callstack": "torch_profiler_with_stack",
        "keep_fp8_transpose_cache": "keep_fp8_transpose_cache_when_using_custom_fsdp",
        "torch_fsdp2_reshard_after_forward": "parallel.reshard_after_forward",
        "cuda_graph_scope_deprecated": "cuda_graph_scope",
        "rl_default_temperature": "grpo_default_temperature",
        "rl_default_top_p": "grpo_default_top_p",
        "inference_dynamic_batching_max_requests":
            "inference_dynamic_batching_max_requests_override",
        "inference_dynamic_batching_max_tokens":
            "inference_dynamic_batching_max_tokens_override",
        "hybrid_override_pattern": "hybrid_layer_pattern",
        "num_nextn_predict_layers": "mtp_num_layers",
        "data_parallel_replicate_degree": "num_distributed_optimizer_instances",
        "enable_fused_linear_ce": "memory.chunked_loss",
        "fully_parallel_save": "ckpt_fully_parallel_save",
    }
    for name, canonical in expected.items():
        match = registry().lookup(name)
        assert match is not None and match.knob.key == canonical and match.alias, name


def test_kimi_zero_mtp_depth_means_off():
    alias = registry().lookup("num_nextn_predict_layers").alias
    assert alias.to_canonical(0) is None and alias.to_canonical(2) == 2


def test_upstream_defaults_coerce():
    """Knob construction checks each default; rebuilding the upstream knobs repeats it."""
    for knob in registry():
        if knob.area in UPSTREAM_AREAS:
            fields = {f: getattr(knob, f) for f in Knob.__dataclass_fields__}
            Knob(**fields)
            if knob.default is not None:
                assert coerce(knob, knob.default) == knob.default, knob.key


def test_enable_gpt_oss_sets_gpt_oss_yarn_over_the_command_line():
    """Megatron's --enable-gpt-oss (examples/gptoss/02_train.sh passes it with --rope-type
    rope): its model builder writes gpt-oss's YaRN values over the arguments; jaxtrain does
    the same and names what it replaced."""
    from jaxtrain.models import ModelConfig
    base = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=128",
            "max_position_embeddings=256", "seq_length=64", "position_embedding_type=rope",
            "rope_type=rope", "normalization=RMSNorm"]
    cfg = load_config(None, [*base, "enable_gpt_oss=true"])
    m = ModelConfig.from_config({**cfg})
    assert (m.rope_type, m.yarn_scaling_factor, m.original_max_position_embeddings) == (
        "yarn", 32.0, 131072)
    assert (m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_mscale, m.yarn_mscale_all_dim,
            m.yarn_truncate) == (32.0, 1.0, 1.0, 0.0, False)
    assert any("enable_gpt_oss" in w and "rope_type = 'rope'" in w for w in cfg.warnings)
    assert ModelConfig.from_config({**load_config(None, base)}).rope_type == "rope"
