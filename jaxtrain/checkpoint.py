"""Checkpoints with Orbax: save, retention, resume, finetune and reshard on load.

A checkpoint is one Orbax step directory ``<root>/step_<N>`` holding the items

    params       the parameter tree (tensorstore/OCDBT)
    opt_state    the optimizer state (left out with no_save_optim)
    rng          the train state's key as raw key data (left out with no_save_rng)
    train        {step, opt_step}: iterations run and updates applied
    loss_scale   fp16 loss-scale state, when the run has one
    spike_stats  pgs gradient-spike statistics, when the run has them
    fp8          the quantization state (``TrainState.quant_state``: FP8 delayed scaling's amax
                 histories and scales), when the run has one
    meta         JSON: consumed samples (the data iterator's whole state), param_scan_axis,
                 the ModelConfig, the LR-schedule knobs and the resolved config

Orbax writes a step into a temporary directory and renames it when complete, so a save that
did not finish (a killed process) is never listed and never picked as the latest; stale
temporary directories are removed when a manager opens the directory again.

Arrays restore into the shardings of the template state the caller builds on the current mesh,
so a checkpoint saved on one device layout loads on another. Layer-stacked leaves (every leaf
under a ``layers`` key, in params and in the optimizer state mirroring them) move their layer
axis when the checkpoint's ``param_scan_axis`` differs from the model's. Leaves the run has and
the checkpoint lacks, or the reverse, are handled as ``dist_ckpt_strictness`` says.

Non-persistent checkpoints (``non_persistent_save_interval``) are extra saves kept only for
crash recovery, newest one only: ``global`` ones in ``non_persistent_global_ckpt_dir`` (default
``<save>/non_persistent``), ``local`` ones per host (see :mod:`jaxtrain.local_checkpoint`). A
resume takes one when it is at least as new as the newest persistent checkpoint.

    ckpt = Checkpointer.from_config(cfg, run_dir, model_cfg)
    restored = ckpt.restore(state)            # (state, consumed) or None
    ckpt.maybe_save(step, state, consumed)    # every save_interval steps (force=True: now)
    ckpt.close()                              # waits for an async save to finish
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain import local_checkpoint
from jaxtrain.config.errors import ConfigError
from jaxtrain.models import hf

log = logging.getLogger("jaxtrain.checkpoint")

STEP_PREFIX = "step"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}_(\d+)$")
ITEMS = ("params", "opt_state", "rng", "train", "loss_scale", "spike_stats", "fp8", "meta")
# Train-state fields saved whole, each as its own item: field name -> item name on disk. The
# quantization state keeps the item name "fp8" of the field's first name (TrainState.fp8), so
# checkpoints from before and after the rename to quant_state are the same and load alike.
STATE_ITEMS = {"loss_scale": "loss_scale", "spike_stats": "spike_stats", "quant_state": "fp8"}
FLAT_ITEMS = ("params", "opt_state")  # stored as {leaf name: array}; strictness compares names
FINAL_DIR = "final"
NON_PERSISTENT_DIR = "non_persistent"  # Megatron's subdirectory of the save/load directory

# ModelConfig fields a checkpoint's parameters depend on: a difference makes it unloadable
# into this model (or loadable into a different function), and the error names the field.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "ffn_hidden_size", "vocab_size", "position_embedding_type",
               "normalization", "activation", "gated_linear_unit", "add_bias_linear",
               "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights")

# Config knobs that shape the LR and weight-decay schedules (Megatron's OptimizerParamScheduler
# checks the same quantities on resume: peak/floor LR, warmup, decay horizon and style, WD).
SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_init", "lr_warmup_iters", "lr_warmup_samples",
                 "lr_warmup_fraction", "lr_decay_style", "lr_decay_iters", "lr_decay_samples",
                 "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
                 "train.lr_scheduler", "decoupled_lr", "decoupled_min_lr", "weight_decay",
                 "start_weight_decay", "end_weight_decay", "weight_decay_incr_style")

TORCH_CONVERSION = ("convert it to Hugging Face format first (Megatron-Bridge, or Megatron's "
                    "tools/checkpoint/convert.py with an HF saver), then import it with "
                    "jaxtrain.models.from_hf")


def _ocp():
    import orbax.checkpoint as ocp  # imported late: orbax is slow to import

    return ocp


def schedule_settings(cfg) -> dict:
    """The schedule knobs of a config (or a checkpoint's stored config) with the decay horizon
    explicit: a run that sets neither lr_decay_iters nor lr_decay_samples decays over its
    train_samples (or train_iters), recorded as lr_decay_samples (lr_decay_iters)."""
    out = {k: _jsonable(cfg.get(k)) for k in SCHEDULE_KEYS}
    if out["lr_decay_iters"] is None and out["lr_decay_samples"] is None:
        if cfg.get("train_samples"):
            out["lr_decay_samples"] = cfg.get("train_samples")
        elif cfg.get("train_iters"):
            out["lr_decay_iters"] = cfg.get("train_iters")
    return out


def schedule_policy(cfg) -> str:
    """What a resume does with schedule knobs that differ from the checkpoint's: 'config'
    (override_opt_param_scheduler: keep this config's), 'checkpoint'
    (use_checkpoint_opt_param_scheduler: adopt the checkpoint's) or 'check' (neither: stop,
    as Megatron asserts they match)."""
    use_ckpt = bool(cfg.get("use_checkpoint_opt_param_scheduler"))
    override = bool(cfg.get("override_opt_param_scheduler"))
    if use_ckpt and override:
        if cfg.is_set("override_opt_param_scheduler"):
            raise ConfigError("override_opt_param_scheduler and use_checkpoint_opt_param_"
                              "scheduler are both true: the first keeps this config's LR "
                              "schedule on resume, the second takes the checkpoint's; set one "
                              "of them to false")
        return "checkpoint"  # jaxtrain's default override=true yields to an explicit choice
    return "checkpoint" if use_ckpt else "config" if override else "check"


@dataclasses.dataclass(frozen=True)
class LocalRoot:
    """A directory of local (per-host) non-persistent checkpoints."""

    path: pathlib.Path

    def __str__(self):
        return f"{self.path} (local)"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save_dir: pathlib.Path | None = None       # where step checkpoints go; None saves none
    save_interval: int | None = None           # steps between saves; None: exits and end only
    keep_last: int = 0                         # newest checkpoints kept (0: all)
    retain_interval: int | None = None         # also keep steps divisible by this
    async_save: bool = False
    save_optim: bool = True
    save_rng: bool = True
    save_last: bool = True                     # save when training ends (disable_last_saving)
    final_dir: pathlib.Path | None = None      # HF export at the end (pgs train.save_final)
    auto_resume: bool = False                  # resume from save_dir's newest complete one
    resume_from: pathlib.Path | None = None    # pgs: resume fully from this checkpoint
    load: pathlib.Path | None = None           # Megatron load directory (or a step directory)
    load_step: int | None = None               # ckpt_step
    finetune: bool = False                     # with load: params only, iteration from 0
    pretrained: pathlib.Path | None = None     # finetune from here when load holds nothing
    load_optim: bool = True
    load_rng: bool = True
    exit_on_missing: bool = True
    strictness: str = "assume_ok_unexpected"   # dist_ckpt_strictness
    schedule_policy: str = "config"            # see schedule_policy()
    np_interval: int | None = None             # non_persistent_save_interval
    np_type: str | None = None                 # non_persistent_ckpt_type: global or local
    np_global_dir: pathlib.Path | None = None  # non_persistent_global_ckpt_dir
    np_local_dir: pathlib.Path | None = None   # non_persistent_local_ckpt_dir

    @classmethod
    def from_config(cls, cfg, run_directory: pathlib.Path) -> "CheckpointConfig":
        save = cfg.get("save")
        maxtext = bool(cfg.get("enable_checkpointing"))
        save_dir = pathlib.Path(save) if save else (
            pathlib.Path(run_directory) / "checkpoints" if maxtext else None)
        resume = cfg.get("train.resume_from") or None
        save_final = cfg.get("train.save_final")
        fmt = cfg.get("ckpt_format") or "torch_dist"
        if fmt not in ("torch_dist", "zarr"):  # the registry rejects these first; a guard
            raise ConfigError(f"ckpt_format {fmt!r}: jaxtrain reads and writes Orbax "
                              f"checkpoints only; {TORCH_CONVERSION}")
        np_interval, np_type = cfg.get("non_persistent_save_interval") or None, cfg.get(
            "non_persistent_ckpt_type") or None
        np_global, np_local = (cfg.get("non_persistent_global_ckpt_dir"),
                               cfg.get("non_persistent_local_ckpt_dir"))
        if np_interval and np_type is None:
            raise ConfigError("non_persistent_save_interval needs non_persistent_ckpt_type: "
                              "global (a directory every host reads) or local (per host)")
        if np_type == "local" and not np_local:
            raise ConfigError("non_persistent_ckpt_type local needs "
                              "non_persistent_local_ckpt_dir, a directory on each host's disk")
        strictness = cfg.get("dist_ckpt_strictness") or "assume_ok_unexpected"
        return cls(
            save_dir=save_dir, save_interval=cfg.get("save_interval") or None,
            keep_last=cfg.get("train.keep_checkpoints") or 0,
            retain_interval=cfg.get("save_retain_interval") or None,
            async_save=bool(cfg.get("async_save")),
            save_optim=not cfg.get("no_save_optim"), save_rng=not cfg.get("no_save_rng"),
            save_last=not cfg.get("disable_last_saving"),
            final_dir=pathlib.Path(save) / FINAL_DIR if (save_final and save) else None,
            auto_resume=bool(cfg.get("auto_continue_train") or maxtext or resume == "auto"),
            resume_from=pathlib.Path(resume) if resume and resume != "auto" else None,
            load=pathlib.Path(cfg["load"]) if cfg.get("load") else None,
            load_step=cfg.get("ckpt_step"), finetune=bool(cfg.get("finetune")),
            pretrained=(pathlib.Path(cfg["pretrained_checkpoint"])
                        if cfg.get("pretrained_checkpoint") else None),
            load_optim=not cfg.get("no_load_optim"), load_rng=not cfg.get("no_load_rng"),
            exit_on_missing=bool(cfg.get("exit_on_missing_checkpoint")),
            strictness=strictness, schedule_policy=schedule_policy(cfg),
            np_interval=np_interval, np_type=np_type,
            np_global_dir=pathlib.Path(np_global) if np_global else None,
            np_local_dir=pathlib.Path(np_local) if np_local else None)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def _move(seq, src: int, dst: int) -> list:
    """``seq`` with the element at ``src`` moved to ``dst`` (what np.moveaxis does to axes)."""
    seq = list(seq)
    seq.insert(dst, seq.pop(src))
    return seq


def _flat(tree) -> dict:
    """``tree``'s non-empty leaves by path name (Orbax cannot store zero-size arrays, which
    optax's masked transforms leave as placeholders); :func:`_unflat` puts them back."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if leaf.size:
            name = re.sub(r"[^A-Za-z0-9_]+", "_", jax.tree_util.keystr(path)).strip("_")
            while name in out:
                name += "_"
            out[name] = (path, leaf)
    return out


def _unflat(restored: dict, template):
    names = iter(_flat(template))  # the names in leaf order
    leaves = [restored[next(names)] if leaf.size else leaf
              for leaf in jax.tree.leaves(template)]
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _is_layered(path) -> bool:
    return any(isinstance(k, jax.tree_util.DictKey) and k.key in ("layers", "moe_layers")
               for k in path)


def _device_sharding(sharding):
    """Orbax restores into device memory; host-resident leaves move there afterwards."""
    kind = getattr(sharding, "memory_kind", None)
    if kind not in (None, "device"):
        return sharding.with_memory_kind("device")
    return sharding


def _moved_sharding(sharding, ndim: int, src: int, dst: int):
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*_move(spec, src, dst)),
                             memory_kind=sharding.memory_kind)
    return sharding


