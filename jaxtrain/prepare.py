"""Command line: ``python -m jaxtrain.prepare CONFIG [key=value | --section.key value ...]``.

pgs's ``prepare``: score every conversation of ``data.dataset`` by how well the model
(``model.name_or_path``) already predicts it, drop outliers, pick ``preprocess.budget`` rows
by ``preprocess.strategy``, hold ``preprocess.eval_holdout`` rows out, and write them to
``preprocess.output_dir``; training with ``preprocess.enabled: true`` then reads those rows
instead of ``data.dataset`` (and the held-out ones as its validation set when
``data.eval_dataset`` is empty). It reads the same config as training: the dataset, its split,
``data.messages_field``, ``data.max_seq_length`` and the masking knobs.

Steps:

1. **Rows**: ``data.dataset`` read as training reads it; ``preprocess.max_samples`` > 0 keeps a
   seeded random sample of that many (in the sample's order).
2. **Encoding**: each row rendered and masked exactly as training encodes it
   (:func:`jaxtrain.data.sft.encode_rows`: chat template, ``max_seq_length``, the trained
   tokens). A row the encoder skips cannot be scored (counted by reason in the metadata, then
   removed by the filters); a malformed row is an error naming it.
3. **Scoring**: one teacher-forced forward per batch, no gradients. Rows are sorted by length
   and grouped into batches of at most ``preprocess.batch_size`` rows and
   ``preprocess.max_batch_tokens`` padded tokens, each padded to a length bucket (a power of
   two up to 256, then a multiple of 256) and a row count (a power of two) so few shapes
   compile. Each row gets the mean NLL of its targets (``_score_avg_nll``; perplexity
   ``_score_ppl``) and of its trained targets (``_score_response_*``); see
   :mod:`jaxtrain.data.prepared`. The output layer runs over chunks of positions, so the
   logits of a whole batch never exist at once. With ``preprocess.hes`` the same forward also
   gives each position's predictive entropy: HES is the sum of the highest
   ``preprocess.hes_top_k_pct`` percent of a row's target entropies (at least one; 0 for rows
   shorter than 5 tokens), ``_score_hes``, and ``_score_hes_normalized`` its min-max scaling
   over the rows with a positive HES.
4. **Buckets, filters, held-out rows, selection, files**: :mod:`jaxtrain.data.prepared`.
   ``preprocess.min_ppl`` / ``max_ppl`` (<= 0: no upper bound) on ``preprocess.filter_score``
   (response or full perplexity). Seeds: ``data.seed``, else ``seed`` (pgs: 42), for the
   max_samples sample, the held-out draw and the random / curriculum samples.
5. **Metadata** ``prepared_meta.json``: the model, dataset, settings, counts at each step
   (read, sampled, unscoreable by reason, removed by each filter, held out, selected), the
   selected rows' difficulty buckets and perplexity statistics, with ``preprocess.group_field``
   a profile of each group before (the rows the selection chose from) and after selection,
   and the source row numbers (0-based, in the dataset's read order) of the selected rows (in
   the file's order) and of the held-out ones.

Scoring runs on one device (JAX's first). A configuration problem prints one message on
stderr and exits with status 2.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import random
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import models
from jaxtrain.checkpoint import hf_init
from jaxtrain.config import ConfigError, load_config
from jaxtrain.data import chat, prepared, rows, sft
from jaxtrain.data.tokenizers import build_tokenizer
from jaxtrain.logs import setup_logging
from jaxtrain.loss import token_nll
from jaxtrain.models.transformer import hidden_states, logits_head
from jaxtrain.runtime import select_platform

USAGE = """usage: python -m jaxtrain.prepare CONFIG [OVERRIDE ...]

Score, filter and select the SFT rows of data.dataset with the model of model.name_or_path
(pgs prepare), writing them to preprocess.output_dir; then train with preprocess.enabled: true.

CONFIG     the training config (a pgs-style YAML file: model, data and preprocess sections)
OVERRIDE   key=value, --key value or --section.key value, as for python -m jaxtrain.train
           (e.g. preprocess.budget=5000 --preprocess.strategy curriculum)
