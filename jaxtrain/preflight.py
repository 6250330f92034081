"""What a run builds from its config before it touches a device, built without devices.

``--dry-run`` calls :func:`preflight` after resolving the config, and so does the run itself
before it starts the backend: the training config, the data source (its files and tokenizer,
not their contents), the model, the mesh for the job's device count, the LR schedule, the
optimizer, checkpointing, loss scaling and the observers. Every problem any of them finds is
collected into one ConfigError, so a config the dry run accepts is one the run starts with.
"""
from __future__ import annotations

import math

from jaxtrain.config.errors import ConfigError


_MODEL_PARALLEL = ("tensor_model_parallel_size", "context_parallel_size",
                   "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "num_distributed_optimizer_instances")


def smallest_job(cfg) -> int:
    """The fewest devices the config's parallel sizes allow (one data-parallel replica of each
    expert and optimizer-instance group). MaxText's ici/dcn sizes count too: with an axis to
    fill (-1), the model-parallel sizes it implies are only known for a device count."""
    canonical = math.prod(cfg.get(k) or 1 for k in _MODEL_PARALLEL)
    fixed = math.prod(max(v, 1) for k, v in cfg.items() if isinstance(v, int)
                      and k.startswith(("ici_", "dcn_")) and k.endswith("_parallelism"))
    return max(canonical, fixed)


def _problems(what: str, error: Exception) -> list[str]:
    if isinstance(error, ConfigError):
        return list(error.problems)
    return [f"{what}: {error}"]


def _validation(cfg, tcfg, devices: int) -> None:
    """What the evaluator builds before the first step: the validation and test files (when
    validation runs) and MaxText's validation batch for ``devices`` devices."""
    import types

    from jaxtrain.data.sources import validation_plan
    from jaxtrain.evaluation import _eval_rows

    counts = tcfg.eval_iters if isinstance(tcfg.eval_iters, tuple) else (tcfg.eval_iters,)
    if tcfg.full_validation or max(counts) > 0:
        validation_plan(cfg)
    _eval_rows(cfg, tcfg, types.SimpleNamespace(mesh=types.SimpleNamespace(size=devices)))


def _restore_inputs(ccfg) -> None:
    """The checkpoints the run's first restore reads (in Checkpointer.candidates' order), where
    a path that is not there leaves nothing else to restore from: the run would stop at start.
    A directory holding a PyTorch checkpoint stops it too."""
    from jaxtrain.checkpoint import check_not_torch

    def there(path):
        return path is not None and path.exists()

    for path, what in ((ccfg.load, "load"), (ccfg.pretrained, "pretrained_checkpoint"),
                       (ccfg.resume_from, "train.resume_from")):
        if path is not None and path.is_dir():
            check_not_torch(path, what)

    earlier = ccfg.auto_resume and there(ccfg.save_dir)   # save's newest checkpoint comes first
    if ccfg.resume_from is not None and not earlier and not ccfg.resume_from.exists():
        raise ConfigError(f"train.resume_from {ccfg.resume_from} does not exist; point it at a "
                          f"checkpoint, or set it to auto")
    earlier = earlier or ccfg.resume_from is not None or there(ccfg.load)
    if ccfg.pretrained is not None and not earlier and not ccfg.pretrained.exists():
        raise ConfigError(f"pretrained_checkpoint {ccfg.pretrained} does not exist"
                          + (f", and load {ccfg.load} holds no checkpoint either"
                             if ccfg.load is not None else ""))
    if ccfg.load is not None and ccfg.exit_on_missing and not earlier and ccfg.pretrained is None:
        raise ConfigError(f"load {ccfg.load} does not exist (and exit_on_missing_checkpoint is "
                          f"true); fix the path, or set exit_on_missing_checkpoint to false to "
                          f"start from scratch")


def _hf_weights(cfg, model_cfg, ccfg) -> None:
    """The weights model.name_or_path starts a fresh run from: readable, and an embedding with
    the model's vocabulary. A run that will resume from a checkpoint needs none."""
    from jaxtrain.checkpoint import hf_init

    path = hf_init.model_dir(cfg)
    resumes = (ccfg.resume_from is not None or ccfg.load is not None
               or ccfg.pretrained is not None
               or (ccfg.auto_resume and ccfg.save_dir is not None and ccfg.save_dir.exists()))
    if path is None or resumes:
        return
    hf_init.check_weights(path)
    if model_cfg is not None:
        hf_init.check_vocab(path, model_cfg)


def _dpo_reference(cfg, model_cfg) -> None:
    """The frozen reference a DPO run loads (when a directory names it): its weights readable,
    its embedding the policy's vocabulary."""
    from jaxtrain import dpo
    from jaxtrain.checkpoint import hf_init

    if not cfg.get("dpo.enabled") or not dpo.reference_name(cfg):
        return
    path = dpo.reference_dir(cfg)
    hf_init.check_weights(path)
    if model_cfg is not None:
        hf_init.check_vocab(path, model_cfg)


def _distill(cfg) -> None:
    """A pgs distill run's sources, tokenizers, teachers and their vocabularies."""
    from jaxtrain.distill.plan import plan

    plan(cfg)


def preflight(cfg, world_size: int | None = None) -> None:
    """Build every device-free part of the run; raise one ConfigError with all problems.

    ``world_size`` is the job's device count; without it the mesh is checked for the smallest
    job the parallel sizes allow."""
    from jaxtrain import models
    from jaxtrain.checkpoint import CheckpointConfig
    from jaxtrain.data.sources import data_plan
    from jaxtrain.logs import run_dir
    from jaxtrain.loss_scale import LossScaleConfig
    from jaxtrain.models.config import assumed_accelerator
    from jaxtrain.observe.trackers import check_trackers
    from jaxtrain.optim.optimizers import OptimConfig, build_optimizer
    from jaxtrain.optim.schedules import ScheduleConfig, make_lr_schedule
    from jaxtrain.parallel.mesh import MeshConfig
    from jaxtrain.parallel.stages import plan as pipeline_plan
    from jaxtrain.parallel.xla_flags import accelerator_of, platform_kind
    from jaxtrain.train_config import TrainConfig

    problems: list[str] = []

    def attempt(what, build):
        try:
            return build()
        except (ConfigError, ValueError, TypeError, KeyError, OSError) as e:
            problems.extend(_problems(what, e))
            return None
        except Exception as e:  # noqa: BLE001 -- a bug, reported with the other problems
            problems.append(f"internal error while checking the {what}: {type(e).__name__}: "
                            f"{e} (a bug in jaxtrain: this config should be refused with a "
                            f"reason, or accepted)")
            return None

    tcfg = attempt("training", lambda: TrainConfig.from_config(cfg))
    attempt("trackers", lambda: check_trackers(cfg))
    distill = cfg.dialect == "pgs-distill"
    plan = attempt("data", lambda: data_plan(cfg)) if not distill else None
    if distill:
        attempt("distillation", lambda: _distill(cfg))
    elif tcfg is not None:
        attempt("validation", lambda: _validation(cfg, tcfg, world_size or smallest_job(cfg)))
    vocab = plan.vocab_size if plan is not None else cfg.get("vocab_size")
    model_cfg = None
    if vocab:
        with assumed_accelerator(accelerator_of(platform_kind(cfg))):
            model_cfg = attempt("model", lambda: models.ModelConfig.from_config(
                {**cfg, "vocab_size": vocab}))
    attempt("mesh", lambda: MeshConfig.from_config(cfg, world_size or smallest_job(cfg)))
    if model_cfg is not None and tcfg is not None:
        attempt("pipeline", lambda: pipeline_plan(cfg, model_cfg.num_layers,
                                                  tcfg.microbatch_counts()))
    steps = tcfg.train_iters if tcfg is not None and tcfg.train_iters else None
    schedule = attempt("LR schedule", lambda: make_lr_schedule(
        ScheduleConfig.from_config(cfg, total_steps=steps))) if steps or not (
        cfg.get("train.epochs")) else None
    opt_cfg = attempt("optimizer", lambda: OptimConfig.from_config(cfg))
    if opt_cfg is not None and model_cfg is not None and schedule is not None:
        attempt("optimizer", lambda: build_optimizer(opt_cfg, schedule,
                                                     models.logical_axes(model_cfg)))
    attempt("checkpointing", lambda: _restore_inputs(CheckpointConfig.from_config(
        cfg, run_dir(cfg))))
    attempt("loss scaling", lambda: LossScaleConfig.from_config(cfg))
    attempt("model weights", lambda: _hf_weights(cfg, model_cfg, CheckpointConfig.from_config(
        cfg, run_dir(cfg))))
    attempt("DPO reference", lambda: _dpo_reference(cfg, model_cfg))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
