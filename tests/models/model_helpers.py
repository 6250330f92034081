"""Helpers for the model tests: tiny configs, perturbed parameters, token batches."""
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models import ModelConfig, abstract

VOCAB, SEQ = 97, 16


def tiny(**changes) -> ModelConfig:
    """A 2-layer GQA Llama-like config; ``changes`` override fields."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    return ModelConfig(**{**base, **changes})


def random_params(cfg, seed=0, scale=0.3):
    """Random parameters for ``cfg`` without compiling anything (numpy, seeded by leaf path).

    Weights and biases are N(0, scale); norm scales are 1 + N(0, scale) (N(0, scale) when
    zero-centred). A leaf with the same path and shape gets the same value in every config, so
    two configs differ only in the parameters one of them lacks.
    """
    def leaf(path, spec):
        name = jax.tree_util.keystr(path)
        rng = np.random.RandomState((zlib.crc32(name.encode()) + seed) % 2**32)
        x = scale * rng.standard_normal(spec.shape)
        if name.endswith("['scale']") and not cfg.apply_layernorm_1p:
            x = x + 1.0
        return jnp.asarray(x, spec.dtype)

    return jax.tree_util.tree_map_with_path(leaf, abstract(cfg))


def tokens(batch=2, seq=SEQ, vocab=VOCAB, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (batch, seq)), jnp.int32)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def check_packed_sequences(params, cfg, tol: float = 1e-5):
    """Two documents packed in a row (segments 1 and 2, positions from 0 in each) give each
    document's logits as if it ran alone."""
    from jaxtrain.models import forward

    a, b = tokens(1, 7, seed=1), tokens(1, 9, seed=2)
    packed = forward(params, jnp.concatenate([a, b], 1), cfg,
                     segment_ids=jnp.asarray([[1] * 7 + [2] * 9]),
                     positions=jnp.asarray([list(range(7)) + list(range(9))]))
    assert float(jnp.abs(packed[:, :7] - forward(params, a, cfg)).max()) <= tol
    assert float(jnp.abs(packed[:, 7:] - forward(params, b, cfg)).max()) <= tol


def check_left_padded_decode(params, cfg, new_tokens: int = 5):
    """A short prompt left-padded next to a long one continues as it does alone (greedy):
    padding leaves no trace in a recurrent layer's state or convolution."""
    import numpy as np

    from jaxtrain.models import generate
    from jaxtrain.models.decode import left_pad

    short, long = [5, 9], [3, 1, 4, 1, 5, 9, 2]
    ids, pad = left_pad([short, long])
    both = np.asarray(generate(params, cfg, ids, new_tokens, pad=pad))
    alone = np.asarray(generate(params, cfg, jnp.asarray([short]), new_tokens))
    np.testing.assert_array_equal(both[0], alone[0])
