"""Configuration: the knob registry, the four config dialects, and validation.

    from jaxtrain.config import load_config
    cfg = load_config("run.yml", ["lr=1e-4", "--train.seed", "3"])
    cfg["lr"], cfg.origin("lr"), cfg.derived
"""
from jaxtrain.config.errors import ConfigError
from jaxtrain.config.registry import registry
from jaxtrain.config.resolve import complete, load_config
from jaxtrain.config.resolved import Config

__all__ = ["Config", "ConfigError", "complete", "load_config", "registry"]
