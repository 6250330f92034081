"""Each system's files resolve the way that system reads them: Megatron-LM command lines with
Megatron-LM's flags and defaults, Primus experiments with Primus's preset layout, MaxText files
with base.yml and model files where MaxText keeps them."""
import pytest

from jaxtrain.config import ConfigError, load_config

GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--max-position-embeddings", "2048",
             "--attention-backend", "auto", "--micro-batch-size", "1",
             "--global-batch-size", "1536", "--train-iters", "500000", "--weight-decay", "0.1",
             "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
             "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
             "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
             "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
             "--split", "949,50,1", "--log-interval", "100", "--eval-iters", "10"]


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--max-position-embeddings", "128", "--train-iters", "10"]


def megatron_lm(*args, **kw):
    return load_config(None, list(args), enforce_status=False, **kw)


# --- Megatron-LM command lines -----------------------------------------------------------------

def test_bare_megatron_lm_command_line_takes_megatron_lm_defaults():
    cfg = megatron_lm(*GPT3_175B)
    assert cfg.dialect == "megatron-lm"
    # Megatron-LM's own defaults, not Primus's: GeLU MLP with biases, tied embeddings, learned
    # absolute positions, LayerNorm (Primus: SwiGLU, no biases, untied, RoPE, RMSNorm).
    assert cfg["swiglu"] is False and cfg["add_bias_linear"] is True
    assert cfg["untie_embeddings_and_output_weights"] is False
    assert cfg["position_embedding_type"] == "learned_absolute"
    assert cfg["normalization"] == "LayerNorm"
    assert "Megatron-LM arguments.py" in cfg.origin("swiglu")
    assert cfg.origin("num_layers") == "command line (--num-layers)"
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["fp16"]) == (96, 12288, True)
    assert cfg["lr_warmup_fraction"] == 0.001 and cfg["lr_warmup_iters"] == 0
    assert cfg.defaults_about.startswith("Megatron-LM's argparse defaults")


def test_gpt3_flags_load_with_their_pipeline():
    """Megatron-LM's GPT-3 175B example: TP 8 x PP 16 (96 layers, 6 per stage, 1F1B)."""
    from jaxtrain.parallel import stages

    cfg = load_config(None, GPT3_175B, world_size=1024)
    plan = stages.plan(cfg, cfg["num_layers"], cfg.derived["num_microbatches"])
    assert (plan.ranks, plan.chunks, plan.schedule) == (16, 1, "1f1b")
    assert plan.counts == (6,) * 16


def test_negative_and_renamed_flags():
    cfg = megatron_lm(*SMALL, "--disable-bias-linear", "--no-rope-fusion",
                      "--no-masked-softmax-fusion", "--no-position-embedding",
                      "--untie-embeddings-and-output-weights", "--swiglu",
                      "--fp8-format", "hybrid", "--use-mcore-models",
                      "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files")
    assert cfg["add_bias_linear"] is False and cfg["apply_rope_fusion"] is False
    assert cfg["masked_softmax_fusion"] is False and cfg["add_position_embedding"] is False
    assert cfg["untie_embeddings_and_output_weights"] is True and cfg["swiglu"] is True
    assert cfg["fp8"] == "hybrid"
    assert cfg["create_attention_mask_in_dataloader"] is False
    assert cfg["mmap_bin_files"] is False


def test_flags_that_cannot_matter_under_xla_warn_instead_of_failing():
    cfg = load_config(None, [*SMALL, "--no-rope-fusion", "--use-mcore-models",
                             "--no-masked-softmax-fusion"])
    assert any("apply_rope_fusion" in w for w in cfg.warnings)


def test_multi_value_flags_parse():
    cfg = megatron_lm("--data-path", "0.3", "/d/a_text_document", "0.7", "/d/b_text_document",
                      *SMALL)
    assert cfg["data_path"] == ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"]
    assert cfg["num_layers"] == 2
    with pytest.raises(ConfigError, match="--num-layers needs a value"):
        megatron_lm("--num-layers")


