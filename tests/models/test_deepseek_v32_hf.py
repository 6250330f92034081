"""DeepSeek-V3.2 (DeepSeek sparse attention) against transformers and Megatron-LM: logits with
the indexer's top-k selection active (fp32, tiny random configs with wider-than-init weights),
from_hf / to_hf round trips, greedy decode over the indexer's key cache, packed documents;
the selection's tie rules; the indexer's KL loss against Megatron's own
``compute_dsa_indexer_loss``; what reaches the indexer's and the model's gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import (VOCAB, check_left_padded_decode, check_packed_sequences, max_diff,
                           random_params, tokens)
from test_hf import _hf_logits, _randomize, check_greedy_decode, check_parity_and_round_trip

from jaxtrain.models import ModelConfig, forward, from_hf
from jaxtrain.models import dsa
from jaxtrain.models.transformer import hidden_states

_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8,
             qk_nope_head_dim=8, index_topk=5, index_head_dim=16, index_n_heads=8,
             first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


def _saved(config_cls, model_cls, kw, path, seed=0):
    """The transformers model of config ``kw``, randomized and saved to ``path``."""
    model = _randomize(model_cls(config_cls(**kw, attn_implementation="eager")).eval(), seed)
    model.save_pretrained(path)
    return model


def _model(path, seed=0, **changes):
    return _saved(tr.DeepseekV32Config, tr.DeepseekV32ForCausalLM, {**_BASE, **changes}, path,
                  seed)


def test_parity_and_round_trip(tmp_path):
    """16 tokens, 5 kept per query: the selection changes the logits (checked below)."""
    cfg = check_parity_and_round_trip(_model(tmp_path / "hf"), tmp_path)
    assert (cfg.dsa_index_heads, cfg.dsa_index_head_dim, cfg.dsa_index_topk) == (8, 16, 5)
    assert cfg.dsa_k_norm_epsilon == 1e-6 and not cfg.dsa_rope_interleaved
    assert cfg.moe is not None and cfg.multi_latent_attention


def test_greedy_decode_matches_transformers(tmp_path):
    """6 prompt tokens and 8 new ones: the later steps select 5 of up to 13 cached keys."""
    check_greedy_decode(_model(tmp_path / "hf"), tmp_path / "hf")


@pytest.mark.slow
def test_packed_documents_and_left_padded_decoding_select_within_their_own(tmp_path):
    _model(tmp_path / "hf", first_k_dense_replace=3, index_topk=3)
    cfg, params = from_hf(tmp_path / "hf")
    check_packed_sequences(params, cfg, tol=2e-5)
    check_left_padded_decode(params, cfg)


def _cfg(**changes):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                vocab_size=VOCAB, max_position_embeddings=64, multi_latent_attention=True,
                q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                v_head_dim=8, qk_layernorm=True, normalization="RMSNorm",
                dsa_index_heads=4, dsa_index_head_dim=16, dsa_index_topk=4)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("change", [
    dict(dsa_index_topk=16), dict(dsa_index_topk=2), dict(dsa_scoring_relu=False),
    dict(dsa_rope_interleaved=True), dict(dsa_k_norm_epsilon=1.0)])
def test_each_indexer_setting_changes_the_logits(change):
    base = _cfg()
    params = random_params(base)
    ref = forward(params, tokens(), base)
    assert max_diff(forward(params, tokens(), _cfg(**change)), ref) > 1e-3


def test_topk_covering_the_sequence_is_dense_attention():
    params = random_params(_cfg())
    dense = _cfg().replace(dsa_index_heads=0)
    plain = {k: v for k, v in params.items()}
    plain["layers"] = {**params["layers"], "attn": {
        k: v for k, v in params["layers"]["attn"].items() if k != "indexer"}}
    assert max_diff(forward(params, tokens(), _cfg(dsa_index_topk=16)),
                    forward(plain, tokens(), dense)) <= 1e-5


def test_selection_keeps_k_visible_keys_ties_to_the_earlier():
    cfg = _cfg(dsa_index_topk=2)
    scores = jnp.asarray([[[0.0, 3.0, 1.0, 1.0, 1.0, 0.5]]])
    visible = jnp.ones_like(scores, bool)
    assert np.asarray(dsa.select(scores, visible, cfg))[0, 0].tolist() == [
        False, True, True, False, False, False]
    # the threshold mask (MaxText's indexer_mask_exact_topk false) keeps every tie of the k-th
    loose = dsa.select(scores, visible, cfg.replace(dsa_exact_topk=False))
    assert np.asarray(loose)[0, 0].tolist() == [False, True, True, True, True, False]
    # a row with fewer visible keys than k keeps them all; invisible keys never
    few = visible.at[..., 1:].set(False)
    assert np.asarray(dsa.select(scores, few, cfg))[0, 0].tolist() == [True] + [False] * 5
    approx = dsa.select(scores, visible, cfg.replace(dsa_approx_topk_recall=0.95))
    assert np.asarray(approx)[0, 0].sum() == 2


def _megatron_loss(scores, keep, q, k, scale, coeff, sparse):
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        compute_dsa_indexer_loss)

    class _TP:
        def size(self):
            return 1

    class _Groups:
        tp = _TP()

    B, T, S = scores.shape
    # Megatron takes the top-k indices; rows with fewer visible keys fill up with masked ones
    fill = np.where(np.asarray(keep), 0.0, -np.arange(1, S + 1)[::-1] * 1e-3 - 1e3)
    idx = torch.tensor(np.argsort(-fill, -1, kind="stable")[..., :int(keep.sum(-1).max())])
    masked = torch.tensor(np.where(np.tril(np.ones((T, S), bool)), np.asarray(scores), -np.inf))
    torch_q = torch.tensor(np.asarray(q)).permute(1, 0, 2, 3)
    torch_k = torch.tensor(np.asarray(k)).permute(1, 0, 2, 3)
    return compute_dsa_indexer_loss(masked.float(), idx, torch_q, torch_k, scale, coeff, sparse,
                                    _Groups()).item()


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_equals_megatrons(sparse):
    rng = np.random.RandomState(0)
    B, T, N, H, k = 2, 8, 3, 6, 3
    scores = jnp.asarray(rng.randn(B, T, T), jnp.float32)
    q = jnp.asarray(rng.randn(B, T, N, H), jnp.float32)
    key = jnp.asarray(rng.randn(B, T, N, H), jnp.float32)
    cfg = _cfg(dsa_index_topk=k)
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    keep = dsa.select(scores, visible, cfg)
    ours = float(dsa.indexer_kl(scores, q, key, visible, keep, 0.4, sparse))
    assert ours == pytest.approx(_megatron_loss(scores, keep, q, key, 0.4, 1.0, sparse),
                                 rel=1e-5)


def _losses(cfg, params):
    """(LM loss, Σ over layers of the indexer KL) of a training forward."""
    def fn(p):
        hidden, stats = hidden_states(p, tokens(), cfg, deterministic=False,
                                      rng=jax.random.PRNGKey(0), with_moe_stats=True)
        _, kl = dsa.pop(stats)
        return jnp.mean(hidden ** 2), kl
    return fn


def test_the_loss_trains_only_the_indexer_and_the_main_loss_never_reaches_it():
    cfg = _cfg(dsa_loss_coeff=0.1)
    params = random_params(cfg)
    main, kl = jax.jit(_losses(cfg, params))(params)
    assert float(kl) > 0
    g_main = jax.jit(jax.grad(lambda p: _losses(cfg, p)(p)[0]))(params)
    g_kl = jax.jit(jax.grad(lambda p: _losses(cfg, p)(p)[1]))(params)
    indexer = lambda g: g["layers"]["attn"]["indexer"]  # noqa: E731
    rest = lambda g: {**g["layers"], "attn": {  # noqa: E731
        k: v for k, v in g["layers"]["attn"].items() if k != "indexer"}}
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(indexer(g_main)))
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(rest(g_kl)))
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(indexer(g_kl)))
    sparse = jax.jit(_losses(cfg.replace(dsa_sparse_loss=True), params))(params)[1]
    assert abs(float(sparse) - float(kl)) > 1e-4
    off = hidden_states(params, tokens(), _cfg(), deterministic=False,
                        rng=jax.random.PRNGKey(0), with_moe_stats=True)[1]
    assert off is None   # no indexer loss without its coefficient


def test_objective_weight_sums_over_layers_or_averages_them():
    cfg = _cfg(dsa_loss_coeff=0.5, num_layers=4)
    assert dsa.loss_weight(cfg) == 0.5
    assert dsa.loss_weight(cfg.replace(dsa_loss_layer_mean=True)) == 0.125
    assert dsa.metrics(jnp.float32(8.0), cfg)["indexer_loss"] == 1.0


def test_hf_logits_show_the_selection(tmp_path):
    """The same checkpoint with every key kept (index_topk 64) gives other logits: the parity
    test above compares with the selection on."""
    model = _model(tmp_path / "hf")
    wide = _model(tmp_path / "wide", index_topk=64)
    assert max_diff(_hf_logits(model, tokens()), _hf_logits(wide, tokens())) > 1e-2


@pytest.mark.parametrize("mode, saved", [("device", True), ("remat", False)])
def test_custom_remat_places_the_indexer_cutoff(mode, saved, capsys):
    """MaxText's indexer_cutoff_threshold: the k-th score per query is a named tensor the
    custom policy keeps (device) or recomputes (remat)."""
    from jax.ad_checkpoint import print_saved_residuals

    cfg = _cfg(scan_layers=False, remat_policy="custom",
               remat_tensors=(("indexer_cutoff_threshold", mode),))
    print_saved_residuals(lambda p: forward(p, tokens(), cfg).sum(), random_params(cfg))
    assert ("named 'indexer_cutoff_threshold'" in capsys.readouterr().out) == saved


_GLM = dict(_BASE, num_hidden_layers=5, index_topk_freq=2, index_skip_topk_offset=2,
            rms_norm_eps=1e-5)


def _glm(path, seed=0, **changes):
    return _saved(tr.GlmMoeDsaConfig, tr.GlmMoeDsaForCausalLM, {**_GLM, **changes}, path, seed)


def test_glm5_index_sharing_parity_round_trip_and_decode(tmp_path):
    """GLM-5: interleaved RoPE in the indexer; layers 1, 2, 4 ("full") select their keys,
    3 and 5 ("shared") attend with the selection of the full layer before them."""
    model = _glm(tmp_path / "hf")
    assert model.config.indexer_types == ["full", "full", "shared", "full", "shared"]
    cfg = check_parity_and_round_trip(model, tmp_path)
    assert cfg.dsa_shared_layers == (False, False, True, False, True)
    assert cfg.dsa_rope_interleaved
    check_greedy_decode(model, tmp_path / "hf")


def test_glm5_sharing_layers_have_no_indexer(tmp_path):
    """The sharing layers live in stacks of their own without indexer parameters; the parity
    test above (16 tokens, 5 kept) fails if they attend to every key instead of the selection
    of the full layer before them."""
    _glm(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert "indexer" not in params["dsa_shared_moe_layers"]["attn"]
    assert "indexer" in params["moe_layers"]["attn"]
    assert params["dsa_shared_moe_layers"]["attn"]["wq_b"].shape[1] == 2   # layers 3 and 5


@pytest.mark.slow
def test_head_chunks_give_the_same_values_with_less_memory():
    """MaxText's mla_qk_head_chunk_size: the indexer's scores and the loss's attention target
    summed a chunk of heads at a time: equal loss and gradients, a smaller working set."""
    cfg = _cfg(dsa_loss_coeff=0.1, dsa_index_heads=8, dsa_index_topk=8, num_attention_heads=8,
               max_position_embeddings=128)
    params = random_params(cfg)
    toks = tokens(seq=96)

    def loss(cfg):
        def fn(p):
            hidden, stats = hidden_states(p, toks, cfg, deterministic=False,
                                          rng=jax.random.PRNGKey(0), with_moe_stats=True)
            return jnp.mean(hidden ** 2) + dsa.pop(stats)[1]
        return jax.jit(jax.value_and_grad(fn))

    whole, chunked = loss(cfg), loss(cfg.replace(dsa_head_chunk=2))
    (a, ga), (b, gb) = whole(params), chunked(params)
    assert float(a) == pytest.approx(float(b), rel=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), ga, gb)

    def temp(f):
        return f.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert temp(chunked) < 0.8 * temp(whole)
