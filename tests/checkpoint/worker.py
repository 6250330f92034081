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


def state_on(devices, sharding, cfg):
    """A TrainState (params, adam state, key) on the product's layout for ``devices``:
    ``sharding`` is what data parallelism shards (no_shard = DP, optim_grads_params = FSDP)."""
    import dataclasses

    import jax
    import optax

    from jaxtrain.parallel.mesh import MeshConfig, make_mesh
    from jaxtrain.parallel.sharding import Layout
    from jaxtrain.step import abstract_state, create_state, state_shardings

    mcfg = MeshConfig(data=len(devices), sharding=sharding)
    layout = Layout(make_mesh(mcfg, devices), mcfg)
    tcfg = type("T", (), {"loss_scale": None, "spike_detection": False})
    opt = optax.adam(1e-3)
    shardings = state_shardings(layout, cfg, abstract_state(cfg, opt, tcfg))
    state = create_state(jax.random.key(0), cfg, opt, tcfg, shardings)
    return dataclasses.replace(state, step=jax.numpy.int32(7), opt_step=jax.numpy.int32(7))


def tokens():
    import numpy as np

    return np.arange(16, dtype=np.int32).reshape(2, 8) * 3 % 64


def reshard_save(directory):
    import jax
    import numpy as np

    from jaxtrain import models
    from jaxtrain.checkpoint import CheckpointConfig, Checkpointer

    assert jax.device_count() == 8
    cfg = model_cfg(1)
    state = state_on(jax.devices(), "optim_grads_params", cfg)
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

    from jaxtrain import models
    from jaxtrain.checkpoint import CheckpointConfig, Checkpointer

    assert jax.device_count() == 2
    cfg = model_cfg(int(axis))
    template = state_on(jax.devices(), "no_shard", cfg)
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