def test_megatron_lm_required_arguments():
    with pytest.raises(ConfigError, match="must give --hidden-size, --num-attention-heads, "
                                          "--max-position-embeddings"):
        load_config(None, ["--num-layers", "2"])


def test_megatron_lm_flags_also_work_under_a_config_file(write):
    path = write("run.yml", "num_layers: 4\nadd_bias_linear: true\n")
    cfg = load_config(path, ["--disable-bias-linear"], enforce_status=False)
    assert cfg.dialect == "megatron" and cfg["add_bias_linear"] is False


def test_fp8_param_gather_from_nvidias_llama3_example_is_accepted():
    cfg = load_config(None, [*SMALL, "--fp8-format", "hybrid", "--fp8-param-gather"])
    assert cfg["fp8_param_gather"] is True


# --- Primus ------------------------------------------------------------------------------------

def primus_checkout(write):
    """A small Primus layout: module presets, model presets (extends chains), an experiment."""
    write("primus/primus/configs/modules/module_base.yaml", "trainable: false\n")
    write("primus/primus/configs/modules/megatron/trainer_base.yaml", """
        extends:
          - ../module_base.yaml
        trainable: true
        lr_warmup_iters: 40
        micro_batch_size: 2
        batch_size: null
        lr: 2.5e-4
    """)
    write("primus/primus/configs/modules/megatron/pre_trainer.yaml", """
        extends: [trainer_base.yaml]
        lr: 2.0e-5
        train_iters: 1000
    """)
    write("primus/primus/configs/models/megatron/tiny_base.yaml", """
        normalization: RMSNorm
        swiglu: true
        num_layers: 2
    """)
    write("primus/primus/configs/models/megatron/tiny.yaml", """
        extends:
          - tiny_base.yaml
        hidden_size: 64
        num_attention_heads: 4
    """)
    return write("primus/examples/megatron/configs/MI300X/tiny-pretrain.yaml", """
        work_group: ${PRIMUS_TEAM:amd}
        user_name: root
        exp_name: tiny
        workspace: ./output
        modules:
          pre_trainer:
            framework: megatron
            config: pre_trainer.yaml
            model: tiny.yaml
            overrides:
              train_iters: 200
              lr_decay_iters: null
              dataloader_type: null
    """)


def test_primus_experiment_finds_presets_in_its_checkout(write):
    exp = primus_checkout(write)
    cfg = load_config(exp, enforce_status=False)
    assert cfg.dialect == "primus"
    assert cfg["hidden_size"] == 64 and cfg["normalization"] == "RMSNorm"
    assert "tiny_base.yaml" in cfg.origin("normalization")
    # Module presets are Primus's defaults, not the user's choices.
    assert cfg["lr"] == 2e-5 and not cfg.is_set("lr")
    assert "pre_trainer.yaml" in cfg.origin("lr")
    assert cfg["lr_warmup_iters"] == 40 and cfg["micro_batch_size"] == 2
    assert cfg.origin("micro_batch_size") == "default: Primus module preset trainer_base.yaml"
    assert cfg["train_iters"] == 200 and cfg.is_set("train_iters")
    # null means "unset": the knob keeps its default.
    assert cfg["micro_batch_size"] == 2 and cfg["dataloader_type"] == load_config(
        None)["dataloader_type"]


def test_primus_defaults_yield_to_an_explicit_choice(write):
    exp = primus_checkout(write)
    cfg = load_config(exp, ["lr_warmup_fraction=0.1"], enforce_status=False)
    assert cfg["lr_warmup_fraction"] == 0.1 and cfg["lr_warmup_iters"] == 0


def test_primus_path_points_at_a_checkout_from_anywhere(write, tmp_path, monkeypatch):
    exp = primus_checkout(write)
    elsewhere = write("elsewhere/exp.yaml", (tmp_path / exp).read_text()
                      if not str(exp).startswith("/") else open(exp).read())
    with pytest.raises(ConfigError, match="model preset 'tiny.yaml' not found"):
        load_config(elsewhere, enforce_status=False)
    cfg = load_config(elsewhere, enforce_status=False, primus_path=str(tmp_path / "primus"))
    assert cfg["hidden_size"] == 64
    monkeypatch.setenv("PRIMUS_PATH", str(tmp_path / "primus"))
    assert load_config(elsewhere, enforce_status=False)["hidden_size"] == 64


