"""Megatron's SentencePiece and BERT WordPiece tokenizers, and Primus's HF-backed types."""
import pytest

from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.data.sources import training_data
from jaxtrain.data.tokenizers import PRIMUS_HF, load_tokenizer
from tests.data import helpers
from tests.data.test_pipeline import config

spm = pytest.importorskip("sentencepiece")

LINES = ["the cat sat on the mat", "a dog ran far and the fox saw it", "owl and cat and dog"]


def sp_model(tmp_path, name="sp", **options):
    """A tiny BPE SentencePiece model trained on LINES (unk 0, bos 1, eos 2, no pad)."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(LINES * 20),
                                   model_prefix=str(tmp_path / name), vocab_size=40,
                                   model_type="bpe", minloglevel=2, **options)
    path = str(tmp_path / f"{name}.model")
    return path, spm.SentencePieceProcessor(model_file=path)


def test_sentencepiece_types_follow_megatron(tmp_path):
    path, sp = sp_model(tmp_path)
    n, cat = len(sp), sp.encode("the cat")
    gpt = load_tokenizer("GPTSentencePieceTokenizer", path)
    assert (gpt.vocab_size, gpt.eod, gpt.encode("the cat")) == (n, 2, cat)
    llama = load_tokenizer("Llama2Tokenizer", path)
    assert (llama.vocab_size, llama.eod, llama.encode("the cat")) == (n, 2, [1] + cat)
    assert llama.encode_batch(["the cat"]) == [[1] + cat]
    # <CLS> <SEP> <EOD> <MASK>, then <PAD> (the model has no pad piece), then the sentinels;
    # the BOS/EOS pieces exist already
    full = load_tokenizer("SentencePieceTokenizer", path, vocab_extra_ids=2)
    assert full.vocab_size == n + 7 and full.eod == n + 2
    assert (full.cls, full.sep, full.mask, full.pad, full.bos, full.eos) == (n, n + 1, n + 3,
                                                                              n + 4, 1, 2)
    assert full.extra_ids == [n + 5, n + 6]
    dog = sp.encode("dog")
    assert full.encode("the cat<EOD>dog<extra_id_1></s>") == cat + [n + 2] + dog + [n + 6, 2]
    assert full.decode(full.encode("the cat<EOD>dog")) == "the cat <EOD> dog"
    padded_path, padded = sp_model(tmp_path, "padded", pad_id=3)
    with_pad = load_tokenizer("SentencePieceTokenizer", padded_path)
    assert with_pad.pad == 3 and with_pad.vocab_size == len(padded) + 4


def test_sentencepiece_through_the_config(tmp_path):
    path, sp = sp_model(tmp_path)
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}] * 8)
    common = ["dataset_type=hf", f"hf_train_files={src}", f"tokenizer_model={path}",
              "add_bos=false"]
    full = training_data(config(*common, "tokenizer_type=SentencePieceTokenizer",
                                "vocab_extra_ids=3"))
    n = len(sp)
    assert full.vocab_size == n + 8 and full.eod == n + 2
    row = full.samples.arrays["tokens"][0]
    assert row[:len(sp.encode("the cat")) + 1].tolist() == sp.encode("the cat") + [n + 2]
    llama = training_data(config(*common, "tokenizer_type=Llama2Tokenizer"))
    assert llama.samples.arrays["tokens"][0][:4].tolist() == [1] + sp.encode("the cat") + [2]
    with pytest.raises(ConfigError, match="vocab_extra_ids 3: only SentencePieceTokenizer"):
        training_data(config(*common, "tokenizer_type=GPTSentencePieceTokenizer",
                             "vocab_extra_ids=3"))
    with pytest.raises(ConfigError, match="not a SentencePiece model"):
        load_tokenizer("GPTSentencePieceTokenizer", str(src))


def bert_vocab(tmp_path, extra=()):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "a", ",",
             "caf", "##e", "##é", "The", "CAT", "##S", *extra]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(words) + "\n")
    return str(path), len(words)


def test_bert_wordpiece(tmp_path):
    vocab, n = bert_vocab(tmp_path)
    text = "The CATS, café zebra"
    low = load_tokenizer("BertWordPieceLowerCase", vocab_file=vocab, vocab_extra_ids=2)
    assert low.encode(text) == [5, 6, 7, 9, 10, 11, 1]            # the cat ##s , caf ##e [UNK]
    case = load_tokenizer("BertWordPieceCase", vocab_file=vocab)
    assert case.encode(text) == [13, 14, 15, 9, 10, 12, 1]         # The CAT ##S , caf ##é [UNK]
    assert low.encode("[EOS]") == [1, 1, 1]          # appended tokens are ids only
    assert (low.bos, low.eos, low.eod, low.extra_ids, low.vocab_size) == (
        n, n + 1, n + 1, [n + 2, n + 3], n + 4)
    assert (low.cls, low.sep, low.pad, low.mask) == (2, 3, 0, 4)
    assert (case.eod, case.vocab_size) == (n + 1, n + 2)
    has_eos, m = bert_vocab(tmp_path, extra=("[EOS]",))
    assert load_tokenizer("BertWordPieceCase", vocab_file=has_eos).eod == m - 1
    (tmp_path / "short.txt").write_text("[UNK]\nthe\n")
    with pytest.raises(ConfigError, match=r"\[CLS\], \[SEP\], \[PAD\], \[MASK\] missing"):
        load_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "short.txt"))


def test_primus_types_load_hugging_face_tokenizers(tmp_path):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    for kind in PRIMUS_HF + ("Llama2Tokenizer",):                  # a directory: Primus's way
        t = load_tokenizer(kind, tok)
        assert t.encode("the cat") == [2, 3] and t.eod == 0, kind
    src = helpers.write_jsonl(tmp_path / "d.jsonl", [{"text": "dog sat"}] * 4)
    data = training_data(load_config(None, [
        "seq_length=8", "dataset_type=hf", f"hf_train_files={src}", f"tokenizer_model={tok}",
        "tokenizer_type=DeepSeekV3Tokenizer"], world_size=1))
    assert data.samples.arrays["tokens"][0][:3].tolist() == [4, 5, 0]


def test_refused_and_planned_tokenizer_types():
    for kind in ("MultimodalTokenizer", "NullMultimodalTokenizer"):
        with pytest.raises(ConfigError, match=f"tokenizer_type = '{kind}' is not supported.*"
                                              "vision-language"):
            load_config(None, [f"tokenizer_type={kind}"], world_size=1)
    with pytest.raises(ConfigError, match="not implemented yet: tokenizer_type = 'SFTTokenizer'"):
        load_config(None, ["tokenizer_type=SFTTokenizer"], world_size=1)
