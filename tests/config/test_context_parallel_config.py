"""Context parallelism from each document's keys: Megatron's context_parallel_size /
cp_comm_type / hierarchical_context_parallel_sizes, MaxText's context mesh axes and
context_parallel_strategy / _load_balance / _reorder_strategy, pgs's parallel.context_parallel
and cp_rotate_method, all onto the one set of canonical knobs the model reads."""
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig

MEGATRON = ["mock_data=true", "vocab_size=128", "seq_length=64", "num_layers=2",
            "hidden_size=64", "num_attention_heads=8", "attention_dropout=0",
            "global_batch_size=16"]


def _maxtext(*extra, world=8):
    return load_config("base.yml", ["max_target_length=64", "attention_dropout=0", *extra],
                       world_size=world)


@pytest.mark.parametrize("strategy, kind", [("all_gather", "allgather"), ("ring", "p2p"),
                                            ("ulysses", "a2a")])
def test_maxtext_context_axis_is_context_parallelism(strategy, kind):
    cfg = _maxtext("ici_context_parallelism=4", f"context_parallel_strategy={strategy}")
    assert cfg["context_parallel_size"] == 4 and cfg["cp_comm_type"] == kind
    assert cfg.derived["data_parallel_size"] == 2
    assert ModelConfig.from_config(cfg).cp_comm_type == kind


def test_maxtext_default_strategy_is_all_gather_and_usp_is_hierarchical():
    assert _maxtext("ici_context_parallelism=2")["cp_comm_type"] == "allgather"
    cfg = _maxtext("ici_context_parallelism=2", "ici_context_usp_ulysses_parallelism=2",
                   "context_parallel_strategy=usp")
    assert cfg["context_parallel_size"] == 4 and cfg["cp_comm_type"] == "a2a+p2p"
    assert cfg["hierarchical_context_parallel_sizes"] == [2, 2]
    assert ModelConfig.from_config(cfg).cp_a2a_size == 2
    with pytest.raises(ConfigError, match="all-to-all axis of context_parallel_strategy usp"):
        _maxtext("ici_context_usp_ulysses_parallelism=2")
    with pytest.raises(ConfigError, match="sequence parallelism of activations"):
        _maxtext("ici_sequence_parallelism=2")


@pytest.mark.parametrize("extra, reorder", [
    ([], "dual_chunk_swap"), (["context_parallel_reorder_strategy=auto"], "dual_chunk_swap"),
    (["context_parallel_reorder_strategy=striped"], "striped"),
    (["context_parallel_load_balance=false"], None)])
def test_maxtext_load_balancing_picks_the_token_order(extra, reorder):
    cfg = _maxtext("ici_context_parallelism=2", *extra)
    assert ModelConfig.from_config(cfg).cp_reorder == reorder


@pytest.mark.parametrize("world, method, cp, kind", [
    (8, "allgather", 8, "allgather"), (16, "alltoall", 8, "p2p"), (12, "allgather", 12,
                                                                    "allgather"),
    (4, "all_to_all", 4, "p2p"), (1, "allgather", 1, "p2p")])
def test_pgs_context_parallel_spans_up_to_eight_devices(world, method, cp, kind):
    """pgs: min(world, 8) devices (all of them when 8 does not divide the world); allgather
    gathers K/V, alltoall passes them round a ring; one device has no CP."""
    cfg = load_config(None, [*MEGATRON, "seq_length=96", "packing=false",
                             "parallel.context_parallel=true",
                             f"parallel.cp_rotate_method={method}"], world_size=world)
    assert cfg["context_parallel_size"] == cp and cfg["cp_comm_type"] == kind


def test_pgs_context_parallel_refusals():
    with pytest.raises(ConfigError, match="packing and parallel.context_parallel"):
        load_config(None, [*MEGATRON, "parallel.context_parallel=true", "packing=true"],
                    world_size=8)
    with pytest.raises(ConfigError, match="implies context_parallel_size = 8"):
        load_config(None, [*MEGATRON, "packing=false", "parallel.context_parallel=true",
                           "context_parallel_size=2"], world_size=8)


def test_megatron_hierarchical_sizes_and_per_layer_kinds_reach_the_model():
    cfg = load_config(None, [*MEGATRON, "context_parallel_size=4", "cp_comm_type=a2a+p2p",
                             "hierarchical_context_parallel_sizes=[2,2]"], world_size=8)
    model = ModelConfig.from_config(cfg)
    assert (model.cp_comm_type, model.cp_a2a_size) == ("a2a+p2p", 2)
    cfg = load_config(None, [*MEGATRON, "context_parallel_size=2",
                             "cp_comm_type=[p2p,all_gather]"], world_size=8)
    assert ModelConfig.from_config(cfg).cp_comm_type == ("p2p", "allgather")
    same = load_config(None, [*MEGATRON, "context_parallel_size=2", "cp_comm_type=[a2a,a2a]"],
                       world_size=8)
    assert ModelConfig.from_config(same).cp_comm_type == "a2a"
