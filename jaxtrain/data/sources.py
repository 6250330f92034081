"""Choosing the training data from the config.

- Megatron ``mock_data`` and MaxText ``dataset_type: synthetic``: seeded uniform random tokens
  over ``vocab_size`` (nothing to learn: for throughput and plumbing); with ``packing`` on and
  ``max_segments_per_seq`` >= 2, each synthetic row is cut into 2..max_segments_per_seq
  attention segments, as MaxText's synthetic rows are;
- Megatron indexed files: ``data_path`` (a blend "w1 prefix1 w2 prefix2", cut by ``split``),
  or ``train_data_path``/``valid_data_path``/``test_data_path``, or a file holding the blend
  (``data_args_path``) or per-split blends (``per_split_data_args_path``): GPT samples built
  as Megatron builds them (:mod:`jaxtrain.data.gpt_dataset`);
- MaxText ``dataset_type: hf`` with ``hf_path`` (a local directory or file; its
  ``hf_data_dir`` sub-folder when there is one; of a directory, the files of split
  ``train_split``, named as Hugging Face names them) and/or ``hf_train_files`` (globs of
  .jsonl/.json/.parquet), and pgs ``data.dataset`` as a local file or folder (a folder's
  files of split ``data.dataset_split``): documents tokenised with the configured tokenizer,
  packed first-fit into ``seq_length + 1`` tokens when ``packing`` is on (else one padded
  document per row). The files are read and tokenised once at start-up (there is no
  streaming reader: ``data.streaming`` changes nothing; corpora larger than host memory go
  through ``python -m jaxtrain.data.preprocess`` into memory-mapped indexed files). pgs
  ``data.seed`` orders the training samples; pgs documents end with the EOD when packed;
- MaxText ``dataset_type: grain``: ``grain_train_files`` (a glob, or a weighted mixture;
  or ``grain_train_mixture_config_path``) of ArrayRecord/Parquet/TFRecord files
  (``grain_file_type``; :mod:`jaxtrain.data.grain_files`), packed by ``grain_packing_type``
  (hf and grain first_fit rows hold at most ``max_segments_per_seq`` documents when it is > 0);
  ``grain_eval_files`` is the validation set (hf: ``hf_eval_files`` or ``hf_eval_split``);

  MaxText's hf and grain documents are framed as MaxText frames them: the column
  ``train_data_columns`` (``eval_data_columns``) is tokenised (or read as token ids with
  ``tokenize_train_data``/``tokenize_eval_data`` false), BOS and EOS are added by ``add_bos``
  / ``add_eos`` (the EOS is the only separator between packed documents: attention and
  targets stay inside a document through its segment id, so add_eos false packs documents
  with nothing between them, as MaxText does), then a document longer than a sample is cut
  to one (``use_truncation``; hf keeps BOS/EOS and shortens the text, as Hugging Face's
  truncation does, grain cuts the framed ids) or split into sample-sized pieces. The samples
  are shuffled with ``data.seed`` (MaxText's data_shuffle_seed; set in MaxText and pgs files), or kept in file order
  (``enable_data_shuffling`` false);
- MaxText ``dataset_type: olmo_grain``: fixed windows of AI2's OLMo token files through
  ``olmo_index_path`` (:mod:`jaxtrain.data.olmo`); validation reads them in another order;
- ``dataset_type: corpus``: jaxtrain's generated text corpus with its own BPE tokenizer.

``dataloader_type`` sets the sample order (:mod:`jaxtrain.data.batches`);
``num_dataset_builder_threads`` threads build the indexed datasets' index arrays.

Validation and test sets (:func:`validation_data`, :func:`heldout_test_data`): the valid/test splits
of the Megatron data (``split`` of ``data_path``, or ``valid_data_path``/``test_data_path``),
sized as Megatron sizes them; with ``multiple_validation_sets`` each validation prefix is a
set of its own. Mock and synthetic data draw other random tokens per split. pgs
``data.eval_dataset`` is a local file read like ``data.dataset``: its first
``data.eval_samples`` documents; for a directory, ``data.eval_split`` picks the files whose
names start with the split (Hugging Face's convention: ``test.jsonl``, ``test-00000.parquet``,
``test/...``), while a single file is used whatever the split (as pgs reads local files).

The vocabulary given to the model is the tokenizer's (or ``vocab_size`` without one); the
model pads it by ``make_vocab_size_divisible_by``.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data import corpus, gpt_dataset, grain_files, olmo, preference, sft, text_files
from jaxtrain.data.rows import SPLIT_WORDS, _names_split, eval_files, hf_eval_files, hf_files
from jaxtrain.data.batches import TokenData, windows
from jaxtrain.data.tokenizers import build_tokenizer

MOCK_TOKENS = 1 << 20


def _loader(cfg, eod) -> dict:
    """TokenData's document-mask and loader fields from the config."""
    return dict(eod=eod, reset_position_ids=cfg["reset_position_ids"],
                reset_attention_mask=cfg["reset_attention_mask"],
                eod_mask_loss=cfg["eod_mask_loss"], dataloader_type=cfg["dataloader_type"],
                num_workers=cfg["num_workers"])


