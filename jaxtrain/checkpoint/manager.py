"""The Orbax managers: saving, retention, async saves, non-persistent and local checkpoints.

:class:`Checkpointer` owns one Orbax ``CheckpointManager`` per directory it writes (a
``writer``: retention by ``train.keep_checkpoints`` newest and ``save_retain_interval``
multiples, async with ``async_save``) and one read-only manager per directory it reads (a
``reader``). :meth:`Checkpointer.maybe_save` writes a persistent checkpoint every
``save_interval`` steps, or a non-persistent one every ``non_persistent_save_interval`` steps:
``global`` ones under ``non_persistent_global_ckpt_dir`` (default ``<save>/non_persistent``)
keep only the newest, ``local`` ones go to each host's disk (:mod:`jaxtrain.checkpoint.local`).
Finding and restoring checkpoints is :class:`jaxtrain.checkpoint.restore.Restoring`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.checkpoint import export, integrity, local
from jaxtrain.checkpoint.compat import schedule_settings
from jaxtrain.checkpoint.config import CheckpointConfig
from jaxtrain.checkpoint.layout import (FLAT_ITEMS, FORMAT_VERSION, ITEMS, NON_PERSISTENT_DIR,
                                        STATE_ITEMS, STEP_PREFIX, LocalRoot, flat, jsonable,
                                        orbax, where)
from jaxtrain.checkpoint.restore import Restoring

log = logging.getLogger("jaxtrain.checkpoint")


class Checkpointer(Restoring):
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
        self.restored_items: dict = {}  # trees restored beside the state (SIDE_ITEMS)
        # dist_ckpt_strictness return_*: leaf names per item that the last restore found only
        # in this run ("unexpected", Megatron's word) or only in the checkpoint ("missing")
        self.mismatch: dict = {"unexpected": {}, "missing": {}}
        if (ccfg.final_dir is not None or ccfg.hf_steps) and model_cfg is not None:
            export.check_exportable(model_cfg)
        self.best: float | None = None
        self._unsealed: list[tuple[Any, pathlib.Path]] = []   # (manager, step directory)

    @classmethod
    def from_config(cls, cfg, run_directory, model_cfg=None, logger=None) -> "Checkpointer":
        return cls(CheckpointConfig.from_config(cfg, pathlib.Path(run_directory)), model_cfg,
                   {k: jsonable(v) for k, v in cfg.items()}, cfg.dialect, logger)

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
            ocp = orbax()
            options = ocp.CheckpointManagerOptions(
                step_prefix=STEP_PREFIX, create=True,
                enable_async_checkpointing=self.ccfg.async_save, cleanup_tmp_directories=True,
                preservation_policy=self._preservation(keep_newest))
            items = dict(item_names=ITEMS)
            if not self.ccfg.use_ocdbt:   # MaxText checkpoint_storage_use_ocdbt: false
                items = dict(item_handlers={
                    **{k: ocp.StandardCheckpointHandler(use_ocdbt=False) for k in ITEMS},
                    "meta": ocp.JsonCheckpointHandler()})
            self._writers[root] = ocp.CheckpointManager(root, options=options, **items)
        return self._writers[root]

    def reader(self, root: pathlib.Path):
        """A read-only manager for ``root`` (kept apart from the writers: a restore may ask
        for part of an item, which registers a different Orbax handler than saving does)."""
        root = pathlib.Path(root).absolute()
        if root not in self._readers:
            ocp = orbax()
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
                   extra: dict | None = None, items: dict | None = None) -> bool:
        """Save at multiples of save_interval, or now with ``force``; otherwise a
        non-persistent checkpoint at multiples of non_persistent_save_interval (Megatron: a
        step due for both gets the persistent one). False if nothing was saved. ``extra``
        (small JSON: e.g. the validation iterators' positions) goes into the meta and comes
        back as ``restored_extra`` after a restore; ``items`` (trees beside the state, named in
        SIDE_ITEMS) come back as ``restored_items``."""
        c = self.ccfg
        if c.save_dir is None:
            return False
        self._seal(block=False)
        if force or (c.save_interval and step % c.save_interval == 0):
            if step == self.last_saved:
                return False
            self._write(self.saver, step, state, consumed, extra, items)
            self.last_saved = step
            if c.hf_steps and self.model_cfg is not None:
                export.write_model(state.params, self.model_cfg, export.step_dir(c.save_dir, step),
                                   c.side_dirs)
                export.purge_steps(c.save_dir, set(self.saver.all_steps()) | {step})
            self.log.info("checkpoint step %d %s %s", step,
                          "being written to" if c.async_save else "saved in",
                          c.save_dir / f"{STEP_PREFIX}_{step}")
            return True
        if not (c.np_interval and step % c.np_interval == 0) or step == self.last_non_persistent:
            return False
        root = self.non_persistent_root(c.save_dir)
        if isinstance(root, LocalRoot):
            items, meta = self._contents(step, state, consumed, extra, items)
            local.save(root.path, step, {
                k: v if k in FLAT_ITEMS else {n: leaf for n, (_, leaf) in flat(v).items()}
                for k, v in items.items()}, meta)
        else:
            self._write(self.writer(root, keep_newest=1), step, state, consumed, extra, items)
        self.last_non_persistent = step
        self.log.info("non-persistent checkpoint step %d saved in %s", step, root)
        return True

    def _contents(self, step, state, consumed, extra, side=None) -> tuple[dict, dict]:
        """(items, meta) of a checkpoint of ``state`` and the trees ``side``."""
        c = self.ccfg
        items = {**(side or {}), "params": {k: v for k, (_, v) in flat(state.params).items()},
                 "train": {"step": state.step, "opt_step": state.opt_step}}
        if c.save_optim:
            items["opt_state"] = {k: v for k, (_, v) in flat(state.opt_state).items()}
        if c.save_rng and state.rng is not None:
            items["rng"] = {"key": jax.random.key_data(state.rng)
                            if jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key) else state.rng}
        for field, item in STATE_ITEMS.items():
            if getattr(state, field, None) is not None:
                items[item] = getattr(state, field)
        meta = {"format": FORMAT_VERSION, "step": int(step), "consumed": int(consumed),
                "items": sorted(items),
                "param_scan_axis": getattr(self.model_cfg, "param_scan_axis", None),
                "model": (jsonable(dataclasses.asdict(self.model_cfg))
                          if self.model_cfg is not None else None),
                "schedule": schedule_settings(self.config) if self.config else None,
                "dialect": self.dialect, "config": self.config, "extra": extra or {}}
        return items, json.loads(json.dumps(meta, default=str))

    def _write(self, manager, step, state, consumed, extra, side=None):
        ocp = orbax()
        items, meta = self._contents(step, state, consumed, extra, side)
        args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
        args["meta"] = ocp.args.JsonSave(meta)
        if step in manager.all_steps():  # a rerun over an old directory: replace it
            manager.delete(step)
        manager.save(step, args=ocp.args.Composite(**args), force=True)
        if self.ccfg.verify_integrity:
            self._unsealed.append((manager, where(manager.directory, step)))
            self._seal(block=not self.ccfg.async_save)

    def _seal(self, block: bool):
        """verify_integrity: the manifest of each checkpoint saved since the last call, once
        its (async) save is complete; ``block`` waits for the saves in flight."""
        pending = []
        for manager, step_dir in self._unsealed:
            if block:
                manager.wait_until_finished()
            elif manager.is_saving_in_progress():
                pending.append((manager, step_dir))
                continue
            if jax.process_index() == 0 and step_dir.is_dir():   # not removed by retention
                integrity.write(step_dir)
        self._unsealed = pending

    def export_final(self, params, what: str = "") -> pathlib.Path | None:
        """pgs train.save_final: the model in Hugging Face format in ``<save>/final``;
        ``what`` names the weights in the log when they are not the trained ones."""
        if self.ccfg.final_dir is None or self.model_cfg is None:
            return None
        return export.export_final(params, self.model_cfg, self.ccfg.final_dir, self.log,
                                   self.ccfg.side_dirs, what)

    def track_best(self, params, step: int, metrics: dict) -> pathlib.Path | None:
        """save_hf with validation: the model in ``<save>/best`` whenever ``val_composite``
        (pgs eval_sources), else ``val_loss``, reaches a new low."""
        c = self.ccfg
        metric = "val_composite" if "val_composite" in metrics else "val_loss"
        if not c.hf_steps or self.model_cfg is None or metric not in metrics:
            return None
        value = float(metrics[metric])
        if self.best is not None and value >= self.best:
            return None
        self.best = value
        path = export.write_best(params, self.model_cfg, c.save_dir, step, metric, value,
                                 c.side_dirs)
        self.log.info("best model so far (%s %.4f at step %d) in %s", metric, value, step, path)
        return path

    def wait(self):
        for manager in self._writers.values():
            manager.wait_until_finished()
        self._seal(block=True)

    def close(self):
        """Wait for pending saves to finish (and seal them), then release the managers."""
        self._seal(block=True)
        for manager in [*self._writers.values(), *self._readers.values()]:
            manager.wait_until_finished()
            manager.close()
        self._writers.clear()
        self._readers.clear()
