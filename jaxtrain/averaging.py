"""pgs ``train.ema`` and ``train.base_merge``: a moving average of the weights, and a periodic
pull of the weights back toward the pretrained ones. Both act between train steps, as jitted
functions of their own (the train step knows nothing of them).

EMA (pgs ``ModelEMA``). An fp32 shadow of the trained parameters (:func:`moe.trainable`: all
but the expert bias) starts as the weights the run starts from. At every step that is a multiple
of ``ema_every`` (the loop's step number, skipped steps counted) the t-th update does::

    d_t = min(ema_decay, 1 - 1/(t+1))       t = updates so far, this one included
    shadow <- d_t * shadow + (1 - d_t) * theta

so the first update averages half and half and the decay ramps up to ``ema_decay``. A step the
train step skipped (gradient spike, fp16 overflow) changed no weight and updates nothing, as
pgs updates only after an optimizer step. The shadow and t are saved with every checkpoint
(item ``ema``) and restored on a resume, which continues the same average; the final Hugging
Face export writes the shadow, cast to each parameter's dtype.

Base merge (pgs ``BaseModelMerge``). At every multiple of ``base_merge_every``::

    theta <- (1 - r) * theta + r * theta_base        (lerp)

with ``theta_base`` the weights ``model.name_or_path`` names, kept in fp16. With ``slerp``, a
weight that is a matrix in the Hugging Face checkpoint (two or more dimensions there: a head
axis and the head-dim axis after it count as one, as in q_proj) is interpolated on the sphere
per layer (and per expert), flattened::

    cos w = <a, b> / (|a| |b|),   theta <- sin((1-r) w)/sin w * a + sin(r w)/sin w * b

falling back to lerp when either norm is below 1e-8 or |cos w| > 0.9999; vectors (norms,
biases) always lerp. The arithmetic is fp32, the result cast back to the weight's dtype.

Memory. As pgs keeps both copies in CPU memory, the shadow and the fp16 base live in host
memory (JAX's ``pinned_host`` memory kind, else ``unpinned_host``; device memory on a platform
with neither); the update brings them to the device, computes there and writes them back. When
plugins.pre_rl holds the base weights on the device already, the merge reads that copy
(rounded to fp16 like pgs's) instead of loading them twice.
"""
from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain import models
from jaxtrain.checkpoint import hf_init
from jaxtrain.models.moe import merge_trainable, trainable
from jaxtrain.step import device_memory

log = logging.getLogger("jaxtrain.averaging")

HOST_KINDS = ("pinned_host", "unpinned_host")   # preferred first
EMA_ITEM = "ema"                                # the checkpoint item of the shadow
NORM_EPS = 1e-8                                 # slerp -> lerp below this norm (pgs)
PARALLEL_COS = 0.9999                           # slerp -> lerp above this |cos| (pgs)
_BATCH_AXES = ("layers", "exp")                 # one checkpoint tensor per layer and expert
_HEAD_AXES = ("q_heads", "kv_heads")            # with a following "kv": one checkpoint axis


def host_memory_kind(device) -> str | None:
    """The host memory kind ``device``'s platform offers (pinned first), or None."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memory kinds keeps it on device
        return None
    return next((k for k in HOST_KINDS if k in kinds), None)


def _in_memory(shardings, kind: str | None):
    return jax.tree.map(lambda s: s.with_memory_kind(kind) if kind else device_memory(s),
                        shardings)


def _to_device(tree, shardings):
    """Inside jit: ``tree`` (placed by ``shardings``) moved to device memory."""
    return jax.device_put(tree, jax.tree.map(device_memory, shardings))


# ------------------------------------------------------------------------------- EMA


def ema_decay_at(decay, t):
    """pgs's ramp: the decay of the t-th update (t >= 1)."""
    return jnp.minimum(jnp.float32(decay), 1.0 - 1.0 / (jnp.asarray(t, jnp.float32) + 1.0))


def ema_init(params) -> dict:
    """A fresh EMA of ``params``: their trainable leaves in fp32, no update yet."""
    return {"params": jax.tree.map(lambda p: p.astype(jnp.float32), trainable(params)),
            "count": jnp.int32(0)}


