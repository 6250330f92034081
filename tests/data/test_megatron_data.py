"""jaxtrain's GPT datasets side by side with Megatron's own (megatron-core's
``BlendedMegatronDatasetBuilder``, ``BlendedDataset`` and ``GPTDataset``) on the same tiny
indexed files, written by jaxtrain's own writer: blends weighted and unweighted, in the
``data_path`` + ``split`` form and the per-split form, compared sample by sample; and the loss
mask and token rewriting on the tokenizer's pad id. Skips when megatron.core cannot be
imported."""
import numpy as np
import pytest

from jaxtrain.data import gpt_dataset as gd
from jaxtrain.data.batches import TokenData, make_batch
from tests.data import helpers
from tests.megatron_ref import process_group_fixture  # noqa: F401 - used by pytestmark
from tests.megatron_ref import megatron_core, single_process_group

pytestmark = pytest.mark.usefixtures("process_group_fixture")

SEQ, SEED = 8, 1234


class StubTokenizer:
    """What Megatron's GPTDatasetConfig/GPTDataset read from a tokenizer (no pad unless given:
    reading ``pad`` then raises, as on Megatron tokenizers without one)."""

    def __init__(self, vocab_size=1000, eod=0, pad=None):
        self.vocab_size, self.eod, self.eos, self._pad = vocab_size, eod, eod, pad
        self.unique_identifiers = {"class": "StubTokenizer", "eod": eod, "pad": pad}

    @property
    def pad(self):
        if self._pad is None:
            raise AttributeError("no pad")
        return self._pad


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    """Three prefixes of different sizes (so their one-epoch sample counts differ), plus one
    of 10 long documents (split rounding)."""
    tmp = tmp_path_factory.mktemp("megatron_data")
    out = {}
    for name, n, seed in (("a", 60, 1), ("b", 150, 2), ("c", 90, 3)):
        out[name] = helpers.write_indexed(tmp / name, helpers.random_docs(n, vocab=900, lo=2,
                                                                          hi=30, seed=seed))
    out["ten"] = helpers.write_indexed(tmp / "ten", helpers.random_docs(10, vocab=900, lo=40,
                                                                        hi=60, seed=4))
    return out


def megatron_build(tmp_path, sizes, blend=None, blend_per_split=None, split=None, tok=None):
    megatron_core()
    single_process_group()
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ, blend=blend, blend_per_split=blend_per_split,
        split=split, path_to_cache=str(tmp_path / "megatron_cache"),
        tokenizer=tok or StubTokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


def _text(sample) -> np.ndarray:
    """Megatron's sample dict -> the T + 1 tokens it was cut from."""
    return np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])


def compare(mine, theirs, limit=None):
    """(samples compared, samples equal) over the first ``limit`` samples (all: None)."""
    assert (mine is None) == (theirs is None)
    if mine is None:
        return 0, 0
    assert len(mine) == len(theirs)
    n = len(theirs) if limit is None else min(limit, len(theirs))
    equal = sum(np.array_equal(np.asarray(mine[i], np.int64), _text(theirs[i])) for i in range(n))
    return n, equal


def _blend_arg(prefixes, weights):
    """jaxtrain's blend spelling ("w1 p1 w2 p2", or the prefixes alone)."""
    if weights is None:
        return list(prefixes)
    return " ".join(f"{w} {p}" for w, p in zip(weights, prefixes))


DATA_PATH_CASES = {
    "weighted": (("a", "b", "c"), (0.2, 0.3, 0.5), "90,7,3", [200, 40, 16]),
    "weighted_uneven": (("a", "b"), (30, 70), "98,2,0", [301, 7, 0]),
    "unweighted": (("a", "b"), None, "90,7,3", [200, 40, 16]),
    "unweighted_capped": (("a", "b", "c"), None, "90,7,3", [100_000, None, 16]),
    "single_weighted": (("b",), (1.0,), "90,7,3", [200, 40, 16]),
    "single_split_rounding": (("ten",), None, "45,45,10", [20, 20, None]),
}


@pytest.mark.parametrize("case", list(DATA_PATH_CASES))
def test_data_path_blends_equal_megatron(case, prefixes, tmp_path):
    names, weights, split, sizes = DATA_PATH_CASES[case]
    paths = [prefixes[n] for n in names]
    theirs = megatron_build(tmp_path, sizes, blend=(paths, list(weights) if weights else None),
                            split=split)
    mine = gd.build_datasets(seq_length=SEQ, seed=SEED, num_samples=sizes,
                             data_path=_blend_arg(paths, weights), split=split)
    for k, s in enumerate(gd.SPLITS):
        n, equal = compare(mine[s], theirs[k])
        assert equal == n, f"{case} {s}: {equal} of {n} samples agree"


PER_SPLIT_CASES = {
    "weighted": ([(("a", "b"), (1, 3)), (("b", "c"), (2, 2)), None], [200, 40, 0]),
    "unweighted": ([(("a", "b", "c"), None), (("a", "c"), None), (("b",), None)],
                   [200, None, 16]),
    "mixed": ([(("c", "a"), None), (("b", "a"), (0.9, 0.1)), (("c",), (1.0,))], [90, 30, 8]),
}


@pytest.mark.parametrize("case", list(PER_SPLIT_CASES))
def test_per_split_blends_equal_megatron(case, prefixes, tmp_path):
    blends, sizes = PER_SPLIT_CASES[case]
    per_split = [None if b is None else ([prefixes[n] for n in b[0]],
                                         list(b[1]) if b[1] else None) for b in blends]
    theirs = megatron_build(tmp_path, sizes, blend_per_split=per_split)
    args = {f"{s}_data_path": None if b is None else _blend_arg(*b)
            for s, b in zip(gd.SPLITS, per_split)}
    mine = gd.build_datasets(seq_length=SEQ, seed=SEED, num_samples=sizes, **args)
    for k, s in enumerate(gd.SPLITS):
        n, equal = compare(mine[s], theirs[k])
        assert equal == n, f"{case} {s}: {equal} of {n} samples agree"


