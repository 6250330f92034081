"""Multi-token prediction beyond the side-by-side with Megatron (test_mtp_megatron.py): shifts
within packed sequences, packing that changes nothing, the knobs flipped in training, and what
is refused by name."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import VOCAB, random_params, tiny, tokens

from jaxtrain import loop
from jaxtrain.config import ConfigError, load_config
from jaxtrain.loss import model_loss
from jaxtrain.models import ModelConfig, abstract
from jaxtrain.models.mtp import sequences, shift_left


def test_shift_left_stays_within_each_sequence():
    x = jnp.asarray([[1, 2, 3, 4, 5, 6]])
    seq = sequences(jnp.asarray([[7, 7, 7, 9, 9, 9]]), x)
    np.testing.assert_array_equal(shift_left(x, 1, seq), [[2, 3, 0, 5, 6, 0]])
    np.testing.assert_array_equal(shift_left(x, 2, seq), [[3, 0, 0, 6, 0, 0]])
    np.testing.assert_array_equal(shift_left(x, 2), [[3, 4, 5, 6, 0, 0]])


def test_packed_documents_predict_as_if_alone():
    """Two documents packed in a row give the MTP depths the token-loss sums of the two
    documents run alone (no token of one is predicted from the other)."""
    cfg = tiny(mtp_num_layers=2, max_position_embeddings=32)
    params = random_params(cfg)
    a, b = tokens(1, 7, seed=1), tokens(1, 9, seed=2)

    def sums(toks, seg=None, pos=None):
        targets = jnp.roll(toks, -1, 1)
        mask = jnp.ones(toks.shape, jnp.float32).at[:, -1].set(0.0)
        if seg is not None:   # each document's last token has no target
            mask = mask.at[:, 6].set(0.0)
            targets = targets.at[:, 6].set(0)
        micro = {"tokens": toks, "targets": targets, "loss_mask": mask}
        if seg is not None:
            micro.update(segment_ids=seg, positions=pos)
        s = sequences(seg, toks)
        weights = [shift_left(mask, k, s) for k in (1, 2)]
        _, stats = model_loss(params, micro, mask, cfg, mtp_weights=weights)
        return np.asarray(stats["mtp"])

    packed = sums(jnp.concatenate([a, b], 1), jnp.asarray([[1] * 7 + [2] * 9]),
                  jnp.asarray([list(range(7)) + list(range(9))]))
    np.testing.assert_allclose(packed, sums(a) + sums(b), rtol=1e-5)


TINY = ["mock_data=true", "vocab_size=128", "seq_length=16", "max_position_embeddings=16",
        "num_layers=2", "hidden_size=32", "num_attention_heads=4", "micro_batch_size=2",
        "global_batch_size=4", "lr_warmup_iters=0", "bf16=false", "train_iters=2",
        "log_interval=1", "exp_name=run", "hardware=cpu", "mtp_num_layers=2"]


def _train(tmp_path, *extra):
    cfg = load_config(None, [*TINY, f"workspace={tmp_path}", *extra], world_size=1)
    loop.train(cfg, devices=jax.devices()[:1])
    return [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_mtp_knobs_in_training(tmp_path):
    """mtp_num_layers reports each depth's loss; mtp_loss_scaling_factor moves the gradient
    (not the reported main loss); mtp_use_repeated_layer trains one module for both depths."""
    base = _train(tmp_path / "a")
    assert {"mtp_1_loss", "mtp_2_loss"} <= set(base[0])
    assert base[0]["mtp_1_loss"] > 0 and base[0]["mtp_2_loss"] > 0
    heavier = _train(tmp_path / "b", "mtp_loss_scaling_factor=0.9")
    assert heavier[0]["loss"] == pytest.approx(base[0]["loss"], rel=1e-6)
    assert heavier[0]["grad_norm"] != pytest.approx(base[0]["grad_norm"], rel=1e-3)
    repeated = _train(tmp_path / "c", "mtp_use_repeated_layer=true")
    assert repeated[-1]["mtp_2_loss"] > 0
    cfg = ModelConfig.from_config(load_config(None, [*TINY, "mtp_use_repeated_layer=true"]))
    assert abstract(cfg)["mtp"]["eh_proj"].shape == (64, 1, 32)   # [2D, depths, D]


@pytest.mark.slow
def test_factor_zero_leaves_the_main_gradients_of_the_plain_model():
    """With mtp_loss_scaling_factor 0 the decoder's gradients are those of the model without
    MTP (the MTP modules only read it)."""
    cfg = tiny(mtp_num_layers=1, vocab_size=VOCAB)
    plain = cfg.replace(mtp_num_layers=0)
    params = random_params(cfg)
    micro = {"tokens": tokens(), "targets": jnp.roll(tokens(), -1, 1),
             "loss_mask": jnp.ones(tokens().shape, jnp.float32)}
    w = micro["loss_mask"] / micro["loss_mask"].sum()

    def with_mtp(p, factor):
        lm, stats = model_loss(p, micro, w, cfg, mtp_weights=[shift_left(w, 1)])
        return lm + factor * jnp.mean(stats["mtp"])

    g0 = jax.grad(with_mtp)(params, 0.0)
    g_plain = jax.grad(lambda p: model_loss(p, micro, w, plain)[0])(
        {k: v for k, v in params.items() if k != "mtp"})
    for key in g_plain:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0[key],
                     g_plain[key])
    g1 = jax.grad(with_mtp)(params, 1.0)
    assert not np.allclose(g1["layers"]["attn"]["wq"], g0["layers"]["attn"]["wq"])


@pytest.mark.parametrize("extra, says", [
    (["context_parallel_size=2"], "with multi-token prediction"),
    (["fp8=hybrid", "fp8_recipe=delayed"], "delayed-scaling FP8 with multi-token"),
    (["plugins.dft=true"], "token-weighting objectives"),
    (["hybrid_layer_pattern=M*"], "a hybrid model's MTP layers are the pattern after '/'"),
    (["num_experts=4", "moe_router_topk=2", "mtp_use_repeated_layer=true"],
     "mtp_use_repeated_layer: not implemented yet with an MoE layer last"),
])
def test_what_mtp_does_not_run_with_is_named(extra, says):
    with pytest.raises((ConfigError, ValueError)) as e:
        ModelConfig.from_config(load_config(None, [*TINY, "global_batch_size=16", *extra],
                                            world_size=8))
    assert says in str(e.value)


def test_maxtext_files_mtp_is_refused(write):
    path = write("mt.yml", "base_config: base.yml\nmtp_num_layers: 1\n")
    with pytest.raises(ConfigError, match="MaxText's multi-token prediction differs"):
        load_config(path, ["steps=10", "dataset_type=synthetic", "hardware=cpu"])


def test_global_aux_loss_carries_the_mtp_layers_counts():
    """Megatron's global_aux_loss with MoE MTP layers: each MTP layer's router reads its own
    row of the earlier microbatches' counts (after the decoder's rows), as the decoder's
    layers read theirs; the rows of other layers do not reach it."""
    from jaxtrain.models.moe import MoEConfig
    from jaxtrain.models.moe.step import moe_layer_ids, zero_stats

    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16, layer_freq=1,
                    load_balancing=("global_aux_loss",), aux_loss_coeff=(0.1,))
    cfg = tiny(mtp_num_layers=1, vocab_size=VOCAB, moe=moe)
    assert moe_layer_ids(cfg) == (0, 1, 2)   # the MTP layer's row is the last
    params = random_params(cfg)
    micro = {"tokens": tokens(), "targets": jnp.roll(tokens(), -1, 1),
             "loss_mask": jnp.ones(tokens().shape, jnp.float32)}
    w = micro["loss_mask"] / micro["loss_mask"].sum()

    def lb(counts):
        state = {"aux_counts": counts, "steps": jnp.float32(1.0)}
        _, stats = model_loss(params, micro, w, cfg, moe_state=state, train=True,
                              rng=jax.random.key(0), mtp_weights=[shift_left(w, 1)])
        return np.asarray(stats["lb"][:, 0])

    base = np.asarray(zero_stats(cfg)["aux_counts"]) + 4.0
    skewed = base.copy()
    skewed[2] = [16.0, 0.0, 0.0, 0.0]   # only the MTP layer's earlier counts change
    a, b = lb(jnp.asarray(base)), lb(jnp.asarray(skewed))
    np.testing.assert_allclose(a[:2], b[:2], rtol=1e-6)
    assert abs(a[2] - b[2]) > 1e-3 * abs(a[2])
