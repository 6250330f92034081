"""CheckpointConfig: the checkpoint knobs of a resolved config, read once."""
from __future__ import annotations

import dataclasses
import pathlib

from jaxtrain.checkpoint.compat import TORCH_CONVERSION
from jaxtrain.checkpoint.layout import FINAL_DIR
from jaxtrain.config.dialects import hf as hf_config
from jaxtrain.config.errors import ConfigError


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


def side_dirs(cfg) -> tuple:
    """Directories whose tokenizer and generation files go into exported models: the
    tokenizer's, then the model's (model.name_or_path)."""
    out = []
    tok = cfg.get("tokenizer_model")
    if tok and pathlib.Path(str(tok)).is_dir():
        out.append(pathlib.Path(str(tok)))
    name = cfg.get("model.name_or_path")
    if name:
        try:
            out.append(hf_config.locate(str(name)))
        except ConfigError:
            pass
    return tuple(out)


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
    hf_steps: bool = False                     # save_hf: each save (and the best) as HF too
    side_dirs: tuple = ()                      # where the tokenizer/generation files come from
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
    verify_integrity: bool = False             # SHA-256 manifests written and checked
    use_ocdbt: bool = True                     # Orbax's OCDBT store; False: a file per array

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
            hf_steps=bool(cfg.get("save_hf") and save_dir is not None),
            side_dirs=side_dirs(cfg),
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
            np_local_dir=pathlib.Path(np_local) if np_local else None,
            verify_integrity=bool(cfg.get("verify_integrity")),
            use_ocdbt=cfg.get("checkpoint_storage_use_ocdbt") is not False)
