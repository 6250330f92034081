"""Bad input of every kind: exit status 2, one readable message naming the key or file."""
import pytest

from tests.conftest import run_module

GOOD = "stderr_sink_level: INFO\n"

# (file name, file text or None for no file, overrides, text the message must contain)
CASES = {
    "typo": ("run.yml", "lerning_rate: 0.1\n", [], "unknown key 'lerning_rate'"),
    "typo suggestion": ("run.yml", "stderr_sink_levle: INFO\n", [], "did you mean stderr_sink_level"),
    "pgs typo": ("sft.yml", "train:\n  learning_rat: 1.0e-5\n", [], "did you mean train.learning_rate"),
    "cli typo": ("run.yml", GOOD, ["hidden_sise=4"], "unknown key 'hidden_sise'"),
    "wrong type int": ("run.yml", GOOD, ["micro_batch_size=abc"], "micro_batch_size (in command line): expected an integer"),
    "wrong type float": ("run.yml", "lr: fast\n", [], "lr (in"),
    "wrong type bool": ("run.yml", GOOD, ["check_for_spiky_loss=maybe"], "expected true or false"),
    "wrong type list": ("run.yml", "recompute_layer_ids: 3\n", [], "expected a list"),
    "bad choice": ("run.yml", GOOD, ["lr_decay_style=cosinus"], "'cosinus' is not one of"),
    "bad level": ("run.yml", "stderr_sink_level: LOUD\n", [], "'LOUD' is not one of: DEBUG"),
    "bad level cli": ("run.yml", GOOD, ["stderr_sink_level=LOUD"], "stderr_sink_level"),
    "fp16 and bf16": ("run.yml", "fp16: true\nbf16: true\n", [], "fp16 and bf16 are exclusive"),
    "min_lr above lr": ("run.yml", "lr: 1.0e-5\nmin_lr: 1.0e-4\n", [], "min_lr (0.0001) must not exceed lr"),
    "heads vs tp": ("run.yml", "num_attention_heads: 6\ntensor_model_parallel_size: 4\n", [],
                    "num_attention_heads (6) must be divisible by tensor_model_parallel_size (4)"),
    "warmup twice": ("run.yml", "lr_warmup_fraction: 0.1\nlr_warmup_iters: 5\n", [],
                     "lr_warmup_fraction excludes"),
    "wsd without length": ("run.yml", "lr_decay_style: WSD\n", [], "WSD needs lr_wsd_decay_iters"),
    "alias conflict": ("run.yml", "train_iters: 100\nsteps: 200\n", [], "train_iters and steps both set"),
    "pgs contradiction": ("sft.yml", "plugins:\n  deft: true\n  dft: true\n", [],
                          "choose one token-weighting objective"),
    "dpo smoothing": ("sft.yml", "dpo:\n  enabled: true\n  label_smoothing: 0.6\n", [],
                      "dpo.label_smoothing (0.6) must be below 0.5"),
    "planned knob": ("run.yml", "num_seq_splits: 2\n", [],
                     "not implemented yet: num_seq_splits"),
    "rejected knob": ("run.yml", "vision_pretraining: true\n", [], "vision_pretraining is not supported"),
    "missing file": ("absent.yml", None, [], "config file not found"),
    "malformed yaml": ("run.yml", "lr: [1, 2\n", [], "not valid YAML at line"),
    "not a mapping": ("run.yml", "- lr\n- 3\n", [], "top level must be a mapping"),
    "missing base": ("run.yml", "base_config: nowhere.yml\n", [], "base_config names 'nowhere.yml'"),
    "base loop": ("loop.yml", "base_config: loop.yml\n", [], "chain loops back"),
    "unset env": ("exp.yml", "exp_name: ${SURELY_UNSET_VAR_42}\n", [], "SURELY_UNSET_VAR_42 is not set"),
    "primus field": ("exp.yml", "modules:\n  pre_trainer:\n    overides: {lr: 1}\n", [],
                     "modules.pre_trainer.overides: unknown module field"),
    "missing preset": ("exp.yml", "modules:\n  pre_trainer:\n    model: llama9_1T.yaml\n", [],
                       "model preset 'llama9_1T.yaml' not found"),
    "teachers not mapping": ("opd.yml", "teachers:\n  big: Qwen/Qwen3-8B\n", [],
                             "teachers.big must be a mapping"),
    "cli not override": ("run.yml", GOOD, ["lr"], "'lr' is not an override"),
    "cli flag needs value": ("run.yml", GOOD, ["--lr"], "--lr needs a value"),
    "planned value": ("run.yml", "optimizer: lion\n", [], "not implemented yet: optimizer"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_with_message(name, write, tmp_path, cli):
    file_name, text, overrides, expected = CASES[name]
    path = write(file_name, text) if text is not None else tmp_path / file_name
    code, out, err = cli(path, "--dry-run", *overrides)
    assert code == 2, (out, err)
    assert expected in err, err
    assert err.startswith("jaxtrain: config error:") and "Traceback" not in err
    assert out == ""


def test_batch_divisibility_needs_world_size(write, cli):
    path = write("run.yml", "global_batch_size: 16\nmicro_batch_size: 2\nmock_data: true\n"
                 "vocab_size: 64\n")
    code, _, err = cli(path, "--dry-run", "--world-size", "3")
    assert code == 2 and "global_batch_size (16) must be divisible by micro_batch_size x " \
                        "data-parallel size (2 x 3)" in err
    code, out, _ = cli(path, "--dry-run", "--world-size", "4")
    assert code == 0 and "# num_microbatches: 2" in out


def test_usage_errors(cli):
    code, _, err = cli()
    assert code == 2 and "give a config file or a command line" in err
    code, _, err = cli("run.yml", "--world-size", "zero")
    assert code == 2 and "--world-size needs a positive integer" in err


def test_many_problems_are_reported_together(write, cli):
    path = write("run.yml", "lerning_rate: 1\nmicro_batch_size: x\nvision_pretraining: true\n")
    code, _, err = cli(path, "--dry-run")
    assert code == 2 and "3 configuration problems" in err
    assert "lerning_rate" in err and "micro_batch_size" in err and "vision_pretraining" in err


def test_real_process_exit_code_and_no_traceback(write):
    path = write("run.yml", "lr: [1, 2\n")
    result = run_module("jaxtrain.train", path, "--dry-run")
    assert result.returncode == 2 and result.stdout == ""
    assert "not valid YAML" in result.stderr and "Traceback" not in result.stderr
