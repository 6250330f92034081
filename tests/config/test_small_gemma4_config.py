"""Gemma 4 small (per-layer inputs, KV sharing) from Megatron-style knobs: what the dry run
refuses by name (exit 2), and the model checks behind it."""
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig

TINY = ["normalization=RMSNorm", "position_embedding_type=rope", "num_layers=4",
        "hidden_size=32", "num_attention_heads=4", "vocab_size=128", "seq_length=16",
        "max_position_embeddings=16", "window_size=[3,0]", "window_attn_skip_freq=2",
        "global_kv_channels=16", "qk_layernorm=true", "hidden_size_per_layer_input=4",
        "num_kv_shared_layers=2", "bf16=false", "mock_data=true", "train_iters=2",
        "global_batch_size=8", "micro_batch_size=1", "lr_warmup_iters=0"]


def model(*args):
    return ModelConfig.from_config(load_config(None, [*TINY, *args]))


def test_knobs_build_the_sharing_layers():
    cfg = model("use_double_wide_mlp=true")
    assert cfg.kv_roles == ("store", "store", "reuse", "reuse")
    assert (cfg.per_layer_input_size, cfg.double_wide_shared_mlp) == (4, True)


@pytest.mark.parametrize("args, match", [
    (["pipeline_model_parallel_size=2", "world_size=2"], "pipeline_model_parallel_size 2 with "
                                                        "hidden_size_per_layer_input"),
    (["context_parallel_size=2", "world_size=2"], "context_parallel_size 2 with"),
    (["num_kv_shared_layers=4"], "num_kv_shared_layers.*at least one"),
    (["num_kv_shared_layers=0", "use_double_wide_mlp=true"], "use_double_wide_mlp"),
    (["window_attn_skip_freq=4"], "global layers, and no earlier layer of that kind"),
])
def test_refused_by_name(args, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        model(*args)


def test_dry_run_refuses_pipelines_with_exit_2(cli):
    code, _, err = cli("--dry-run", *TINY, "pipeline_model_parallel_size=2", "world_size=2")
    assert code == 2 and "pipeline_model_parallel_size" in err and "Traceback" not in err
