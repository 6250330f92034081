"""Multi-token prediction side by side with Megatron's own GPTModel (megatron-core, local layer
specs, on the CPU): the same weights in, the same main loss, the same per-depth MTP losses
and the same gradients of Megatron's objective (the main loss plus mtp_loss_scaling_factor times
the mean over depths, each depth over its own tokens) for every parameter, a masked row
included. Skips when megatron.core cannot be imported."""
import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.loss import model_loss
from jaxtrain.models import ModelConfig, abstract
from jaxtrain.step import _loss_weights, _mtp_weights
from tests.megatron_ref import process_group_fixture  # noqa: F401 - used by pytestmark
from tests.megatron_ref import megatron_core, single_process_group

pytestmark = pytest.mark.usefixtures("process_group_fixture")

V, D, N, K, H, F, S, B = 64, 32, 4, 2, 8, 48, 12, 2
DEPTHS, FACTOR = 2, 0.3


def _megatron(seed=0):
    """Megatron's GPTModel (2 layers, 2 MTP depths) with random weights, its objective's
    gradients and losses for one batch: (named numpy params, named grads, main loss, the
    per-depth MTP losses, the batch)."""
    megatron_core()
    import torch
    single_process_group()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    # CPU-only torch: RoPE's table and the dropout RNG fork ask for a CUDA device (no dropout)
    torch.cuda.current_device = lambda: "cpu"
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    cfg = TransformerConfig(
        num_layers=2, hidden_size=D, num_attention_heads=N, num_query_groups=K,
        ffn_hidden_size=F, mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S,
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec,
                                                           use_transformer_engine=False),
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (B, S))
    labels = np.concatenate([ids[:, 1:], rng.integers(0, V, (B, 1))], 1)
    mask = np.ones((B, S), np.float32)
    mask[1, 9:] = 0
    model.train()
    MTPLossLoggingHelper.tracker.clear()
    out = model(torch.tensor(ids), torch.arange(S)[None].expand(B, S),
                torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1),
                labels=torch.tensor(labels), loss_mask=torch.tensor(mask))
    loss = (out * torch.tensor(mask)).sum() / mask.sum()
    loss.backward()
    mtp = MTPLossLoggingHelper.tracker["values"].numpy().copy()   # each depth's token mean
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    batch = {"tokens": ids, "targets": labels, "loss_mask": mask}
    return params, grads, float(loss), mtp, batch


def _layer(t, pre):
    """A Megatron transformer layer's tensors (``t``: name -> array) as jaxtrain's layer tree."""
    qkv = t[pre + "self_attention.linear_qkv.weight"].reshape(K, (N // K + 2), H, D)
    fc1 = t[pre + "mlp.linear_fc1.weight"]
    return {"attn_norm": {"scale": t[pre + "input_layernorm.weight"]},
            "attn": {"wq": qkv[:, :N // K].reshape(N, H, D).transpose(2, 0, 1),
                     "wk": qkv[:, N // K].transpose(2, 0, 1),
                     "wv": qkv[:, N // K + 1].transpose(2, 0, 1),
                     "wo": t[pre + "self_attention.linear_proj.weight"].T.reshape(N, H, D)},
            "mlp_norm": {"scale": t[pre + "pre_mlp_layernorm.weight"]},
            "mlp": {"wi_0": fc1[:F].T, "wi_1": fc1[F:].T,
                    "wo": t[pre + "mlp.linear_fc2.weight"].T}}


def _ours(t):
    """The jaxtrain parameter tree (layer axis first: param_scan_axis 0) of Megatron's."""
    stack = lambda trees: jax.tree.map(lambda *a: np.stack(a), *trees)  # noqa: E731
    mtp = [{"enorm": {"scale": t[f"mtp.layers.{k}.enorm.weight"]},
            "hnorm": {"scale": t[f"mtp.layers.{k}.hnorm.weight"]},
            "final_norm": {"scale": t[f"mtp.layers.{k}.final_layernorm.weight"]},
            "eh_proj": t[f"mtp.layers.{k}.eh_proj.weight"].T,
            "layer": _layer(t, f"mtp.layers.{k}.transformer_layer.")} for k in range(DEPTHS)]
    return {"embedding": t["embedding.word_embeddings.weight"],
            "output": t["output_layer.weight"].T,
            "final_norm": {"scale": t["decoder.final_layernorm.weight"]},
            "layers": stack([_layer(t, f"decoder.layers.{i}.") for i in range(2)]),
            "mtp": stack(mtp)}


def test_mtp_losses_and_gradients_equal_megatrons():
    params_t, grads_t, main, mtp, batch = _megatron()
    cfg = ModelConfig(num_layers=2, hidden_size=D, num_attention_heads=N, num_query_groups=K,
                      ffn_hidden_size=F, vocab_size=V, max_position_embeddings=S,
                      untie_embeddings_and_output_weights=True, param_scan_axis=0,
                      mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR,
                      dtype="float32", weight_dtype="float32")
    params = jax.tree.map(jnp.asarray, _ours(params_t))
    assert jax.tree.map(np.shape, params) == jax.tree.map(lambda s: s.shape, abstract(cfg))
    micro = {k: jnp.asarray(v) for k, v in batch.items()}
    tcfg = types.SimpleNamespace(per_token_loss=False, data_parallel_size=1)
    weights = _loss_weights(micro["loss_mask"][None], tcfg)[0]

    def objective(p):
        lm, stats = model_loss(p, micro, weights, cfg, train=True,
                               mtp_weights=_mtp_weights(micro, weights, tcfg, 1, DEPTHS))
        return lm + FACTOR * jnp.mean(stats["mtp"]), (lm, stats["mtp"])

    (_, (lm, per_depth)), grads = jax.value_and_grad(objective, has_aux=True)(params)
    assert float(lm) == pytest.approx(main, rel=1e-5)
    np.testing.assert_allclose(np.asarray(per_depth), mtp, rtol=1e-5)
    want = _ours(grads_t)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        w = want
        for key in path:
            w = w[key.key]
        scale = max(np.abs(w).max(), 1e-6)
        assert np.abs(np.asarray(g) - w).max() / scale < 2e-5, jax.tree_util.keystr(path)