def _random_tokens(cfg, name: str, split: int = 0) -> TokenData:
    """Seeded uniform tokens; ``split`` 1 and 2 (valid, test) draw other streams. MaxText's
    synthetic rows are cut into segments when packing is on (:func:`_synthetic_segments`)."""
    vocab = cfg["vocab_size"]
    if not vocab:
        raise ConfigError(f"{name} needs vocab_size (the range of the random token ids)")
    rng = np.random.default_rng([cfg["seed"], split] if split else cfg["seed"])
    stream = rng.integers(0, vocab, size=MOCK_TOKENS, dtype=np.int32)
    rows = windows(stream, cfg["seq_length"])
    if not cfg["mock_data"] and _synthetic(cfg):
        rows = _synthetic_segments(cfg, rows, rng)
    return TokenData(rows, vocab, name,
                     dataloader_type=cfg["dataloader_type"], num_workers=cfg["num_workers"])


def _synthetic_segments(cfg, rows: np.ndarray, rng):
    """MaxText's synthetic rows with packing on and max_segments_per_seq >= 2: each row cut
    at random places into 2..max_segments_per_seq segments (at most seq_length), attention
    kept inside a segment, positions running on through the row and every target counted,
    as MaxText's ``_make_packed_segment_ids`` batches are; otherwise the rows unchanged."""
    T, most = cfg["seq_length"], cfg["max_segments_per_seq"]
    if not cfg["packing"] or most < 2 or T < 2:
        return rows
    n = len(rows)
    count = rng.integers(2, min(most, T) + 1, size=(n, 1))
    ranks = np.argsort(np.argsort(rng.random((n, T - 1)), axis=-1), axis=-1)
    starts = np.concatenate([np.ones((n, 1), bool), ranks < count - 1,
                             np.zeros((n, 1), bool)], axis=-1)   # the last target: last segment
    return text_files.Rows({"tokens": rows, "segment_ids": np.cumsum(starts, -1, np.int32),
                            "positions": np.broadcast_to(np.arange(T + 1, dtype=np.int32),
                                                         rows.shape)})


def _gpt_loader(cfg, tok) -> dict:
    """TokenData's fields for Megatron's GPT datasets: the document masks, the tokenizer's
    pad id masked and rewritten as Megatron's GPTDataset does, and Megatron's cyclic sampler
    order (:class:`~jaxtrain.data.batches.MegatronCyclicOrder`)."""
    return {**_loader(cfg, tok.eod if tok else None), "pad": gpt_dataset.dataset_pad_id(tok),
            "megatron_order": True}


def _corpus(cfg) -> TokenData:
    tok = corpus.tokenizer()
    eod = tok.token_to_id(corpus.EOD)
    ids = [i for doc in corpus.documents() for i in tok.encode(doc).ids + [eod]]
    vocab = tok.get_vocab_size()
    if cfg["vocab_size"] and cfg["vocab_size"] < vocab:
        raise ConfigError(f"vocab_size {cfg['vocab_size']} is smaller than the corpus "
                          f"tokenizer's {vocab}; leave vocab_size unset")
    return TokenData(windows(np.asarray(ids, np.int32), cfg["seq_length"]), vocab, "corpus",
                     **_loader(cfg, eod))


def _vocab(cfg, tok, name) -> int:
    """The model's vocabulary: the tokenizer's, or a larger vocab_size a model file or the
    config sets (MaxText model files and Hugging Face configs size the embedding themselves:
    Qwen3's 151,936 rows for a 151,669-token tokenizer); a smaller one yields to the tokenizer,
    as Megatron's vocab_size does."""
    if tok is not None:
        given = cfg["vocab_size"] if cfg.is_set("vocab_size") else None
        return max(given or 0, tok.vocab_size)
    if not cfg["vocab_size"]:
        raise ConfigError(f"{name}: set tokenizer_type/tokenizer_model (or vocab_size) so the "
                          "model knows the vocabulary")
    return cfg["vocab_size"]


