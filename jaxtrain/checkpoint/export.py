"""pgs's ``train.save_final``: the final model in Hugging Face format in ``<save>/final``."""
from __future__ import annotations

import logging
import pathlib

from jaxtrain.config.errors import ConfigError
from jaxtrain.models import hf


def check_exportable(model_cfg) -> None:
    """ConfigError, before any training, when ``model_cfg`` has no Hugging Face equivalent."""
    try:
        hf.check_exportable(model_cfg, hf.hf_family(model_cfg))
    except ValueError as e:
        raise ConfigError(f"train.save_final exports Hugging Face format: {e}; "
                          "set train.save_final to false") from None


def export_final(params, model_cfg, final_dir: pathlib.Path, log: logging.Logger) -> pathlib.Path:
    """``params`` of ``model_cfg`` written in Hugging Face format to ``final_dir``."""
    path = hf.to_hf(params, model_cfg, final_dir)
    log.info("final model exported in Hugging Face format to %s", path)
    return path