def ema_update(ema: dict, params, decay: float, skipped=False) -> dict:
    """One EMA update toward ``params``; none where ``skipped`` (the step changed nothing)."""
    t = ema["count"] + 1
    w = 1.0 - ema_decay_at(decay, t)
    moved = jax.tree.map(lambda s, p: s + w * (p.astype(jnp.float32) - s), ema["params"],
                         trainable(params))
    return {"params": jax.tree.map(lambda new, old: jnp.where(skipped, old, new), moved,
                                   ema["params"]),
            "count": jnp.where(skipped, ema["count"], t).astype(jnp.int32)}


def ema_params(ema: dict, params):
    """``params`` with the trainable leaves replaced by the EMA's, in the params' dtypes."""
    return merge_trainable(params, jax.tree.map(lambda e, p: e.astype(p.dtype), ema["params"],
                                                trainable(params)))


# ------------------------------------------------------------------------------- merge


def lerp(a, b, t):
    return a + t * (b - a)


def slerp(a, b, t, batch_axes: tuple[int, ...] = ()):
    """Spherical interpolation of ``a`` toward ``b`` (fp32), each slice along ``batch_axes``
    flattened to one vector; lerp where a norm is below NORM_EPS or |cos| > PARALLEL_COS."""
    over = tuple(i for i in range(a.ndim) if i not in batch_axes)
    norm_a = jnp.sqrt(jnp.sum(a * a, over, keepdims=True))
    norm_b = jnp.sqrt(jnp.sum(b * b, over, keepdims=True))
    tiny = (norm_a < NORM_EPS) | (norm_b < NORM_EPS)
    cos = jnp.sum(a * b, over, keepdims=True) / jnp.where(tiny, 1.0, norm_a * norm_b)
    cos = jnp.clip(cos, -1.0, 1.0)
    fallback = tiny | (jnp.abs(cos) > PARALLEL_COS)
    omega = jnp.arccos(cos)
    sin = jnp.where(fallback, 1.0, jnp.sin(omega))
    spherical = jnp.sin((1.0 - t) * omega) / sin * a + jnp.sin(t * omega) / sin * b
    return jnp.where(fallback, lerp(a, b, t), spherical)


def slerp_layout(axes) -> tuple[tuple[int, ...], bool]:
    """(the axes that index separate checkpoint tensors, whether each such tensor is a matrix)
    for a leaf with logical ``axes``."""
    axes = tuple(axes)
    batch = tuple(i for i, a in enumerate(axes) if a in _BATCH_AXES)
    rest = [a for a in axes if a not in _BATCH_AXES]
    dims = len(rest) - sum(a in _HEAD_AXES and b == "kv" for a, b in zip(rest, rest[1:]))
    return batch, dims >= 2


def merge(params, base, ratio: float, method: str, axes):
    """pgs's merge of ``params`` toward ``base`` (``axes``: the params' logical axes); the
    base is rounded to fp16 as pgs stores it."""
    def one(p, b, ax):
        a = p.astype(jnp.float32)
        b = b.astype(jnp.float16).astype(jnp.float32)
        batch, matrix = slerp_layout(ax)
        out = slerp(a, b, ratio, batch) if method == "slerp" and matrix else lerp(a, b, ratio)
        return out.astype(p.dtype)

    trained = trainable(params)
    return merge_trainable(params, jax.tree.map(one, trained, trainable(base),
                                                trainable(axes)))


# ------------------------------------------------------------------------------- the run


def _mb(tree) -> float:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)) / 2**20


