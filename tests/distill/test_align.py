"""xtok's chunk alignment (jaxtrain.distill.align) between two different tiny byte-level BPE
tokenizers: every kept chunk is the same bytes on both sides, chunks close only at common
token ends, the student's own (non-canonical) sampled split is kept, whitespace chunks carry no
loss, a stop token pairs with the teacher's end of turn, and a broken UTF-8 tail is left out."""
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxtrain.distill import align

TEXT = "the quick brown fox  jumps over the lazy dog, così naïve"


def _tok(corpus, size, eos):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>", eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


@pytest.fixture(scope="module")
def pair():
    student = _tok([TEXT, "quick quick brown brown lazy"] * 30, 330, "<|im_end|>")
    teacher = _tok(["the fox over the dog", "naïve così"] * 30, 290, "<|eot|>")
    return student, teacher


def _joined(table, ids):
    return b"".join(table[i] for i in ids)


def test_chunks_are_the_same_bytes_on_both_sides(pair):
    student, teacher = pair
    s_ids = student.encode(TEXT, add_special_tokens=False)
    first = student.convert_tokens_to_ids(list("the"))     # "the" sampled byte by byte
    assert all(i is not None for i in first) and len(s_ids) > 0
    assert student.decode(s_ids[:1]) == "the"
    sampled = first + s_ids[1:]                            # not the canonical encoding
    a = align.ByteChunks(student, teacher, [student.eos_token_id], teacher.eos_token_id)
    t_ids, ch = a.view(sampled)
    assert teacher.decode(t_ids) == TEXT and t_ids != sampled
    sb, tb = a.student_bytes, a.teacher_bytes
    n = len(ch.keep)
    texts = []
    for c in range(n):
        s_part = [sampled[i] for i, k in enumerate(ch.student) if k == c]
        t_part = [t_ids[j] for j, k in enumerate(ch.teacher) if k == c]
        assert _joined(sb, s_part) == _joined(tb, t_part)
        texts.append(_joined(sb, s_part))
        assert ch.keep[c] == (not texts[-1].isspace())
    assert b"".join(texts) == TEXT.encode()
    assert not all(ch.keep)                                 # the double space's chunk
    for i, j in ch.one_to_one:
        assert ch.student.count(ch.student[i]) == 1 and ch.teacher.count(ch.teacher[j]) == 1
    assert ch.student[:3] == [0, 0, 0]                     # "t" "h" "e" form one chunk


def test_stop_token_and_broken_utf8_tail(pair):
    student, teacher = pair
    a = align.ByteChunks(student, teacher, [student.eos_token_id], teacher.eos_token_id)
    ids = student.encode("the dog", add_special_tokens=False) + [student.eos_token_id]
    t_ids, ch = a.view(ids)
    assert t_ids[-1] == teacher.eos_token_id
    assert (len(ids) - 1, len(t_ids) - 1) == ch.one_to_one[-1] and ch.keep[-1]
    assert a.clean(ids + [5, 6]) == ids and a.clean([5, len(student) + 3, 6]) == [5]
    head = student.convert_tokens_to_ids(["Ã"])[0]           # the first byte of "é" or "ï" ...
    tail_ids = student.encode("dog", add_special_tokens=False) + [head]
    t_ids, ch = a.view(tail_ids)
    assert ch.student[-1] == -1 and teacher.decode(t_ids) == "dog"


def test_common_ends():
    got = align.common_ends([2, 3, 6, 7], [1, 3, 4, 6, 8])
    assert [(list(s), list(t)) for s, t in got] == [([0, 1], [0, 1]), ([2], [2, 3]),
                                                    ([3], [4])]


def test_xtok_on_aligned_chunks_matches_numpy(pair):
    """The xtok loss on the chunks of two different tokenizers: per-token advantages are the
    teacher's chunk log-prob minus the student's, as a NumPy loop over the chunks gives them."""
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.distill import losses

    student, teacher = pair
    a = align.ByteChunks(student, teacher, [student.eos_token_id], teacher.eos_token_id)
    s_ids = student.encode(TEXT, add_special_tokens=False) + [student.eos_token_id]
    t_ids, ch = a.view(s_ids)
    rng = np.random.default_rng(0)
    s_lp = -rng.random(len(s_ids)).astype(np.float32)
    t_lp = -rng.random(len(t_ids)).astype(np.float32)
    n = len(ch.keep)
    t_chunk = np.asarray(align.chunk_logps(ch.teacher, t_lp, n), np.float32)
    w = np.full(len(s_ids), 1 / len(s_ids), np.float32)
    value, stats = losses.xtok(jnp.asarray(s_lp), jnp.asarray(ch.student), jnp.asarray(t_chunk),
                               jnp.asarray(ch.keep), jnp.asarray(w))
    want, k1 = 0.0, 0.0
    for c in range(n):
        s_rows = [i for i, k in enumerate(ch.student) if k == c]
        s_sum = s_lp[s_rows].sum()
        if ch.keep[c]:
            want += sum(w[i] * -(t_lp[[j for j, k in enumerate(ch.teacher) if k == c]].sum()
                                 - s_sum) for i in s_rows)
            k1 += s_sum - t_chunk[c]
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats["k1"]), k1, rtol=1e-5, atol=1e-5)