def valid_samples(cfg, eval_iters: int) -> int | None:
    """Megatron's validation target for a set read ``eval_iters`` global batches per run: every
    periodic run plus the final one ((train_iters // eval_interval + 1) runs; one run with
    skip_train or without eval_interval). None (one epoch) with full_validation."""
    train_iters, interval = cfg["train_iters"], cfg["eval_interval"]
    if cfg["full_validation"] or not eval_iters:
        return None
    if cfg["skip_train"] or not interval:
        runs = 1
    elif train_iters:
        runs = train_iters // interval + 1
    else:
        return None
    return runs * eval_iters * cfg["global_batch_size"]


def split_samples(cfg) -> list[int | None]:
    """Megatron's train/valid/test sample targets: train_samples (or train_iters x global
    batch), :func:`valid_samples`, and eval_iters global batches (one epoch with
    full_validation)."""
    gbs = cfg["global_batch_size"]
    train_iters = cfg["train_iters"]
    train = cfg["train_samples"] or (train_iters * gbs if train_iters else None)
    eval_iters = cfg["eval_iters"] if isinstance(cfg["eval_iters"], int) else 0
    test = eval_iters * gbs if eval_iters and not cfg["full_validation"] else None
    return [train, valid_samples(cfg, eval_iters), test]


def _read_json(path, what):
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r}: no such file")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _megatron_paths(cfg):
    """(data_path blend, [train, valid, test] per-split blends) after reading the args files."""
    data_path = cfg["data_path"]
    per_split = [cfg["train_data_path"], cfg["valid_data_path"], cfg["test_data_path"]]
    if cfg["data_args_path"]:
        data_path = _read_json(cfg["data_args_path"], "data_args_path")
    if cfg["per_split_data_args_path"]:
        spec = _read_json(cfg["per_split_data_args_path"], "per_split_data_args_path")
        if not isinstance(spec, dict):
            raise ConfigError(f"per_split_data_args_path {cfg['per_split_data_args_path']}: "
                              "expected a JSON object with train/valid/test keys")
        per_split = [spec.get(s) for s in gpt_dataset.SPLITS]
    return data_path, per_split


def megatron_datasets(cfg, splits=gpt_dataset.SPLITS, num_samples=None, data_path=None,
                      per_split=None) -> dict:
    """{"train", "valid", "test"} GPT datasets (or None) from the Megatron data knobs; only
    ``splits`` are built. ``num_samples``/``data_path``/``per_split`` override the config's."""
    if data_path is None and per_split is None:
        data_path, per_split = _megatron_paths(cfg)
    per_split = per_split or [None] * 3
    if cfg["num_dataset_builder_threads"] < 1:
        raise ConfigError(f"num_dataset_builder_threads {cfg['num_dataset_builder_threads']}: "
                          "give at least 1 thread")
    return gpt_dataset.build_datasets(
        seq_length=cfg["seq_length"], seed=cfg["seed"],
        num_samples=num_samples or split_samples(cfg), data_path=data_path,
        split=cfg["split"], train_data_path=per_split[0], valid_data_path=per_split[1],
        test_data_path=per_split[2], cache_dir=cfg["data_cache_path"],
        mmap=cfg["mmap_bin_files"], splits=splits, threads=cfg["num_dataset_builder_threads"])


def _megatron(cfg) -> TokenData:
    tok = build_tokenizer(cfg)
    vocab = _vocab(cfg, tok, "data_path")
    train = megatron_datasets(cfg)["train"]
    if train is None:
        raise ConfigError("the train split is empty: check split and data_path")
    return TokenData(train, vocab, "indexed", **_gpt_loader(cfg, tok))


def _text_tokenizer(cfg, name: str):
    tok = build_tokenizer(cfg)
    if tok is None:
        raise ConfigError(f"{name}: text data needs a tokenizer: set tokenizer_type and "
                          "tokenizer_model (MaxText tokenizer_path)")
    return tok


def _text_field(cfg) -> str:
    columns = cfg["train_data_columns"]
    return columns if isinstance(columns, str) else columns[0]


def _encode(tok, texts) -> list:
    texts = list(texts)
    encode_batch = getattr(tok, "encode_batch", None)
    return encode_batch(texts) if encode_batch else [tok.encode(t) for t in texts]


