"""The pipeline plan from Megatron's and Primus's knobs: which layers each stage holds and
which schedule runs them (:func:`plan`).

Stages are numbered in layer order: with p pipeline ranks and v model chunks per rank, stage
s = c·p + r is chunk c of rank r (Megatron's interleaving). The split, first rule that applies:

- ``pipeline_model_parallel_layout`` (Megatron's layout language): stages separated by ``|``,
  ``E`` the embedding (first stage), ``t`` a decoder layer, ``L`` the loss (last stage), ``m``
  an MTP layer; ``x*n`` and ``(...)*n`` repeat, commas are cosmetic. The stage count / p gives v.
  The MTP layers (mtp_num_layers of them, all in the last stage of one rank) run with the
  output layer on the last rank; a layout that gives them another rank (Megatron's
  mtp_standalone) is accepted and they still run there.
- ``decoder_pipeline_manual_split_list`` (Primus): layers per rank (length p; each rank's
  share split evenly over its chunks) or per stage (length p·v).
- Otherwise Megatron's rule: ``decoder_first/last_pipeline_num_layers`` fix the first/last
  rank's layers and the rest are split evenly over the middle ranks; else every rank gets
  (L + [embedding] + [loss]) / p, counting the embedding and loss as one layer each when
  ``account_for_embedding/loss_in_pipeline_split`` (their stage then builds one decoder layer
  fewer); ``standalone_embedding_stage`` gives the first rank no decoder layers. Each rank's
  layers are split evenly over its v chunks.

The schedule: ``pipeline_schedule`` when set; else Primus's ``pp_algorithm`` under
``patch_primus_pipeline`` (zero-bubble = ZB-H1, zero-bubble-heuristic = ZB-H2 planned with
``pp_cost_f/b/w``, zbv-formatted / v-half / v-min = the V schedule with 2p − 1 / p / ⌈2p/3⌉
chunk forwards in flight); else ``patch_zero_bubble`` (ZB-H1, ZB-H2 when
``zero_bubble_max_pending_backward`` is 2p, the V schedule with ``zero_bubble_v_schedule``);
else ``enable_1f1b_v`` (Primus's 1F1B-V: the V placement with whole backwards); else
Megatron's 1F1B, interleaved with virtual stages.
"""
from __future__ import annotations

import dataclasses
import re

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.patterns import dsa_shared_pattern
from jaxtrain.parallel import schedules as sched

_LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def parse_layout(text: str) -> list[str]:
    """The layout string expanded into one string per stage (``"Et*2|tt|tL"`` ->
    ``["Ett", "tt", "tL"]``)."""
    s = text.replace(",", "").replace(" ", "")
    for _ in range(32):   # innermost parentheses first, then single characters
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        if new == s:
            break
        s = new
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = sorted(set(s) - set(_LAYER_CHARS) - {"|"})
    if bad:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} does not parse: unknown "
                          f"{''.join(bad)!r}; use E (embedding), t (decoder layer), m (MTP), "
                          f"L (loss), | between stages, x*n and (...)*n to repeat")
    return s.split("|")


def _from_layout(text: str, num_layers: int, p: int, mtp_layers: int = 0) -> tuple[int, ...]:
    stages = parse_layout(text)
    if len(stages) % p:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} has {len(stages)} stages, "
                          f"not a multiple of pipeline_model_parallel_size {p}")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r}: the embedding E must come "
                          f"once, first")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r}: the loss L must come once, "
                          f"last")
    _check_mtp(text, stages, p, mtp_layers)
    counts = tuple(st.count("t") for st in stages)
    if sum(counts) != num_layers:
        raise ConfigError(f"pipeline_model_parallel_layout {text!r} places {sum(counts)} "
                          f"decoder layers (t); the model has num_layers {num_layers}")
    return counts


def _check_mtp(text: str, stages: list[str], p: int, mtp_layers: int):
    """Megatron's rules for the MTP layers (m) of a layout: mtp_num_layers of them, after every
    decoder layer, all in one stage that is the last of its rank."""
    flat = "".join(stages)
    where = f"pipeline_model_parallel_layout {text!r}"
    if flat.count("m") != mtp_layers:
        raise ConfigError(f"{where} places {flat.count('m')} MTP layers (m); mtp_num_layers is "
                          f"{mtp_layers}")
    if not mtp_layers:
        return
    if "t" in flat[flat.index("m"):]:
        raise ConfigError(f"{where}: the MTP layers (m) must come after every decoder layer (t)")
    holders = [i for i, st in enumerate(stages) if "m" in st]
    v = len(stages) // p
    if len(holders) > 1 or holders[0] // p != v - 1:
        raise ConfigError(f"{where}: the MTP layers (m) must all sit in one stage, the last "
                          f"virtual stage of its rank (as in Megatron)")


