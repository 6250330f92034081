"""Start-up order: nothing may start the JAX backend before the XLA flags are written and the
multi-process job is joined (XLA reads XLA_FLAGS once, when the first backend starts, and
``jax.distributed.initialize`` must come before it). ``ddp_num_buckets`` needs the model's
size for its flags; counting it must not start the backend."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from jaxtrain.parallel.xla_flags import AR_THRESHOLD

# Runs train.main's start-up for a GPU-bound config (hardware gpu, no JAX_PLATFORMS), records
# whether a backend had started when the flags were applied and when the job was joined, then
# starts the CPU backend with the XLA_FLAGS start-up wrote and stops.
PROBE = r"""
import json, os, sys
import jax
from jax._src import xla_bridge
from jaxtrain import train
from jaxtrain.parallel import distributed, xla_flags

seen = {}
real_apply = xla_flags.apply

def apply(cfg, platform, **kw):
    seen["backend_before_flags"] = xla_bridge.backends_are_initialized()
    out = real_apply(cfg, platform, **kw)
    seen["added"] = list(out.added)
    return out

class Joined(Exception):
    pass

def initialize(cfg, platform):
    seen["backend_before_distributed"] = xla_bridge.backends_are_initialized()
    seen["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    jax.config.update("jax_platforms", "cpu")          # this machine's backend, these flags
    seen["devices"] = len(jax.devices())
    raise Joined

xla_flags.apply, distributed.initialize = apply, initialize
try:
    seen["exit"] = train.main(sys.argv[1:])
except Joined:
    pass
print("PROBE " + json.dumps(seen))
"""

TINY = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=2", "hidden_size=16", "num_attention_heads=2", "micro_batch_size=2",
        "global_batch_size=4", "train_iters=1", "lr_warmup_iters=0", "hardware=gpu"]


def test_ddp_num_buckets_flags_reach_xla_before_the_backend_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",
                                                            "JAX_NUM_CPU_DEVICES")}
    # the device count shows XLA read this XLA_FLAGS text, ours appended to it
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=3")
    result = subprocess.run([sys.executable, "-c", PROBE, *TINY, "ddp_num_buckets=2",
                             f"workspace={tmp_path}"], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, result.stdout[-2000:] + result.stderr[-3000:]
    seen = json.loads(lines[-1][len("PROBE "):])
    assert seen.get("backend_before_flags") is False, seen
    assert seen.get("backend_before_distributed") is False, seen
    assert any(f.startswith(f"--{AR_THRESHOLD}=") for f in seen["added"]), seen
    assert f"--{AR_THRESHOLD}=" in seen["xla_flags"]
    assert seen["devices"] == 3
    assert "cannot take effect" not in result.stderr
