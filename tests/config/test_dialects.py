"""The four ways to write a config resolve to one result, with the documented precedence."""
import pytest

from jaxtrain.config import ConfigError, load_config
from tests.conftest import write_hf_model


def resolved(path=None, *overrides, world_size=None):
    """Resolution without the planned-knob gate: these tests exercise merging, not status."""
    return load_config(path, overrides, world_size=world_size, enforce_status=False)


def test_flat_maxtext_file_with_base_config_chain(write):
    write("bases/common.yml", """
        base_config: base.yml
        steps: 50
        log_period: 5
        stderr_sink_level: WARNING
    """)
    cfg_path = write("run.yml", """
        base_config: bases/common.yml
        steps: 200
        remat_policy: minimal
    """)
    cfg = resolved(cfg_path)
    assert cfg["train_iters"] == 200 and cfg.origin("train_iters") == str(cfg_path)
    assert cfg["log_interval"] == 5 and "common.yml" in cfg.origin("log_interval")
    assert cfg["remat_policy"] == "minimal" and cfg["stderr_sink_level"] == "WARNING"


def test_primus_megatron_experiment(write, monkeypatch):
    monkeypatch.setenv("EXP_NAME", "llama-test")
    write("my_model.yaml", """
        bases: [my_base.yaml]
        hidden_size: 256
        num_attention_heads: 8
    """)
    write("my_base.yaml", """
        num_layers: 4
        hidden_size: 128
        normalization: RMSNorm
    """)
    path = write("exp.yaml", """
        work_group: ${TEAM:amd}
        user_name: ${USER_UNSET_FOR_TEST:root}
        exp_name: ${EXP_NAME:exp_pretrain}
        workspace: ./output
        modules:
          pre_trainer:
            framework: megatron
            config: pre_trainer.yaml
            model: my_model.yaml
            overrides:
              global_batch_size: 64
              train_iters: 200
              lr: 3.0e-4
        models:
          pre_train:
            overrides:
              num_layers: 6
    """)
    cfg = resolved(path)
    assert cfg["exp_name"] == "llama-test" and cfg["work_group"] == "amd"
    assert cfg["user_name"] == "root"
    assert cfg["hidden_size"] == 256 and cfg["normalization"] == "RMSNorm"
    assert cfg["num_layers"] == 6 and "models.pre_train.overrides" in cfg.origin("num_layers")
    assert cfg["lr"] == 3e-4 and cfg["global_batch_size"] == 64
    assert cfg["kv_channels"] == 32 and cfg.origin("kv_channels") == "derived"
    assert cfg.dialect == "primus"
    # Primus's loader reads only 'extends' now; a preset chained with 'bases' is followed,
    # and the run says where it parts from Primus's
    said = [w for w in cfg.warnings if "my_model.yaml chains its presets with 'bases'" in w]
    assert len(said) == 1 and "Megatron's defaults" in said[0]


def test_primus_maxtext_framework_uses_maxtext_defaults(write):
    path = write("exp.yaml", """
        modules:
          pre_trainer:
            framework: maxtext
            overrides:
              steps: 30
    """)
    cfg = resolved(path)
    assert cfg.dialect == "maxtext" and cfg["log_interval"] == 100 and cfg["train_iters"] == 30
    assert resolved(None)["log_interval"] == 1


def test_pgs_sectioned_file_with_dashed_override(write):
    path = write("sft.yaml", """
        model:
          name_or_path: null
        train:
          epochs: 3
          max_steps: -1
        data:
          max_seq_length: 2048
          packing: true
    """)
    cfg = resolved(path, "--train.learning_rate", "1e-5")
    assert cfg.dialect == "pgs-train"
    assert cfg["lr"] == 1e-5 and cfg.origin("lr") == "command line"
    assert cfg["seq_length"] == 2048 and cfg["packing"] is True
    assert cfg["train_iters"] is None and cfg["train.epochs"] == 3
    assert cfg["seed"] == 42 and cfg["micro_batch_size"] == 1
    assert cfg["min_lr"] == 2e-6 and cfg["lr_warmup_fraction"] == 0.05
    assert resolved(path)["lr"] == 2e-5


def test_pgs_distill_file_named_sections(write, tmp_path, monkeypatch):
    # a tiny stand-in for the student in the local Hugging Face cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    write_hf_model(tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc")
    path = write("opd.yaml", """
        model:
          student: Qwen/Qwen3-0.6B
        teachers:
          big: {model: Qwen/Qwen3-8B, backend: hf}
        sources:
          math: {path: prompts.jsonl, weight: 2.0}
        train:
          steps: 100
    """)
    cfg = resolved(path, "--teachers.big.offload", "true")
    assert cfg.dialect == "pgs-distill"
    assert cfg["model.name_or_path"] == "Qwen/Qwen3-0.6B"
    assert cfg["teachers.big.model"] == "Qwen/Qwen3-8B" and cfg["teachers.big.offload"] is True
    assert cfg["sources.math.weight"] == 2.0 and cfg["train_iters"] == 100
    assert cfg["lr"] == 1e-6


