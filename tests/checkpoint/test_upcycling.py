"""moe_use_upcycling (Megatron): a dense checkpoint becomes the MoE model's starting point at
iteration 0 with a fresh optimizer; upcycling preserves the function (equal first-step loss);
the refusals are configuration errors (exit 2)."""
import pytest
from test_checkpoint import TINY, compilation_cache, losses, steps_in  # noqa: F401

from jaxtrain import loop
from jaxtrain.config import ConfigError, load_config

# Every run has the same schedule, so runs of one model share their compiled programs.
BASE = [*TINY, "hidden_dropout=0", "seed=3", "lr=0.05", "train_iters=2"]
MOE = ["num_experts=4", "moe_router_topk=2"]   # softmax over the top 2: weights sum to 1


def train(directory, *args):
    loop.train(load_config(None, [*BASE, f"save={directory}", *args], world_size=1))
    return losses(directory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A dense model trained 2 steps and saved."""
    directory = tmp_path_factory.mktemp("dense")
    train(directory)
    return directory


@pytest.mark.slow
def test_upcycled_moe_starts_where_the_dense_model_is(dense, tmp_path):
    # the dense model's loss on the first batch from its trained weights (a pretrained start)
    ref = train(tmp_path / "ref", f"load={dense}", "finetune=true")[1]
    up = train(tmp_path / "up", *MOE, "moe_use_upcycling=true", f"load={dense}")
    assert abs(up[1] - ref) < 1e-5, (up[1], ref)
    assert steps_in(tmp_path / "up") == ["step_0", "step_2"]   # the converted model first
    scratch = train(tmp_path / "off", *MOE)[1]                 # knob off: the MoE's own init
    assert abs(scratch - ref) > 1e-3, (scratch, ref)
    # upcycling is for the first start only: the MoE run's own checkpoints are refused
    with pytest.raises(ConfigError, match="already holds checkpoints.*remove moe_use_upcycling"):
        train(tmp_path / "up", *MOE, "moe_use_upcycling=true", f"load={dense}")


def test_refusals(tmp_path, cli, write):
    (tmp_path / "empty").mkdir()
    config = write("c.yml", "".join(a.replace("=", ": ", 1) + "\n" for a in [*BASE, *MOE]))
    code, _, err = cli(config, "moe_use_upcycling=true", f"load={tmp_path / 'empty'}",
                       f"save={tmp_path / 'a'}")
    assert code == 2 and "no dense checkpoint to convert in load" in err, err
    for args, message in ((["moe_use_upcycling=true", f"load={tmp_path}"], "set num_experts"),
                          ([*MOE, "moe_layer_freq=[0]*2", "moe_use_upcycling=true",
                            f"load={tmp_path}"], "makes no layer an MoE layer"),
                          ([*MOE, "moe_use_upcycling=true"], r"from load \(or pretrained")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*BASE, *args], world_size=1)