@functools.lru_cache(maxsize=None)
def _mover(src: int, dst: int, sharding):
    return jax.jit(lambda x: jnp.moveaxis(x, src, dst), out_shardings=sharding)


def find_torch_checkpoint(path: pathlib.Path) -> str | None:
    """What marks ``path`` as a Megatron/PyTorch checkpoint, if anything does."""
    if (path / "latest_checkpointed_iteration.txt").exists():
        return "latest_checkpointed_iteration.txt"
    for pattern in ("iter_*", "*.pt", "*.distcp", "*.pth"):
        found = next(iter(path.glob(pattern)), None)
        if found is not None:
            return found.name
    return None


class Checkpointer:
    """Saves and restores train states under one root directory with Orbax managers."""

    def __init__(self, ccfg: CheckpointConfig, model_cfg=None, config: dict | None = None,
                 dialect: str | None = None, logger: logging.Logger | None = None):
        self.ccfg, self.model_cfg, self.log = ccfg, model_cfg, logger or log
        self.config, self.dialect = config or {}, dialect
        self._writers: dict[pathlib.Path, Any] = {}
        self._readers: dict[pathlib.Path, Any] = {}
        self.last_saved: int | None = None
        self.last_non_persistent: int | None = None
        self.restored_extra: dict = {}
        # dist_ckpt_strictness return_*: leaf names per item that the last restore found only
        # in this run ("unexpected", Megatron's word) or only in the checkpoint ("missing")
        self.mismatch: dict = {"unexpected": {}, "missing": {}}
        if ccfg.final_dir is not None and model_cfg is not None:
            try:
                hf._check_exportable(model_cfg, hf.hf_family(model_cfg))
            except ValueError as e:
                raise ConfigError(f"train.save_final exports Hugging Face format: {e}; "
                                  "set train.save_final to false") from None

    @classmethod
    def from_config(cls, cfg, run_directory, model_cfg=None, logger=None) -> "Checkpointer":
        return cls(CheckpointConfig.from_config(cfg, pathlib.Path(run_directory)), model_cfg,
                   {k: _jsonable(v) for k, v in cfg.items()}, cfg.dialect, logger)

    # ------------------------------------------------------------------ managers

    def _preservation(self, keep_newest: int | None = None):
        from orbax.checkpoint import checkpoint_managers as cm

        if keep_newest is not None:
            return cm.LatestN(keep_newest)
        keep, retain = self.ccfg.keep_last, self.ccfg.retain_interval
        if retain:  # Megatron: multiples of the interval and the newest (or keep_last newest)
            return cm.AnyPreservationPolicy([cm.LatestN(keep or 1), cm.EveryNSteps(retain)])
        return cm.LatestN(keep or None)

    def writer(self, root: pathlib.Path, keep_newest: int | None = None):
        """The manager that saves under ``root`` (retention: the save knobs, or the newest
        ``keep_newest``); opening it removes unfinished saves left there."""
        root = pathlib.Path(root).absolute()
        if root not in self._writers:
            ocp = _ocp()
            options = ocp.CheckpointManagerOptions(
                step_prefix=STEP_PREFIX, create=True,
                enable_async_checkpointing=self.ccfg.async_save, cleanup_tmp_directories=True,
                preservation_policy=self._preservation(keep_newest))
            self._writers[root] = ocp.CheckpointManager(root, options=options, item_names=ITEMS)
        return self._writers[root]

    def reader(self, root: pathlib.Path):
        """A read-only manager for ``root`` (kept apart from the writers: a restore may ask
        for part of an item, which registers a different Orbax handler than saving does)."""
        root = pathlib.Path(root).absolute()
        if root not in self._readers:
            ocp = _ocp()
            options = ocp.CheckpointManagerOptions(step_prefix=STEP_PREFIX, read_only=True,
                                                   create=False)
            self._readers[root] = ocp.CheckpointManager(root, options=options, item_names=ITEMS)
        return self._readers[root]

    @property
    def saver(self):
        return self.writer(self.ccfg.save_dir) if self.ccfg.save_dir else None

    def steps(self, root: pathlib.Path) -> list[int]:
        """Complete checkpoints under ``root``, oldest first."""
        if not pathlib.Path(root).is_dir():
            return []
        manager = self.reader(root)
        manager.reload()
        return sorted(manager.all_steps())

    def non_persistent_root(self, base: pathlib.Path | None):
        """Where the non-persistent checkpoints that go with ``base`` (the save or load
        directory) live; None without non_persistent_ckpt_type."""
        c = self.ccfg
        if c.np_type == "local":
            return LocalRoot(c.np_local_dir)
        if c.np_type == "global":
            return c.np_global_dir or (pathlib.Path(base) / NON_PERSISTENT_DIR if base else None)
        return None

    # ------------------------------------------------------------------ saving

    def maybe_save(self, step: int, state, consumed: int, force: bool = False,
                   extra: dict | None = None) -> bool:
        """Save at multiples of save_interval, or now with ``force``; otherwise a
        non-persistent checkpoint at multiples of non_persistent_save_interval (Megatron: a
        step due for both gets the persistent one). False if nothing was saved. ``extra``
        (small JSON: e.g. the validation iterators' positions) goes into the meta and comes
        back as ``restored_extra`` after a restore."""
        c = self.ccfg
        if c.save_dir is None:
            return False
        if force or (c.save_interval and step % c.save_interval == 0):
            if step == self.last_saved:
                return False
            self._write(self.saver, step, state, consumed, extra)
            self.last_saved = step
            self.log.info("checkpoint step %d %s %s", step,
                          "being written to" if c.async_save else "saved in",
                          c.save_dir / f"{STEP_PREFIX}_{step}")
            return True
        if not (c.np_interval and step % c.np_interval == 0) or step == self.last_non_persistent:
            return False
        root = self.non_persistent_root(c.save_dir)
        if isinstance(root, LocalRoot):
            items, meta = self._contents(step, state, consumed, extra)
            local_checkpoint.save(root.path, step, {
                k: v if k in FLAT_ITEMS else {n: leaf for n, (_, leaf) in _flat(v).items()}
                for k, v in items.items()}, meta)
        else:
            self._write(self.writer(root, keep_newest=1), step, state, consumed, extra)
        self.last_non_persistent = step
        self.log.info("non-persistent checkpoint step %d saved in %s", step, root)
        return True

    def _contents(self, step, state, consumed, extra) -> tuple[dict, dict]:
        """(items, meta) of a checkpoint of ``state``."""
        c = self.ccfg
        items = {"params": {k: v for k, (_, v) in _flat(state.params).items()},
                 "train": {"step": state.step, "opt_step": state.opt_step}}
        if c.save_optim:
            items["opt_state"] = {k: v for k, (_, v) in _flat(state.opt_state).items()}
        if c.save_rng and state.rng is not None:
            items["rng"] = {"key": jax.random.key_data(state.rng)
                            if jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key) else state.rng}
        for field, item in STATE_ITEMS.items():
            if getattr(state, field, None) is not None:
                items[item] = getattr(state, field)
        meta = {"format": FORMAT_VERSION, "step": int(step), "consumed": int(consumed),
                "items": sorted(items),
                "param_scan_axis": getattr(self.model_cfg, "param_scan_axis", None),
                "model": (_jsonable(dataclasses.asdict(self.model_cfg))
                          if self.model_cfg is not None else None),
                "schedule": schedule_settings(self.config) if self.config else None,
                "dialect": self.dialect, "config": self.config, "extra": extra or {}}
        return items, json.loads(json.dumps(meta, default=str))

    def _write(self, manager, step, state, consumed, extra):
        ocp = _ocp()
        items, meta = self._contents(step, state, consumed, extra)
        args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
        args["meta"] = ocp.args.JsonSave(meta)
        if step in manager.all_steps():  # a rerun over an old directory: replace it
            manager.delete(step)
        manager.save(step, args=ocp.args.Composite(**args), force=True)

    def export_final(self, params) -> pathlib.Path | None:
        """pgs train.save_final: the model in Hugging Face format in ``<save>/final``."""
        if self.ccfg.final_dir is None or self.model_cfg is None:
            return None
        path = hf.to_hf(params, self.model_cfg, self.ccfg.final_dir)
        self.log.info("final model exported in Hugging Face format to %s", path)
        return path

    def wait(self):
        for manager in self._writers.values():
            manager.wait_until_finished()

    def close(self):
        """Wait for pending saves to finish, then release the managers."""
        for manager in [*self._writers.values(), *self._readers.values()]:
            manager.wait_until_finished()
            manager.close()
        self._writers.clear()
        self._readers.clear()

    # ------------------------------------------------------------------ what to restore

    def _locate(self, path: pathlib.Path, step: int | None, what: str):
        """(root, step) of a complete checkpoint at ``path`` (a root or a step directory)."""
        path = pathlib.Path(path)
        match = _STEP_DIR.match(path.name)
        if match and (path / "_CHECKPOINT_METADATA").exists():
            root, step = path.parent, int(match.group(1)) if step is None else step
        else:
            root = path
        if path.is_dir():
            torch = find_torch_checkpoint(path)
            if torch:
                raise ConfigError(f"{what} {path} holds a PyTorch/Megatron checkpoint "
                                  f"({torch}); jaxtrain reads Orbax checkpoints only: "
                                  f"{TORCH_CONVERSION}")
        steps = self.steps(root)
        if not steps:
            return None
        if step is None:
            return root, steps[-1]
        if step not in steps:
            raise ConfigError(f"{what} {root} has no complete checkpoint for step {step} "
                              f"(ckpt_step); it has steps {steps}")
        return root, step

    def _with_non_persistent(self, base, persistent) -> list[tuple]:
        """[(root, step)] to try for ``base``: its newest non-persistent checkpoint when that
        is at least as new as ``persistent`` (Megatron's rule), then ``persistent``."""
        root, step = self.non_persistent_root(base), None
        if isinstance(root, LocalRoot):
            step = local_checkpoint.newest_common_step(root.path)
        elif root is not None:
            steps = self.steps(root)
            step = steps[-1] if steps else None
        found = [persistent] if persistent else []
        if step is not None and (persistent is None or step >= persistent[1]):
            found.insert(0, (root, step))
        return found

    def candidates(self) -> list[tuple]:
        """(root, step, mode) to restore, best first (a local non-persistent checkpoint that
        does not fit this run's layout falls back to the next); mode 'full' or 'params'.
        Empty: start fresh."""
        c = self.ccfg
        if c.auto_resume and c.save_dir is not None:
            found = self._with_non_persistent(
                c.save_dir, self._locate(c.save_dir, None, "save directory"))
            if found:
                return [(*f, "full") for f in found]
        if c.resume_from is not None:
            found = self._locate(c.resume_from, None, "train.resume_from")
            if not found:
                raise ConfigError(f"train.resume_from {c.resume_from} holds no complete "
                                  "checkpoint; point it at a step_* directory or an output_dir "
                                  "with one, or set it to auto")
            return [(*found, "full")]
        if c.load is not None:
            found = self._locate(c.load, c.load_step, "load")
            if c.load_step is None:  # ckpt_step names a persistent step exactly
                found = self._with_non_persistent(c.load, found)
            else:
                found = [found] if found else []
            if found:
                return [(*f, "params" if c.finetune else "full") for f in found]
        if c.pretrained is not None:  # Megatron: finetune from it when load has nothing
            found = self._locate(c.pretrained, c.load_step, "pretrained_checkpoint")
            if not found:
                raise ConfigError(f"pretrained_checkpoint {c.pretrained} holds no complete "
                                  "checkpoint" + (f", and load {c.load} holds none either"
                                                  if c.load else ""))
            if c.load is not None:
                self.log.info("load %s holds no checkpoint: finetuning from "
                              "pretrained_checkpoint %s", c.load, c.pretrained)
            return [(*found, "params")]
        if c.load is not None:
            if c.exit_on_missing:
                raise ConfigError(f"load {c.load} holds no complete checkpoint (and "
                                  "exit_on_missing_checkpoint is true); fix the path, or set "
                                  "exit_on_missing_checkpoint to false to start from scratch")
            self.log.warning("load %s holds no checkpoint; starting from scratch", c.load)
        return []

    def upcycle_source(self) -> tuple:
        """(root, step) of the dense checkpoint moe_use_upcycling converts: load's newest (or
        ckpt_step), else pretrained_checkpoint's. Megatron upcycles on a run's first start
        only: a save directory that already holds checkpoints is refused."""
        c = self.ccfg
        saved = self.steps(c.save_dir) if c.save_dir is not None else []
        if saved:
            raise ConfigError(f"moe_use_upcycling converts a dense checkpoint on the first start "
                              f"of an MoE run, but save {c.save_dir} already holds checkpoints "
                              f"(steps {saved}); to continue that run, remove moe_use_upcycling "
                              "(Megatron's rule), or save somewhere else")
        for path, what in ((c.load, "load"), (c.pretrained, "pretrained_checkpoint")):
            found = self._locate(path, c.load_step, what) if path is not None else None
            if found:
                return found
        named = " or ".join(f"{what} {path}" for path, what in
                            ((c.load, "load"), (c.pretrained, "pretrained_checkpoint")) if path)
        raise ConfigError(f"moe_use_upcycling: no dense checkpoint to convert in "
                          f"{named or 'load (unset)'}; point load at the dense model's "
                          "checkpoint directory")

    def plan(self):
        """(root, step, mode) to restore first, mode 'full' or 'params'; None to start fresh."""
        found = self.candidates()
        return found[0] if found else None

    # ------------------------------------------------------------------ restoring

    @staticmethod
    def where(root, step: int) -> pathlib.Path:
        if isinstance(root, LocalRoot):
            return local_checkpoint.step_dir(root.path, step)
        return pathlib.Path(root) / f"{STEP_PREFIX}_{step}"

    def read_meta(self, root, step: int) -> dict:
        where = self.where(root, step)
        try:
            if isinstance(root, LocalRoot):
                meta = local_checkpoint.read_meta(root.path, step)
            else:
                ocp = _ocp()
                meta = self.reader(root).restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any read failure means a broken directory
            raise ConfigError(f"checkpoint {where} is corrupt or incomplete: cannot read its "
                              f"metadata ({type(e).__name__}: {e})") from None
        if not isinstance(meta, dict) or "consumed" not in meta:
            raise ConfigError(f"checkpoint {where} is corrupt or incomplete: its metadata "
                              "lacks the data position")
        return meta

    def check_compatible(self, meta: dict, where) -> None:
        saved = meta.get("model") or {}
        if self.model_cfg is None:
            return
        here = dataclasses.asdict(self.model_cfg)
        diff = [f"{k} = {saved[k]!r} there, {here[k]!r} here" for k in ARCH_FIELDS
                if k in saved and _jsonable(here[k]) != saved[k]]
        if diff:
            raise ConfigError(f"checkpoint {where} was saved from a different model: "
                              + "; ".join(diff) + ". Set the model knobs to the checkpoint's "
                              "values, or load a matching checkpoint")

    def check_schedule(self, meta: dict, where) -> None:
        """override_opt_param_scheduler / use_checkpoint_opt_param_scheduler on a resume."""
        policy = self.ccfg.schedule_policy
        saved = meta.get("schedule") or (schedule_settings(meta["config"])
                                         if meta.get("config") else None)
        if policy == "config" or not saved or not self.config:
            return
        here = schedule_settings(self.config)
        diff = [f"{k} = {saved[k]!r} there, {here[k]!r} here" for k in SCHEDULE_KEYS
                if k in saved and saved[k] != here[k]]
        if not diff:
            return
        if policy == "check":
            raise ConfigError(f"checkpoint {where} was trained with a different LR schedule: "
                              + "; ".join(diff) + ". Set override_opt_param_scheduler to true "
                              "to continue with this config's schedule, or "
                              "use_checkpoint_opt_param_scheduler to take the checkpoint's")
        raise ConfigError(f"use_checkpoint_opt_param_scheduler: the schedule of checkpoint "
                          f"{where} differs from this config's ({'; '.join(diff)}). It is "
                          "adopted when the config is resolved: python -m jaxtrain.train does "
                          "that; elsewhere resolve the config again with the overrides of "
                          "jaxtrain.checkpoint_args.checkpoint_overrides(cfg)")

    def _stored_names(self, root, step: int, items) -> dict[str, set[str]]:
        """item -> the leaf names the checkpoint holds for it."""
        if isinstance(root, LocalRoot):
            stored = local_checkpoint.keys(root.path, step)
            return {k: stored.get(k, set()) for k in items}
        ocp, where = _ocp(), self.where(root, step)
        out = {}
        handler = ocp.PyTreeCheckpointHandler()
        try:
            for item in items:
                try:
                    out[item] = set(handler.metadata(where / item).keys())
                except Exception as e:  # noqa: BLE001
                    raise ConfigError(f"checkpoint {where} is corrupt or incomplete: cannot "
                                      f"read the metadata of {item} ({type(e).__name__}: "
                                      f"{e})") from None
        finally:
            handler.close()
        return out

    def _reconcile(self, where, requested: dict[str, set], stored: dict[str, set]
                   ) -> dict[str, list[str]]:
        """Apply dist_ckpt_strictness to leaf names this run asks for that the checkpoint lacks
        (Megatron's "unexpected") and names the checkpoint holds that this run does not ask for
        ("missing"); returns the names that keep their initial values."""
        mode = self.ccfg.strictness
        absent = {i: sorted(requested[i] - stored[i]) for i in requested
                  if requested[i] - stored[i]}
        extra = {i: sorted(stored[i] - requested[i]) for i in requested
                 if stored[i] - requested[i]}

        def show(found):
            return "; ".join(f"{item}: {', '.join(names[:8])}"
                             + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
                             for item, names in found.items())

        self.mismatch = {"unexpected": absent if mode.startswith("return_") else {},
                         "missing": extra if mode == "return_all" else {}}
        fail = []
        if absent and mode in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
            fail.append(f"in this run but not in the checkpoint: {show(absent)}")
        if extra and mode == "raise_all":
            fail.append(f"in the checkpoint but not in this run: {show(extra)}")
        if fail:
            raise ConfigError(f"checkpoint {where} does not match this run's state "
                              f"(dist_ckpt_strictness {mode}): " + "; ".join(fail) + ". If "
                              "the optimizer differs, set no_load_optim; to start what the "
                              "checkpoint lacks from its initial values, set "
                              "dist_ckpt_strictness to log_unexpected")
        if absent and mode in ("log_unexpected", "log_all"):
            self.log.warning("checkpoint %s lacks leaves this run has; they keep their initial "
                             "values: %s", where, show(absent))
        if extra and mode == "log_all":
            self.log.warning("checkpoint %s holds leaves this run does not use; they are not "
                             "loaded: %s", where, show(extra))
        return absent

    def restore(self, template) -> tuple[Any, int] | None:
        """The train state from the checkpoint the config names, in ``template``'s shardings,
        and the samples consumed; None when the run starts fresh."""
        found, why = self.candidates(), []
        for root, step, mode in found:
            try:
                return self.restore_from(root, step, template, mode)
            except local_checkpoint.Unusable as e:
                why.append(f"{self.where(root, step)}: {e}")
                self.log.warning("local checkpoint %s does not fit this run (%s); trying the "
                                 "next", self.where(root, step), e)
        if found:
            raise ConfigError("no checkpoint to resume from fits this run: " + "; ".join(why)
                              + ". Local checkpoints restore only onto the devices and "
                              "shardings that saved them; keep a global checkpoint too")
        return None

    def restore_from(self, root, step: int, template, mode: str = "full"):
        c, local = self.ccfg, isinstance(root, LocalRoot)
        where = self.where(root, step)
        meta = self.read_meta(root, step)
        self.check_compatible(meta, where)
        if mode == "full":
            self.check_schedule(meta, where)
        saved_items = set(meta.get("items", ()))
        here_axis = getattr(self.model_cfg, "param_scan_axis", None)
        saved_axis = meta.get("param_scan_axis")
        moved = ((saved_axis, here_axis) if None not in (saved_axis, here_axis)
                 and saved_axis != here_axis else None)
        if moved and local:
            raise local_checkpoint.Unusable(f"param_scan_axis {saved_axis} there, {here_axis} "
                                            "here")

        rng_template = None
        if template.rng is not None:
            rng_template = {"key": jax.random.key_data(template.rng)
                            if jnp.issubdtype(template.rng.dtype, jax.dtypes.prng_key)
                            else template.rng}
        wanted = {"params": _flat(template.params)}
        if mode == "full":
            wanted["train"] = {"step": template.step, "opt_step": template.opt_step}
            if c.load_optim:
                wanted["opt_state"] = _flat(template.opt_state)
            for field, item in STATE_ITEMS.items():
                if getattr(template, field, None) is not None:
                    wanted[item] = getattr(template, field)
            if c.load_rng and rng_template is not None:
                wanted["rng"] = rng_template
        missing = sorted(k for k in wanted if k not in saved_items)
        if "params" in missing or "train" in missing:
            raise ConfigError(f"checkpoint {where} is corrupt or incomplete: it lacks "
                              f"{missing}")
        for name in missing:
            self.log.warning("checkpoint %s holds no %s (saved without it); that state starts "
                             "fresh", where, name)
            del wanted[name]

        flat = [k for k in FLAT_ITEMS if k in wanted]
        kept = self._reconcile(where, {k: set(wanted[k]) for k in flat},
                               self._stored_names(root, step, flat))
        trees = dict(wanted)  # the template trees the restored leaves go back into
        for name in flat:
            wanted[name] = {k: v for k, v in wanted[name].items() if k not in kept.get(name, ())}
        if local:  # every item as {leaf name: (path, leaf)}, as it was saved
            wanted = {k: v if k in flat else _flat(v) for k, v in wanted.items()}
        wanted = {k: v for k, v in wanted.items() if v or k not in flat}

        targets, fixes = {}, {}
        for name, tree in wanted.items():
            targets[name], fixes[name] = self._abstract(tree, moved if name in
                                                        ("params", "opt_state") else None)
        if local:
            got = local_checkpoint.restore(root.path, step, targets)
        else:
            got = self._read(root, step, where, targets)
        out = {k: self._finish(got[k], wanted[k], fixes[k]) for k in wanted}
        for name in flat:  # leaves the checkpoint lacks keep the template's values
            restored = {k: leaf for k, (_, leaf) in trees[name].items() if k in kept.get(name, ())}
            restored.update(out.get(name, {}))
            out[name] = _unflat(restored, getattr(template, name))
        if local:
            out = {k: v if k in flat else _unflat(v, trees[k]) for k, v in out.items()}

        state = template
        changes = {"params": out["params"]}
        consumed = 0
        if mode == "full":
            changes.update(step=out["train"]["step"], opt_step=out["train"]["opt_step"])
            if "opt_state" in out:
                changes["opt_state"] = out["opt_state"]
            for field, item in STATE_ITEMS.items():
                if item in out:
                    changes[field] = out[item]
            if "rng" in out:
                changes["rng"] = (jax.random.wrap_key_data(
                    out["rng"]["key"], impl=jax.random.key_impl(template.rng))
                    if jnp.issubdtype(template.rng.dtype, jax.dtypes.prng_key)
                    else out["rng"]["key"])
            consumed = int(meta["consumed"])
            self.restored_extra = meta.get("extra") or {}
        state = dataclasses.replace(state, **changes)
        self.log.info("restored %s from %s (step %d, %d samples consumed%s)",
                      "parameters" if mode == "params" else "the train state", where, step,
                      int(meta["consumed"]),
                      f"; layer axis {moved[0]} -> {moved[1]}" if moved else "")
        return state, consumed

    def _read(self, root, step: int, where, targets: dict) -> dict:
        """Orbax restore of ``targets``; the flat items ask only for the leaves named (a
        partial restore: the checkpoint may hold more)."""
        ocp = _ocp()
        args = {}
        for name, target in targets.items():
            if name in FLAT_ITEMS:
                args[name] = ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True)
            else:
                args[name] = ocp.args.StandardRestore(target)
        try:
            return self.reader(root).restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"checkpoint {where} cannot be restored into this run: "
                              f"{type(e).__name__}: {str(e)[:500]}. If the optimizer differs, "
                              "set no_load_optim; if files are missing, the checkpoint is "
                              "corrupt") from None

    @staticmethod
    def _abstract(tree, moved):
        """Restore targets for ``tree`` (or a :func:`_flat` dict of it) and per-leaf axis moves."""
        if isinstance(tree, dict) and tree and all(
                isinstance(v, tuple) and len(v) == 2 for v in tree.values()):
            flat, treedef = [tree[k] for k in sorted(tree)], jax.tree.structure(
                {k: 0 for k in tree})
        else:
            flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves, fixes = [], []
        for path, leaf in flat:
            sharding = _device_sharding(leaf.sharding)
            shape, fix = tuple(leaf.shape), None
            if moved is not None and _is_layered(path) and leaf.ndim > max(moved):
                src, dst = moved
                shape = tuple(_move(shape, dst, src))
                sharding = _moved_sharding(sharding, leaf.ndim, dst, src)
                fix = (src, dst)
            leaves.append(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding))
            fixes.append(fix)
        return treedef.unflatten(leaves), fixes

    @staticmethod
    def _finish(restored, template, fixes):
        leaves = jax.tree.leaves(restored)
        if isinstance(template, dict) and template and all(
                isinstance(v, tuple) and len(v) == 2 for v in template.values()):
            template = {k: leaf for k, (_, leaf) in template.items()}
        targets = jax.tree.leaves(template)
        out = []
        for x, target, fix in zip(leaves, targets, fixes):
            if fix is not None:
                x = _mover(*fix, _device_sharding(target.sharding))(x)
            if x.sharding != target.sharding:
                x = jax.device_put(x, target.sharding)
            out.append(x)
        return jax.tree.unflatten(jax.tree.structure(template), out)
