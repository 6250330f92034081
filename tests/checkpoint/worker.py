"""Subprocess helpers for the checkpoint tests (a process dies, or has a different device count).

    python tests/checkpoint/worker.py train --kill-after-save N  KEY=VALUE ...
        train; SIGKILL this process in step N + 1 (step N's checkpoint and metrics row are
        complete)
    python tests/checkpoint/worker.py train --kill-in-commit N   KEY=VALUE ...
        train with async saves; SIGKILL this process while step N's checkpoint is being
        committed (written to its temporary directory, not yet renamed)
    python tests/checkpoint/worker.py reshard-save DIR      (8 devices, FSDP-sharded state)
    python tests/checkpoint/worker.py reshard-load DIR AXIS... (2 devices, replicated: DP)
"""
import os
import pathlib
import signal
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def train(argv):
    from jaxtrain import checkpoint, loop
    from jaxtrain.config import load_config

    mode, step, overrides = argv[0], int(argv[1]), argv[2:]
    if mode == "--kill-after-save":
        real = checkpoint.Checkpointer.maybe_save

        def maybe_save(self, it, *args, **kw):
            if it == step + 1:  # called after step N's metrics row was written
                assert self.last_saved == step
                self.wait()
                kill()
            return real(self, it, *args, **kw)

        checkpoint.Checkpointer.maybe_save = maybe_save
    else:
        from orbax.checkpoint._src.path import atomicity

        real = atomicity.AtomicRenameTemporaryPath.finalize

        async def finalize(self, *args, **kw):
            if self.get_final().name == f"{checkpoint.STEP_PREFIX}_{step}":
                kill()
            return await real(self, *args, **kw)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    loop.train(load_config(None, overrides, world_size=1, enforce_status=False))
    sys.exit(3)  # not killed: the test fails


def model_cfg(axis):
    from jaxtrain.models import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                       vocab_size=64, max_position_embeddings=8, param_scan_axis=axis)


def state_on(mesh, cfg, spec_for):
    """A TrainState (params, adam state, key) laid out on ``mesh`` by ``spec_for(leaf)``."""
    import jax
    import optax
    from jax.sharding import NamedSharding

    from jaxtrain import models
    from jaxtrain.step import TrainState

    abstract = models.abstract(cfg)
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, spec_for(a)), abstract)
    params = models.init(cfg, jax.random.key(0), shardings)
    opt = optax.adam(1e-3)
    opt_state = jax.jit(opt.init)(params)
    return TrainState(step=jax.numpy.int32(7), opt_step=jax.numpy.int32(7), params=params,
                      opt_state=opt_state, rng=jax.random.key(5), loss_scale=None,
                      spike_stats=None)


def tokens():
    import numpy as np

    return np.arange(16, dtype=np.int32).reshape(2, 8) * 3 % 64


def reshard_save(directory):
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxtrain import models
    from jaxtrain.checkpoint import CheckpointConfig, Checkpointer

    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def fsdp(a):  # shard the first axis divisible by 8 (FSDP), else replicate
        for i, n in enumerate(a.shape):
            if n % 8 == 0:
                return P(*([None] * i), "fsdp")
        return P()

    cfg = model_cfg(1)
    state = state_on(mesh, cfg, fsdp)
    assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(state.params))
    ckpt = Checkpointer(CheckpointConfig(save_dir=pathlib.Path(directory)), cfg)
    ckpt.maybe_save(7, state, consumed=28, force=True)
    ckpt.close()
    np.save(pathlib.Path(directory) / "logits.npy",
            np.asarray(models.forward(state.params, tokens(), cfg)))


def reshard_load(directory, *axes):
    for axis in axes:
        _reshard_load(directory, axis)


def _reshard_load(directory, axis):
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxtrain import models
    from jaxtrain.checkpoint import CheckpointConfig, Checkpointer

    assert jax.device_count() == 2
    mesh = Mesh(np.array(jax.devices()), ("data",))
    cfg = model_cfg(int(axis))
    template = state_on(mesh, cfg, lambda a: P())
    ckpt = Checkpointer(CheckpointConfig(save_dir=pathlib.Path(directory), auto_resume=True), cfg)
    state, consumed = ckpt.restore(template)
    ckpt.close()
    assert consumed == 28 and int(state.step) == 7
    for x, t in zip(jax.tree.leaves(state.params), jax.tree.leaves(template.params)):
        assert x.shape == t.shape and x.sharding == t.sharding, (x.shape, x.sharding)
    got = np.asarray(models.forward(state.params, tokens(), cfg))
    want = np.load(pathlib.Path(directory) / "logits.npy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("MAXDIFF", float(np.abs(got - want).max()))


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "train":
        train(rest)
    elif command == "reshard-save":
        reshard_save(*rest)
    elif command == "reshard-load":
        reshard_load(*rest)