def _packed(cfg, tok, docs, name: str, packing_type: str = "first_fit", eod_sep: bool = True,
            bos: int | None = None, vocab: int | None = None, max_docs: int | None = None,
            **loader) -> TokenData:
    """Token lists packed (``packing_type``: first_fit, best_fit, concat_then_split) or padded
    into samples of seq_length + 1 tokens; with ``eod_sep`` and packing each document ends
    with the EOD (the MaxText pipelines frame documents themselves: :func:`_framed`).
    ``max_docs`` caps the documents of a first_fit/best_fit row (max_segments_per_seq)."""
    eod = tok.eod if tok is not None else None
    if eod_sep and cfg["packing"] and eod is not None:
        docs = [list(d) + [eod] for d in docs]
    length = cfg["seq_length"] + 1
    if not cfg["packing"]:
        arrays = text_files.pad_rows(docs, length)
    elif packing_type == "concat_then_split":
        arrays = text_files.concat_split(docs, length, bos)
    else:
        arrays = text_files.pack(docs, length, "best" if packing_type == "best_fit" else "first",
                                 max_docs)
    if len(arrays["tokens"]) == 0:
        raise ConfigError(f"{name}: the documents hold no tokens")
    return TokenData(text_files.Rows(arrays), vocab or _vocab(cfg, tok, name), name,
                     **{**_loader(cfg, eod), "reset_position_ids": False,
                        "reset_attention_mask": False, **loader})


def _text(cfg, files: list[str], name: str, limit: int | None = None) -> TokenData:
    """pgs data.dataset documents of ``files`` (the first ``limit``), tokenised, packed or
    padded (an EOD after each document when packing; long documents split)."""
    tok = _text_tokenizer(cfg, name)
    texts = itertools.islice(text_files.read_documents(files, _text_field(cfg)), limit)
    return _packed(cfg, tok, _encode(tok, texts), name)


def _columns(cfg, split: str) -> tuple[str, bool, str]:
    """(field, tokenize, tokenize key) of MaxText's training or validation files."""
    key = "train_data_columns" if split == "train" else "eval_data_columns"
    columns = cfg[key]
    if isinstance(columns, list):
        if len(columns) != 1:
            raise ConfigError(f"{key} {columns}: pretraining data is read from one column; "
                              "name exactly one")
        columns = columns[0]
    tkey = "tokenize_train_data" if split == "train" else "tokenize_eval_data"
    return columns, cfg[tkey], tkey


def _framed(cfg, tok, docs, tokenize: bool, hf: bool) -> list[list[int]]:
    """MaxText's documents: token ids (``tokenize``: the texts encoded, BOS/EOS added by
    add_bos/add_eos when the tokenizer has them; else the ids as stored, framed by nothing),
    then cut to one sample (use_truncation; hf keeps BOS/EOS and shortens the text between,
    grain cuts the framed ids) or split into sample-sized pieces."""
    length = cfg["seq_length"] + 1
    head, tail = [], []
    if tokenize:
        docs = _encode(tok, docs)
        if cfg["add_bos"] and getattr(tok, "bos", None) is not None:
            head = [tok.bos]
        if cfg["add_eos"] and tok.eod is not None:
            tail = [tok.eod]
    out = []
    for ids in docs:
        ids = [int(i) for i in ids]
        start = head if not (head and ids[:1] == head) else []   # a tokenizer's own BOS
        if cfg["use_truncation"]:
            if hf:
                ids = start + ids[:max(0, length - len(start) - len(tail))] + tail
            else:
                ids = (start + ids + tail)[:length]
            out.append(ids)
        else:
            ids = start + ids + tail
            out += [ids[i:i + length] for i in range(0, len(ids), length)]
    return [d for d in out if d]


def _hf(cfg, files: list[str], name: str, split: str = "train") -> TokenData:
    """MaxText hf files: documents framed by :func:`_framed`, packed first-fit or padded."""
    field, tokenize, tkey = _columns(cfg, split)
    tok = _text_tokenizer(cfg, name) if tokenize else build_tokenizer(cfg)
    docs = _framed(cfg, tok, text_files.read_documents(files, field, not tokenize, tkey),
                   tokenize, hf=True)
    return _packed(cfg, tok, docs, name, eod_sep=False,
                   vocab=_vocab(cfg, tok, f"{name} (token ids)"),
                   max_docs=cfg["max_segments_per_seq"])


