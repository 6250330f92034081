"""Logging sinks from the config: stderr at ``stderr_sink_level``, the run directory's
``jaxtrain.log`` at ``file_sink_level``, and ``sink_level`` on the root ``jaxtrain`` logger.
"""
from __future__ import annotations

import logging
import pathlib
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FILE = "jaxtrain.log"


def run_dir(cfg) -> pathlib.Path:
    """Where a run writes: ``save`` when set, else Primus's workspace/work_group/user_name/exp_name."""
    if cfg.get("save"):
        return pathlib.Path(cfg["save"])
    parts = [cfg.get(k) or "" for k in ("work_group", "user_name", "exp_name")]
    return pathlib.Path(cfg.get("workspace") or ".", *[p for p in parts if p])


def setup_logging(cfg, directory: pathlib.Path | None = None) -> logging.Logger:
    """Attach the configured sinks to the ``jaxtrain`` logger (replacing earlier ones)."""
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
    return logger
