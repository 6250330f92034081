"""Logging sinks from the config: stderr at ``stderr_sink_level``, the run directory's
``jaxtrain.log`` at ``file_sink_level``, and ``sink_level`` on the root ``jaxtrain`` logger.
Megatron's ``logging_level`` sets Python's root logger (other libraries' messages);
``config_logger_dir`` receives the resolved config as JSON when a run starts.
"""
from __future__ import annotations

import json
import logging
import pathlib
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FILE = "jaxtrain.log"
CONFIG_FILE = "config.json"


def run_dir(cfg) -> pathlib.Path:
    """Where a run writes: ``save`` when set, else Primus's workspace/work_group/user_name/exp_name,
    else MaxText's base_output_directory/run_name (an experiment's exp_name wins over run_name)."""
    if cfg.get("save"):
        return pathlib.Path(cfg["save"])
    keys = ("work_group", "user_name", "exp_name") if cfg.get("exp_name") else ("run_name",)
    parts = [cfg.get(k) or "" for k in keys]
    return pathlib.Path(cfg.get("workspace") or ".", *[p for p in parts if p])


def setup_logging(cfg, directory: pathlib.Path | None = None) -> logging.Logger:
    """Attach the configured sinks to the ``jaxtrain`` logger (replacing earlier ones), set the
    root logger's level from ``logging_level``, and (for a run: ``directory`` given) dump the
    config into ``config_logger_dir``."""
    if cfg.get("logging_level") is not None:
        logging.getLogger().setLevel(root_level(cfg["logging_level"]))
    logger = logging.getLogger("jaxtrain")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(cfg.get("sink_level") or logging.DEBUG)
    logger.propagate = False
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(cfg["stderr_sink_level"])
    stderr.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
    logger.addHandler(stderr)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        sink = logging.FileHandler(directory / LOG_FILE, encoding="utf-8")
        sink.setLevel(cfg["file_sink_level"])
        sink.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(sink)
        if cfg.get("config_logger_dir"):
            dump_config(cfg, pathlib.Path(cfg["config_logger_dir"]))
    return logger


def root_level(value) -> int:
    """A level number from a number or a level name such as ``INFO``."""
    return value if isinstance(value, int) else logging.getLevelName(str(value).upper())


def dump_config(cfg, directory: pathlib.Path) -> pathlib.Path:
    """Write every resolved value (and the derived ones) to ``directory/config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"values": dict(cfg), "derived": dict(getattr(cfg, "derived", {})),
               "set": sorted(k for k in cfg if getattr(cfg, "is_set", lambda _: False)(k))}
    path = directory / CONFIG_FILE
    path.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
    return path