def _grain(cfg, key: str, name: str, workers_key: str) -> TokenData:
    """MaxText's grain files (:mod:`jaxtrain.data.grain_files`) of ``key``, framed as hf
    files are (but cut after BOS/EOS are added) and packed by ``grain_packing_type``."""
    split = "train" if key == "grain_train_files" else "eval"
    field, tokenize, tkey = _columns(cfg, split)
    tok = _text_tokenizer(cfg, name) if tokenize else build_tokenizer(cfg)
    mixture = cfg["grain_train_mixture_config_path"] if key == "grain_train_files" else ""
    if mixture:
        key, sources = "grain_train_mixture_config_path", grain_files.mixture_file(mixture)
    elif not cfg[key]:
        raise ConfigError(f"dataset_type grain needs {key} (a glob of "
                          f"{cfg['grain_file_type']} files)")
    else:
        sources = grain_files.parse_sources(cfg[key], key)
    docs = [_framed(cfg, tok, grain_files.read_texts(grain_files.find_files(pattern, key),
                                                     cfg["grain_file_type"], field,
                                                     not tokenize, tkey), tokenize, hf=False)
            for pattern, _ in sources]
    if len(docs) > 1 or sources[0][1] is not None:
        seed = cfg["data.seed"]
        docs = grain_files.mix(docs, [w for _, w in sources],
                               cfg["seed"] if seed is None else seed)
    else:
        docs = docs[0]
    bos = getattr(tok, "bos", None) if tokenize and cfg["add_bos"] else None
    # MaxText caps grain's first_fit bins only (its best_fit and concat_then_split take no cap)
    cap = cfg["max_segments_per_seq"] if cfg["grain_packing_type"] == "first_fit" else None
    return _packed(cfg, tok, docs, name, cfg["grain_packing_type"], eod_sep=False, bos=bos,
                   vocab=_vocab(cfg, tok, f"{name} (token ids)"), max_docs=cap,
                   **_workers(cfg, workers_key))


def _workers(cfg, key: str) -> dict:
    """grain_worker_count(_eval) as the set's loader threads (-1 keeps num_workers)."""
    workers = cfg[key]
    if workers < -1:
        raise ConfigError(f"{key} {workers}: give a count of 0 or more, or -1")
    return {"num_workers": workers} if workers >= 0 else {}


def _olmo(cfg, name: str, workers_key: str, eval_seed: int | None = None) -> TokenData:
    """MaxText's olmo_grain instances (:mod:`jaxtrain.data.olmo`); ``eval_seed`` orders a
    validation pass over them (always shuffled)."""
    source = olmo.instances(cfg)
    tok = build_tokenizer(cfg)
    loader = {**_loader(cfg, tok.eod if tok else None), **_workers(cfg, workers_key)}
    if eval_seed is not None:
        loader.update(dataloader_type="cyclic", seed=eval_seed)
    return TokenData(source, _vocab(cfg, tok, "dataset_type olmo_grain"), name, **loader)


def _dataset_files(cfg) -> list[str]:
    """pgs data.dataset: a file as it is, a folder's files of split data.dataset_split (all
    of them when the split is left at its default and no file name gives a split)."""
    spec, split = cfg["data.dataset"], cfg["data.dataset_split"]
    if os.path.isdir(spec) and not cfg.is_set("data.dataset_split"):
        files = text_files.expand(spec, "data.dataset")
        if not any(_names_split(f, spec, w) for f in files for w in (split, *SPLIT_WORDS)):
            return files
    return eval_files(spec, split, "data.dataset", "data.dataset_split")


def has_megatron_paths(cfg) -> bool:
    return any(cfg[k] for k in ("data_path", "train_data_path", "data_args_path",
                                "per_split_data_args_path"))


def training_data(cfg) -> TokenData:
    """The training set the config asks for, or a ConfigError saying how to ask for one."""
    data = _training_data(cfg)
    seed = cfg["data.seed"]
    if seed is not None:
        data = dataclasses.replace(data, seed=seed)
    if not cfg["enable_data_shuffling"] and data.name in ("dataset_type hf",
                                                          "dataset_type grain"):
        data = dataclasses.replace(data, dataloader_type="single")
    return data