def test_command_line_forms(write):
    path = write("run.yml", "lr: 1.0e-4\n")
    cfg = resolved(path, "train_iters=7", "lr_warmup_iters=0", "--seed", "9", "--micro-batch-size=3", "--bf16",
                   "--train.weight_decay", "0.2")
    assert (cfg["train_iters"], cfg["seed"], cfg["micro_batch_size"]) == (7, 9, 3)
    assert cfg["bf16"] is True and cfg["weight_decay"] == 0.2


def test_precedence_default_preset_base_file_cli(write):
    """A Megatron file: registry defaults < model preset < base config < file < command line."""
    write("models/p.yaml", "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n")
    write("common.yml", "num_layers: 3\nhidden_size: 96\n")
    path = write("run.yml", "base_config: common.yml\nmodel_name: p\nnum_layers: 5\n")
    cfg = resolved(path, "num_layers=6")
    assert cfg.dialect == "megatron"
    assert cfg["num_attention_heads"] == 4 and "model_name p" in cfg.origin("num_attention_heads")
    assert cfg["hidden_size"] == 96 and cfg["num_layers"] == 6
    assert resolved(path)["num_layers"] == 5
    assert resolved(None)["num_layers"] == 24


def test_maxtext_precedence_puts_the_model_file_over_the_files(write):
    """MaxText: base.yml < the config chain < models/<model_name>.yml < the command line."""
    write("models/p.yml", "base_num_decoder_layers: 2\nbase_emb_dim: 64\n"
          "base_num_query_heads: 4\nbase_num_kv_heads: 4\n")
    write("base.yml", "base_num_decoder_layers: 3\nbase_emb_dim: 96\nsteps: 9\n")
    path = write("run.yml", "base_config: base.yml\nmodel_name: p\n"
                            "base_num_decoder_layers: 5\nsteps: 7\n")
    cfg = resolved(path, "base_num_decoder_layers=6")
    assert cfg.dialect == "maxtext"
    assert cfg["num_layers"] == 6 and cfg["hidden_size"] == 64
    assert cfg["train_iters"] == 7 and cfg.origin("train_iters") == str(path)
    assert cfg.origin("train_iters") != "default" and "base.yml" in resolved(
        write("bare.yml", "base_config: base.yml\n")).origin("train_iters")
    quiet = resolved(path)
    assert quiet["num_layers"] == 2 and "model_name p" in quiet.origin("num_layers")


def test_aliases_agreeing_in_one_file_are_fine(write):
    path = write("run.yml", "train_iters: 100\nsteps: 100\n")
    assert resolved(path)["train_iters"] == 100


def test_alias_conflict_in_one_file_is_an_error(write):
    path = write("run.yml", "train_iters: 10\nsteps: 20\n")
    with pytest.raises(ConfigError, match="train_iters and steps both set"):
        resolved(path)


def test_alias_on_command_line_overrides_file(write):
    path = write("run.yml", "lr: 1.0e-4\n")
    assert resolved(path, "--train.learning_rate", "1e-5")["lr"] == 1e-5


def test_override_model_config_false_forbids_clashes(write):
    write("p.yaml", "num_layers: 2\n")
    path = write("run.yml", "model_name: p\noverride_model_config: false\nnum_layers: 4\n")
    with pytest.raises(ConfigError, match="num_layers is set by the model preset"):
        resolved(path)
    path = write("ok.yml", "model_name: p\noverride_model_config: true\nnum_layers: 4\n")
    assert resolved(path)["num_layers"] == 4


def test_model_presets_by_name_are_normalised():
    assert resolved(None, "model_name=llama3-8b")["num_query_groups"] == 8


def test_derived_values_and_quiet_adjustments():
    cfg = resolved(None, "hidden_size=512", "num_attention_heads=8", "swiglu=true")
    assert cfg["kv_channels"] == 64 and cfg["ffn_hidden_size"] == int(4 * 512 * 2 / 3 / 64) * 64
    assert cfg["sequence_parallel"] is False and cfg.origin("sequence_parallel") == "derived"
    cfg = resolved(None, "fp16=true")
    assert cfg["fp16"] and not cfg["bf16"]
    cfg = resolved(None, "train_samples=1000")
    assert cfg["train_iters"] is None
    cfg = resolved(None, "lr_warmup_fraction=0.1")
    assert cfg["lr_warmup_iters"] == 0


def test_batch_arithmetic_for_a_world_size():
    cfg = resolved(None, "global_batch_size=64", "micro_batch_size=4",
                   "tensor_model_parallel_size=2", world_size=8)
    assert cfg.derived["data_parallel_size"] == 4 and cfg.derived["num_microbatches"] == 4
    cfg = resolved(None, "global_batch_size=30", "micro_batch_size=4",
                   "decrease_batch_size_if_needed=true", world_size=2)
    assert cfg["global_batch_size"] == 24
    cfg = resolved(None, "--train.per_device_batch_size", "2", "--train.gradient_accumulation_steps",
                   "4", "global_batch_size=null", world_size=4)
    assert cfg["global_batch_size"] == 32 and cfg.derived["num_microbatches"] == 4


def test_config_is_immutable():
    cfg = resolved(None)
    with pytest.raises(TypeError):
        cfg["lr"] = 1.0
