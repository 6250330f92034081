"""Observability tests: trackers write to local stores only (offline W&B, a file MLflow store,
a trackio database in a temporary directory), and readers that load back what they wrote."""
import os
import tempfile

import pytest

_STORE = tempfile.mkdtemp(prefix="jaxtrain-observe-")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("WANDB_CONFIG_DIR", os.path.join(_STORE, "wandb-config"))
os.environ.setdefault("WANDB_CACHE_DIR", os.path.join(_STORE, "wandb-cache"))
os.environ.setdefault("TRACKIO_DIR", os.path.join(_STORE, "trackio"))  # read when trackio loads
os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture
def cfg(tmp_path):
    """cfg("key=value", ..., file=path) -> a resolved Config whose run directory is tmp_path/run."""
    from jaxtrain.config import load_config

    def _cfg(*overrides, file=None):
        return load_config(file, [f"save={tmp_path / 'run'}", *overrides])

    return _cfg