def _training_data(cfg) -> TokenData:
    if cfg["mock_data"]:
        return _random_tokens(cfg, "mock_data")
    if has_megatron_paths(cfg):
        return _megatron(cfg)
    if cfg.get("dpo.enabled"):   # pgs DPO: preference pairs (jaxtrain.data.preference)
        tok = _text_tokenizer(cfg, "data.dataset")
        return preference.training_data(cfg, tok, _vocab(cfg, tok, "data.dataset"))
    if sft.wanted(cfg):
        tok = _text_tokenizer(cfg, "data.dataset")
        return sft.training_data(cfg, tok, _vocab(cfg, tok, "data.dataset"))
    if cfg.is_set("data.dataset"):
        return _text(cfg, _dataset_files(cfg), "data.dataset")
    kind = cfg["dataset_type"]
    if kind == "synthetic":
        return _random_tokens(cfg, "dataset_type synthetic")
    if kind == "corpus":
        return _corpus(cfg)
    if kind == "hf":
        return _hf(cfg, hf_files(cfg), "dataset_type hf")
    if kind == "grain":
        return _grain(cfg, "grain_train_files", "dataset_type grain", "grain_worker_count")
    if kind == "olmo_grain":
        return _olmo(cfg, "dataset_type olmo_grain", "grain_worker_count")
    raise ConfigError("no training data configured: set data_path (Megatron indexed files), "
                      "mock_data: true, dataset_type: hf with hf_path/hf_train_files, "
                      "dataset_type: grain with grain_train_files, dataset_type: olmo_grain "
                      "with olmo_index_path, dataset_type: synthetic or dataset_type: corpus")


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """Which training source a config names, its files, and the model's vocabulary."""

    name: str
    files: tuple[str, ...]
    vocab_size: int | None


def data_plan(cfg) -> DataPlan:
    """What :func:`training_data` would read, found without reading it: the source, that its
    files exist, that its tokenizer loads (a ConfigError naming the knob otherwise)."""
    if cfg["mock_data"] or (not has_megatron_paths(cfg) and not cfg.is_set("data.dataset")
                            and cfg["dataset_type"] == "synthetic"):
        name = "mock_data" if cfg["mock_data"] else "dataset_type synthetic"
        if not cfg["vocab_size"]:
            raise ConfigError(f"{name} needs vocab_size (the range of the random token ids)")
        return DataPlan(name, (), cfg["vocab_size"])
    if has_megatron_paths(cfg):
        data_path, per_split = _megatron_paths(cfg)
        keys = (["data_args_path" if cfg["data_args_path"] else "data_path"]
                + (["per_split_data_args_path"] * 3 if cfg["per_split_data_args_path"] else
                   ["train_data_path", "valid_data_path", "test_data_path"]))
        files = []
        for key, blend in zip(keys, [data_path, *per_split]):
            for prefix in gpt_dataset.parse_blend(blend, key)[0]:
                for ext in (".bin", ".idx"):
                    if not os.path.isfile(f"{prefix}{ext}"):
                        raise ConfigError(f"{key}: {prefix}{ext} does not exist (a Megatron "
                                          f"indexed dataset is PREFIX.bin + PREFIX.idx; write "
                                          f"them with python -m jaxtrain.data.preprocess)")
                    files.append(f"{prefix}{ext}")
        return DataPlan("indexed", tuple(files), _vocab(cfg, build_tokenizer(cfg), "data_path"))
    if cfg.get("dpo.enabled"):
        tok = _text_tokenizer(cfg, "data.dataset")
        return DataPlan("preference pairs", tuple(preference.plan(cfg, tok)),
                        _vocab(cfg, tok, "data.dataset"))
    if sft.wanted(cfg):
        tok = _text_tokenizer(cfg, "data.dataset")
        return DataPlan("chat data", tuple(sft.plan(cfg, tok)), _vocab(cfg, tok, "data.dataset"))
    if cfg.is_set("data.dataset"):
        files = _dataset_files(cfg)
        return DataPlan("data.dataset", tuple(files), _vocab(
            cfg, _text_tokenizer(cfg, "data.dataset"), "data.dataset"))
    kind = cfg["dataset_type"]
    if kind == "corpus":
        return DataPlan("corpus", (), corpus.tokenizer().get_vocab_size())
    if kind == "hf":
        files = hf_files(cfg)
        if not files:
            raise ConfigError("dataset_type hf needs hf_path (a local folder or file) or "
                              "hf_train_files")
        return DataPlan("dataset_type hf", tuple(files),
                        _vocab(cfg, _text_tokenizer(cfg, "dataset_type hf"), "dataset_type hf"))
    if kind == "grain":
        key = ("grain_train_mixture_config_path" if cfg["grain_train_mixture_config_path"]
               else "grain_train_files")
        if not cfg[key]:
            raise ConfigError(f"dataset_type grain needs grain_train_files (a glob of "
                              f"{cfg['grain_file_type']} files)")
        sources = (grain_files.mixture_file(cfg[key]) if key != "grain_train_files"
                   else grain_files.parse_sources(cfg[key], key))
        files = [f for pattern, _ in sources for f in grain_files.find_files(pattern, key)]
        field, tokenize, _ = _columns(cfg, "train")
        tok = _text_tokenizer(cfg, "dataset_type grain") if tokenize else build_tokenizer(cfg)
        return DataPlan("dataset_type grain", tuple(files),
                        _vocab(cfg, tok, "dataset_type grain (token ids)"))
    if kind == "olmo_grain":
        source = olmo.instances(cfg)   # the index and its token files (memory-mapped, not read)
        return DataPlan("dataset_type olmo_grain", tuple(f for f, _, _ in source.files), _vocab(
            cfg, build_tokenizer(cfg), "dataset_type olmo_grain"))
    return _training_data(cfg)   # the "no training data configured" error


