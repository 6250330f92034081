"""pgs ``prepare``'s data side: scored rows -> difficulty buckets, filters, a held-out set, the
budget's selection, and the files training reads back (``preprocess.*``).

The scores themselves come from the model (:mod:`jaxtrain.prepare`); here a scored row is the
dataset's row with pgs's score columns added: ``_score_avg_nll`` / ``_score_ppl`` (mean NLL
of every target token of the encoded conversation, and its perplexity), ``_score_response_nll``
/ ``_score_response_ppl`` (the same over the trained tokens; the whole-sequence values when
none is trained), ``_score_length`` (tokens) and ``_score_response_token_count``; perplexities
are ``exp(min(nll, 20))`` rounded to 2 decimals, NLLs to 4, as pgs writes them. A row that
cannot be scored (the encoder skips it) gets infinite perplexities and length 0.

The steps, in pgs's order:

1. :func:`classify`: difficulty buckets by percentiles of the finite response perplexities
   of all scored rows: ``easy`` at or below the 25th (the value at index ``int(0.25 n)`` of
   the sorted list), ``hard`` at or above the 75th, ``medium`` between.
2. :func:`filter_rows`: a row whose perplexity (``filter_score``: response or full) is below
   ``min_ppl`` is too easy, above ``max_ppl`` (when > 0) too hard; then fewer than 10 tokens is
   too short and more than 32,768 too long.
3. :func:`split_holdout`: ``eval_holdout`` rows drawn at random (seeded) from the filtered
   rows, kept out of the selection.
4. :func:`select`: ``budget`` rows by ``strategy`` (when the budget is below the pool's size;
   else the pool, in its order):

   - ``random``: a seeded uniform sample;
   - ``curriculum``: a seeded uniform sample like ``random``, then (with or without a budget)
     ordered by response perplexity, lowest first, each row's ``_score_rank`` its place;
     training keeps that order;
   - ``optimal``: a J-shaped mix over the buckets whose shares follow the budget (below 2,000:
     35% easy, 50% medium, 15% hard; below 10,000: 25/50/20 + 5% very hard; else 20/50/25 + 5%),
     each share ``int(budget * share)`` and very hard the remainder; easy and medium take their
     bucket's rows in order (highest ``_score_ifd`` first when rows carry one), very hard the
     highest-perplexity hard rows, hard the next ones; a short bucket's shortfall comes from
     the unselected medium, then easy, then hard rows. Each selected row gets pgs's FLOW weight
     ``exp(-ppl / median ppl)`` (``_score_flow_weight``, of the selection's median);
   - ``balanced``: ``budget // 3`` rows of each bucket in order, the remainder from further
     medium rows (fewer than the budget when buckets run short, as in pgs);
   - ``medium_focus``: the rows closest to the pool's median response perplexity;
   - ``hard_focus``: the highest response perplexities;
   - ``flow``: the highest FLOW weights ``exp(-ppl / median ppl)``, i.e. the lowest response
     perplexities.

   Sorts are stable: ties keep the pool's order. The pool's median is pgs's, the element at
   index ``n // 2`` of the sorted values.
5. :func:`write_rows`: ``scored_data`` (and ``eval_data`` for the held-out rows) in
   ``output_dir`` as parquet, or as jsonl when asked or when the rows do not survive a parquet
   round trip unchanged (fields whose types differ between rows, keys some rows lack: Arrow
   would fill them with nulls, which a chat template can read differently); the other format's
   file of the same name is removed, so training cannot pick up a stale one. The metadata
   (``prepared_meta.json``) is written by the caller; :func:`profile` gives its per-group part.
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
from collections import Counter
from typing import Iterable

from jaxtrain.config.errors import ConfigError

PREPARED = "scored_data"
HOLDOUT = "eval_data"
META = "prepared_meta.json"
FORMATS = ("parquet", "jsonl")
STRATEGIES = ("random", "optimal", "curriculum", "balanced", "medium_focus", "hard_focus",
              "flow")
BUCKETS = ("easy", "medium", "hard")
MIN_TOKENS, MAX_TOKENS = 10, 32768   # pgs filter_samples's length bounds
NLL_CAP = 20.0                       # perplexities are exp(min(nll, NLL_CAP))
EASY_PERCENTILE, HARD_PERCENTILE = 25.0, 75.0
REASONS = ("too_easy", "too_hard", "too_short", "too_long")

RESPONSE_PPL, FULL_PPL = "_score_response_ppl", "_score_ppl"


# ---------------------------------------------------------------- files


def find(output_dir: str, basename: str = PREPARED) -> str | None:
    """``basename``.parquet (preferred) or .jsonl in ``output_dir``, or None."""
    for ext in FORMATS:
        path = os.path.join(str(output_dir), f"{basename}.{ext}")
        if os.path.isfile(path):
            return path
    return None


def read_meta(output_dir: str) -> dict:
    """The metadata of the preparation in ``output_dir`` ({} without a readable one)."""
    try:
        with open(os.path.join(str(output_dir), META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _dumps(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, default=repr)


def _lossless_parquet(rows: list[dict]):
    """The Arrow table of ``rows`` when it reads back exactly as written, else None."""
    import pyarrow as pa

    if not rows:
        return None
    try:
        table = pa.Table.from_struct_array(pa.array(rows))
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    back = table.to_pylist()
    if len(back) != len(rows) or any(_dumps(a) != _dumps(b) for a, b in zip(back, rows)):
        return None
    return table


def _write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_rows(rows: list[dict], output_dir: str, fmt: str, basename: str = PREPARED) -> str:
    """Write ``rows`` as ``basename``.parquet or .jsonl in ``output_dir`` (parquet falls back
    to jsonl when the rows do not round-trip through it); returns the path written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(output_dir, exist_ok=True)
    table = _lossless_parquet(rows) if fmt == "parquet" else None
    if table is not None:
        path = os.path.join(str(output_dir), f"{basename}.parquet")
        try:
            pq.write_table(table, path + ".tmp")
        except (pa.ArrowException, OSError, ValueError):   # e.g. a struct without fields
            table = None
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
    if table is None:
        path = os.path.join(str(output_dir), f"{basename}.jsonl")
        _write_jsonl(rows, path + ".tmp")
    os.replace(path + ".tmp", path)
    remove(output_dir, basename, keep=path.rsplit(".", 1)[1])
    return path


