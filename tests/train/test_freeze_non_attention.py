"""pgs train.freeze_non_attention on hybrid models: the Gated DeltaNet layers (all but their
norms) keep their weights, with no optimizer state and no weight decay, and no gradient flows
into them; the full-attention layers, embeddings and head train."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file

from jaxtrain.models import ModelConfig, logical_axes
from jaxtrain.models.spec import LINEAR_STACKS
from jaxtrain.optim.config import OptimConfig
from jaxtrain.optim.freeze import is_frozen, stop_frozen
from jaxtrain.optim.optimizers import build_optimizer

from tests.conftest import ROOT
from tests.train.sft_helpers import pair_task, write_chat_model, write_jsonl

HYBRID = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
              experimental_attention_variant="gdn", linear_attention_freq=2,
              linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
              linear_value_head_dim=8, attention_output_gate=True)


def _paths(tree):
    return {tuple(str(k.key) for k in kp): leaf
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
def test_the_optimizer_leaves_frozen_weights_alone():
    """With weight decay and Adam, one step moves every trained leaf and none of the frozen
    ones; the frozen ones hold no optimizer state."""
    from jaxtrain.models import abstract

    cfg = ModelConfig.from_config(HYBRID)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype),
                          abstract(cfg))
    grads = jax.tree.map(lambda a: jnp.ones_like(a), params)
    results = {}
    for freeze in (False, True):
        opt = build_optimizer(OptimConfig(name="adam", lr=1e-2, weight_decay=0.1,
                                          freeze_linear=freeze), lambda s: 1e-2,
                              logical_axes(cfg))
        state = opt.init(params)
        updates, _ = jax.jit(opt.update)(grads, state, params)
        results[freeze] = (_paths(optax.apply_updates(params, updates)),
                           sum(x.size for x in jax.tree.leaves(state)))
    before = _paths(params)
    moved = {p for p, a in results[True][0].items() if not np.array_equal(a, before[p])}
    frozen = {p for p in before if is_frozen(p)}
    assert frozen and all(p[0] in LINEAR_STACKS for p in frozen)
    assert ("linear_layers", "attn_norm", "scale") not in frozen
    assert ("linear_layers", "linear_attn", "norm", "scale") not in frozen
    assert moved == set(before) - frozen
    assert all(not np.array_equal(a, before[p]) for p, a in results[False][0].items()
               if p[-1] != "scale")   # without the knob the same leaves move
    assert results[True][1] < results[False][1]   # no Adam moments for frozen leaves


@pytest.mark.slow
def test_no_gradient_reaches_frozen_weights():
    from jaxtrain.models import forward, init

    cfg = ModelConfig.from_config(HYBRID)
    params = init(cfg, jax.random.key(1))
    toks = jnp.arange(16, dtype=jnp.int32).reshape(1, 16) % 64
    loss = lambda p: jnp.mean(forward(stop_frozen(p), toks, cfg) ** 2)  # noqa: E731
    grads = _paths(jax.jit(jax.grad(loss))(params))
    for path, g in grads.items():
        assert (np.abs(np.asarray(g)).max() == 0) == is_frozen(path), path


@pytest.mark.slow
def test_pgs_quickstart_freezes_the_gated_deltanet_layers(tmp_path):
    """pgs's quickstart (in float32, shorter rows) on a Qwen3.5 chat model (layer 0 Gated
    DeltaNet, layer 1 full attention) with train.freeze_non_attention: the export loads in
    transformers with jaxtrain's logits; layer 0's projections and MLP are the starting ones,
    its norms, layer 1 and the embeddings moved."""
    import torch
    import transformers

    from jaxtrain import train
    from jaxtrain.models import forward, from_hf

    model = write_chat_model(tmp_path / "model", family="qwen3_5")
    data = write_jsonl(tmp_path / "chat.jsonl", pair_task(48))
    config = tmp_path / "quickstart.yaml"
    shutil.copy(ROOT / "tests" / "data" / "pgs" / "quickstart.yaml", config)
    import os
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert train.main([str(config), f"model.name_or_path={model}", f"data.dataset={data}",
                           "train.max_steps=2", "train.freeze_non_attention=true",
                           "model.torch_dtype=float32", "train.bf16=false",
                           "train.learning_rate=1e-3", "data.max_seq_length=256"]) == 0
    finally:
        os.chdir(cwd)
    final = tmp_path / "output" / "final"
    start, end = load_file(str(model / "model.safetensors")), load_file(
        str(final / "model.safetensors"))
    same = lambda k: np.array_equal(start[k], end[k])  # noqa: E731
    for k in start:
        if k.startswith("model.layers.0.") and "norm" not in k:
            assert same(k), k
    for k in ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"):
        assert not same(k), k
    ids = [[3, 5, 7, 11, 13, 17, 19, 23]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    cfg, params = from_hf(final)
    ours = np.asarray(forward(params, np.asarray(ids, np.int32), cfg))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_mamba_layers_are_frozen_too():
    """Megatron's hybrid stack: the Mamba-2 sublayers (but their norms) get no gradient; the
    attention and MLP sublayers do."""
    from jaxtrain.models import forward, init

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                      hybrid_layers="M*-", position_embedding_type="none", mamba_head_dim=8,
                      mamba_num_groups=2, mamba_state_dim=8, mamba_chunk_size=4)
    params = init(cfg, jax.random.key(1))
    toks = jnp.arange(16, dtype=jnp.int32).reshape(1, 16) % 64
    loss = lambda p: jnp.mean(forward(stop_frozen(p), toks, cfg) ** 2)  # noqa: E731
    grads = _paths(jax.jit(jax.grad(loss))(params))
    frozen = {p for p in grads if is_frozen(p)}
    assert ("mamba_layers", "mamba", "wx") in frozen
    assert ("mamba_layers", "mamba", "norm", "scale") not in frozen
    assert not any(p[0] != "mamba_layers" for p in frozen)
    for path, g in grads.items():
        assert (np.abs(np.asarray(g)).max() == 0) == is_frozen(path), path
