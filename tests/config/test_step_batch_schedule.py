"""Megatron-LM's step_batch_size_schedule in the dry run: the global batch is the schedule's
last, Megatron's own refusals (with global_batch_size or rampup_batch_size), batches that the
micro-batch x data-parallel size does not divide, and eval_global_batch_size's divisibility."""
import pytest

from jaxtrain.config import ConfigError, load_config

BASE = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=1", "hidden_size=16", "num_attention_heads=2", "micro_batch_size=2",
        "train_samples=100", "lr_warmup_iters=0"]


def test_the_last_batch_is_the_global_batch():
    cfg = load_config(None, [*BASE, "step_batch_size_schedule=0:4 80:8 1K:16"], world_size=2)
    assert cfg["global_batch_size"] == 16 and cfg.derived["num_microbatches"] == 4


@pytest.mark.parametrize("extra, match", [
    (["global_batch_size=8"], "step_batch_size_schedule and global_batch_size"),
    (["rampup_batch_size=4 4 40", "global_batch_size=null"],
     "step_batch_size_schedule and rampup_batch_size"),
    (["decrease_batch_size_if_needed=true"], "decrease_batch_size_if_needed"),
    (["step_batch_size_schedule=0:4 80:6"], r"batch sizes \[6\] are not divisible"),
    (["step_batch_size_schedule=8:4 80:8"], "first threshold must be 0"),
    (["eval_global_batch_size=6"], "eval_global_batch_size .6. must be divisible"),
])
def test_refused_by_name(extra, match):
    args = [*BASE, "step_batch_size_schedule=0:4 80:8", *extra]
    with pytest.raises(ConfigError, match=match):
        load_config(None, args, world_size=2)


def test_a_single_entry_stays_a_schedule():
    """YAML 1.1 reads 8:4 as the base-60 number 484; an override keeps what was written."""
    from jaxtrain.config.files import parse_scalar
    assert parse_scalar("8:4") == "8:4" and parse_scalar("12") == 12
    with pytest.raises(ConfigError, match="first threshold must be 0"):
        load_config(None, [*BASE, "step_batch_size_schedule=8:4"], world_size=2)
    cfg = load_config(None, [*BASE, "step_batch_size_schedule=0:8"], world_size=2)
    assert cfg["global_batch_size"] == 8


def test_megatron_lm_release_test_loads():
    """Megatron-LM's gpt3_15b_8t_release functional test (a step schedule, sample-based, no
    global batch) resolves: its last batch, 1152, is the run's global batch."""
    args = ["--micro-batch-size", "4", "--step-batch-size-schedule", "0:384 200B:768 400B:1152",
            "--train-samples", "19531250", "--seq-length", "4096", "--max-position-embeddings",
            "4096", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--lr-warmup-samples", "3906252", "--lr-decay-samples", "1949218748", "--lr",
            "0.00045", "--mock-data", "--vocab-size", "128"]
    cfg = load_config(None, args, world_size=8)
    assert cfg["global_batch_size"] == 1152 and cfg.derived["num_microbatches"] == 36
