"""A small English corpus generated on the spot, and a byte-level BPE tokenizer trained on it.

The text is produced by a seeded grammar (little stories, counting, arithmetic, calendars), so it
has real structure for a tiny model to learn, needs no download, and is the same on every
machine: the quickstart trains on it.
"""
from __future__ import annotations

import functools
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD = "<|endoftext|>"
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
ANIMALS = "cat dog fox owl horse goat rabbit mouse crow bear wolf duck".split()
ADJECTIVES = "small old quick quiet brown grey clever lazy young happy tired brave".split()
PLACES = "river hill barn forest garden field bridge village meadow pond".split()
THINGS = "apple stone feather basket rope lantern bell loaf key coin".split()
VERBS = (("finds", "found"), ("carries", "carried"), ("drops", "dropped"), ("hides", "hid"),
         ("watches", "watched"), ("follows", "followed"))


def _story(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    adj, place, thing = rng.choice(ADJECTIVES), rng.choice(PLACES), rng.choice(THINGS)
    now, past = rng.choice(VERBS)
    day = rng.choice(DAYS)
    return (f"On {day} the {adj} {a} walked to the {place}. There the {a} {past} a {thing}. "
            f"A {b} saw the {a} and asked, \"Where did you get the {thing}?\" "
            f"The {a} said, \"I {past.replace('ed', 'ed')} it by the {place}.\" "
            f"Now the {b} {now} the {thing} every {day}.")


def _arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 6)):
        x, y = rng.randint(0, 10), rng.randint(0, 10)
        lines.append(f"{NUMBERS[x]} plus {NUMBERS[y]} is {NUMBERS[x + y]}.")
    return " ".join(lines)


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 12)
    length = rng.randint(4, 8)
    return "Counting: " + ", ".join(NUMBERS[start:start + length]) + "."


def _calendar(rng: random.Random) -> str:
    i, j = rng.randrange(7), rng.randrange(12)
    return (f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}, and after {MONTHS[j]} comes "
            f"{MONTHS[(j + 1) % 12]}. The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.")


def documents(num_docs: int = 3000, seed: int = 0) -> list[str]:
    """``num_docs`` short documents (about 430 KB for the default), the same for a given seed."""
    rng = random.Random(seed)
    makers = (_story, _story, _arithmetic, _counting, _calendar)
    return [rng.choice(makers)(rng) for _ in range(num_docs)]


@functools.lru_cache(maxsize=4)
def tokenizer(vocab_size: int = 512, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer trained on :func:`documents`; ``EOD`` is token 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents(seed=seed), trainer=trainer)
    return tok
