"""Command line: ``python -m jaxtrain.train CONFIG [key=value | --section.key value ...]``.

Options: ``--dry-run`` prints the resolved config as YAML and exits without touching a
device; ``--world-size N`` checks batch arithmetic for N devices in a dry run; ``--help``.
A configuration problem prints one message on stderr and exits with status 2.
"""
from __future__ import annotations

import os
import sys

from jaxtrain.checks import BuildError, TrainingError
from jaxtrain.config import ConfigError, load_config, registry
from jaxtrain.logs import run_dir, setup_logging
from jaxtrain.parallel import distributed, xla_flags
from jaxtrain.preflight import preflight, smallest_job
from jaxtrain.runtime import select_platform

USAGE = """usage: python -m jaxtrain.train [CONFIG] [OVERRIDE ...] [--dry-run] [--world-size N]
                                [--primus-path DIR]

CONFIG     a YAML file: flat keys (MaxText style, base_config chains), a Primus experiment
           (framework/modules/models), or pgs-style sections (train: {learning_rate: ...});
           without one, the command line alone is the config (a Megatron-LM command line
           such as --num-layers 2 --disable-bias-linear takes Megatron-LM's defaults)
OVERRIDE   key=value, --key value, --key=value, --section.key value (pgs style) or any
           Megatron-LM flag (--no-rope-fusion, --data-path 0.3 A 0.7 B); values are read as
           YAML scalars; the command line wins over the file
--dry-run  print the fully resolved config (canonical keys) and exit without touching devices
--world-size N
           with --dry-run: check batch sizes and derive data-parallel values for N devices
--primus-path DIR
           a Primus checkout whose presets (primus/configs/...) Primus experiments use;
           default: $PRIMUS_PATH, else the checkout the experiment lives in
--help     this text; the knobs themselves: python -m jaxtrain.knobs
"""
EXIT_CONFIG = 2


def _split_args(argv):
    flags = {"dry_run": False, "world_size": None, "help": False, "primus_path": None}
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            flags["help"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg == "--primus-path" or arg.startswith("--primus-path="):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                              else "")
            i += 0 if "=" in arg else 1
            if not text:
                raise ValueError("--primus-path needs a folder (a Primus checkout)")
            flags["primus_path"] = text
        elif arg == "--world-size" or arg.startswith("--world-size="):
            text = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                              else "")
            i += 0 if "=" in arg else 1
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"--world-size needs a positive integer, got {text!r}")
            flags["world_size"] = int(text)
        else:
            rest.append(arg)
        i += 1
    return flags, rest


def _fail(message: str) -> int:
    print(f"jaxtrain: {message}", file=sys.stderr)
    return EXIT_CONFIG


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        flags, rest = _split_args(argv)
    except ValueError as e:
        return _fail(str(e))
    if flags["help"]:
        print(USAGE, end="")
        return 0
    if not rest:
        return _fail("give a config file or a command line: python -m jaxtrain.train CONFIG "
                     "[key=value ...] (see --help)")
    path, overrides = (None, rest) if rest[0].startswith("-") or "=" in rest[0] else (
        rest[0], rest[1:])
    try:
        cfg, world = _checked(path, overrides, flags["world_size"], flags["primus_path"])
    except ConfigError as e:
        return _fail(f"config error: {e}")
    logger = setup_logging(cfg)  # file sinks come once the process's rank is known
    for warning in cfg.warnings:
        logger.warning("%s", warning)
    if flags["dry_run"]:
        areas = {}
        for knob in registry():
            areas.setdefault(knob.area, []).append(knob.key)
        extra = [k for k in cfg if registry().knobs.get(k) is None]
        for key in extra:
            areas.setdefault(registry().lookup(key).knob.area, []).append(key)
        sys.stdout.write(cfg.to_yaml(areas))
        if flags["world_size"] is None:
            sys.stdout.write(f"# checked for {world} device(s), the smallest job these parallel "
                             f"sizes allow; --world-size N checks another\n")
        return 0
    return _train(cfg, path, overrides, flags["primus_path"], logger)


def apply_env(cfg) -> dict:
    """Primus ``env``: set the experiment's environment variables before JAX starts; the
    caller's own settings win. Returns what was set."""
    added = {str(k): str(v) for k, v in (cfg.get("env") or {}).items()
             if str(k) not in os.environ}
    os.environ.update(added)
    return added


def _checked(path, overrides, world_size, primus_path):
    """(config, device count) resolved and preflighted (jaxtrain.preflight) for ``world_size``
    devices, or for the smallest job the config's parallel sizes allow."""
    cfg = load_config(path, overrides, world_size=world_size, primus_path=primus_path)
    if world_size is None:
        world_size = smallest_job(cfg)
        cfg = load_config(path, overrides, world_size=world_size, primus_path=primus_path)
    preflight(cfg, world_size)
    return cfg, world_size


CACHE_ENV = "JAXTRAIN_COMPILATION_CACHE"


def compilation_cache_dir(cfg) -> str | None:
    """Where JAX's persistent compilation cache lives, so a restarted run skips compiling:
    MaxText's ``jax_cache_dir`` when set ("" turns it off), else $JAXTRAIN_COMPILATION_CACHE
    (a folder, or "off"), else ``jax_cache`` beside the run directory. None: leave JAX's own
    setting (its JAX_COMPILATION_CACHE_DIR) alone."""
    if cfg.get("jax_cache_dir") is not None:
        return os.path.expanduser(cfg["jax_cache_dir"]) or None
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env in ("", "off", "0") else os.path.expanduser(env)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    return str(run_dir(cfg).resolve().parent / "jax_cache")


def _train(cfg, path, overrides, primus_path, logger) -> int:
    """Set XLA flags, join the multi-process job if there is one, pick the platform,
    re-resolve for the job's device count, and run the loop."""
    import jax   # JAX, the checkpoint code and the loop load only for a training run

    try:
        apply_env(cfg)
        platform = xla_flags.platform_kind(cfg)
        xla_flags.apply(cfg, platform)
        cache = compilation_cache_dir(cfg)
        if cache is not None:
            jax.config.update("jax_compilation_cache_dir", cache)
        setup = distributed.initialize(cfg, platform)
        if setup.process_id == 0:  # only process 0 writes the run directory's log and config
            logger = setup_logging(cfg, run_dir(cfg))
        backend = select_platform(cfg)
        logger.info("run directory %s; JAX backend %s; process %d of %d (%s)", run_dir(cfg),
                    backend, setup.process_id, setup.num_processes, setup.source)
        if cache is not None:
            logger.info("persistent compilation cache in %s", cache)
        from jaxtrain.checkpoint_args import checkpoint_overrides  # use_checkpoint_args & co

        cfg, _ = _checked(path, [*overrides, *checkpoint_overrides(cfg)], jax.device_count(),
                          primus_path)
        if cfg.dialect == "pgs-distill":
            from jaxtrain.distill.run import train
        else:
            from jaxtrain.loop import train

        train(cfg, logger)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    except TrainingError as e:
        logger.error("%s", e)
        return 1
    except BuildError as e:
        logger.debug("internal error while building the run", exc_info=e.__cause__)
        return _fail(f"internal error while building the run from {path or 'the command line'}: "
                     f"{e} (a bug in jaxtrain: the dry run should have refused this config; "
                     f"the traceback is in the run directory's jaxtrain.log)")
    return 0


if __name__ == "__main__":
    from jaxtrain import cli

    sys.exit(cli.run(main))