def test_primus_experiment_extends_another(write):
    primus_checkout(write)
    child = write("primus/examples/megatron/configs/MI300X/child.yaml", """
        extends:
          - tiny-pretrain.yaml
        modules:
          pre_trainer:
            overrides:
              train_iters: 70
    """)
    cfg = load_config(child, enforce_status=False)
    assert cfg["train_iters"] == 70 and cfg["hidden_size"] == 64 and cfg["exp_name"] == "tiny"


@pytest.mark.parametrize("framework, words", [("torchtitan", "TorchTitan"),
                                              ("megatron_bridge", "Megatron-Bridge")])
def test_other_primus_frameworks_are_refused_by_name(write, framework, words):
    path = write("exp.yaml", f"""
        modules:
          pre_trainer:
            framework: {framework}
            config: pre_trainer.yaml
            model: x.yaml
            overrides: {{}}
    """)
    with pytest.raises(ConfigError, match=words):
        load_config(path)


def test_primus_post_training_module_is_refused_by_name(write):
    path = write("exp.yaml", """
        modules:
          post_trainer:
            framework: megatron
            config: sft_trainer.yaml
            model: x.yaml
    """)
    with pytest.raises(ConfigError, match="post_trainer.*planned for a later issue"):
        load_config(path)


# --- MaxText -----------------------------------------------------------------------------------

def maxtext_checkout(write):
    write("maxtext/src/maxtext/configs/base.yml", """
        hardware: tpu
        steps: 150001
        base_emb_dim: 2048
        base_num_query_heads: 16
        base_num_kv_heads: 16
        base_mlp_dim: 7168
        base_num_decoder_layers: 16
        head_dim: 128
        model_name: default
        dataset_type: synthetic
    """)
    write("maxtext/src/maxtext/configs/models/tiny-3.1.yml", """
        base_emb_dim: 256
        base_num_query_heads: 4
        base_num_kv_heads: 2
        base_mlp_dim: 512
        base_num_decoder_layers: 2
        head_dim: 64
        vocab_size: 1000
    """)
    return write("maxtext/src/maxtext/configs/gpu/models/tiny.yml", """
        base_config: base.yml
        hardware: gpu
        model_name: tiny-3.1
        base_emb_dim: 999
    """)


def test_maxtext_file_in_a_checkout_uses_its_base_yml_and_model_file(write):
    path = maxtext_checkout(write)
    cfg = load_config(path, enforce_status=False)
    assert cfg.dialect == "maxtext"
    assert "base.yml" in cfg.origin("train_iters") and cfg["train_iters"] == 150001
    assert not cfg.is_set("train_iters")
    # The model file wins over the file, as in MaxText.
    assert cfg["hidden_size"] == 256 and "tiny-3.1" in cfg.origin("hidden_size")
    assert any("base_emb_dim" in w or "hidden_size" in w for w in cfg.warnings)


def test_a_value_the_command_line_overrides_is_never_judged(write):
    path = write("run.yml", "base_config: base.yml\nhardware: tpu\nsteps: 5\n")
    with pytest.raises(ConfigError, match="hardware"):
        load_config(path)
    assert load_config(path, ["hardware=cpu"])["hardware"] == "cpu"


def test_maxtext_base_yml_defaults_not_primus(write):
    cfg = load_config("base.yml", ["run_name=x"])
    assert cfg["weight_dtype"] == "float32" and cfg["attention"] == "autoselected"
    assert "MaxText base.yml" in cfg.origin("weight_dtype")


