"""Model FLOPs per token (metrics.flop_terms) against hand counts: only matmul weights, k of E
routed experts plus router and shared expert in MoE layers, MLA's projections and head dims."""
import pytest

from jaxtrain.metrics import flop_terms
from jaxtrain.models import ModelConfig, abstract
from jaxtrain.models.moe import MoEConfig

D, V, T = 32, 97, 16
BASE = dict(num_layers=2, hidden_size=D, num_attention_heads=4, vocab_size=V,
            max_position_embeddings=64, ffn_hidden_size=64)


def per_token(cfg):
    dense, attn = flop_terms(cfg, abstract(cfg))
    return dense + attn * T


@pytest.mark.parametrize("bias", [False, True])   # biases are not matmuls: same count
def test_dense_gqa(bias):
    cfg = ModelConfig(**BASE, num_query_groups=2, add_bias_linear=bias,
                      untie_embeddings_and_output_weights=False)
    attn = D * 4 * 8 + 2 * D * 2 * 8 + 4 * 8 * D        # q, k and v (2 groups), o; head dim 8
    mlp = 3 * D * 64                                    # gated: gate, up, down
    n = 2 * (attn + mlp) + D * V                        # tied output layer counts
    assert per_token(cfg) == 6 * n + 12 * 2 * 4 * 8 * T


def test_moe_with_mla_and_a_dense_layer():
    cfg = ModelConfig(**BASE, num_query_groups=None, multi_latent_attention=True,
                      q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                      v_head_dim=6, qk_layernorm=True,
                      moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=16,
                                    shared_expert_size=16, layer_freq=(0, 1),
                                    score_function="sigmoid", expert_bias=True))
    mla = (D * 16 + 16 * 4 * 12            # q down, q up (4 heads x (8 + 4))
           + D * (8 + 4) + 8 * 4 * 8 + 8 * 4 * 6    # kv down (+ shared RoPE key), k up, v up
           + 4 * 6 * D)                    # o
    dense_mlp = 3 * D * 64
    moe = D * 8 + 2 * 3 * D * 16 + 3 * D * 16   # router, 2 of 8 experts, shared expert
    n = 2 * mla + dense_mlp + moe + D * V       # untied: the output layer, not the embedding
    assert (mla, moe, n) == (2880, 4864, 19872)
    assert per_token(cfg) == 6 * n + 6 * 2 * 4 * (12 + 6) * T == 133056


def test_gated_deltanet_hybrid():
    """One Gated DeltaNet layer (projections q, k [D,2,8], v, z [D,4,6], b, a [D,4], o) and one
    gated softmax-attention layer (the gate projection counts); the score term counts only the
    softmax layer, the linear layer adds its chunked-rule matmuls."""
    cfg = ModelConfig(**BASE, linear_attention_layers=(True, False), linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                      linear_chunk_size=16, attention_output_gate=True,
                      untie_embeddings_and_output_weights=False)
    lin = 2 * D * 2 * 8 + 2 * D * 4 * 6 + 2 * D * 4 + 4 * 6 * D
    attn = 5 * D * 4 * 8                               # q, k, v, gate, o (MHA, head dim 8)
    mlp = 3 * D * 64
    n = lin + attn + 2 * mlp + D * V
    rule = 6 * 4 * (3 * 16 * 8 + 2 * 16 * 6 + 3 * 8 * 6)
    assert per_token(cfg) == 6 * n + rule + 12 * 1 * 4 * 8 * T


def test_gemma4_global_layers():
    """A sliding layer (4 heads of 8, 2 kv heads) and a global one (heads of 16, one kv head
    whose key projection also gives the values): the global layer's projections and its score
    term count its own head width; the layer scalar is not a matmul."""
    cfg = ModelConfig(**BASE, num_query_groups=2, sliding_window=4,
                      sliding_window_layers=(True, False), global_kv_channels=16,
                      global_num_query_groups=1, attention_k_eq_v=True, layer_scalar=True,
                      untie_embeddings_and_output_weights=False)
    local = D * 4 * 8 + 2 * D * 2 * 8 + 4 * 8 * D
    wide = D * 4 * 16 + D * 1 * 16 + 4 * 16 * D        # q, k (= v), o
    n = local + wide + 2 * 3 * D * 64 + D * V
    assert per_token(cfg) == 6 * n + 6 * 4 * (2 * 8 + 2 * 16) * T


def test_gemma4_small_per_layer_inputs_and_kv_sharing():
    """Three layers (sliding, global, then a sliding one sharing the first one's keys and
    values, its MLP twice as wide), per-layer inputs 8 wide: the sharing layer counts no key or
    value projection but its attention scores; the per-layer gates and projections and the
    model-wide input projection count, the per-layer table (a gather) does not."""
    cfg = ModelConfig(**{**BASE, "num_layers": 3}, num_query_groups=2, sliding_window=4,
                      sliding_window_layers=(True, False, True), global_kv_channels=16,
                      untie_embeddings_and_output_weights=False, per_layer_input_size=8,
                      kv_shared_layers=1, double_wide_shared_mlp=True)
    local = D * 4 * 8 + 2 * D * 2 * 8 + 4 * 8 * D
    wide = D * 4 * 16 + 2 * D * 2 * 16 + 4 * 16 * D
    shared = D * 4 * 8 + 4 * 8 * D + 3 * D * 128
    ple = 3 * 2 * D * 8 + D * 3 * 8
    n = local + wide + 2 * 3 * D * 64 + shared + ple + D * V
    assert per_token(cfg) == 6 * n + 6 * 4 * (2 * (2 * 8) + 2 * 16) * T


def test_windowed_and_chunked_layers_count_their_keys():
    """At T = 16, a layer with a window of 4 (or chunks of 4) counts 4 keys per query; the full
    layer 16; a NoPE layer of a chunked model attends fully."""
    from jaxtrain.metrics import flops_per_token

    full = ModelConfig(**BASE)
    dense, attn = flop_terms(full, abstract(full))
    per_layer = attn / 2
    windowed = full.replace(sliding_window=4, sliding_window_layers=(True, False))
    assert flops_per_token(windowed, abstract(windowed), T) == dense + per_layer * (4 + T)
    chunked = full.replace(attention_chunk_size=4, no_rope_layers=(False, True))
    assert flops_per_token(chunked, abstract(chunked), T) == dense + per_layer * (4 + T)
    assert flops_per_token(full, abstract(full), T) == dense + attn * T