--help     this text; the preprocess knobs: python -m jaxtrain.knobs --area preprocess
"""
EXIT_CONFIG = 2
MIN_BUCKET = 16        # shortest padded length
CHUNK = 256            # padded lengths above this are multiples of it (and the longest chunk)
CHUNK_TOKENS = 2048    # rows x positions per output-layer chunk (bounds the logits' memory)
PROGRESS_EVERY = 20    # batches between progress lines
KNOBS = ("output_dir", "format", "max_samples", "budget", "strategy", "group_field",
         "eval_holdout", "min_ppl", "max_ppl", "filter_score", "batch_size", "max_batch_tokens",
         "hes", "hes_top_k_pct")

log = logging.getLogger("jaxtrain.prepare")


# ---------------------------------------------------------------- batching


def bucket_length(n: int, cap: int) -> int:
    """The padded length of a sequence of ``n`` tokens: a power of two (at least MIN_BUCKET)
    up to CHUNK, above it the smaller of that power and ``cap`` rounded up to CHUNK."""
    b = max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())
    if b > CHUNK:
        b = min(b, -(-max(cap, n) // CHUNK) * CHUNK)
    return b


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def plan_batches(lengths: dict[int, int], batch_size: int, max_batch_tokens: int, cap: int
                 ) -> list[tuple[int, int, list[int]]]:
    """(padded length T, padded rows B, row ids) per batch, shortest rows first. A batch of
    length bucket T holds at most ``min(batch_size, max_batch_tokens // T)`` rows (at least
    one), so B·T stays within ``max_batch_tokens`` unless a single row exceeds it; B is the
    batch's row count rounded up to a power of two, within that bound."""
    def room(t: int) -> int:
        return max(1, min(batch_size, max_batch_tokens // t))

    out, current, t_cur = [], [], 0
    for i in sorted(lengths, key=lambda i: (lengths[i], i)):
        t = bucket_length(lengths[i], cap)
        if current and len(current) + 1 > room(t):
            out.append((t_cur, min(room(t_cur), 1 << (len(current) - 1).bit_length()), current))
            current = []
        current.append(i)
        t_cur = t
    if current:
        out.append((t_cur, min(room(t_cur), 1 << (len(current) - 1).bit_length()), current))
    return out


# ---------------------------------------------------------------- the model


def _token_scores(params, tokens, segment_ids, *, model_cfg, chunk: int, entropy: bool):
    """Per position t of tokens [B,T]: the NLL of token t+1 and (with ``entropy``) the
    entropy of the prediction, both [B,T] float32 (the last position's are meaningless)."""
    hidden = hidden_states(params, tokens, model_cfg, segment_ids=segment_ids)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    B, T, D = hidden.shape
    n = T // chunk
    h = hidden.reshape(B, n, chunk, D).swapaxes(0, 1)
    t = targets.reshape(B, n, chunk).swapaxes(0, 1)

    def one(xs):
        logits = logits_head(params, xs[0], model_cfg)
        nll = token_nll(logits, xs[1])
        if not entropy:
            return nll, jnp.zeros_like(nll)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        p = jnp.exp(logits - log_z[..., None])
        return nll, log_z - jnp.sum(p * logits, axis=-1)

    nll, ent = jax.lax.map(one, (h, t))
    return nll.swapaxes(0, 1).reshape(B, T), ent.swapaxes(0, 1).reshape(B, T)


class Scorer:
    """The jitted scoring forward of one model (one compilation per batch shape)."""

    def __init__(self, params, model_cfg, entropy: bool):
        self.params = params
        self.fn = jax.jit(functools.partial(_token_scores, model_cfg=model_cfg, entropy=entropy),
                          static_argnames=("chunk",))
        self.entropy = entropy

    def __call__(self, tokens: np.ndarray, segment_ids: np.ndarray):
        B, T = tokens.shape
        chunk = min(_pow2_floor(max(1, CHUNK_TOKENS // B)), min(T, CHUNK))
        nll, ent = self.fn(self.params, jnp.asarray(tokens), jnp.asarray(segment_ids),
                           chunk=chunk)
        return np.asarray(nll), (np.asarray(ent) if self.entropy else None)


def load_model(cfg, tok):
    """(ModelConfig, parameters on one device) of ``model.name_or_path``, as training builds
    the model from that directory."""
    path = hf_init.model_dir(cfg)
    if path is None:
        raise ConfigError("python -m jaxtrain.prepare scores rows with the model's own weights: "
                          "set model.name_or_path to a Hugging Face model directory")
    given = cfg["vocab_size"] if cfg.is_set("vocab_size") else None
    model_cfg = models.ModelConfig.from_config({**cfg, "vocab_size": max(given or 0,
                                                                         tok.vocab_size)})
    hf_init.check_weights(path)
    hf_init.check_vocab(path, model_cfg)
    abstract = models.abstract(model_cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = hf_init.load_params(path, model_cfg, abstract, jax.tree.map(lambda _: one, abstract))
    return model_cfg, params


# ---------------------------------------------------------------- scoring


def row_scores(nll: np.ndarray, weights: np.ndarray, length: int) -> dict:
    """pgs's score columns of one row from its per-position NLL (position t: target t+1)."""
    targets = nll[:length - 1].astype(np.float64)
    trained = np.asarray(weights[1:length]) > 0
    n_resp = int(trained.sum())
    response = float(targets[trained].mean()) if n_resp else None
    return prepared.scores(float(targets.mean()), response, length, n_resp)


def hes(entropy: np.ndarray, length: int, top_k_pct: float) -> float:
    """High-Entropy Sum: the sum of the highest ``top_k_pct`` percent (at least one) of the
    row's target entropies; 0 below 5 tokens (pgs)."""
    if length < 5:
        return 0.0
    ent = np.sort(entropy[:length - 1].astype(np.float64))
    k = max(1, int(len(ent) * top_k_pct / 100.0))
    return round(float(ent[-k:].sum()), 4)


def score(encoded: dict[int, chat.Encoded], scorer: Scorer, batch_size: int,
          max_batch_tokens: int, cap: int, hes_pct: float | None) -> dict[int, dict]:
    """Score columns of each encoded row (keys as ``encoded``'s)."""
    lengths = {i: len(e.ids) for i, e in encoded.items()}
    batches = plan_batches(lengths, max(1, batch_size), max(1, max_batch_tokens), cap)
    total = sum(lengths.values())
    log.info("scoring %d rows in %d batches (at most %d rows and %d padded tokens each)",
             len(encoded), len(batches), batch_size, max_batch_tokens)
    out, done, done_tokens, t0 = {}, 0, 0, time.perf_counter()
    for b, (T, B, ids) in enumerate(batches):
        tokens = np.zeros((B, T), np.int32)
        segments = np.zeros((B, T), np.int32)
        for r, i in enumerate(ids):
            tokens[r, :lengths[i]] = encoded[i].ids
            segments[r, :lengths[i]] = 1
        nll, ent = scorer(tokens, segments)
        for r, i in enumerate(ids):
            out[i] = row_scores(nll[r], encoded[i].weights, lengths[i])
            if hes_pct is not None:
                out[i]["_score_hes"] = hes(ent[r], lengths[i], hes_pct)
        done += len(ids)
        done_tokens += sum(lengths[i] for i in ids)
        if b % PROGRESS_EVERY == 0 or b == len(batches) - 1:
            rate = done_tokens / max(time.perf_counter() - t0, 1e-6)
            log.info("scored %d/%d rows (%.0f tokens/s, about %.0f s left)", done, len(encoded),
                     rate, (total - done_tokens) / max(rate, 1e-6))
    return out


def normalise_hes(scored: list[dict]) -> None:
    """``_score_hes_normalized``: min-max scaling over the rows with a positive HES (pgs)."""
    values = [r["_score_hes"] for r in scored if r.get("_score_hes", 0) > 0]
    if not values:
        return
    low, high = min(values), max(values)
    span = high - low if high > low else 1.0
    for r in scored:
        raw = r.get("_score_hes", 0.0)
        r["_score_hes_normalized"] = round((raw - low) / span, 4) if raw > 0 else 0.0


# ---------------------------------------------------------------- the pipeline


def dataset_source(cfg) -> sft.Source:
    """``data.dataset`` as training reads it (whatever ``preprocess.enabled`` says)."""
    if cfg["data.sources"]:
        raise ConfigError("python -m jaxtrain.prepare prepares data.dataset, and data.sources "
                          "lists several datasets: prepare each one with its own config "
                          "(data.dataset, preprocess.output_dir), then list their scored_data "
                          "files in data.sources")
    if not cfg["data.dataset"]:
        raise ConfigError("python -m jaxtrain.prepare needs data.dataset (a local .jsonl, .json "
                          "or .parquet file, or a folder of them)")
    return sft.Source(name=str(cfg["data.dataset"]), dataset=str(cfg["data.dataset"]),
                      split=cfg["data.dataset_split"], messages_field=cfg["data.messages_field"],
                      last_turn_only=cfg["data.last_turn_only"],
                      any_split=not cfg.is_set("data.dataset_split"))


def seed_of(cfg) -> int:
    return cfg["data.seed"] if cfg["data.seed"] is not None else cfg["seed"]


def prepare(cfg) -> dict:
    """Run the preparation the config describes; returns the metadata written."""
    p = {k: cfg[f"preprocess.{k}"] for k in KNOBS}
    seed, out_dir = seed_of(cfg), str(p["output_dir"])
    source = dataset_source(cfg)
    read = list(rows.read(source.files("data.dataset"), "data.dataset"))
    n_read = len(read)
    order = list(range(n_read))
    if 0 < p["max_samples"] < n_read:
        order = random.Random(seed).sample(order, p["max_samples"])
    read = [read[i] for i in order]
    if not read:
        raise ConfigError(f"data.dataset {source.dataset!r}: no rows")
    field = p["group_field"]
    if field and not any(field in r for _, r in read):
        raise ConfigError(f"preprocess.group_field {field!r}: no row of data.dataset has this "
                          f"field (the first row has {sorted(read[0][1])})")
    log.info("prepare: %d rows of %s (of %d read)", len(read), source.dataset, n_read)

    tok = build_tokenizer(cfg)
    if tok is None:
        raise ConfigError("python -m jaxtrain.prepare renders rows with the model's chat "
                          "template: set model.name_or_path (or tokenizer_model)")
    hf_tok = sft.hf_tokenizer(tok, "data.dataset", cfg)
    try:
        chat.check_template(hf_tok, sft.chat_options(cfg, source))
    except chat.BadTemplate as e:
        raise ConfigError(f"tokenizer_model {getattr(tok, 'path', '')}: {e}") from None
    encoded, skipped = {}, Counter()
    for j, (where, got) in enumerate(sft.encode_rows(read, hf_tok, cfg, source)):
        if isinstance(got, str):
            skipped[got] += 1
        elif len(got.ids) < 2:
            skipped["fewer than 2 tokens"] += 1
        else:
            encoded[j] = got
    if skipped:
        log.info("prepare: %d row(s) cannot be scored: %s", sum(skipped.values()),
                 ", ".join(f"{n} {why}" for why, n in skipped.most_common()))

    model_cfg, params = load_model(cfg, tok)
    hes_pct = p["hes_top_k_pct"] if p["hes"] else None
    got = score(encoded, Scorer(params, model_cfg, entropy=hes_pct is not None),
                p["batch_size"], p["max_batch_tokens"], cfg["seq_length"], hes_pct) \
        if encoded else {}
    scored, index = [], {}
    for j, (_, row) in enumerate(read):
        row.update(got.get(j) or prepared.unscoreable())
        if hes_pct is not None:
            row.setdefault("_score_hes", 0.0)
        index[id(row)] = order[j]
        scored.append(row)
    if hes_pct is not None:
        normalise_hes(scored)

    prepared.classify(scored)
    pool, removed = prepared.filter_rows(scored, p["min_ppl"], p["max_ppl"], p["filter_score"])
    if not pool:
        hint = ("preprocess.max_ppl: 0 turns the upper bound off (data far from the model's "
                "own, e.g. another language)" if p["max_ppl"] > 0 else
                "check data.messages_field and data.max_seq_length: rows the encoder skips "
                "cannot be scored")
        raise ConfigError(f"preprocess: no row of {len(scored)} passed the filters "
                          f"(filter_score {p['filter_score']}, min_ppl {p['min_ppl']}, max_ppl "
                          f"{p['max_ppl']}; removed: {dict(removed)}; unscoreable: "
                          f"{dict(skipped)}); {hint}")
    if 0 < len(pool) <= p["eval_holdout"]:
        raise ConfigError(f"preprocess.eval_holdout {p['eval_holdout']}: only {len(pool)} rows "
                          "passed the filters; hold out fewer so that some remain to train on")
    pool, held = prepared.split_holdout(pool, p["eval_holdout"], seed)
    selected = prepared.select(pool, p["budget"], p["strategy"], seed)
    if p["strategy"] == "curriculum":
        selected = prepared.order_curriculum(selected)

    out_file = prepared.write_rows(selected, out_dir, p["format"])
    eval_file = None
    if held:
        eval_file = prepared.write_rows(held, out_dir, p["format"], prepared.HOLDOUT)
    else:
        prepared.remove(out_dir, prepared.HOLDOUT)   # a stale holdout may overlap this selection
    meta = {
        "model": str(cfg[hf_init.KEY]), "source_dataset": source.dataset,
        "dataset_split": source.split, "messages_field": source.messages_field,
        "max_seq_length": cfg["seq_length"], "strategy": p["strategy"], "budget": p["budget"],
        "seed": seed, "filter_score": p["filter_score"], "min_ppl": p["min_ppl"],
        "max_ppl": p["max_ppl"], "format": out_file.rsplit(".", 1)[1], "output_file": out_file,
        "eval_file": eval_file, "num_samples": len(selected), "eval_holdout": len(held),
        "counts": {"read": n_read, "sampled": len(read), "scored": len(encoded),
                   "unscoreable": dict(skipped), "removed": dict(removed),
                   "passed_filters": len(pool) + len(held), "held_out": len(held),
                   "pool": len(pool), "selected": len(selected)},
        "difficulty_distribution": prepared.buckets(selected),
        "ppl_stats": prepared.ppl_stats(selected),
    }
    if hes_pct is not None:
        values = sorted(r["_score_hes"] for r in selected)
        meta["hes"] = {"top_k_pct": hes_pct, "median": values[len(values) // 2] if values
                       else None}
    if field:
        meta["group_field"] = field
        meta["groups"] = {"before": prepared.profile(pool, field),
                          "after": prepared.profile(selected, field)}
    meta["selected_rows"] = [index[id(r)] for r in selected]
    meta["eval_rows"] = [index[id(r)] for r in held]
    with open(os.path.join(out_dir, prepared.META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    stats = meta["ppl_stats"] or {}
    log.info("prepare: %d rows -> %s (response perplexity median %s, buckets %s)%s",
             len(selected), out_file, stats.get("median"), meta["difficulty_distribution"],
             f"; {len(held)} held out -> {eval_file}" if held else "")
    return meta


# ---------------------------------------------------------------- command line


def _fail(message: str) -> int:
    print(f"jaxtrain: {message}", file=sys.stderr)
    return EXIT_CONFIG


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE, end="")
        return 0
    if not argv:
        return _fail("give the training config: python -m jaxtrain.prepare CONFIG "
                     "[key=value ...] (see --help)")
    path, overrides = (None, argv) if argv[0].startswith("-") or "=" in argv[0] else (
        argv[0], argv[1:])
    try:
        cfg = load_config(path, overrides)   # no device count: scoring uses one device
        logger = setup_logging(cfg)
        for warning in cfg.warnings:
            logger.warning("%s", warning)
        select_platform(cfg)
        meta = prepare(cfg)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    held = f", {meta['eval_holdout']} held out in {meta['eval_file']}" if meta["eval_file"] else ""
    print(f"prepared {meta['num_samples']} of {meta['counts']['read']} rows in "
          f"{meta['output_file']}{held}; metadata in "
          f"{os.path.join(os.path.dirname(meta['output_file']), prepared.META)}")
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
