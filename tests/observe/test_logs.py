"""Logging levels, the run directory's log file and the config dump."""
import json
import logging

import pytest

from jaxtrain.config import ConfigError
from jaxtrain.logs import LOG_FILE, setup_logging


@pytest.fixture
def root_level():
    """The root logger; afterwards its level and the jaxtrain logger are as they were."""
    root, ours = logging.getLogger(), logging.getLogger("jaxtrain")
    before = root.level, ours.level, ours.propagate, list(ours.handlers)
    yield root
    root.setLevel(before[0])
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
        handler.close()
    ours.setLevel(before[1])
    ours.propagate = before[2]
    for handler in before[3]:
        ours.addHandler(handler)


@pytest.mark.parametrize("value, level", [("30", 30), ("error", logging.ERROR),
                                          ("DEBUG", logging.DEBUG)])
def test_logging_level_sets_the_root_logger(cfg, root_level, value, level):
    root_level.setLevel(logging.INFO)
    setup_logging(cfg())
    assert root_level.level == logging.INFO  # null keeps it
    setup_logging(cfg(f"logging_level={value}"))
    assert root_level.level == level


def test_logging_level_must_be_a_level(cfg):
    with pytest.raises(ConfigError, match="logging_level"):
        cfg("logging_level=LOUD")


def test_run_directory_log_file_and_config_dump(cfg, tmp_path, root_level):
    c = cfg(f"config_logger_dir={tmp_path / 'cfgdump'}", "lr=0.02", "file_sink_level=WARNING")
    logger = setup_logging(c, tmp_path / "run")
    logger.info("not in the file")
    logger.warning("in the file")
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "in the file" in text and "not in the file" not in text
    dump = json.loads((tmp_path / "cfgdump" / "config.json").read_text())
    assert dump["values"]["lr"] == 0.02 and "lr" in dump["set"]
    setup_logging(cfg(), tmp_path / "run2")
    assert not (tmp_path / "run2" / "config.json").exists()
    assert not list(tmp_path.glob("**/config.json"))[1:]
