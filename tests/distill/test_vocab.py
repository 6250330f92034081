"""The shared vocabulary of a student and a teacher (jaxtrain.distill.vocab): the end-of-turn
swap (given or automatic), stop ids, completions cut for scoring, and tokenizer pairs refused
by the teacher's option name."""
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxtrain.config.errors import ConfigError
from jaxtrain.distill import vocab

CORPUS = ["the quick brown fox jumps over the lazy dog", "what follows red? blue",
          "perché città così naïve café größte número"] * 20


def _tok(corpus, size, specials, eos, extra=()):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    if extra:
        fast.add_special_tokens({"additional_special_tokens": list(extra)})
    return fast


@pytest.fixture(scope="module")
def pair():
    teacher = _tok(CORPUS, 300, ["<|endoftext|>", "<|eot|>"], "<|eot|>")
    student = _tok(CORPUS, 300, ["<|endoftext|>", "<|eot|>"], "<|eot|>", extra=["<|im_end|>"])
    student.eos_token = "<|im_end|>"
    return student, teacher


def test_shared_vocabulary_swap_and_stops(pair):
    student, teacher = pair
    im_end, eot = student.convert_tokens_to_ids("<|im_end|>"), teacher.eos_token_id
    b = vocab.bridge(student, teacher, teacher="big")          # automatic eos swap
    assert b.shared == len(teacher) and im_end >= b.shared
    assert b.swap == ((im_end, eot),) and im_end in b.stop_ids
    text = student.encode("the lazy dog", add_special_tokens=False)
    assert b.clean(text + [im_end, 5, 6]) == text + [im_end]        # stop kept, rest dropped
    assert b.to_teacher(text + [im_end]) == text + [eot]
    tool = len(student)                                              # an id beyond both
    assert b.clean(text + [tool, 7]) == text                         # cut before it
    given = vocab.bridge(student, teacher, teacher="big", eos_map={"<|im_end|>": "<|eot|>"},
                         stop_tokens=["<|endoftext|>"])
    assert given.swap == b.swap and student.convert_tokens_to_ids("<|endoftext|>") in \
        given.stop_ids
    assert given.vocab.size == b.shared and given.vocab.swap == b.swap


def test_pairs_without_a_shared_vocabulary_are_refused_by_name(pair):
    student, teacher = pair
    other = _tok(["entirely different words here"] * 20 + CORPUS[:1], 290,
                 ["<|endoftext|>", "<|eot|>"], "<|eot|>")
    with pytest.raises(ConfigError, match=r"teachers\.big: .*split .* differently.*xtok"):
        vocab.bridge(student, other, teacher="big")
    with pytest.raises(ConfigError, match=r"teachers\.big: the student's vocabulary .* smaller"):
        vocab.bridge(other, student, teacher="big")
    with pytest.raises(ConfigError, match=r"teachers\.big\.eos_map: token '<\|nope\|>'"):
        vocab.bridge(student, teacher, teacher="big", eos_map={"<|nope|>": "<|eot|>"})
    with pytest.raises(ConfigError, match=r"teachers\.big\.eos_map: student id .* inside"):
        vocab.bridge(student, teacher, teacher="big", eos_map={"<|eot|>": "<|endoftext|>"})
    with pytest.raises(ConfigError, match="model.stop_tokens: token '<x>'"):
        vocab.bridge(student, teacher, teacher="big", stop_tokens=["<x>"])
