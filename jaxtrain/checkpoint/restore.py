"""What to restore and restoring it: the restore half of :class:`~jaxtrain.checkpoint.Checkpointer`.

Which checkpoint a run starts from (:meth:`Restoring.candidates`): with auto-resume the save
directory's newest, else ``train.resume_from``, else ``load`` (newest or ``ckpt_step``; a
finetune takes its parameters only), else ``pretrained_checkpoint`` (parameters only). Beside
a save or load directory, the newest non-persistent checkpoint is tried first when it is at
least as new as the newest persistent one (Megatron's rule); a local one that does not fit
this run's devices and shardings falls back to the next candidate.

The restore reads the metadata, checks it (:mod:`jaxtrain.checkpoint.compat`), asks Orbax (or
:mod:`jaxtrain.checkpoint.local`) for the leaves the template has, in the template's
shardings and with the layer axis moved where ``param_scan_axis`` differs
(:mod:`jaxtrain.checkpoint.layout`), and returns the template with them put in.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.checkpoint import compat, integrity, local
from jaxtrain.checkpoint.layout import (FLAT_ITEMS, SIDE_ITEMS, STATE_ITEMS, STEP_DIR,
                                        LocalRoot, flat, orbax, place, restore_targets, unflat)
from jaxtrain.checkpoint.layout import where as _where
from jaxtrain.config.errors import ConfigError


class Restoring:
    """Finding and restoring checkpoints. A mixin of :class:`Checkpointer`, which provides
    ``ccfg``, ``model_cfg``, ``config``, ``log``, ``mismatch``, ``restored_extra`` and the
    Orbax managers (``reader``, ``steps``, ``non_persistent_root``)."""

    # ------------------------------------------------------------------ what to restore

    def _locate(self, path: pathlib.Path, step: int | None, what: str):
        """(root, step) of a complete checkpoint at ``path`` (a root or a step directory)."""
        path = pathlib.Path(path)
        match = STEP_DIR.match(path.name)
        if match and (path / "_CHECKPOINT_METADATA").exists():
            root, step = path.parent, int(match.group(1)) if step is None else step
        else:
            root = path
        if path.is_dir():
            compat.check_not_torch(path, what)
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
            step = local.newest_common_step(root.path)
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
        return _where(root, step)

    def read_meta(self, root, step: int) -> dict:
        where = self.where(root, step)
        try:
            if isinstance(root, LocalRoot):
                meta = local.read_meta(root.path, step)
            else:
                ocp = orbax()
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
        """The checkpoint's model matches this one (:func:`compat.check_model`)."""
        compat.check_model(meta, self.model_cfg, where)

    def check_schedule(self, meta: dict, where) -> None:
        """override_opt_param_scheduler / use_checkpoint_opt_param_scheduler on a resume."""
        compat.check_schedule(meta, self.ccfg.schedule_policy, self.config, where)

    def _stored_names(self, root, step: int, items) -> dict[str, set[str]]:
        """item -> the leaf names the checkpoint holds for it."""
        if isinstance(root, LocalRoot):
            stored = local.keys(root.path, step)
            return {k: stored.get(k, set()) for k in items}
        ocp, where = orbax(), self.where(root, step)
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
        absent, extra = compat.differences(requested, stored)
        self.mismatch = compat.reported(absent, extra, mode)
        compat.apply_strictness(where, absent, extra, mode, self.log)
        return absent

    def restore(self, template, items: dict | None = None) -> tuple[Any, int] | None:
        """The train state from the checkpoint the config names, in ``template``'s shardings,
        and the samples consumed; None when the run starts fresh. ``items``: templates of
        trees saved beside the state (SIDE_ITEMS) to restore into ``restored_items``."""
        found, why = self.candidates(), []
        for root, step, mode in found:
            try:
                return self.restore_from(root, step, template, mode, items)
            except local.Unusable as e:
                why.append(f"{self.where(root, step)}: {e}")
                self.log.warning("local checkpoint %s does not fit this run (%s); trying the "
                                 "next", self.where(root, step), e)
        if found:
            raise ConfigError("no checkpoint to resume from fits this run: " + "; ".join(why)
                              + ". Local checkpoints restore only onto the devices and "
                              "shardings that saved them; keep a global checkpoint too")
        return None

    def restore_from(self, root, step: int, template, mode: str = "full",
                     items: dict | None = None):
        c, is_local = self.ccfg, isinstance(root, LocalRoot)
        self.restored_items = {}
        where = self.where(root, step)
        if c.verify_integrity and not is_local:
            self.log.info("verified %d files of checkpoint %s", integrity.verify(where), where)
        meta = self.read_meta(root, step)
        self.check_compatible(meta, where)
        if mode == "full":
            self.check_schedule(meta, where)
        saved_items = set(meta.get("items", ()))
        here_axis = getattr(self.model_cfg, "param_scan_axis", None)
        saved_axis = meta.get("param_scan_axis")
        moved = ((saved_axis, here_axis) if None not in (saved_axis, here_axis)
                 and saved_axis != here_axis else None)
        if moved and is_local:
            raise local.Unusable(f"param_scan_axis {saved_axis} there, {here_axis} here")

        rng_template = None
        if template.rng is not None:
            rng_template = {"key": jax.random.key_data(template.rng)
                            if jnp.issubdtype(template.rng.dtype, jax.dtypes.prng_key)
                            else template.rng}
        wanted = {"params": flat(template.params)}
        if mode == "full":
            wanted["train"] = {"step": template.step, "opt_step": template.opt_step}
            if c.load_optim:
                wanted["opt_state"] = flat(template.opt_state)
            for field, item in STATE_ITEMS.items():
                if getattr(template, field, None) is not None:
                    wanted[item] = getattr(template, field)
            if c.load_rng and rng_template is not None:
                wanted["rng"] = rng_template
            wanted.update(items or {})
        missing = sorted(k for k in wanted if k not in saved_items)
        if "params" in missing or "train" in missing:
            raise ConfigError(f"checkpoint {where} is corrupt or incomplete: it lacks "
                              f"{missing}")
        for name in missing:
            self.log.warning("checkpoint %s holds no %s (saved without it); that state starts "
                             "fresh", where, name)
            del wanted[name]

        flat_items = [k for k in FLAT_ITEMS if k in wanted]
        kept = self._reconcile(where, {k: set(wanted[k]) for k in flat_items},
                               self._stored_names(root, step, flat_items))
        trees = dict(wanted)  # the template trees the restored leaves go back into
        for name in flat_items:
            wanted[name] = {k: v for k, v in wanted[name].items() if k not in kept.get(name, ())}
        if is_local:  # every item as {leaf name: (path, leaf)}, as it was saved
            wanted = {k: v if k in flat_items else flat(v) for k, v in wanted.items()}
        wanted = {k: v for k, v in wanted.items() if v or k not in flat_items}

        targets, fixes = {}, {}
        for name, tree in wanted.items():
            targets[name], fixes[name] = restore_targets(tree, moved if name in
                                                         ("params", "opt_state", *SIDE_ITEMS)
                                                         else None)
        if is_local:
            got = local.restore(root.path, step, targets)
        else:
            got = self._read(root, step, where, targets)
        out = {k: place(got[k], wanted[k], fixes[k]) for k in wanted}
        for name in flat_items:  # leaves the checkpoint lacks keep the template's values
            restored = {k: leaf for k, (_, leaf) in trees[name].items() if k in kept.get(name, ())}
            restored.update(out.get(name, {}))
            out[name] = unflat(restored, getattr(template, name))
        if is_local:
            out = {k: v if k in flat_items else unflat(v, trees[k]) for k, v in out.items()}

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
            self.restored_items = {k: out[k] for k in items or () if k in out}
        state = dataclasses.replace(state, **changes)
        self.log.info("restored %s from %s (step %d, %d samples consumed%s)",
                      "parameters" if mode == "params" else "the train state", where, step,
                      int(meta["consumed"]),
                      f"; layer axis {moved[0]} -> {moved[1]}" if moved else "")
        return state, consumed

    def _read(self, root, step: int, where, targets: dict) -> dict:
        """Orbax restore of ``targets``; the flat items ask only for the leaves named (a
        partial restore: the checkpoint may hold more)."""
        ocp = orbax()
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