def test_llama31_model_name_turns_on_llama31_rope_scaling(write):
    write("models/llama3.1-tiny.yml", "base_num_decoder_layers: 2\nbase_emb_dim: 128\n"
          "base_num_query_heads: 4\nbase_num_kv_heads: 4\nhead_dim: 32\nbase_mlp_dim: 256\n")
    write("models/llama3-tiny.yml", "base_num_decoder_layers: 2\nbase_emb_dim: 128\n"
          "base_num_query_heads: 4\nbase_num_kv_heads: 4\nhead_dim: 32\nbase_mlp_dim: 256\n")
    path = write("run.yml", "base_config: base.yml\nmodel_name: llama3.1-tiny\n")
    assert load_config(path, enforce_status=False)["rope_type"] == "llama3.1"
    path = write("run3.yml", "base_config: base.yml\nmodel_name: llama3-tiny\n")
    assert load_config(path, enforce_status=False)["rope_type"] in (None, "rope")


def test_tensor_sequence_axis_is_tensor_parallelism_with_sequence_sharding():
    cfg = load_config("base.yml", ["ici_fsdp_parallelism=1", "ici_tensor_sequence_parallelism=-1"],
                      world_size=8, enforce_status=False)
    assert cfg["tensor_model_parallel_size"] == 8 and cfg["sequence_parallel"] is True


def test_logical_axis_rules_are_checked_against_jaxtrains_table():
    ok = load_config("base.yml", ["logical_axis_rules=[['norm', 'fsdp']]"], world_size=8,
                     enforce_status=False)
    assert ok["logical_axis_rules"] == [["norm", "fsdp"]]
    with pytest.raises(ConfigError, match=r"logical_axis_rules entry \['embed'"):
        load_config("base.yml", ["logical_axis_rules=[['embed', 'tensor']]",
                                 "ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"],
                    world_size=8, enforce_status=False)


def test_primus_env_is_set_before_jax_starts_and_the_callers_wins(write, monkeypatch):
    from jaxtrain.train import apply_env

    path = write("exp.yaml", """
        env:
          XLA_PYTHON_CLIENT_MEM_FRACTION: ".97"
          JAXTRAIN_TEST_KEPT: "from the file"
        modules:
          pre_trainer:
            framework: megatron
            overrides: {train_iters: 100}
    """)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("JAXTRAIN_TEST_KEPT", "from the caller")
    cfg = load_config(path, enforce_status=False)
    assert apply_env(cfg) == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".97"}
    import os
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".97"
    assert os.environ["JAXTRAIN_TEST_KEPT"] == "from the caller"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")


def test_primus_stage_pretrain_runs_and_other_trainers_are_refused_by_name():
    assert load_config(None, ["stage=pretrain"])["stage"] == "pretrain"
    with pytest.raises(ConfigError, match=r"not implemented yet: stage = 'sft'.*later issue"):
        load_config(None, ["stage=sft"])


def test_mtp_zero_means_off():
    assert load_config(None, ["mtp_num_layers=0"])["mtp_num_layers"] is None
    assert load_config(None, ["mtp_num_layers=1"])["mtp_num_layers"] == 1


def test_learnable_softmax_type_is_sink_attention():
    from jaxtrain.models import ModelConfig

    cfg = load_config(None, [*SMALL, "--softmax-type", "learnable", "--vocab-size", "64",
                             "--position-embedding-type", "rope"])
    assert cfg["softmax_type"] == "learnable" and cfg["use_sink_attention"] is True
    assert ModelConfig.from_config({**cfg}).attention_sinks
    assert not ModelConfig.from_config({**load_config(None, [*SMALL, "--vocab-size", "64"])}
                                       ).attention_sinks


def test_one_listed_cp_comm_type_serves_every_layer():
    """Megatron's default cp_comm_type is ['p2p']: one kind listed is every layer's."""
    from jaxtrain.models import ModelConfig

    cfg = load_config(None, ["num_layers=4", "hidden_size=64", "num_attention_heads=4",
                             "vocab_size=128", "context_parallel_size=2", "cp_comm_type=[a2a]",
                             "attention_dropout=0"], world_size=2)
    assert ModelConfig.from_config(cfg).cp_comm_type == "a2a"
