"""The persistent compilation cache is on by default beside the run directory, so a restarted
run loads its compiled programs instead of compiling them again."""
import os
import subprocess
import sys

import pytest

from jaxtrain.train import CACHE_ENV, compilation_cache_dir
from tests.conftest import ROOT

TINY = ["mock_data=true", "vocab_size=128", "seq_length=16", "max_position_embeddings=16",
        "num_layers=2", "hidden_size=32", "num_attention_heads=4", "micro_batch_size=2",
        "global_batch_size=2", "train_iters=2", "lr_warmup_iters=0", "exp_name=cached"]


def test_where_the_cache_lives(tmp_path, monkeypatch):
    cfg = {"workspace": str(tmp_path / "ws"), "exp_name": "run", "jax_cache_dir": None}
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache_dir(cfg) == str(tmp_path / "ws" / "jax_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")   # JAX's own setting stays
    assert compilation_cache_dir(cfg) is None
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert compilation_cache_dir(cfg) == str(tmp_path / "mine")
    monkeypatch.setenv(CACHE_ENV, "off")
    assert compilation_cache_dir(cfg) is None
    assert compilation_cache_dir({**cfg, "jax_cache_dir": "~/jc"}) == os.path.expanduser("~/jc")
    assert compilation_cache_dir({**cfg, "jax_cache_dir": ""}) is None


@pytest.mark.slow
def test_a_restarted_run_reads_the_compiled_step_from_the_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}   # the default: on
    env.update(PYTHONPATH=str(ROOT), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_LOG_COMPILES="1")   # cache hits and misses logged as warnings
    cache = tmp_path / "jax_cache"
    counts, hits = [], []
    for attempt in range(2):
        done = subprocess.run([sys.executable, "-m", "jaxtrain.train", *TINY,
                               f"save={tmp_path / f'run{attempt}'}"], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"persistent compilation cache in {cache}" in done.stderr
        counts.append(len(os.listdir(cache)))
        hits.append("Persistent compilation cache hit for 'jit_step'" in done.stderr)
    assert counts[0] > 0 and hits == [False, True]
    assert counts[1] == counts[0]   # the second run compiled nothing new
