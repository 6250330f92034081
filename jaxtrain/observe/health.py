"""pgs training-health metrics (``health/*`` row fields), after palingenesis' ``HealthMonitor``
(src/palingenesis/health.py), computed by jitted functions of their own beside the train step.

Like pgs, everything is measured at logged steps only (multiples of ``log_interval``):

- ``logging.rl_readiness`` (every logged step): the mean entropy -sum p log p (nats) of the
  model's next-token distribution at up to 64 randomly drawn loss tokens of the step's last
  microbatch. ``output_entropy`` is the latest value, ``output_entropy_ema`` the mean of the last
  100, ``entropy_trend`` (from 10 values on) the relative change between the older and newer
  half of the last 20. From 10 values on, ``rl_readiness_warning`` is 1 at the step where the
  mean falls below ``logging.rl_entropy_floor`` (a warning is logged then) and 0 while it is at
  or above; pgs warns once per run, here the warning re-arms once the mean has recovered.
- ``logging.health_tier2_every`` (steps that are multiples of it): one extra forward/backward
  pass (dropout off) over the step's batch, split into two halves (alternate microbatches when
  their number is even, else alternate sequences), gives the half gradients g1, g2 (token means)
  and the whole-batch gradient g. ``grad_cosine_sim`` (pgs) is the cosine between g and the g of
  the previous tier-2 step, over the first 500,000 gradient entries in parameter order (pgs's
  sample; the embedding comes first); ``grad_cosine_halves`` is cos(g1, g2) over all entries.
  ``gns`` is pgs's B_simple = tr(Sigma) / |G|^2 in sequences, estimated here as McCandlish et
  al. (2018, App. A) do from two batch sizes: with S1, S2 sequences in the halves and S in all,
  E|g_h|^2 = |G|^2 + tr(Sigma)/S_h and E|g|^2 = |G|^2 + tr(Sigma)/S, so
  tr(Sigma) = (mean_h |g_h|^2 - |g|^2) / (mean_h 1/S_h - 1/S) and |G|^2 = |g|^2 - tr(Sigma)/S
  (pgs itself substitutes a proxy from the spread of recent losses). One step's value is noisy
  and can be negative; ``gns_ema`` is the mean of the last 50. ``cuda_peak_gb``,
  ``cuda_allocated_gb`` (1e9 bytes) and ``cuda_utilization_pct`` (in use / the allocator's limit)
  come from the devices' memory stats where the backend reports them; XLA's peak is never reset.
- ``logging.health_tier3_every``: weights grouped as pgs groups them (``embed``, ``layer_<i>``,
  ``lm_head``; tensors of two or more dimensions per layer). ``weight_norm_min/max/ratio`` over
  the groups' mean Frobenius norms, ``wnorm/<group>`` for the first and last three groups.
  ``stable_rank_min/mean`` and ``srank/<group>``: ||W||_F^2 / sigma_max(W)^2 of the largest
  weight (as the matrix of its linear map, heads merged) of layers 0, n/3, n/2, 2n/3, n-1 and of
  ``lm_head``, each cut to its top-left 512 x 512 block as in pgs. ``weight_drift_mean/max``:
  | ||W|| - ||W0|| | / ||W0|| over weights of more than 1000 entries, W0 being the weights at the
  first tier-3 step (pgs's snapshot; only norms are kept). ``warnings`` counts stable rank < 3,
  norm ratio > 100 and drift > 0.5, each also logged.

Every pass runs the training loss (:func:`jaxtrain.loss.model_loss`) on the train state's
quantization state, so FP8 delayed scaling measures with the training scales. The gradients
are taken after the step's update (the train step's own are gone by then); the
tier-2 pass holds two float32 gradient copies besides the state, and its time shows in the
step_time of the step that follows it. The knobs default to 10 and 100 steps in pgs files and to
0 (off) elsewhere, so Megatron and MaxText runs pay nothing unasked.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.loss import model_hidden, model_loss
from jaxtrain.models.params import ParamSpec, param_specs
from jaxtrain.models.transformer import logits_head
from jaxtrain.observe.memory import device_memory_stats

log = logging.getLogger("jaxtrain.observe.health")

SAMPLE = 500_000          # gradient entries compared across tier-2 steps (pgs)
ENTROPY_TOKENS = 64       # tokens whose output entropy is measured (pgs)
SRANK_BLOCK = 512         # stable rank on the top-left block of this size (pgs)
DRIFT_MIN_SIZE = 1000     # weights of more entries count for drift (pgs)
_NORMS, _RANKS = "_health/weight_norms", "_health/stable_ranks"
_ENTROPY, _ENTROPY_N = "_health/entropy", "_health/entropy_tokens"


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight matrix: a parameter, or one layer of a stacked one."""

    path: tuple[str, ...]
    layer: int | None           # index on the stacked layer axis
    layer_axis: int | None
    shape: tuple[int, ...]      # one layer's shape
    rows: int                   # the matrix of its linear map is [rows, size // rows]
    group: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _walk(tree: dict, path=()):
    """(path, ParamSpec) in declaration order (embedding first, as pgs's parameter order)."""
    for key, value in tree.items():
        if isinstance(value, ParamSpec):
            yield path + (key,), value
        else:
            yield from _walk(value, path + (key,))


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def catalog(model_cfg) -> list[Weight]:
    """The weights that pgs groups: two or more dimensions per layer, leaf by leaf."""
    groups = {"embedding": "embed", "position_embedding": "embed", "output": "lm_head",
              "layers": None}
    out = []
    for path, spec in _walk(param_specs(model_cfg)):
        if path[0] not in groups:
            continue
        axes, shape = list(spec.axes), list(spec.shape)
        if spec.layer_axis is not None:
            del axes[spec.layer_axis], shape[spec.layer_axis]
        if len(shape) < 2:
            continue
        rows = math.prod(shape[:-1]) if axes[-1] == "embed" else shape[0]
        layers = range(spec.shape[spec.layer_axis]) if spec.layer_axis is not None else [None]
        for i in layers:
            out.append(Weight(path, i, spec.layer_axis, tuple(shape), rows,
                              groups[path[0]] or f"layer_{i}"))
    return out