def test_blend_sizes_are_megatrons(prefixes):
    """Each weighted part holds ceil(ceil(target·w)·1.005) samples, the blend Σ ceil(target·w);
    an unweighted blend is weighted by one epoch of each part, at most the target long."""
    a, b, c = prefixes["a"], prefixes["b"], prefixes["c"]
    out = gd.build_datasets(seq_length=SEQ, seed=SEED, num_samples=[301, None, None],
                            data_path=f"30 {a} 70 {b}", split="100,0,0")["train"]
    assert len(out) == 91 + 211                       # ceil(90.3) + ceil(210.7) > 301
    assert [d.num_samples for d in out.datasets] == [92, 213]
    out = gd.build_datasets(seq_length=SEQ, seed=SEED, num_samples=[10**6, None, None],
                            data_path=[a, b, c], split="100,0,0")["train"]
    epochs = [len(d) for d in out.datasets]
    assert len(out) == sum(epochs) and [d.num_samples for d in out.datasets] == [None] * 3
    counts = np.bincount(out.dataset_index, minlength=3)
    assert counts.tolist() == epochs                   # each part once, in proportion


# ----------------------------------------------------------------------------- pad ids

def _megatron_batch_fields(sample):
    return {"tokens": sample["tokens"].numpy(), "targets": sample["labels"].numpy(),
            "loss_mask": sample["loss_mask"].numpy()}


@pytest.mark.parametrize("pad,eod_mask", [(7, False), (7, True), (None, False), (0, True)])
def test_pad_labels_are_masked_and_rewritten_as_megatron(pad, eod_mask, tmp_path):
    """Megatron's GPTDataset masks the loss where the label is the tokenizer's pad id and
    rewrites pad ids to 0 in tokens and labels; a pad id equal to the EOD (pad 0 here) or
    absent (None) is no pad at all."""
    rng = np.random.RandomState(5)
    docs = []
    for _ in range(40):
        d = rng.randint(1, 12, rng.randint(3, 20))
        d[rng.rand(len(d)) < 0.3] = 7                 # pad ids inside the documents
        d[-1] = 0                                     # each document ends with the EOD (0)
        docs.append(d)
    prefix = helpers.write_indexed(tmp_path / "p", docs)
    tok = StubTokenizer(vocab_size=12, eod=0, pad=pad)
    theirs = megatron_build(tmp_path, [64, None, None], blend=([prefix], None),
                            split="100,0,0", tok=StubTokenizer(12, 0, pad))[0]
    mine = gd.build_datasets(seq_length=SEQ, seed=SEED, num_samples=[64, None, None],
                             data_path=prefix, split="100,0,0")["train"]
    data = TokenData(mine, 12, "indexed", eod=0, eod_mask_loss=eod_mask,
                     pad=gd.dataset_pad_id(tok))
    theirs.config.eod_mask_loss = eod_mask
    # Megatron caches the first sample's loss mask when no EOD option is on, then masks that
    # cached tensor in place on the pads: every later sample would inherit the first one's pad
    # positions (docs/fidelity.md). Compare with each sample's own mask.
    theirs.masks_and_position_ids_are_cacheable = False
    rows = np.stack([mine[i] for i in range(len(mine))])
    got = make_batch(rows, data, per_micro=1)
    for i in range(len(mine)):
        want = _megatron_batch_fields(theirs[i])
        for key in ("tokens", "targets", "loss_mask"):
            np.testing.assert_array_equal(got[key][i, 0], want[key], err_msg=f"{key} row {i}")
    if pad == 7:
        assert got["loss_mask"].min() == 0 and not np.any(got["targets"] == 7)


@pytest.mark.parametrize("pad_token", ["<pad>", helpers.EOD, None])
def test_hf_tokenizer_pad_id_is_megatrons(pad_token, tmp_path):
    """The pad id a Hugging Face tokenizer gives jaxtrain's GPT datasets is the one Megatron's
    GPTDataset takes from Megatron's HuggingFaceTokenizer over the same files (none when the
    tokenizer has no pad or pads with its EOS)."""
    megatron_core()
    from megatron.core.tokenizers import MegatronTokenizer
    from transformers import PreTrainedTokenizerFast

    from jaxtrain.data.tokenizers import HFTokenizer

    tok = helpers.word_tokenizer()
    tok.add_special_tokens(["<pad>"])
    kw = {"pad_token": pad_token} if pad_token else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=helpers.EOD, unk_token="<unk>",
                            **kw).save_pretrained(str(tmp_path / "tok"))
    theirs = MegatronTokenizer.from_pretrained(tokenizer_path=str(tmp_path / "tok"),
                                               metadata_path={"library": "huggingface"})
    mine = HFTokenizer(str(tmp_path / "tok"))
    prefix = helpers.write_indexed(tmp_path / "d", helpers.random_docs(20, vocab=16, lo=4))
    ds = megatron_build(tmp_path, [8, None, None], blend=([prefix], None), split="100,0,0",
                        tok=theirs)[0]
    want = ds._pad_token_id
    assert gd.dataset_pad_id(mine) == (None if want is None or want < 0 else want)
    assert (gd.dataset_pad_id(mine) is not None) == (pad_token == "<pad>")