class WeightAveraging:
    """The EMA and the base merge of one run: :meth:`templates` before the restore,
    :meth:`start` after it, then :meth:`after_step` and :meth:`merge_due` each step,
    :meth:`items` at each save and :meth:`final` for the export."""

    def __init__(self, tcfg, model_cfg, abstract_params, param_shardings, replicated, device,
                 logger: logging.Logger | None = None):
        self.tcfg, self.model_cfg, self.log = tcfg, model_cfg, logger or log
        self.abstract, self.param_shardings = abstract_params, param_shardings
        self.host = host_memory_kind(device)
        self.ema_shardings = {"params": _in_memory(trainable(param_shardings), self.host),
                              "count": replicated}
        self.ema: dict | None = None
        self.base = None
        self._update = self._merge = None

    @classmethod
    def for_run(cls, run, device, logger=None) -> "WeightAveraging | None":
        """None unless train.ema or train.base_merge is on."""
        t = run.tcfg
        if t.ema_decay is None and t.base_merge_ratio is None:
            return None
        return cls(t, run.model_cfg, run.abstract.params, run.shardings.params,
                   run.shardings.step, device, logger)

    @property
    def where(self) -> str:
        return f"{self.host} memory" if self.host else "device memory"

    def templates(self) -> dict:
        """The checkpoint items to restore beside the train state (shapes and shardings)."""
        if self.tcfg.ema_decay is None:
            return {}
        shapes = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32),
                                         trainable(self.abstract)),
                  "count": jax.ShapeDtypeStruct((), jnp.int32)}
        return {EMA_ITEM: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
            self.ema_shardings)}

    def start(self, params, restored: dict, base_dir=None, base=None):
        """The EMA (``restored``'s, else fresh from ``params``) and the base weights (``base``,
        a tree already held, else read from the Hugging Face directory ``base_dir``)."""
        t = self.tcfg
        if t.ema_decay is not None:
            self._start_ema(params, restored.get(EMA_ITEM))
        if t.base_merge_ratio is not None:
            self._start_merge(base_dir, base)

    def _start_ema(self, params, restored):
        t, ps = self.tcfg, self.param_shardings
        if restored is None:   # computed on the device, kept where ema_shardings say
            self.ema = jax.jit(lambda p: jax.device_put(ema_init(_to_device(p, ps)),
                                                        self.ema_shardings),
                               in_shardings=(ps,), out_shardings=self.ema_shardings)(params)
        else:
            self.ema = restored

        def update(ema, params, skipped):
            new = ema_update({**ema, "params": _to_device(ema["params"],
                                                          self.ema_shardings["params"])},
                             _to_device(params, ps), t.ema_decay, skipped)
            return jax.device_put(new, self.ema_shardings)

        self._update = jax.jit(update, donate_argnums=0,
                               in_shardings=(self.ema_shardings, ps, None),
                               out_shardings=self.ema_shardings)
        count = int(self.ema["count"])
        self.log.info("train.ema: fp32 shadow of the weights (%.1f MiB) in %s, decay %s, "
                      "updated every %d steps%s", _mb(self.ema["params"]), self.where,
                      t.ema_decay, t.ema_every,
                      f"; continuing after update {count}" if restored is not None else "")

    def _start_merge(self, base_dir, base):
        t, ps = self.tcfg, self.param_shardings
        if base is None:
            half = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float16),
                                self.abstract)
            base = hf_init.load_params(base_dir, self.model_cfg, half, _in_memory(ps, self.host))
            held = f"in fp16 in {self.where}"
        else:
            held = "shared with plugins.pre_rl's copy"
        self.base = base
        base_shardings = jax.tree.map(lambda x: x.sharding, base)
        axes = models.logical_axes(self.model_cfg)

        def merge_fn(params, base):
            merged = merge(_to_device(params, ps), _to_device(base, base_shardings),
                           t.base_merge_ratio, t.base_merge_method, axes)
            return jax.device_put(merged, ps)

        self._merge = jax.jit(merge_fn, donate_argnums=0, in_shardings=(ps, base_shardings),
                              out_shardings=ps)
        self.log.info("train.base_merge: base weights of %s (%.1f MiB, %s); %s toward them by "
                      "%s every %d steps", base_dir, _mb(base), held, t.base_merge_method,
                      t.base_merge_ratio, t.base_merge_every)

    def after_step(self, it: int, params, skipped) -> None:
        """Step ``it`` has run: update the EMA when due (``skipped``: the step's flag)."""
        if self._update is not None and it % self.tcfg.ema_every == 0:
            self.ema = self._update(self.ema, params, skipped)

    def merge_due(self, it: int, params) -> Any:
        """``params``, merged toward the base when step ``it`` is due (then donated)."""
        if self._merge is None or it % self.tcfg.base_merge_every:
            return params
        self.log.info("step %d: base_merge applied (%s, ratio %s)", it,
                      self.tcfg.base_merge_method, self.tcfg.base_merge_ratio)
        return self._merge(params, self.base)

    def items(self) -> dict:
        """What checkpoints keep beside the train state."""
        return {EMA_ITEM: self.ema} if self.ema is not None else {}

    def final(self, params) -> tuple[Any, str]:
        """(the weights the final export writes, what they are): the EMA's when on."""
        if self.ema is None:
            return params, ""
        ps, out = self.param_shardings, _in_memory(self.param_shardings, self.host)

        def cast(ema, params):
            return jax.device_put(ema_params(_to_device(ema, self.ema_shardings),
                                             _to_device(params, ps)), out)

        return (jax.jit(cast, in_shardings=(self.ema_shardings, ps), out_shardings=out)(
            self.ema, params), "EMA weights, train.ema")