def _group_names(weights: list[Weight]) -> list[str]:
    return list(dict.fromkeys(w.group for w in weights))


def stable_rank_sample(weights: list[Weight]) -> list[Weight]:
    """pgs's sample: the largest weight of layers 0, n/3, n/2, 2n/3 and n-1, and of lm_head."""
    layers = [g for g in _group_names(weights) if g.startswith("layer_")]
    n = len(layers)
    picked = [layers[i] for i in sorted({0, n // 3, n // 2, 2 * n // 3, n - 1})] if n else []
    picked += [g for g in ("lm_head",) if any(w.group == g for w in weights)]
    out = []
    for group in picked:
        best = None
        for w in weights:
            if w.group == group and (best is None or w.size > best.size):
                best = w
        out.append(best)
    return out


def matrix(params, w: Weight):
    """The weight as the [rows, cols] matrix of its linear map."""
    x = _get(params, w.path)
    if w.layer is not None:
        x = jnp.take(x, w.layer, axis=w.layer_axis)
    return x.reshape(w.rows, -1)


def stable_rank(m):
    """||M||_F^2 / sigma_max^2 of the top-left SRANK_BLOCK square block (pgs)."""
    m = m[:SRANK_BLOCK, :SRANK_BLOCK].astype(jnp.float32)
    top = jnp.linalg.svd(m, compute_uv=False)[0]
    return jnp.sum(jnp.square(m)) / jnp.maximum(jnp.square(top), 1e-30)


def noise_scale(sq_halves, sq_all, sizes):
    """B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018) from the squared gradient norms
    of two halves of sizes ``sizes`` and of the whole batch."""
    s1, s2 = sizes
    small, big = (1 / s1 + 1 / s2) / 2, 1 / (s1 + s2)
    trace = ((sq_halves[0] + sq_halves[1]) / 2 - sq_all) / (small - big)
    return trace / (sq_all - trace * big)


def halves(M: int, B: int) -> np.ndarray:
    """Half (0/1) of each sequence [M, B]: alternate microbatches when M is even, else
    alternate sequences."""
    if M % 2 == 0:
        return np.broadcast_to((np.arange(M) % 2)[:, None], (M, B))
    return np.arange(M * B).reshape(M, B) % 2


def _sq(tree):
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))


def _dot(a, b):
    return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _cosine(dot, sq_a, sq_b):
    return dot / jnp.maximum(jnp.sqrt(sq_a * sq_b), 1e-30)


@functools.lru_cache(maxsize=8)
def _functions(model_cfg, loss_chunks: int, half_precision: bool, layout, params_memory,
               seed: int):
    """(tier2, compare, tier3, entropy), jitted; shared by monitors of the same model."""
    to_device = params_memory[0] if params_memory else (lambda t: t)
    ctx = layout.activations if layout is not None else contextlib.nullcontext
    jit = (functools.partial(jax.jit, out_shardings=layout.replicated()) if layout is not None
           else jax.jit)
    weights = catalog(model_cfg)
    ranked = stable_rank_sample(weights)
    order = [path for path, _ in _walk(param_specs(model_cfg))]

    def grad(params, micro, w, quant_state):
        def loss(p):   # the training loss, on the training quantization scales
            return model_loss(p, micro, w, model_cfg, quant_state=quant_state,
                              num_chunks=loss_chunks, half_precision=half_precision,
                              grad_in_forward=True)[0]
        return jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(params))

    def sample(tree):
        parts, left = [], SAMPLE
        for path in order:
            if left <= 0:
                break
            flat = _get(tree, path).reshape(-1)
            parts.append(flat[:left])
            left -= parts[-1].size
        return jnp.concatenate(parts)

    def tier2(params, batch, quant_state):
        params = to_device(params)
        with ctx():
            M, B = batch["tokens"].shape[:2]
            half = halves(M, B)
            mask = batch["loss_mask"].astype(jnp.float32)
            sel = [jnp.asarray(half == h, jnp.float32)[..., None] for h in (0, 1)]
            counts = [jnp.sum(mask * s) for s in sel]
            w = [mask * s / jnp.maximum(c, 1.0) for s, c in zip(sel, counts)]
            if M % 2 == 0:  # each microbatch lies in one half: one pass over the batch
                xs = (batch, w[0] + w[1], jnp.arange(M) % 2)
            else:           # each microbatch twice, weighted for either half
                xs = (jax.tree.map(lambda x: jnp.concatenate([x, x]), batch),
                      jnp.concatenate(w), jnp.repeat(jnp.arange(2), M))

            def body(carry, x):
                micro, weights, which = x
                g = grad(params, micro, weights, quant_state)
                return tuple(jax.tree.map(lambda a, b, h=h: a + jnp.where(which == h, b, 0.0),
                                          acc, g) for h, acc in enumerate(carry)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            (g1, g2), _ = jax.lax.scan(body, (zeros, zeros), xs)
            total = jnp.maximum(counts[0] + counts[1], 1.0)
            g = jax.tree.map(lambda a, b: (counts[0] * a + counts[1] * b) / total, g1, g2)
            sq1, sq2, sq = _sq(g1), _sq(g2), _sq(g)
            now = sample(g)
            sizes = (int((half == 0).sum()), int((half == 1).sum()))
            return {"health/grad_cosine_halves": _cosine(_dot(g1, g2), sq1, sq2),
                    "health/gns": noise_scale((sq1, sq2), sq, sizes), "sample": now}

    def compare(now, previous):
        return _cosine(jnp.sum(now * previous), _sq(now), _sq(previous))

    def tier3(params):
        params = to_device(params)
        norms = []
        for path, spec in _walk(param_specs(model_cfg)):
            picked = [w for w in weights if w.path == path]
            if not picked:
                continue
            x = jnp.square(_get(params, path).astype(jnp.float32))
            keep = (spec.layer_axis,) if spec.layer_axis is not None else ()
            norms.append(jnp.sqrt(jnp.sum(x, axis=tuple(a for a in range(x.ndim)
                                                         if a not in keep))).reshape(-1))
        ranks = [stable_rank(matrix(params, w)) for w in ranked]
        return {_NORMS: jnp.concatenate(norms),
                _RANKS: jnp.stack(ranks) if ranks else jnp.zeros((0,), jnp.float32)}

    def entropy(params, batch, step, quant_state):
        params = to_device(params)
        with ctx():
            micro = {k: v[-1] for k, v in batch.items()}
            h, _ = model_hidden(params, micro, model_cfg, quant_state=quant_state)
            B, T, D = h.shape
            k = min(ENTROPY_TOKENS, B * T)
            key = jax.random.fold_in(jax.random.key(seed), step)
            score = jnp.where(micro["loss_mask"].reshape(-1) > 0,
                              jax.random.uniform(key, (B * T,)), -1.0)
            top, idx = jax.lax.top_k(score, k)
            logits = logits_head(params, jnp.take(h.reshape(B * T, D), idx, axis=0)[None],
                                 model_cfg)[0]
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
            valid = top >= 0
            n = jnp.sum(valid)
            return {_ENTROPY: jnp.sum(jnp.where(valid, ent, 0.0)) / jnp.maximum(n, 1),
                    _ENTROPY_N: n}

    return jit(tier2), jit(compare), jit(tier3), jit(entropy)


class Health:
    """``due(step)``, then ``fields(step, params, batch)`` right after the step (device values,
    nothing waits), then ``finish(step, values)`` on the fetched values when the step's row is
    built: it turns them into ``health/*`` fields and logs the warnings."""

    def __init__(self, model_cfg, *, log_interval: int = 1, tier2_every: int = 0,
                 tier3_every: int = 0, rl_readiness: bool = False, entropy_floor: float = 1.0,
                 layout=None, params_memory=None, loss_chunks: int = 0,
                 half_precision: bool = False, seed: int = 0, devices=None):
        self.model_cfg, self.log_interval = model_cfg, max(1, log_interval)
        self.tier2_every, self.tier3_every = max(0, tier2_every), max(0, tier3_every)
        self.rl_readiness, self.entropy_floor = rl_readiness, entropy_floor
        self.devices = devices
        self._args = (model_cfg, loss_chunks, half_precision, layout, params_memory, seed)
        self.weights = catalog(model_cfg)
        self.ranked = stable_rank_sample(self.weights)
        self._previous = None                      # tier-2 gradient sample, on device
        self._gns = collections.deque(maxlen=50)
        self._entropy = collections.deque(maxlen=100)
        self._below = False                        # warned, mean not yet back above the floor
        self._initial = None                       # weight norms at the first tier-3 step

    @classmethod
    def from_config(cls, cfg, model_cfg, tcfg, layout=None, params_memory=None) -> Health:
        """The tiers run every so many steps as their knobs say (on by default in pgs files)."""

        def every(key):
            return cfg[key] or 0

        return cls(model_cfg, log_interval=tcfg.log_interval,
                   tier2_every=every("logging.health_tier2_every"),
                   tier3_every=every("logging.health_tier3_every"),
                   rl_readiness=bool(cfg["logging.rl_readiness"]),
                   entropy_floor=cfg["logging.rl_entropy_floor"], layout=layout,
                   params_memory=params_memory, loss_chunks=tcfg.loss_chunks,
                   half_precision=tcfg.half_precision_loss, seed=tcfg.seed)

    @property
    def enabled(self) -> bool:
        return bool(self.tier2_every or self.tier3_every or self.rl_readiness)

    def tier2_due(self, step: int) -> bool:
        return bool(self.tier2_every) and step % self.log_interval == 0 and (
            step % self.tier2_every == 0)

    def tier3_due(self, step: int) -> bool:
        return bool(self.tier3_every) and step > 0 and step % self.log_interval == 0 and (
            step % self.tier3_every == 0)

    def due(self, step: int) -> bool:
        return (self.rl_readiness and step % self.log_interval == 0) or self.tier2_due(step) \
            or self.tier3_due(step)

    def fields(self, step: int, params, batch: dict, quant_state=None) -> dict:
        """Dispatch the metrics due at ``step`` for the step's ``params`` and ``batch``;
        ``quant_state`` is the train state's quantization state (``TrainState.quant_state``), so the
        forward passes use the training scales."""
        tier2, compare, tier3, entropy = _functions(*self._args)
        out: dict[str, Any] = {}
        if self.rl_readiness and step % self.log_interval == 0:
            out.update(entropy(params, batch, jnp.int32(step), quant_state))
        if self.tier2_due(step):
            M, B = batch["tokens"].shape[:2]
            if M * B >= 2:
                got = tier2(params, batch, quant_state)
                now = got.pop("sample")
                if self._previous is not None:
                    got["health/grad_cosine_sim"] = compare(now, self._previous)
                self._previous = now
                out.update(got)
            out.update(self.memory())
        if self.tier3_due(step):
            out.update(tier3(params))
        return out

    def memory(self) -> dict[str, float]:
        stats = device_memory_stats(self.devices)
        out = {}
        if "mem_peak_bytes_in_use" in stats:
            out["health/cuda_peak_gb"] = stats["mem_peak_bytes_in_use"] / 1e9
        if "mem_bytes_in_use" in stats:
            out["health/cuda_allocated_gb"] = stats["mem_bytes_in_use"] / 1e9
            if stats.get("mem_bytes_limit"):
                out["health/cuda_utilization_pct"] = (100 * stats["mem_bytes_in_use"]
                                                      / stats["mem_bytes_limit"])
        return out

    def finish(self, step: int, values: dict) -> dict:
        """``values`` (fetched) with the raw health values replaced by ``health/*`` fields."""
        values = dict(values)
        ent, n = values.pop(_ENTROPY, None), values.pop(_ENTROPY_N, None)
        if ent is not None and int(n) > 0:
            values.update(self._entropy_fields(step, float(ent)))
        if "health/gns" in values:
            gns = float(values.pop("health/gns"))
            if math.isfinite(gns):
                self._gns.append(gns)
                values["health/gns"] = gns
            if self._gns:
                values["health/gns_ema"] = sum(self._gns) / len(self._gns)
        norms, ranks = values.pop(_NORMS, None), values.pop(_RANKS, None)
        if norms is not None:
            values.update(self._tier3_fields(step, np.asarray(norms, np.float64),
                                             np.asarray(ranks, np.float64)))
        return values

    def _entropy_fields(self, step: int, entropy: float) -> dict:
        if not math.isfinite(entropy):
            return {}
        self._entropy.append(entropy)
        mean = sum(self._entropy) / len(self._entropy)
        out = {"health/output_entropy": entropy, "health/output_entropy_ema": mean}
        if len(self._entropy) < 10:
            return out
        recent = list(self._entropy)[-20:]
        old, new = recent[:len(recent) // 2], recent[len(recent) // 2:]
        first = sum(old) / len(old)
        out["health/entropy_trend"] = (sum(new) / len(new) - first) / max(abs(first), 1e-8)
        if mean < self.entropy_floor and not self._below:
            self._below = True
            log.warning("step %d: RL readiness: mean output entropy %.3f nats is below "
                        "logging.rl_entropy_floor %.3f; the output distribution is collapsing, "
                        "which starves RL (GRPO) of signal. If RL follows, consider stopping "
                        "SFT here or preserving entropy.", step, mean, self.entropy_floor)
            out["health/rl_readiness_warning"] = 1.0
        elif mean >= self.entropy_floor:
            self._below = False
            out["health/rl_readiness_warning"] = 0.0
        return out

    def _tier3_fields(self, step: int, norms: np.ndarray, ranks: np.ndarray) -> dict:
        out: dict[str, float] = {}
        by_group: dict[str, list[float]] = {}
        for w, n in zip(self.weights, norms):
            by_group.setdefault(w.group, []).append(float(n))
        means = {g: sum(v) / len(v) for g, v in by_group.items()}
        ratio = 0.0
        if means:
            lo, hi = min(means.values()), max(means.values())
            ratio = hi / max(lo, 1e-8)
            out.update({"health/weight_norm_min": lo, "health/weight_norm_max": hi,
                        "health/weight_norm_ratio": ratio})
            shown = list(means.items())
            out.update({f"health/wnorm/{g}": v for g, v in shown[:3] + shown[-3:]})
        srs = {w.group: float(r) for w, r in zip(self.ranked, ranks)}
        if srs:
            out["health/stable_rank_min"] = min(srs.values())
            out["health/stable_rank_mean"] = sum(srs.values()) / len(srs)
            out.update({f"health/srank/{g}": v for g, v in srs.items()})
        big = np.array([w.size > DRIFT_MIN_SIZE for w in self.weights], bool)
        if self._initial is None:
            self._initial = norms
        else:
            ok = big & (self._initial > 0)
            if ok.any():
                drift = np.abs(norms[ok] - self._initial[ok]) / self._initial[ok]
                out["health/weight_drift_mean"] = float(drift.mean())
                out["health/weight_drift_max"] = float(drift.max())
        warnings = 0
        if srs and min(srs.values()) < 3.0:
            warnings += 1
            log.warning("step %d: low stable rank %.2f (collapse risk)", step, min(srs.values()))
        if ratio > 100:
            warnings += 1
            log.warning("step %d: weight norms differ %.0fx across layers", step, ratio)
        if out.get("health/weight_drift_max", 0.0) > 0.5:
            warnings += 1
            log.warning("step %d: weight norm drift %.1f%% from the first tier-3 step", step,
                        100 * out["health/weight_drift_max"])
        out["health/warnings"] = warnings
        return out
