"""Layouts that cannot be built stop with exit 2 and a message naming the knobs, before any
device work."""
import pytest

from tests.conftest import run_module

TINY = ["mock_data=true", "vocab_size=128", "seq_length=8", "max_position_embeddings=8",
        "num_layers=1", "hidden_size=32", "num_attention_heads=4", "micro_batch_size=1",
        "global_batch_size=8", "train_iters=1", "lr_warmup_iters=0"]


@pytest.mark.parametrize("world, extra, message", [
    (6, ["tensor_model_parallel_size=4"], "world size 6 is not divisible by tensor x pipeline"),
    (8, ["tensor_model_parallel_size=8"], "num_attention_heads (4) must be divisible by "
                                          "tensor_model_parallel_size (8)"),
    (8, ["tensor_model_parallel_size=4", "group_query_attention=true", "num_query_groups=2",
         "num_attention_heads=8"], None),
    (8, ["tensor_model_parallel_size=2", "group_query_attention=true", "num_query_groups=3",
         "num_attention_heads=6", "hidden_size=36"], "num_query_groups (3) must be a multiple "
                                                     "or a divisor"),
    (8, ["num_distributed_optimizer_instances=3"], "divisible by expert_model_parallel_size "
                                                   "(1) x num_distributed_optimizer_instances "
                                                   "(3)"),
    (8, ["tensor_model_parallel_size=2", "distribute_saved_activations=true"],
     "distribute_saved_activations needs tensor_model_parallel_size > 1, recompute_granularity "
     "full and sequence_parallel off"),
    (8, ["global_batch_size=4"], "global_batch_size (4) must be divisible by micro_batch_size x "
                                 "data-parallel size (1 x 8)"),
])
def test_bad_layouts_fail_in_a_dry_run(cli, write, world, extra, message):
    config = write("c.yml", "mock_data: true\n")
    code, out, err = cli(config, "--dry-run", "--world-size", world, *TINY, *extra)
    if message is None:  # groups a divisor of TP: allowed (KV heads replicated), as Megatron
        assert code == 0, err
        return
    assert code == 2 and message in err and "Traceback" not in err


def test_a_real_run_on_too_few_devices_fails_before_compiling(tmp_path):
    config = tmp_path / "c.yml"
    config.write_text("\n".join(k.replace("=", ": ") for k in TINY) + "\n")
    done = run_module("jaxtrain.train", config, "tensor_model_parallel_size=2",
                      f"workspace={tmp_path}", env={"JAX_PLATFORMS": "cpu",
                                                    "JAX_NUM_CPU_DEVICES": "1"})
    assert done.returncode == 2, done.stderr
    assert "world size 1 is not divisible by tensor x pipeline x context parallel sizes (2)" \
        in done.stderr and "Traceback" not in done.stderr
