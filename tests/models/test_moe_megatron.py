"""The MoE router side by side with Megatron's own ``TopKRouter`` (megatron-core): the same
logits in, the same routing probabilities, expert choice and balancing-loss values out
(megatron/core/transformer/moe/router.py). Skips when megatron.core cannot be imported."""
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import moe as M
from tests.megatron_ref import process_group_fixture  # noqa: F401 - used by pytestmark
from tests.megatron_ref import megatron_core, single_process_group

pytestmark = pytest.mark.usefixtures("process_group_fixture")

S, B, E = 16, 4, 8      # Megatron's router takes logits [seq, batch, experts]

# (jaxtrain MoEConfig fields, the balancing type) per case; Megatron gets the same knobs.
CASES = {
    "softmax_top2": dict(topk=2),
    "softmax_pre_top1": dict(topk=1, pre_softmax=True),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid_top2": dict(topk=2, score_function="sigmoid"),
    "sigmoid_top4_groups": dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2),
    "sigmoid_top1_scaled": dict(topk=1, score_function="sigmoid", topk_scaling_factor=2.5),
}
BALANCING = ("aux_loss", "seq_aux_loss")
TRACKER = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def _megatron_route(lg, kw, balancing, z_coeff):
    """Megatron's TopKRouter.routing on logits [S, B, E] in training mode: (dense probs [S, B,
    E], routing map [S, B, E], {tracked loss name: value})."""
    megatron_core()
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    group = single_process_group()
    pg = types.SimpleNamespace(tp=group, cp=group, tp_cp=group, tp_dp_cp=group)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=E,
        moe_router_topk=kw["topk"], moe_router_score_function=kw.get("score_function", "softmax"),
        moe_router_pre_softmax=kw.get("pre_softmax", False),
        moe_router_num_groups=kw.get("num_groups"), moe_router_group_topk=kw.get("group_topk"),
        moe_router_topk_scaling_factor=kw.get("topk_scaling_factor"),
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=z_coeff)
    router = TopKRouter(cfg, pg_collection=pg)
    router.set_layer_number(1)
    router.train()
    moe_utils.clear_aux_losses_tracker()
    probs, rmap = router.routing(torch.tensor(np.asarray(lg), requires_grad=True))
    tracked = {name: float(v["values"][0])
               for name, v in moe_utils.get_moe_layer_wise_logging_tracker().items()}
    moe_utils.clear_aux_losses_tracker()
    return (probs.detach().numpy().reshape(S, B, E), rmap.numpy().reshape(S, B, E), tracked)


def _jaxtrain_route(lg, kw, balancing, z_coeff):
    """jaxtrain's route on the same logits (batch-major tokens, one sequence per row)."""
    m = M.MoEConfig(num_experts=E, load_balancing=(balancing,), aux_loss_coeff=(0.1,),
                    z_loss_coeff=z_coeff, **kw)
    flat = jnp.asarray(np.asarray(lg).transpose(1, 0, 2).reshape(B * S, E))
    probs, idx, _, _, stats = M.route(flat, m, train=True, seqs=B)
    dense = np.zeros((B * S, E), np.float32)
    np.put_along_axis(dense, np.asarray(idx), np.asarray(probs), axis=1)
    dense = dense.reshape(B, S, E).transpose(1, 0, 2)
    return dense, stats


@pytest.mark.parametrize("balancing", BALANCING)
@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_megatron_topk_router(case, balancing):
    kw = CASES[case]
    lg = np.random.RandomState(7).standard_normal((S, B, E)).astype(np.float32) * 2.0
    want_probs, want_map, tracked = _megatron_route(lg, kw, balancing, z_coeff=1e-3)
    probs, stats = _jaxtrain_route(lg, kw, balancing, z_coeff=1e-3)
    np.testing.assert_array_equal(probs > 0, want_map)
    np.testing.assert_allclose(probs, want_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats["lb"][0]), tracked[TRACKER[balancing]], rtol=1e-5)
    np.testing.assert_allclose(float(stats["z"]), tracked["z_loss"], rtol=1e-5)


def test_sigmoid_top1_aux_loss_is_balanced_at_one():
    """Uniform logits: every balancing loss is 1 (perfect balance) for every score function —
    Megatron sum-normalises sigmoid/sqrtsoftplus scores for the aux losses whatever topk."""
    for fn in M.SCORE_FUNCTIONS:
        for k in (1, 2):
            m = M.MoEConfig(num_experts=E, topk=k, score_function=fn, pre_softmax=True,
                            aux_loss_coeff=(0.1,))
            stats = M.route(jnp.zeros((64, E)), m, train=True)[4]
            assert abs(float(stats["lb"][0]) - 1.0) < 1e-5, (fn, k, float(stats["lb"][0]))


def test_sqrtsoftplus_aux_scores_are_sum_normalised():
    """Megatron HEAD's compute_routing_scores_for_aux_loss (sqrtsoftplus is newer than the
    megatron-core release): softplus(x).sqrt() / (sum + 1e-20), whatever topk."""
    lg = np.random.RandomState(3).standard_normal((32, E)).astype(np.float32)
    for k in (1, 3):
        m = M.MoEConfig(num_experts=E, topk=k, score_function="sqrtsoftplus")
        s, amap = M.aux_scores(jnp.asarray(lg), m)
        want = np.sqrt(np.log1p(np.exp(lg.astype(np.float64))))
        want = want / (want.sum(-1, keepdims=True) + 1e-20)
        np.testing.assert_allclose(s, want, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(amap).sum(-1), k)