def remove(output_dir: str, basename: str, keep: str | None = None) -> None:
    """Delete ``basename``'s files in ``output_dir`` (all formats but ``keep``)."""
    for ext in FORMATS:
        path = os.path.join(str(output_dir), f"{basename}.{ext}")
        if ext != keep and os.path.isfile(path):
            os.remove(path)


# ---------------------------------------------------------------- scores


def scores(avg_nll: float, response_nll: float | None, length: int, n_response: int) -> dict:
    """pgs's score columns of a scored row (``response_nll`` None: nothing trained, the
    whole-sequence NLL stands in)."""
    response = avg_nll if not n_response or response_nll is None else response_nll
    return {"_score_ppl": round(math.exp(min(avg_nll, NLL_CAP)), 2),
            "_score_response_ppl": round(math.exp(min(response, NLL_CAP)), 2),
            "_score_length": int(length),
            "_score_avg_nll": round(float(avg_nll), 4),
            "_score_response_nll": round(float(response), 4),
            "_score_response_token_count": int(n_response)}


def unscoreable() -> dict:
    return {"_score_ppl": math.inf, "_score_response_ppl": math.inf, "_score_length": 0}


def _median(values: list[float]) -> float:
    """pgs's median: the element at index n // 2 of the sorted values."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def classify(rows: list[dict]) -> None:
    """Set ``_score_difficulty_bucket`` of every row from the response-perplexity percentiles
    of the rows with a finite one (no bucket when none has)."""
    ppls = sorted(r[RESPONSE_PPL] for r in rows if r.get(RESPONSE_PPL, math.inf) < math.inf)
    if not ppls:
        return
    n = len(ppls)
    easy, hard = ppls[int(n * EASY_PERCENTILE / 100)], ppls[int(n * HARD_PERCENTILE / 100)]
    for r in rows:
        ppl = r.get(RESPONSE_PPL, math.inf)
        r["_score_difficulty_bucket"] = ("easy" if ppl <= easy else "hard" if ppl >= hard
                                         else "medium")


def filter_rows(rows: list[dict], min_ppl: float, max_ppl: float, score: str = "response"
                ) -> tuple[list[dict], Counter]:
    """(the rows kept, how many were removed for each reason); ``max_ppl`` <= 0 has no upper
    perplexity bound."""
    key = RESPONSE_PPL if score == "response" else FULL_PPL
    kept, removed = [], Counter({r: 0 for r in REASONS})
    for r in rows:
        ppl = r.get(key, r.get(FULL_PPL, math.inf))
        length = r.get("_score_length", 0)
        if ppl < min_ppl:
            removed["too_easy"] += 1
        elif max_ppl > 0 and ppl > max_ppl:
            removed["too_hard"] += 1
        elif length < MIN_TOKENS:
            removed["too_short"] += 1
        elif length > MAX_TOKENS:
            removed["too_long"] += 1
        else:
            kept.append(r)
    return kept, removed


def split_holdout(rows: list[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(the rest, ``n`` rows drawn with ``random.Random(seed)``), both in the rows' order;
    nothing is held out for ``n`` <= 0 or ``n`` >= the row count (pgs)."""
    if n <= 0 or n >= len(rows):
        return rows, []
    picked = set(random.Random(seed).sample(range(len(rows)), n))
    return ([r for i, r in enumerate(rows) if i not in picked],
            [r for i, r in enumerate(rows) if i in picked])


def optimal_mix(budget: int) -> tuple[float, float, float, float]:
    """pgs's budget-dependent (easy, medium, hard, very hard) shares."""
    if budget < 2_000:
        return 0.35, 0.50, 0.15, 0.00
    if budget < 10_000:
        return 0.25, 0.50, 0.20, 0.05
    return 0.20, 0.50, 0.25, 0.05


