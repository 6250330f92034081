"""DeepSeek-V4 (models/compressed.py) against transformers' DeepseekV4ForCausalLM: logits of a
tiny random model with every layer kind (sliding window, compressed sparse with the indexer's
top-k active, heavily compressed), hash-routed layers, the clamped SwiGLU and hyper-connections
with the learned head (fp32, wider-than-init weights), YaRN on the compressed layers, and
from_hf / to_hf round trips that transformers loads. The indexer has 16 heads so that its
ReLU'd scores do not tie at the cut (torch's top-k orders ties its own way)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import max_diff, tokens
from test_hf import _hf_logits, _load, _randomize, check_parity_and_round_trip

from jaxtrain.models import compressed, forward, from_hf, to_hf

TOL = 1e-4
SEQ = 24
_BASE = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=12,
             partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
             n_shared_experts=1, routed_scaling_factor=1.5,
             layer_types=["sliding_attention", "compressed_sparse_attention",
                          "heavily_compressed_attention", "compressed_sparse_attention"],
             compress_rates={"compressed_sparse_attention": 4,
                             "heavily_compressed_attention": 8},
             mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=2,
             hc_sinkhorn_iters=5, swiglu_limit=1.5, sliding_window=6, o_groups=2,
             o_lora_rank=8, index_n_heads=16, index_head_dim=12, index_topk=2,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(path, seed=0, **changes):
    """The transformers model, randomized (hash tables too) and saved to ``path``."""
    kw = {**_BASE, **changes}
    model = tr.DeepseekV4ForCausalLM(tr.DeepseekV4Config(**kw, attn_implementation="eager"))
    model = _randomize(model.eval(), seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                table = torch.argsort(torch.rand(kw["vocab_size"], kw["n_routed_experts"],
                                                 generator=gen), -1)
                layer.mlp.gate.tid2eid.copy_(table[:, :kw["num_experts_per_tok"]])
    model.save_pretrained(path)
    return model


def _logits(params, cfg, toks):
    return np.asarray(jax.jit(lambda p, x: forward(p, x, cfg))(params, toks))


def test_parity_and_round_trip(tmp_path):
    """16 tokens: 4 sparse entries (2 kept per query), 2 heavy ones, a window of 6. Positions
    from 0 only: transformers' compressor places its windows by index whatever the positions
    (and would let an offset query see entries not yet closed)."""
    cfg = check_parity_and_round_trip(_model(tmp_path / "hf"), tmp_path, offset=False)
    assert cfg.compress_ratios == (0, 4, 8, 4) and cfg.compress_dense_ratio == 8
    assert (cfg.hc_streams, cfg.hc_head, cfg.moe.hash_layers, cfg.glu_clamp) == (2, True, 2, 1.5)


@pytest.mark.parametrize("change", [
    dict(index_topk=6),                  # every visible entry: the selection matters
    dict(swiglu_limit=100.0),            # the clamp matters
    dict(mlp_layer_types=["moe"] * 4),   # hash routing matters
    dict(hc_mult=3),
    dict(sliding_window=64),
    dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 8}),
], ids=["topk", "clamp", "hash", "streams", "window", "yarn"])
def test_each_setting_matches_and_changes_the_logits(tmp_path, change):
    """Each variation still equals transformers and gives other logits than the base model."""
    toks = tokens(seq=SEQ)
    base = _hf_logits(_model(tmp_path / "base"), toks)
    model = _model(tmp_path / "hf", **change)
    cfg, params = from_hf(tmp_path / "hf")
    ref = _hf_logits(model, toks)
    assert max_diff(_logits(params, cfg, toks), ref) <= TOL
    assert max_diff(ref, base) > 1e-3


def test_yarn_reaches_the_compressed_layers_only(tmp_path):
    _model(tmp_path / "hf", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 8})
    cfg, _ = from_hf(tmp_path / "hf")
    plain, scaled = (compressed.rope_frequencies(cfg, c) for c in (False, True))
    np.testing.assert_allclose(plain, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8))
    assert cfg.rope_type == "yarn" and not np.allclose(scaled, 1.0 / 160000.0 ** (
        np.arange(0, 8, 2) / 8))


def test_export_folds_the_hyper_connection_norm_scale(tmp_path):
    """Our mHC norm has a learned scale (MaxText's); transformers' has none: to_hf folds it
    into the mapping, so the exported model computes the same logits."""
    _model(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    key = jax.random.key(3)
    scale = jax.tree.map(lambda s: 1.0 + 0.3 * jax.random.normal(key, s.shape),
                         params["csa_moe_layers"]["attn_hc"]["norm"])
    params["csa_moe_layers"]["attn_hc"]["norm"] = jax.tree.map(np.asarray, scale)
    toks = tokens(seq=SEQ)
    ours = _logits(params, cfg, toks)
    to_hf(params, cfg, tmp_path / "out")
    assert max_diff(_hf_logits(_load(tmp_path / "out"), toks), ours) <= TOL


def _indexer_kl_reference(scores, logits, keep):
    """Primus's indexer_distill_loss (its formula, float64): per-head softmax of the attention
    logits over the kept entries, summed and L1-normalised; KL against the indexer's softmax."""
    scores, logits, keep = (np.asarray(a, np.float64) for a in (scores, logits, keep))
    keep = keep.astype(bool)
    with np.errstate(invalid="ignore"):   # rows with nothing kept: -inf - -inf, masked below
        return _kl(scores, logits, keep)


def _kl(scores, logits, keep):
    att = np.where(keep[:, None], logits, -np.inf)
    att = np.exp(att - att.max(-1, keepdims=True))
    att = np.where(keep[:, None], att / att.sum(-1, keepdims=True), 0).sum(1)
    target = att / np.maximum(att.sum(-1, keepdims=True), 1e-10)
    s = np.where(keep, scores, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = np.where(keep, p / p.sum(-1, keepdims=True), 0)
    kl = (target * (np.log(target + 1e-10) - np.log(p + 1e-10))).sum(-1)
    return kl.mean()


def test_indexer_loss_equals_primus_formula():
    rng = np.random.default_rng(0)
    B, N, T, C = 2, 3, 5, 4
    scores = rng.normal(size=(B, T, C))
    logits = rng.normal(size=(B, N, T, C))
    keep = rng.random((B, T, C)) < 0.6
    keep[0, 0] = False   # a row with nothing kept adds 0
    ours = compressed._indexer_kl(jnp.asarray(scores, jnp.float32),
                                  jnp.asarray(logits, jnp.float32), jnp.asarray(keep))
    np.testing.assert_allclose(float(ours), _indexer_kl_reference(scores, logits, keep),
                               rtol=1e-5)


@pytest.mark.slow
def test_indexer_trains_only_through_its_loss(tmp_path):
    """With v4_indexer_distill_loss_coeff 0 no gradient reaches the indexer (its selection is
    discrete); with a weight its loss reaches the indexer and nothing else."""
    from jaxtrain.models.transformer import hidden_states
    _model(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    params = jax.tree.map(jnp.asarray, params)
    trained = params
    toks = tokens(seq=SEQ)

    def grads(cfg, main: bool):
        def loss(p):
            hidden, stats = hidden_states({**params, **p}, toks, cfg, deterministic=False,
                                          rng=jax.random.key(0), with_moe_stats=True)
            kl = stats.get("dsa", 0.0) if stats else 0.0
            return (jnp.mean(hidden ** 2) if main else 0.0) + kl
        return jax.grad(loss)(trained)["csa_moe_layers"]["attn"]

    norm = lambda t: sum(float(jnp.abs(a).sum()) for a in jax.tree.leaves(t))  # noqa: E731
    g = grads(cfg, True)
    assert norm(g["indexer"]) == 0 and norm(g["compressor"]) > 0
    g = grads(cfg.replace(compress_index_loss_coeff=0.5), False)
    assert norm(g["indexer"]) > 0
    assert norm({k: v for k, v in g.items() if k != "indexer"}) == 0


def test_greedy_decode_matches_transformers(tmp_path):
    """generate (the compressed cache) picks transformers' greedy tokens; 6 prompt tokens and
    12 new ones cross several compression windows."""
    from test_hf import check_greedy_decode
    check_greedy_decode(_model(tmp_path / "hf"), tmp_path / "hf", new_tokens=12)


@pytest.mark.parametrize("prompt", [pytest.param(1, marks=pytest.mark.slow), 6])
def test_cached_decoding_equals_the_full_forward(tmp_path, prompt):
    """The cache (each layer's key=value head and what its compressors pool; the entries
    pooled from it as windows close, the indexer's top-k over them): generate's logits at every
    step are the full forward's (fp32; this file's wide weights make logits of several units),
    and a decode step of several tokens is the same."""
    from test_decode import _greedy_by_forward

    from jaxtrain.models import decode_step, generate, init_cache, prefill
    _model(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    ids = tokens(2, prompt, seed=3)
    toks, logits = generate(params, cfg, ids, 14, return_logits=True)
    ref_toks, ref_logits = _greedy_by_forward(params, cfg, ids, 14)
    np.testing.assert_array_equal(np.asarray(toks), ref_toks)
    assert np.abs(np.asarray(logits) - ref_logits).max() <= TOL
    seq = jnp.concatenate([ids, toks], 1)
    cache = init_cache(cfg, 2, seq.shape[1])
    _, cache = prefill(params, cfg, seq[:, :prompt], cache)
    last, cache = decode_step(params, cfg, seq[:, prompt:prompt + 5], cache)
    full = _logits(params, cfg, seq)
    assert np.abs(np.asarray(last) - full[:, prompt + 4]).max() <= TOL


@pytest.mark.slow
def test_ragged_prompts_decode_as_each_would_alone(tmp_path):
    """Left-padded prompts of 3, 9 and 6 tokens (left_pad / pad=): each row's tokens and logits
    are those of its prompt alone (its tokens cached at their positions' slots, so its
    compression windows are its own)."""
    from test_decode import check_ragged_decoding
    _model(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    check_ragged_decoding(params, cfg, (3, 9, 6), 10, TOL)


def test_fp8_indexer_is_primus_fake_quantization(tmp_path):
    """use_v4_fp8_indexer: the indexer's queries and keys through FP8 E4M3 with one scale per
    tensor, as Primus's fake_quantize_fp8_e4m3 (transcribed in torch: the same values in fp32
    and bf16), the gradient straight through; in the model it moves the indexer's scores."""
    def primus(x):
        amax = x.abs().amax()
        scale = (448.0 / amax).to(x.dtype)
        return torch.clamp(x * scale, -448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) / scale
    x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype(np.float32) * 3
    for dt, tdt in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        want = primus(torch.tensor(x).to(tdt)).float().numpy()
        got = np.asarray(compressed.fake_fp8(jnp.asarray(x, dt)).astype(jnp.float32))
        np.testing.assert_allclose(got, want, rtol=1e-6)   # (fp32: an ulp from the division)
    assert np.abs(got - x).max() > 1e-3
    grad = jax.grad(lambda v: jnp.sum(compressed.fake_fp8(v) * 2.0))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), 2.0)
    zero = jnp.zeros((2, 3))
    np.testing.assert_array_equal(np.asarray(compressed.fake_fp8(zero)), 0.0)
    _model(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    ids = tokens(2, SEQ)
    plain = _logits(params, cfg, ids)
    fp8 = _logits(params, cfg.replace(compress_index_fp8=True), ids)
    assert 0 < np.abs(fp8 - plain).max()


def test_packed_documents_see_only_windows_inside_their_own():
    """MaxText's packing rule: a window spanning two documents is nobody's entry."""
    seg = jnp.asarray([[1] * 6 + [2] * 10])
    seen = np.asarray(compressed.entry_visible(16, 4, 4, seg))[0]
    assert seen[5].tolist() == [True, False, False, False]
    assert seen[11].tolist() == [False, False, True, False]
    assert seen[15].tolist() == [False, False, True, True]
    assert not seen[:3].any()


@pytest.mark.parametrize("T, W", [(24, 6), (23, 5), (16, 4)])
def test_banded_window_equals_the_full_mask(T, W):
    """The window's keys taken per block of W queries (O(T W) scores) give the full mask's
    attention, with packed documents too."""
    rng = np.random.default_rng(0)
    B, N, H, C = 2, 3, 8, 3
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    entries = jnp.asarray(rng.normal(size=(B, C, H)), jnp.float32)
    keep = jnp.asarray(rng.random((B, T, C)) < 0.5)
    seg = jnp.asarray(np.repeat([[1, 2]], T // 2 + 1, axis=1)[:, :T].repeat(B, 0))
    sinks = jnp.asarray(rng.normal(size=N), jnp.float32)
    for segments in (None, jnp.sort(seg, axis=1)):
        cfg = type("C", (), {"sliding_window": W})
        band = compressed._attend(q, kv, entries, keep, sinks, segments, cfg)
        cfg.sliding_window = None   # the full path with the window as an explicit mask

        def full(segments=segments):
            from jaxtrain.models.attention import visible
            local = visible(T, T, segments, sliding_window=W)[:, None]
            s_loc = jnp.einsum("btnh,bsh->bnts", q, kv) * H ** -0.5
            s_cmp = jnp.einsum("btnh,bch->bntc", q, entries) * H ** -0.5
            low = jnp.finfo(jnp.float32).min
            scores = jnp.concatenate([jnp.where(local, s_loc, low),
                                      jnp.where(keep[:, None], s_cmp, low),
                                      jnp.broadcast_to(sinks[None, :, None, None],
                                                       (B, N, T, 1))], -1)
            p = jax.nn.softmax(scores, -1)
            return (jnp.einsum("bnts,bsh->btnh", p[..., :T], kv)
                    + jnp.einsum("bntc,bch->btnh", p[..., T:T + C], entries))

        np.testing.assert_allclose(band[0], full(), rtol=1e-5, atol=1e-6)