def _eval_iters_per_set(cfg, n: int) -> list[int]:
    iters = cfg["eval_iters"]
    if isinstance(iters, int):
        return [iters] * n
    if len(iters) != n:
        raise ConfigError(f"eval_iters lists {len(iters)} counts for {n} validation set(s); "
                          "give one count per set (or a single integer)")
    return list(iters)


def _set_names(prefixes: list[str]) -> list[str]:
    names = [os.path.basename(p.rstrip("/")) or p for p in prefixes]
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]


def _megatron_valid(cfg, tok, vocab) -> list[TokenData] | None:
    loader = _gpt_loader(cfg, tok)
    data_path, per_split = _megatron_paths(cfg)
    if not cfg["multiple_validation_sets"]:
        iters = cfg["eval_iters"] if isinstance(cfg["eval_iters"], int) else 0
        ds = megatron_datasets(cfg, ("valid",), [None, valid_samples(cfg, iters), None],
                               data_path, per_split)["valid"]
        return [TokenData(ds, vocab, "validation", **loader)] if ds is not None else None
    if any(per_split):
        prefixes, weights = gpt_dataset.parse_blend(per_split[1], "valid_data_path")
        if weights is not None:
            raise ConfigError("multiple_validation_sets: the validation blend has weights; "
                              "list the prefixes alone (each one is evaluated as its own set)")
    else:
        prefixes, _ = gpt_dataset.parse_blend(data_path)
    if not prefixes:
        return None
    sets = []
    for prefix, name, iters in zip(prefixes, _set_names(prefixes),
                                   _eval_iters_per_set(cfg, len(prefixes))):
        target = [None, valid_samples(cfg, iters), None]
        if any(per_split):
            ds = megatron_datasets(cfg, ("valid",), target, None, [None, prefix, None])["valid"]
        else:
            ds = megatron_datasets(cfg, ("valid",), target, prefix, None)["valid"]
        if ds is None:
            raise ConfigError(f"multiple_validation_sets: {prefix} has no documents in the "
                              f"validation split (split {cfg['split']!r})")
        sets.append(TokenData(ds, vocab, name, **loader))
    return sets


def _has_megatron_eval_paths(cfg) -> bool:
    return has_megatron_paths(cfg) or bool(cfg["valid_data_path"] or cfg["test_data_path"])


def _synthetic(cfg) -> bool:
    return cfg["dataset_type"] == "synthetic"