def mtp_standalone(cfg, p: int) -> int | None:
    """Megatron's mtp_standalone: the rank other than the last whose stage the layout gives
    the MTP layers, else None (the executor runs them with the output layer on the last
    rank either way)."""
    layout = cfg.get("pipeline_model_parallel_layout")
    if not layout or not cfg.get("mtp_num_layers"):
        return None
    ranks = {i % p for i, st in enumerate(parse_layout(layout)) if "m" in st} - {p - 1}
    return min(ranks) if ranks else None


def _even(n: int, parts: int, what: str) -> list[int]:
    if n % parts:
        raise ConfigError(what)
    return [n // parts] * parts


def stage_layers(cfg, num_layers: int, p: int, v: int) -> tuple[int, ...]:
    """Decoder layers per stage (p·v stages, in stage order) for the knobs of ``cfg``."""
    layout = cfg.get("pipeline_model_parallel_layout")
    if layout:
        counts = _from_layout(layout, num_layers, p, cfg.get("mtp_num_layers") or 0)
        if len(counts) != p * v:
            raise ConfigError(f"pipeline_model_parallel_layout gives {len(counts) // p} stages "
                              f"per rank; the virtual pipeline size says {v}")
        return counts
    manual = cfg.get("decoder_pipeline_manual_split_list")
    if manual:
        manual = [int(n) for n in manual]
        if sum(manual) != num_layers or min(manual) < 0:
            raise ConfigError(f"decoder_pipeline_manual_split_list {manual} must give "
                              f"non-negative layer counts summing to num_layers {num_layers}")
        if len(manual) == p * v:
            return tuple(manual)
        if len(manual) != p:
            raise ConfigError(f"decoder_pipeline_manual_split_list has {len(manual)} entries; "
                              f"give one per pipeline rank ({p}) or per stage ({p * v})")
        per_rank = manual
        emb = loss = False
    else:
        first = cfg.get("decoder_first_pipeline_num_layers")
        if first is None and cfg.get("standalone_embedding_stage"):
            first = 0    # the first rank holds the embedding alone
        last = cfg.get("decoder_last_pipeline_num_layers")
        emb = bool(cfg.get("account_for_embedding_in_pipeline_split"))
        loss = bool(cfg.get("account_for_loss_in_pipeline_split"))
        if first is not None or last is not None:
            if emb or loss:
                raise ConfigError("decoder_first/last_pipeline_num_layers cannot be combined "
                                  "with account_for_embedding/loss_in_pipeline_split")
            fixed = [n for n in (first, last) if n is not None]
            middle = p - len(fixed)
            rest = num_layers - sum(fixed)
            if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
                raise ConfigError(
                    f"decoder_first_pipeline_num_layers {first} / "
                    f"decoder_last_pipeline_num_layers {last}: the other {rest} of num_layers "
                    f"{num_layers} do not split evenly over the {middle} middle pipeline ranks")
            per_rank = [rest // middle if middle else 0] * p
            if first is not None:
                per_rank[0] = first
            if last is not None:
                per_rank[-1] = last
        else:
            units = num_layers + emb + loss
            per_rank = _even(units, p, (
                f"num_layers {num_layers}" + (" + embedding" if emb else "")
                + (" + loss" if loss else "") + f" = {units} is not divisible by "
                f"pipeline_model_parallel_size {p}; set decoder_first/last_pipeline_num_layers, "
                f"decoder_pipeline_manual_split_list or pipeline_model_parallel_layout for an "
                f"uneven split"))
    per_stage = [0] * (p * v)
    for r, n in enumerate(per_rank):
        chunks = _even(n, v, f"pipeline rank {r} holds {n} layers, not divisible by its {v} "
                             f"virtual stages (virtual_pipeline_model_parallel_size)")
        for c, k in enumerate(chunks):
            per_stage[c * p + r] = k
    if emb:
        per_stage[0] -= 1
    if loss:
        per_stage[-1] -= 1
    if min(per_stage) < 0:
        raise ConfigError("account_for_embedding/loss_in_pipeline_split leaves a stage with "
                          "fewer than zero decoder layers; use fewer pipeline stages")
    return tuple(per_stage)


def bounds(counts) -> tuple[tuple[int, int], ...]:
    """(first layer, end) of each stage from its layer count."""
    out, lo = [], 0
    for n in counts:
        out.append((lo, lo + n))
        lo += n
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What the pipeline runs: ``ranks`` × ``chunks`` stages holding ``counts`` layers each
    (stage order), driven by schedule ``schedule`` (jaxtrain.parallel.schedules.SCHEDULES);
    ``group``: the interleaved schedule's microbatch group; ``costs``: the (F, B, W) costs
    the zero-bubble list scheduler plans with; ``v_limit``: forwards a V schedule's rank keeps
    in flight (None: 2p − 1); ``max_mem``: per rank, the most microbatches' activations the
    zero-bubble-heuristic schedule holds (Primus's pp_max_mem; None: no cap)."""

    ranks: int
    chunks: int
    counts: tuple[int, ...]
    schedule: str
    group: int | None = None
    costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
    v_limit: int | None = None
    print_table: bool = False
    dump: bool = False
    max_mem: tuple[float, ...] | None = None

    def build(self, microbatches: int) -> sched.Schedule:
        """The schedule table for ``microbatches`` (ValueError when it cannot be built)."""
        if self.max_mem is not None:
            return sched.zero_bubble(self.ranks, microbatches, self.schedule, self.costs,
                                     max_mem=self.max_mem)
        if self.schedule == "zbv" and self.v_limit is not None:
            return sched.zbv(self.ranks, microbatches, self.costs, limit=self.v_limit)
        return sched.build(self.schedule, self.ranks, microbatches, self.chunks, self.costs,
                           self.group)


_PRIMUS = {"1f1b": "1f1b", "1f1b-interleaved": "1f1b-interleaved", "zero-bubble": "zb-h1",
           "zero-bubble-heuristic": "zb-h2", "zbv-formatted": "zbv", "v-half": "zbv",
           "v-min": "zbv"}


def _schedule(cfg, p: int) -> tuple[str, str | None]:
    """(schedule name, V memory setup) chosen by the dialects' switches."""
    own = cfg.get("pipeline_schedule")
    if own:
        return own, None
    if cfg.get("patch_primus_pipeline"):
        algo = cfg.get("pp_algorithm") or "1f1b-interleaved"
        return _PRIMUS[algo], {"v-half": "half", "v-min": "min"}.get(algo, "zb")
    if cfg.get("enable_1f1b_v"):   # Primus's zero-bubble runtime, whole backwards
        if cfg.get("zero_bubble_v_schedule") or (cfg.get("patch_zero_bubble")
                                                 and cfg.get("enable_zero_bubble", True)):
            raise ConfigError("enable_1f1b_v runs whole backwards and cannot be combined with "
                              "the zero-bubble split (enable_zero_bubble / zero_bubble_v_"
                              "schedule), as Primus asserts; set enable_zero_bubble false")
        return "1f1b-v", None
    if cfg.get("patch_zero_bubble") and cfg.get("enable_zero_bubble", True):
        if cfg.get("zero_bubble_v_schedule"):
            return "zbv", cfg.get("zero_bubble_v_schedule_mem_setup") or "half"
        pending = cfg.get("zero_bubble_max_pending_backward", "auto")
        if pending in ("auto", None) or int(pending) <= p:
            return "zb-h1", None
        if int(pending) >= 2 * p:
            return "zb-h2", None
        raise ConfigError(f"zero_bubble_max_pending_backward {pending}: give auto, "
                          f"{p} (ZB-H1, 1F1B's memory) or {2 * p} (ZB-H2)")
    return None, None


def _chunks(cfg, num_layers: int, p: int) -> int | None:
    v = cfg.get("virtual_pipeline_model_parallel_size") or cfg.get(
        "num_virtual_stages_per_pipeline_rank")
    per_stage = cfg.get("num_layers_per_virtual_pipeline_stage")
    if per_stage:
        if num_layers % (per_stage * p):
            raise ConfigError(f"num_layers {num_layers} is not a multiple of "
                              f"num_layers_per_virtual_pipeline_stage {per_stage} x "
                              f"pipeline_model_parallel_size {p}")
        from_layers = num_layers // (per_stage * p)
        if v and v != from_layers:
            raise ConfigError(f"num_layers_per_virtual_pipeline_stage {per_stage} gives "
                              f"{from_layers} virtual stages per rank, not {v}")
        v = from_layers
    layout = cfg.get("pipeline_model_parallel_layout")
    if layout:
        n = len(parse_layout(layout))
        if v and n != v * p:
            raise ConfigError(f"pipeline_model_parallel_layout has {n} stages; "
                              f"pipeline_model_parallel_size {p} x {v} virtual stages needs "
                              f"{v * p}")
        v = n // p if n % p == 0 else v
    return v


def plan(cfg, num_layers: int, microbatches: int | tuple[int, ...]) -> PipelinePlan | None:
    """The pipeline plan of a resolved config (None without pipeline parallelism); a plan that
    cannot run (split, schedule, microbatches) is a ConfigError naming the keys.
    ``microbatches``: the step's microbatch count, or every count a ramp gives
    (``TrainConfig.microbatch_counts``), each of which the schedule must run."""
    p = cfg.get("pipeline_model_parallel_size") or 1
    if p == 1:
        return None
    name, v_mem = _schedule(cfg, p)
    v = _chunks(cfg, num_layers, p)
    v_shape = name in ("zbv", "1f1b-v")
    if name is None:
        name = "1f1b-interleaved" if v and v > 1 else "1f1b"
    if v_shape:
        if v not in (None, 2):
            raise ConfigError(f"the V schedule ({name}) holds two chunks per rank; "
                              f"virtual_pipeline_model_parallel_size is {v}")
        v = 2
    elif name == "1f1b-interleaved" and not (v and v > 1):
        name = "1f1b"     # Megatron: interleaving needs virtual stages
    elif name != "1f1b-interleaved" and v and v > 1:
        raise ConfigError(f"virtual_pipeline_model_parallel_size {v} needs an interleaved or V "
                          f"schedule; the {name} schedule runs one chunk per rank")
    v = v or 1
    counts = stage_layers(cfg, num_layers, p, v)
    _check_index_sharing(cfg, num_layers, counts)
    group = cfg.get("microbatch_group_size_per_vp_stage") if v > 1 else None
    costs = tuple(_cost(cfg, k) for k in ("pp_cost_f", "pp_cost_b", "pp_cost_w"))
    v_limit = {"zb": None, "half": p, "min": max(1, (2 * p + 2) // 3)}.get(v_mem) \
        if v_shape else None
    out = PipelinePlan(p, v, counts, name, group, costs, v_limit,
                       bool(cfg.get("debug_scheduler_table")), bool(cfg.get("dump_pp_data")),
                       _max_mem(cfg, p, name))
    counts_m = (microbatches,) if isinstance(microbatches, int) else tuple(microbatches)
    ramp = (" (a step of the batch ramp: rampup_batch_size / train.ga_ramp_start)"
            if len(counts_m) > 1 else "")
    for m in counts_m:
        if name == "1f1b-interleaved" and m % (group or p):
            raise ConfigError(
                f"the interleaved pipeline schedule runs microbatches in groups of "
                f"{group or p} (microbatch_group_size_per_vp_stage, default "
                f"pipeline_model_parallel_size); {m} microbatches per step{ramp} "
                f"(global_batch_size / (micro_batch_size x data-parallel size)) is not a "
                f"multiple")
        try:
            out.build(m)
        except ValueError as e:
            raise ConfigError(f"pipeline schedule {name} with {p} stages and {m} "
                              f"microbatches{ramp}: {e}") from None
    return out


def _check_index_sharing(cfg, num_layers: int, counts):
    """DeepSeek sparse attention's index sharing passes a layer's key selection to the layers
    after it, never across stages: each stage must start with a layer computing its own
    (Megatron's rule)."""
    if cfg.get("experimental_attention_variant") != "dsa":
        return
    freq, offset = cfg.get("dsa_indexer_topk_freq") or 1, cfg.get(
        "dsa_indexer_skip_topk_offset") or 0
    if freq == 1:
        return
    shared = dsa_shared_pattern(freq, offset, num_layers)
    starts = [lo + 1 for lo, hi in bounds(counts) if hi > lo and shared[lo]]
    if starts:
        raise ConfigError(f"pipeline stages starting at layer(s) {starts} would reuse the DSA "
                          f"selection of a layer on another stage (dsa_indexer_topk_freq {freq}, "
                          f"dsa_indexer_skip_topk_offset {offset}); split the layers so that "
                          "each stage starts with a layer computing its own")


def _max_mem(cfg, p: int, name: str) -> tuple[float, ...] | None:
    """Primus's pp_max_mem (zero-bubble-heuristic only): per rank, the most microbatches whose
    activations it holds; one value for every rank or one per rank, each at least 1."""
    value = cfg.get("pp_max_mem")
    if value is None:
        return None
    heuristic = cfg.get("patch_primus_pipeline") and cfg.get("pp_algorithm") == \
        "zero-bubble-heuristic"
    if not heuristic:
        raise ConfigError(f"pp_max_mem {value} caps the memory of Primus's zero-bubble-"
                          f"heuristic schedule (patch_primus_pipeline, pp_algorithm "
                          f"zero-bubble-heuristic); the {name} schedule does not read it")
    caps = list(value) if isinstance(value, (list, tuple)) else [value] * p
    if len(caps) != p or min(float(c) for c in caps) < 1:
        raise ConfigError(f"pp_max_mem {value}: give one cap, or one per pipeline rank ({p}), "
                          f"each at least 1 (a microbatch's activations)")
    return tuple(float(c) for c in caps)


def _cost(cfg, key: str) -> float:
    value = cfg.get(key)
    if value is None:
        return 1.0
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"{key} {value}: per-stage costs are not implemented yet; give "
                              f"one value for every stage")
        value = value[0]
    if float(value) <= 0:
        raise ConfigError(f"{key} {value}: give a positive cost")
    return float(value)
