"""Every command-line entry point ends quietly when its reader closes stdout early
(``python -m jaxtrain.knobs | head -1``): no traceback, no "Exception ignored" message."""
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.data import helpers

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
NOISE = ("Traceback", "BrokenPipeError", "Exception ignored", "Broken pipe")


def test_knobs_into_head():
    result = subprocess.run(f"{sys.executable} -m jaxtrain.knobs | head -1", shell=True,
                            capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert result.returncode == 0
    assert len(result.stdout.splitlines()) == 1
    assert not any(n in result.stderr for n in NOISE), result.stderr[-2000:]


def closed_stdout(*argv):
    """Run ``python *argv`` with stdout a pipe whose reader has already gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, *argv], stdout=write, stderr=subprocess.PIPE,
                                text=True, env=ENV, cwd=ROOT, timeout=300)
    finally:
        os.close(write)
    return result


def _preprocess_args(tmp_path):
    tok = helpers.hf_tokenizer_dir(tmp_path / "tok")
    src = helpers.write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in helpers.texts(5)])
    return ["--input", str(src), "--tokenizer", tok, "--output-prefix", str(tmp_path / "out")]


@pytest.mark.parametrize("argv", [
    ["-m", "jaxtrain.knobs"],
    ["-m", "jaxtrain.knobs", "--markdown"],
    ["-m", "jaxtrain.train", "--help"],
    ["-m", "jaxtrain.train", "mock_data=true", "vocab_size=64", "--dry-run"],
    ["-m", "jaxtrain.data.preprocess", "--help"],
    "preprocess",
    ["benchmarks/throughput.py", "--help"],
    ["benchmarks/data_throughput.py", "--help"],
], ids=["knobs", "knobs-markdown", "train-help", "train-dry-run", "preprocess-help",
        "preprocess", "benchmark-throughput", "benchmark-data"])
@pytest.mark.slow
def test_closed_stdout_ends_quietly(argv, tmp_path):
    if argv == "preprocess":
        argv = ["-m", "jaxtrain.data.preprocess", *_preprocess_args(tmp_path)]
    result = closed_stdout(*argv)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any(n in result.stderr for n in NOISE), result.stderr[-2000:]