def validation_data(cfg) -> list[TokenData] | None:
    """The validation set(s) the config holds (several with multiple_validation_sets), or None
    when the data has no validation split."""
    if cfg["mock_data"]:
        return [_random_tokens(cfg, "mock_data validation", split=1)]
    if _has_megatron_eval_paths(cfg):
        tok = build_tokenizer(cfg)
        return _megatron_valid(cfg, tok, _vocab(cfg, tok, "data_path"))
    if cfg["data.eval_samples"] < 1 and (cfg["data.eval_dataset"] or cfg["data.eval_sources"]):
        raise ConfigError(f"data.eval_samples {cfg['data.eval_samples']}: the validation "
                          "subset needs at least one sample")
    if cfg.get("dpo.enabled"):   # held-out preference pairs
        if not preference.has_eval(cfg):
            return None
        tok = _text_tokenizer(cfg, "data.eval_dataset")
        return preference.validation_sets(cfg, tok, _vocab(cfg, tok, "data.eval_dataset"))
    if cfg["data.eval_sources"] or (cfg["data.eval_dataset"] and sft.wanted(cfg)) or (
            sft.maxtext_sft(cfg) and sft.eval_sources(cfg)) or sft.holdout_source(cfg):
        tok = _text_tokenizer(cfg, "data.eval_dataset")
        return sft.validation_sets(cfg, tok, _vocab(cfg, tok, "data.eval_dataset"))
    if cfg["data.eval_dataset"]:
        files = eval_files(cfg["data.eval_dataset"], cfg["data.eval_split"])
        return [_text(cfg, files, "data.eval_dataset", limit=cfg["data.eval_samples"])]
    kind = None if cfg.is_set("data.dataset") else cfg["dataset_type"]
    if kind == "hf":
        files = hf_eval_files(cfg)
        return [_hf(cfg, files, "hf validation", "eval")] if files else None
    if kind == "grain" and cfg["grain_eval_files"]:
        return [_grain(cfg, "grain_eval_files", "grain_eval_files", "grain_worker_count_eval")]
    if kind == "olmo_grain":
        seed = cfg["data.seed"]
        seed = (cfg["seed"] if seed is None else seed) ^ olmo.EVAL_SEED_MASK
        return [_olmo(cfg, "olmo_grain validation", "grain_worker_count_eval", seed)]
    if _synthetic(cfg):
        return [_random_tokens(cfg, "dataset_type synthetic validation", split=1)]
    return None


def validation_plan(cfg) -> tuple[str, ...]:
    """The files :func:`validation_data` and :func:`heldout_test_data` would read, found
    without reading them: that they exist (a ConfigError naming the knob otherwise). The
    Megatron prefixes of the training blend are :func:`data_plan`'s."""
    if cfg["mock_data"]:
        return ()
    if _has_megatron_eval_paths(cfg):
        _, per_split = _megatron_paths(cfg)
        keys = (("per_split_data_args_path",) * 3 if cfg["per_split_data_args_path"] else
                ("train_data_path", "valid_data_path", "test_data_path"))
        files = []
        for key, blend in zip(keys, per_split):
            for prefix in gpt_dataset.parse_blend(blend, key)[0]:
                for ext in (".bin", ".idx"):
                    if not os.path.isfile(f"{prefix}{ext}"):
                        raise ConfigError(f"{key}: {prefix}{ext} does not exist (a Megatron "
                                          f"indexed dataset is PREFIX.bin + PREFIX.idx)")
                    files.append(f"{prefix}{ext}")
        return tuple(files)
    if cfg["data.eval_samples"] < 1 and (cfg["data.eval_dataset"] or cfg["data.eval_sources"]):
        raise ConfigError(f"data.eval_samples {cfg['data.eval_samples']}: the validation "
                          "subset needs at least one sample")
    if cfg.get("dpo.enabled"):
        return (tuple(preference.source(cfg, "data.eval_dataset").files("data.eval_dataset"))
                if preference.has_eval(cfg) else ())
    if cfg["data.eval_sources"] or sft.maxtext_sft(cfg) or sft.holdout_source(cfg):
        return tuple(f for s in sft.eval_sources(cfg) for f in s.files("data.eval_sources"))
    if cfg["data.eval_dataset"]:
        return tuple(eval_files(cfg["data.eval_dataset"], cfg["data.eval_split"]))
    kind = None if cfg.is_set("data.dataset") else cfg["dataset_type"]
    if kind == "hf":
        files = hf_eval_files(cfg)
        if files:
            _columns(cfg, "eval")
        return tuple(files or ())
    if kind == "grain" and cfg["grain_eval_files"]:
        _columns(cfg, "eval")
        key = "grain_eval_files"
        return tuple(f for pattern, _ in grain_files.parse_sources(cfg[key], key)
                     for f in grain_files.find_files(pattern, key))
    return ()


def heldout_test_data(cfg) -> TokenData | None:
    """The test set (Megatron's test split, or random tokens for mock data), or None."""
    if cfg["mock_data"] or _synthetic(cfg):
        return _random_tokens(cfg, "mock test", split=2)
    if not _has_megatron_eval_paths(cfg):
        return None
    tok = build_tokenizer(cfg)
    vocab = _vocab(cfg, tok, "data_path")
    ds = megatron_datasets(cfg, ("test",))["test"]
    return TokenData(ds, vocab, "test", **_gpt_loader(cfg, tok)) \
        if ds is not None else None
