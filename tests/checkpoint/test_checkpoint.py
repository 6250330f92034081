"""Checkpointing (issue 7): exact resume after SIGKILL, atomic async saves, reshard on load,
scan-axis conversion, HF export, retention, the load/save knobs and the error cases."""
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain import loop, models
from jaxtrain.checkpoint import CheckpointConfig, Checkpointer
from jaxtrain.config import ConfigError, load_config

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TINY = ["mock_data=true", "vocab_size=64", "seq_length=8", "max_position_embeddings=8",
        "num_layers=2", "hidden_size=16", "ffn_hidden_size=32", "num_attention_heads=2",
        "micro_batch_size=2", "global_batch_size=4", "lr_warmup_iters=0", "bf16=false",
        "attention_dropout=0", "log_interval=1", "exp_name=run"]
# dropout on: the resumed run reproduces the losses only if the RNG state is restored too
RESUME = [*TINY, "hidden_dropout=0.1", "train_iters=20", "save_interval=5"]


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """These tests run the loop many times with one tiny model: a persistent XLA compilation
    cache, shared with their subprocesses, makes the repeats cheap."""
    directory = str(tmp_path_factory.mktemp("xla_cache"))
    settings = {"jax_compilation_cache_dir": directory,
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    before = {k: getattr(jax.config, k) for k in settings}
    for key, value in settings.items():
        jax.config.update(key, value)
        os.environ[key.upper()] = str(value)
    yield
    for key, value in before.items():
        jax.config.update(key, value)
        os.environ.pop(key.upper(), None)


def config(*args):
    return load_config(None, [*TINY, *args], world_size=1, enforce_status=False)


def losses(directory) -> dict:
    """step -> loss from metrics.jsonl; a step logged twice (rerun after a kill) keeps the last."""
    rows = [json.loads(line) for line in (pathlib.Path(directory) / "metrics.jsonl")
            .read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def worker(*args, devices=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, str(HERE / "worker.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def steps_in(directory) -> list[str]:
    return sorted((p.name for p in pathlib.Path(directory).iterdir()
                   if p.name.startswith("step_")), key=lambda n: (len(n), n))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the 20-step run without interruption."""
    directory = tmp_path_factory.mktemp("reference")
    loop.train(load_config(None, [*RESUME, f"save={directory}"], world_size=1,
                           enforce_status=False))
    got = losses(directory)
    assert sorted(got) == list(range(1, 21))
    return got


def test_exact_resume_after_sigkill(tmp_path, reference):
    run = worker("train", "--kill-after-save", 10, *RESUME, f"save={tmp_path}")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert steps_in(tmp_path) == ["step_5", "step_10"]
    loop.train(load_config(None, [*RESUME, f"save={tmp_path}", "auto_continue_train=true"],
                           world_size=1, enforce_status=False))
    assert losses(tmp_path) == reference  # bit for bit, steps 1-10 killed run, 11-20 resumed
    assert steps_in(tmp_path) == ["step_5", "step_10", "step_15", "step_20"]
    meta = json.loads((tmp_path / "step_20" / "meta" / "metadata").read_text())
    assert meta["consumed"] == 20 * 4 and meta["config"]["save_interval"] == 5


@pytest.mark.slow
def test_sigkill_during_async_save_resumes_from_previous(tmp_path, reference):
    args = [*RESUME, f"train.output_dir={tmp_path}", "async_checkpointing=true"]
    run = worker("train", "--kill-in-commit", 10, *args)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "step_10" not in names
    assert any(n.startswith("step_10.orbax-checkpoint-tmp") for n in names)
    ckpt = Checkpointer.from_config(config(*args, "train.resume_from=auto"), tmp_path)
    assert ckpt.plan()[1:] == (5, "full")  # the unfinished step 10 is never the latest
    ckpt.close()
    loop.train(load_config(None, [*args, "train.resume_from=auto"], world_size=1,
                           enforce_status=False))
    assert losses(tmp_path) == reference
    assert steps_in(tmp_path) == ["step_5", "step_10", "step_15", "step_20"]
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


@pytest.mark.slow
def test_save_on_8_devices_fsdp_restore_on_2_dp_and_unscanned(tmp_path):
    run = worker("reshard-save", tmp_path, devices=8)
    assert run.returncode == 0, run.stderr[-3000:]
    # the same layout, then param_scan_axis 1 -> 0 (params and adam moments move)
    run = worker("reshard-load", tmp_path, 1, 0, devices=2)
    assert run.returncode == 0 and run.stdout.count("MAXDIFF") == 2, run.stderr[-3000:]


@pytest.mark.slow
def test_scanned_axis_1_checkpoint_restores_into_axis_0(tmp_path):
    saved_cfg, here_cfg = _model(num_layers=3), _model(num_layers=3, param_scan_axis=0)
    saved = _bump(_state(saved_cfg), 1)
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path), saved_cfg)
    ckpt.maybe_save(4, saved, consumed=16, force=True)
    ckpt.close()
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path, auto_resume=True), here_cfg)
    state, consumed = ckpt.restore(_state(here_cfg))
    ckpt.close()
    wq = state.params["layers"]["attn"]["wq"]
    assert wq.shape == (3, 16, 2, 8) and consumed == 16
    np.testing.assert_array_equal(wq, np.moveaxis(saved.params["layers"]["attn"]["wq"], 1, 0))
    mu = state.opt_state[0].mu["layers"]["mlp"]["wo"]
    np.testing.assert_array_equal(mu, np.moveaxis(saved.opt_state[0].mu["layers"]["mlp"]["wo"],
                                                  1, 0))
    toks = np.arange(16, dtype=np.int32).reshape(2, 8) * 3 % 64
    np.testing.assert_allclose(models.forward(state.params, toks, here_cfg),
                               models.forward(saved.params, toks, saved_cfg), rtol=1e-5,
                               atol=1e-5)


def _state(cfg):
    import optax

    from jaxtrain.step import TrainState
    params = models.init(cfg, jax.random.key(0))
    return TrainState(step=jax.numpy.int32(0), opt_step=jax.numpy.int32(0), params=params,
                      opt_state=optax.adam(1e-3).init(params), rng=jax.random.key(3),
                      loss_scale=None, spike_stats=None)


def _model(**kw):
    return models.ModelConfig(**{**dict(num_layers=1, hidden_size=16, num_attention_heads=2,
                                        ffn_hidden_size=32, vocab_size=64,
                                        max_position_embeddings=8), **kw})


def _bump(state, k):
    """``state`` with every number moved by ``k`` and another key."""
    state = jax.tree.map(lambda x: x + k if jax.numpy.issubdtype(x.dtype, jax.numpy.number)
                         else x, state)
    state.rng = jax.random.key(100 + k)
    return state


@pytest.mark.parametrize("knobs, kept", [
    (["save_interval=1", "train.keep_checkpoints=5", "save_retain_interval=4"],
     [4, 8, 9, 10, 11, 12]),
    (["save_interval=1", "save_retain_interval=4"], [4, 8, 12]),  # multiples and the newest
    (["--train.save_steps", "3", "train.keep_checkpoints=5"], [3, 6, 9, 12]),
    (["save_interval=1", "train.keep_checkpoints=5"], [8, 9, 10, 11, 12]),
])
@pytest.mark.slow
def test_retention(tmp_path, knobs, kept):
    cfg = config("train_iters=12", f"save={tmp_path}", *knobs)
    mc = _model()
    ckpt, state = Checkpointer.from_config(cfg, tmp_path, mc), _state(mc)
    for step in range(1, 13):
        ckpt.maybe_save(step, state, consumed=4 * step)
    ckpt.close()
    assert steps_in(tmp_path) == [f"step_{s}" for s in kept]


@pytest.mark.slow
def test_restore_modes_finetune_no_load_optim_no_load_rng(tmp_path):
    mc = _model()
    saved = _bump(_state(mc), 1)
    saved.step = saved.opt_step = jax.numpy.int32(9)
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path), mc)
    ckpt.maybe_save(9, saved, consumed=36, force=True)
    ckpt.close()
    fresh = _state(mc)
    same = lambda a, b: all(np.array_equal(x, y) for x, y in  # noqa: E731
                            zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    key_data = jax.random.key_data

    def restore(*knobs):
        c = Checkpointer.from_config(config("train_iters=20", f"load={tmp_path}", *knobs),
                                     tmp_path / "run", mc)
        out = c.restore(_state(mc))
        c.close()
        return out

    state, consumed = restore()  # Primus pre_trainer default finetune=true: weights only
    assert same(state.params, saved.params) and int(state.step) == 0 and consumed == 0
    assert same(state.opt_state, fresh.opt_state)
    state, consumed = restore("finetune=false")
    assert int(state.step) == 9 and int(state.opt_step) == 9 and consumed == 36
    assert same(state.opt_state, saved.opt_state) and same(key_data(state.rng),
                                                           key_data(saved.rng))
    state, _ = restore("finetune=false", "no_load_optim=true")
    assert same(state.opt_state, fresh.opt_state) and same(state.params, saved.params)
    state, _ = restore("finetune=false", "no_load_rng=true")
    assert same(key_data(state.rng), key_data(fresh.rng))
    assert same(state.opt_state, saved.opt_state)


def test_no_save_optim_and_no_save_rng(tmp_path):
    mc = _model()
    cfg = config("train_iters=20", f"save={tmp_path}", "no_save_optim=true", "no_save_rng=true")
    ckpt = Checkpointer.from_config(cfg, tmp_path, mc)
    ckpt.maybe_save(2, _bump(_state(mc), 1), consumed=8, force=True)
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "step_2").iterdir()
                  if p.is_dir()) == ["meta", "params", "train"]


def test_quant_state_is_the_fp8_item_on_disk(tmp_path):
    """``TrainState.quant_state`` (first named ``fp8``) is stored as the item ``fp8``, the name
    checkpoints written before the rename hold it under, and restores into ``quant_state``."""
    from jaxtrain.models.quant_state import init_state
    from jaxtrain.quant import QuantConfig

    mc = _model(quant=QuantConfig("delayed", "e4m3", "e4m3", "e5m2", history_len=4))
    with_quant = lambda state, k: dataclasses.replace(  # noqa: E731
        state, quant_state=jax.tree.map(lambda a: a + k, init_state(mc)))
    saved = with_quant(_state(mc), 2)
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path), mc)
    ckpt.maybe_save(3, saved, consumed=12, force=True)
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "step_3").iterdir() if p.is_dir()) == [
        "fp8", "meta", "opt_state", "params", "rng", "train"]
    c = Checkpointer.from_config(config("train_iters=20", f"load={tmp_path}", "finetune=false"),
                                 tmp_path / "run", mc)
    state, _ = c.restore(with_quant(_state(mc), 0))
    c.close()
    assert jax.tree.structure(state.quant_state) == jax.tree.structure(saved.quant_state)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state.quant_state),
                                                    jax.tree.leaves(saved.quant_state)))


def test_train_resume_from_a_step_directory(tmp_path):
    mc = _model()
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path / "out"), mc)
    for step in (3, 6):
        ckpt.maybe_save(step, _bump(_state(mc), step), consumed=4 * step, force=True)
    ckpt.close()
    c = Checkpointer.from_config(config("train_iters=20", f"train.resume_from={tmp_path}/out/"
                                        "step_3"), tmp_path, mc)
    state, consumed = c.restore(_state(mc))
    assert int(state.step) == 3 and consumed == 12  # a full resume of step 3, not the newest
    c.close()
    c = Checkpointer.from_config(config("train_iters=20", f"load={tmp_path}/out", "ckpt_step=3",
                                        "finetune=false"), tmp_path, mc)
    assert c.plan()[1:] == (3, "full") and c.restore(_state(mc))[1] == 12
    c.close()


@pytest.mark.slow
def test_sigterm_and_exit_duration_save_before_exiting(tmp_path, monkeypatch):
    real = loop.global_batches

    def batches(*args, **kw):
        for i, b in enumerate(real(*args, **kw)):
            if i == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
            yield b

    monkeypatch.setattr(loop, "global_batches", batches)
    previous = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "sig"
    loop.train(config("train_iters=20", "exit_signal_handler=true", f"save={out}",
                      "disable_last_saving=true", "async_save=true"))
    assert signal.getsignal(signal.SIGTERM) == previous
    assert steps_in(out) == ["step_3"]  # saved at the signal despite disable_last_saving
    assert not (out / "final").exists()  # an interrupted run exports no final model

    monkeypatch.setattr(loop, "global_batches", real)
    clock = iter(range(0, 10_000, 31))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(clock)))
    out = tmp_path / "duration"
    last = loop.train(config("train_iters=20", "exit_duration_in_mins=1", f"save={out}",
                             "disable_last_saving=true"))
    assert last["step"] < 20 and steps_in(out) == [f"step_{last['step']}"]


@pytest.mark.slow
def test_save_final_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    loop.train(config("train_iters=2", f"save={tmp_path}", "train.save_final=true",
                      "swiglu=true", "normalization=RMSNorm", "position_embedding_type=rope"))
    assert steps_in(tmp_path) == ["step_2"]  # and the end-of-training checkpoint
    mc = models.ModelConfig.from_config({**config("train_iters=2", "swiglu=true",
                                                  "normalization=RMSNorm",
                                                  "position_embedding_type=rope")})
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path), mc)
    state, _ = ckpt.restore_from(tmp_path, 2, _state(mc), mode="params")
    ckpt.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "final", attn_implementation="eager").eval()
    toks = np.arange(16, dtype=np.int32).reshape(2, 8) * 5 % 64
    with torch.no_grad():
        want = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    got = np.asarray(models.forward(state.params, toks, mc))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_enable_checkpointing_saves_in_run_dir_and_resumes(tmp_path):
    args = [f"workspace={tmp_path}", "enable_checkpointing=true"]
    loop.train(config(*args, "train_iters=2", "save_interval=1"))
    assert steps_in(tmp_path / "run" / "checkpoints") == ["step_1", "step_2"]
    assert loop.train(config(*args, "train_iters=3", "disable_last_saving=true"))["step"] == 3
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]  # steps 1-2, then only step 3
    assert steps_in(tmp_path / "run" / "checkpoints") == ["step_1", "step_2"]  # none at the end


# ---------------------------------------------------------------- errors

def test_missing_checkpoint(tmp_path):
    mc = _model()
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}/none"), tmp_path,
                                 mc).restore(_state(mc))
    assert Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}/none",
                                           "exit_on_missing_checkpoint=false"), tmp_path,
                                    mc).restore(_state(mc)) is None
    with pytest.raises(ConfigError, match="ckpt_step"):
        ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path / "c"), mc)
        ckpt.maybe_save(1, _state(mc), 4, force=True)
        ckpt.close()
        Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}/c", "ckpt_step=4"),
                                 tmp_path, mc).restore(_state(mc))


def test_incompatible_model_names_the_knob(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path), _model())
    ckpt.maybe_save(1, _state(_model()), 4, force=True)
    ckpt.close()
    other = _model(hidden_size=32)
    with pytest.raises(ConfigError, match="hidden_size = 16 there, 32 here"):
        Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}"), tmp_path,
                                 other).restore(_state(other))


def test_corrupt_checkpoint_and_torch_checkpoint(tmp_path):
    import shutil
    mc = _model()
    ckpt = Checkpointer(CheckpointConfig(save_dir=tmp_path / "c"), mc)
    ckpt.maybe_save(1, _state(mc), 4, force=True)
    ckpt.close()
    shutil.rmtree(tmp_path / "c" / "step_1" / "params")
    with pytest.raises(ConfigError, match="corrupt"):
        Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}/c"), tmp_path,
                                 mc).restore(_state(mc))
    (tmp_path / "c" / "step_1" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(ConfigError, match="corrupt"):
        Checkpointer.from_config(config("train_iters=5", f"load={tmp_path}/c"), tmp_path,
                                 mc).restore(_state(mc))
    torch_dir = tmp_path / "megatron"
    (torch_dir / "iter_0000100").mkdir(parents=True)
    (torch_dir / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(ConfigError, match="PyTorch/Megatron checkpoint.*Hugging Face"):
        Checkpointer.from_config(config("train_iters=5", f"load={torch_dir}"), tmp_path,
                                 mc).restore(_state(mc))


@pytest.mark.parametrize("fmt", ["torch", "torch_dcp", "fsdp_dtensor"])
def test_torch_ckpt_formats_mean_orbax_and_say_so(fmt):
    """Primus/Megatron files that write ckpt_format: torch run: Orbax is written, with a warning
    that names the format and the conversion path; without save or load it has no effect."""
    saving = load_config(None, [*TINY, "train_iters=5", f"ckpt_format={fmt}", "save=/tmp/x"],
                         world_size=1)
    assert saving["ckpt_format"] == "torch_dist"
    assert any(f"ckpt_format {fmt!r} is a PyTorch format" in w and "save set" in w
               and "Hugging Face" in w for w in saving.warnings)
    quiet = load_config(None, [*TINY, "train_iters=5", f"ckpt_format={fmt}"], world_size=1)
    assert quiet["ckpt_format"] == "torch_dist" and any("no effect" in w for w in quiet.warnings)
    for ok in ("torch_dist", "zarr"):
        assert not load_config(None, [*TINY, "train_iters=5", f"ckpt_format={ok}",
                                      "save=/tmp/x"], world_size=1).warnings


def test_dry_run_refuses_a_pytorch_checkpoint_to_load(tmp_path, cli, write):
    """load naming a Megatron checkpoint directory stops the dry run with the conversion path."""
    torch_dir = tmp_path / "megatron"
    (torch_dir / "iter_0000100").mkdir(parents=True)
    (torch_dir / "latest_checkpointed_iteration.txt").write_text("100")
    path = write("run.yml", "\n".join(a.replace("=", ": ", 1) for a in TINY) + "\n")
    code, _, err = cli("--dry-run", path, "train_iters=2", "ckpt_format=torch", f"load={torch_dir}",
                       f"workspace={tmp_path}")
    assert code == 2 and "Traceback" not in err
    assert "load" in err and "PyTorch/Megatron checkpoint" in err and "Hugging Face" in err


def test_cli_exits_2_on_missing_load(tmp_path, cli, write):
    path = write("run.yml", "\n".join(a.replace("=", ": ", 1) for a in TINY) + "\n")
    code, _, err = cli(path, "train_iters=2", f"load={tmp_path}/nothing",
                       f"workspace={tmp_path}", "--finetune=false")
    assert code == 2 and "load" in err and "does not exist" in err and "Traceback" not in err