def _ppl(r: dict, default: float = 0.0) -> float:
    return r.get(RESPONSE_PPL, default)


def _by_ifd(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r.get("_score_ifd", 1.0), reverse=True)


def _optimal(rows: list[dict], budget: int) -> list[dict]:
    f_easy, f_medium, f_hard, _ = optimal_mix(budget)
    bucket = {b: [r for r in rows if r.get("_score_difficulty_bucket") == b] for b in BUCKETS}
    n_easy, n_medium, n_hard = (int(budget * f) for f in (f_easy, f_medium, f_hard))
    n_very_hard = budget - n_easy - n_medium - n_hard
    hardest = sorted(bucket["hard"], key=_ppl, reverse=True)
    chosen = (_by_ifd(bucket["easy"])[:n_easy] + _by_ifd(bucket["medium"])[:n_medium]
              + _by_ifd(hardest[n_very_hard:])[:n_hard] + hardest[:n_very_hard])
    if len(chosen) < budget:
        taken = {id(r) for r in chosen}
        spare = [r for b in ("medium", "easy", "hard") for r in _by_ifd(bucket[b])
                 if id(r) not in taken]
        chosen += spare[:budget - len(chosen)]
    if chosen:
        tau = _median([_ppl(r, 1.0) for r in chosen])
        for r in chosen:
            r["_score_flow_weight"] = round(math.exp(-_ppl(r, tau) / max(tau, 1e-6)), 4)
    return chosen


def select(rows: list[dict], budget: int, strategy: str, seed: int) -> list[dict]:
    """``budget`` of ``rows`` by ``strategy`` (see the module docstring); all of them, in their
    order, when the budget does not cut. Curriculum's ordering is :func:`order_curriculum`."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"preprocess.strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if budget <= 0 or budget >= len(rows):
        return list(rows)
    if strategy in ("random", "curriculum"):
        return random.Random(seed).sample(rows, budget)
    if strategy == "optimal":
        return _optimal(rows, budget)
    if strategy == "flow":
        tau = _median([_ppl(r, 1.0) for r in rows])
        weight = {id(r): math.exp(-_ppl(r, tau) / max(tau, 1e-6)) for r in rows}
        chosen = sorted(rows, key=lambda r: weight[id(r)], reverse=True)[:budget]
        for r in chosen:
            r["_score_flow_weight"] = weight[id(r)]
        return chosen
    if strategy == "balanced":
        bucket = {b: [r for r in rows if r.get("_score_difficulty_bucket") == b] for b in BUCKETS}
        per = budget // 3
        chosen = bucket["easy"][:per] + bucket["medium"][:per] + bucket["hard"][:per]
        return chosen + bucket["medium"][per:per + budget - len(chosen)]
    if strategy == "medium_focus":
        mid = _median([_ppl(r) for r in rows])
        return sorted(rows, key=lambda r: abs(_ppl(r) - mid))[:budget]
    return sorted(rows, key=_ppl, reverse=True)[:budget]   # hard_focus


def order_curriculum(rows: list[dict]) -> list[dict]:
    """Lowest response perplexity first (stable), ``_score_rank`` set to each row's place."""
    out = sorted(rows, key=_ppl)
    for i, r in enumerate(out):
        r["_score_rank"] = i
    return out


# ---------------------------------------------------------------- summaries


def group_value(row: dict, field: str) -> str:
    """A row's group under ``field`` as a JSON object key ("(missing)" without the field)."""
    if field not in row or row[field] is None:
        return "(missing)"
    value = row[field]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def profile(rows: Iterable[dict], field: str) -> dict:
    """Per group of ``field``: count, median response NLL, mean response tokens and the
    difficulty buckets' counts (sorted by group)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_value(r, field), []).append(r)
    out = {}
    for name in sorted(groups):
        members = groups[name]
        nlls = [r["_score_response_nll"] for r in members if "_score_response_nll" in r]
        tokens = [r.get("_score_response_token_count", 0) for r in members]
        counts = Counter(r.get("_score_difficulty_bucket", "unknown") for r in members)
        out[name] = {"count": len(members),
                     "median_response_nll": round(_median(nlls), 4) if nlls else None,
                     "mean_response_tokens": round(statistics.fmean(tokens), 2),
                     "buckets": {**{b: counts.pop(b, 0) for b in BUCKETS}, **counts}}
    return out


def buckets(rows: Iterable[dict]) -> dict:
    """How many rows of each difficulty bucket."""
    return dict(Counter(r.get("_score_difficulty_bucket", "unknown") for r in rows))


def ppl_stats(rows: list[dict]) -> dict | None:
    ppls = [r[RESPONSE_PPL] for r in rows if RESPONSE_PPL in r]
    if not ppls:
        return None
    return {"min": round(min(ppls), 2), "median": round(_median(ppls), 2),
            "max": round(max(ppls), 2), "mean": round(statistics.fmean(ppls), 2)}
