"""Checkpointing knobs (issue 7, second part): pretrained_checkpoint, dist_ckpt_strictness, the LR
schedule on resume, use_checkpoint_args and its companions, non-persistent checkpoints (global
and local) and the statuses of the knobs mapped or refused."""
import json
import logging

import jax
import numpy as np
import pytest
from test_checkpoint import (TINY, _bump, _model, _state, compilation_cache,  # noqa: F401
                             losses, steps_in)

from jaxtrain import loop
from jaxtrain.checkpoint import Checkpointer
from jaxtrain.checkpoint_args import checkpoint_overrides
from jaxtrain.config import ConfigError, load_config

CRASH = [*TINY, "hidden_dropout=0.1", "train_iters=8", "save_interval=4"]


def config(*args, world_size=1):
    return load_config(None, [*TINY, "train_iters=20", *args], world_size=world_size)


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def save(directory, state, step=3, *args, model=None):
    """A checkpoint of ``state`` at ``step`` written from a config with ``args``."""
    ckpt = Checkpointer.from_config(config(f"save={directory}", *args), directory,
                                    model or _model())
    ckpt.maybe_save(step, state, consumed=4 * step, force=True)
    ckpt.close()


LOG = logging.getLogger("ckpt_knobs_test")  # outside the jaxtrain tree, which runs reconfigure


def restore(template, *args, model=None):
    ckpt = Checkpointer.from_config(config(*args), "unused-run-dir", model or _model(), LOG)
    try:
        return ckpt.restore(template), ckpt
    finally:
        ckpt.close()


def test_pretrained_checkpoint_when_load_is_empty(tmp_path):
    mc = _model()
    saved = _bump(_state(mc), 1)
    saved.step = saved.opt_step = jax.numpy.int32(3)
    save(tmp_path / "base", saved)
    (tmp_path / "empty").mkdir()
    args = [f"load={tmp_path}/empty", f"pretrained_checkpoint={tmp_path}/base", "finetune=false"]
    (state, consumed), _ = restore(_state(mc), *args)
    assert same(state.params, saved.params) and int(state.step) == 0 and consumed == 0
    assert same(state.opt_state, _state(mc).opt_state)  # finetune forced: weights only
    save(tmp_path / "own", _bump(_state(mc), 5), 7)  # load has one: it wins, fully
    (state, consumed), _ = restore(_state(mc), f"load={tmp_path}/own",
                                   f"pretrained_checkpoint={tmp_path}/base", "finetune=false")
    assert int(state.step) == 5 and consumed == 28
    assert same(state.params, _bump(_state(mc), 5).params)
    with pytest.raises(ConfigError, match="pretrained_checkpoint .*nothing.* holds no complete"
                                          ".*load .*empty holds none"):
        restore(_state(mc), f"load={tmp_path}/empty", f"pretrained_checkpoint={tmp_path}/nothing")


def test_load_main_params_from_ckpt_restores_fp32_master_weights_exactly(tmp_path):
    mc = _model()
    saved = jax.tree.map(lambda x: x + 1e-4 if x.dtype == np.float32 else x, _state(mc))
    save(tmp_path, saved)
    (state, _), _ = restore(_state(mc), f"load={tmp_path}", "bf16=true", "no_load_optim=true",
                            "finetune=false", "load_main_params_from_ckpt=true")
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    assert same(state.params, saved.params)  # not rounded through a bf16 copy
    assert same(state.opt_state, _state(mc).opt_state)


def test_dist_ckpt_strictness(tmp_path, caplog):
    mc = _model()
    saved = _bump(_state(mc), 1)
    save(tmp_path, saved, model=mc)
    template = _state(mc)
    params = dict(template.params)
    dropped = sorted(params)[0]
    del params[dropped]
    params["extra_w"] = jax.numpy.full((3,), 7.0)
    template.params = params

    def run(mode):
        caplog.clear()
        (state, _), ckpt = restore(template, f"load={tmp_path}", f"dist_ckpt_strictness={mode}")
        return state, ckpt.mismatch, caplog.text

    for mode in ("assume_ok_unexpected", "raise_unexpected", "raise_all"):
        with pytest.raises(ConfigError, match=f"strictness {mode}.*in this run but not in the "
                                              "checkpoint: params: extra_w"):
            run(mode)
    with pytest.raises(ConfigError, match=f"in the checkpoint but not in this run: params: "
                                          f"{dropped}"):
        run("raise_all")
    caplog.set_level(logging.WARNING, logger=LOG.name)
    for mode in ("log_unexpected", "log_all", "return_unexpected", "return_all", "ignore_all"):
        state, mismatch, text = run(mode)
        assert np.array_equal(state.params["extra_w"], np.full(3, 7.0)), mode  # kept initial
        assert same({k: v for k, v in state.params.items() if k != "extra_w"},
                    {k: v for k, v in saved.params.items() if k != dropped}), mode
        assert ("extra_w" in text) == mode.startswith("log"), mode
        assert (dropped in text) == (mode == "log_all"), mode
        want = {"unexpected": {"params": ["extra_w"]} if mode.startswith("return") else {},
                "missing": {"params": [dropped]} if mode == "return_all" else {}}
        assert mismatch == want, mode


def test_schedule_on_resume(tmp_path):
    mc = _model()
    save(tmp_path, _bump(_state(mc), 1), 3, "lr=0.001")
    load = [f"load={tmp_path}", "finetune=false"]
    assert restore(_state(mc), *load, "lr=0.002")[0][1] == 12  # default: the config's wins
    with pytest.raises(ConfigError, match=r"different LR schedule: lr = 0.001 there, 0.002 here"):
        restore(_state(mc), *load, "lr=0.002", "override_opt_param_scheduler=false")
    with pytest.raises(ConfigError, match="lr_decay_iters = 20 there, 30 here"):
        restore(_state(mc), *load, "train_iters=30", "override_opt_param_scheduler=false")
    restore(_state(mc), *load, "lr=0.001", "override_opt_param_scheduler=false")  # same: fine
    restore(_state(mc), f"load={tmp_path}", "lr=0.002", "override_opt_param_scheduler=false")
    # a finetune starts the schedule afresh: nothing to check

    adopt = [*load, "lr=0.002", "train_iters=30", "use_checkpoint_opt_param_scheduler=true"]
    with pytest.raises(ConfigError, match="use_checkpoint_opt_param_scheduler.*resolved"):
        restore(_state(mc), *adopt)  # not resolved with the checkpoint's values
    extra = checkpoint_overrides(config(*adopt), tmp_path / "run")
    assert sorted(extra) == ["lr=0.001", "lr_decay_iters=20"]
    cfg = config(*adopt, *extra)
    assert cfg["lr"] == 0.001 and cfg["lr_decay_iters"] == 20 and cfg["train_iters"] == 30
    ckpt = Checkpointer.from_config(cfg, tmp_path / "run", mc)
    assert ckpt.restore(_state(mc))[1] == 12
    ckpt.close()
    finetune = config(f"load={tmp_path}", "lr=0.002", "use_checkpoint_opt_param_scheduler=true")
    assert checkpoint_overrides(finetune, tmp_path / "run") == []  # the schedule starts afresh
    with pytest.raises(ConfigError, match="both true"):
        checkpoint_overrides(config(*load, "override_opt_param_scheduler=true",
                                    "use_checkpoint_opt_param_scheduler=true"), tmp_path / "run")


def test_use_checkpoint_args_overrides(tmp_path):
    saved = ["num_layers=3", "normalization=RMSNorm", "tensor_model_parallel_size=2",
             "tokenizer_type=HuggingFaceTokenizer", "tokenizer_model=/models/tok"]
    cfg = load_config(None, [*TINY, "train_iters=20", f"save={tmp_path}", *saved])
    ckpt = Checkpointer.from_config(cfg, tmp_path)
    ckpt.maybe_save(2, _state(_model()), consumed=8, force=True)
    ckpt.close()
    here = [a for a in TINY if not a.startswith("num_layers")] + [
        "train_iters=20", f"load={tmp_path}", "hidden_size=16", "normalization=LayerNorm",
        "use_checkpoint_args=true"]

    def overrides(*more):
        return dict(a.split("=", 1) for a in checkpoint_overrides(
            load_config(None, [*here, *more]), tmp_path / "run"))

    got = overrides()
    # unforced num_layers: this config leaves it at its default; forced normalization: always
    assert got == {"num_layers": "3", "normalization": '"RMSNorm"',
                   "tokenizer_type": '"HuggingFaceTokenizer"', "tokenizer_model": '"/models/tok"'}
    assert "num_layers" not in overrides("num_layers=5")  # chosen here: kept
    assert "tokenizer_model" not in overrides("use_tokenizer_model_from_checkpoint_args=false")
    assert overrides("use_mp_args_from_checkpoint_args=true")["tensor_model_parallel_size"] == "2"
    assert overrides("use_checkpoint_args=false") == {}
    cfg = load_config(None, [*here, *checkpoint_overrides(load_config(None, here),
                                                          tmp_path / "run")])
    assert cfg["num_layers"] == 3 and cfg["normalization"] == "RMSNorm"
    assert cfg["hidden_size"] == 16 and cfg["tokenizer_model"] == "/models/tok"


def test_use_checkpoint_args_takes_the_architecture_knobs(tmp_path):
    """The checkpoint's layer pattern, Mamba shapes and Gemma/Granite-style layer knobs are
    forced onto a run that resumes with use_checkpoint_args."""
    saved = ["hybrid_layer_pattern=M*", "mamba_state_dim=8", "mamba_head_dim=8",
             "residual_multiplier=0.5", "post_mlp_norm=true"]
    cfg = load_config(None, [*TINY, "train_iters=20", f"save={tmp_path}", *saved])
    ckpt = Checkpointer.from_config(cfg, tmp_path)
    ckpt.maybe_save(2, _state(_model()), consumed=8, force=True)
    ckpt.close()
    here = [*TINY, "train_iters=20", f"load={tmp_path}", "use_checkpoint_args=true"]
    got = dict(a.split("=", 1) for a in checkpoint_overrides(load_config(None, here),
                                                            tmp_path / "run"))
    assert got == {"hybrid_layer_pattern": '"M*"', "mamba_state_dim": "8",
                   "mamba_head_dim": "8", "residual_multiplier": "0.5",
                   "post_mlp_norm": "true"}


@pytest.mark.slow
def test_use_checkpoint_args_on_the_command_line(tmp_path, cli, write):
    save = tmp_path / "ckpt"
    loop.train(config("train_iters=2", f"save={save}", "normalization=RMSNorm"))
    path = write("run.yml", "\n".join(a.replace("=", ": ", 1) for a in TINY) + "\n")
    args = [path, "train_iters=3", f"load={save}", "finetune=false", f"workspace={tmp_path}",
            "normalization=LayerNorm"]
    code, _, err = cli(*args)
    assert code == 2 and "normalization = 'RMSNorm' there, 'LayerNorm' here" in err
    code, _, err = cli(*args, "use_checkpoint_args=true")
    assert code == 0, err[-2000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    loop.train(load_config(None, [*CRASH, f"save={directory}"], world_size=1))
    return losses(directory)


@pytest.mark.parametrize("kind", ["global", "local"])
@pytest.mark.slow
def test_non_persistent_checkpoint_resumes_a_crashed_run(tmp_path, monkeypatch, uninterrupted,
                                                         kind):
    args = [*CRASH, f"save={tmp_path}", "non_persistent_save_interval=3",
            f"non_persistent_ckpt_type={kind}", f"non_persistent_local_ckpt_dir={tmp_path}/local"]
    real = loop.global_batches

    def crashing(*a, **kw):
        for i, batch in enumerate(real(*a, **kw)):
            if i == 7:
                raise RuntimeError("node lost")
            yield batch

    monkeypatch.setattr(loop, "global_batches", crashing)
    with pytest.raises(RuntimeError, match="node lost"):
        loop.train(load_config(None, args, world_size=1))
    assert steps_in(tmp_path) == ["step_4"]  # persistent: 4; non-persistent: 3, then 6 only
    if kind == "global":
        assert steps_in(tmp_path / "non_persistent") == ["step_6"]
    else:
        assert steps_in(tmp_path / "local" / "process_0") == ["step_6"]
    monkeypatch.setattr(loop, "global_batches", real)
    loop.train(load_config(None, [*args, "auto_continue_train=true"], world_size=1))
    assert losses(tmp_path) == uninterrupted  # steps 7-8 resumed from step 6, bit for bit
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert rows.count(5) == rows.count(6) == 1  # not redone from the persistent step 4


def test_non_persistent_retention_choice_and_local_fallback(tmp_path, caplog):
    mc = _model()
    args = [f"save={tmp_path}", "save_interval=4", "non_persistent_save_interval=1",
            "non_persistent_ckpt_type=local", f"non_persistent_local_ckpt_dir={tmp_path}/local"]
    ckpt = Checkpointer.from_config(config(*args), tmp_path, mc)
    assert all(ckpt.maybe_save(s, _bump(_state(mc), s), consumed=4 * s) for s in range(1, 7))
    ckpt.close()
    assert steps_in(tmp_path) == ["step_4"]
    assert steps_in(tmp_path / "local" / "process_0") == ["step_6"]
    resume = [*args, "auto_continue_train=true"]
    (state, consumed), _ = restore(_state(mc), *resume)
    assert consumed == 24 and same(state.params, _bump(_state(mc), 6).params)
    assert same(jax.random.key_data(state.rng), jax.random.key_data(_bump(_state(mc), 6).rng))
    layout = tmp_path / "local" / "process_0" / "step_6" / "layout.json"
    text = json.loads(layout.read_text())
    for leaves in text.values():
        for entry in leaves.values():
            for shard in entry["shards"]:
                shard["devices"] = [d + 100 for d in shard["devices"]]
    layout.write_text(json.dumps(text))
    caplog.set_level(logging.WARNING, logger=LOG.name)
    (state, consumed), _ = restore(_state(mc), *resume)  # not this layout: the global step 4
    assert consumed == 16 and "does not fit this run" in caplog.text
    ckpt = Checkpointer.from_config(config(*args), tmp_path, mc)
    ckpt.maybe_save(8, _bump(_state(mc), 8), consumed=32)  # persistent, newer than local 6
    ckpt.close()
    ckpt = Checkpointer.from_config(config(*resume), tmp_path, mc)
    assert ckpt.plan()[1] == 8
    ckpt.close()
    with pytest.raises(ConfigError, match="needs non_persistent_ckpt_type"):
        Checkpointer.from_config(config("non_persistent_save_interval=2"), tmp_path)
    with pytest.raises(ConfigError, match="needs non_persistent_local_ckpt_dir"):
        Checkpointer.from_config(config("non_persistent_ckpt_type=local"), tmp_path)


def test_statuses_of_mapped_and_refused_knobs():
    assert not config("ckpt_fully_parallel_load=true").warnings  # mapped: Orbax's own loading
    with pytest.raises(ConfigError, match="replication is not supported"):
        config("replication=true")
    assert any("replication_factor has no effect" in w
               for w in config("replication_factor=2").warnings)
    with pytest.raises(ConfigError, match="in_memory.*not supported"):
        config("non_persistent_ckpt_type=in_memory")


@pytest.mark.parametrize("async_save", [False, True])
def test_verify_integrity_writes_a_manifest_and_checks_it_on_load(tmp_path, async_save):
    """Megatron's verify_integrity: a SHA-256 manifest of every file of the saved step
    (synchronous and async saves), checked before a resume reads it: a changed or missing
    file, or a checkpoint saved without it, stops the run naming the file and the knob."""
    from jaxtrain.checkpoint import integrity

    mc = _model()
    saved = _bump(_state(mc), 1)
    flags = ["verify_integrity=true", f"async_save={str(async_save).lower()}"]
    save(tmp_path / "ck", saved, 3, *flags)
    step_dir = tmp_path / "ck" / "step_3"
    manifest = json.loads((step_dir / integrity.MANIFEST).read_text())
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != integrity.MANIFEST]
    assert manifest["algorithm"] == "sha256" and len(manifest["files"]) == len(files) > 3
    (state, _), _ = restore(_state(mc), f"load={tmp_path}/ck", "verify_integrity=true")
    assert same(state.params, saved.params)

    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="verify_integrity.*fails its integrity check") as err:
        restore(_state(mc), f"load={tmp_path}/ck", "verify_integrity=true")
    assert victim.relative_to(step_dir).as_posix() in str(err.value)
    victim.unlink()
    with pytest.raises(ConfigError, match="missing or unreadable"):
        restore(_state(mc), f"load={tmp_path}/ck", "verify_integrity=true")

    save(tmp_path / "plain", saved, 3)   # saved without: no manifest, a resume with it stops
    assert not (tmp_path / "plain" / "step_3" / integrity.MANIFEST).exists()
    with pytest.raises(ConfigError, match="saved without verify_integrity"):
        restore(_state(mc), f"load={tmp_path}/plain", "verify_integrity=true")
    restore(_state(mc), f"load={tmp_path}/plain")
    with pytest.raises(ConfigError, match="needs ckpt_format torch_dist"):
        config("verify_integrity=true", "ckpt_format=zarr")


def test_checkpoint_storage_use_ocdbt_false_writes_a_directory_per_array(tmp_path):
    """MaxText's checkpoint_storage_use_ocdbt: false stores each array in its own directory
    (no OCDBT store); the default keeps OCDBT; both restore the same weights."""
    mc = _model()
    saved = _bump(_state(mc), 2)
    for flag, name in (("true", "ocdbt"), ("false", "plain")):
        save(tmp_path / name, saved, 3, f"checkpoint_storage_use_ocdbt={flag}")
        (state, _), _ = restore(_state(mc), f"load={tmp_path / name}")
        assert same(state.params, saved.params)
    params = lambda name: tmp_path / name / "step_3" / "params"   # noqa: E731
    assert any(p.name.startswith("ocdbt") for p in params("ocdbt").iterdir())
    assert not any(p.name.startswith("ocdbt") for p in params("plain").iterdir())
    assert len([p for p in params("plain").iterdir() if p.is_dir()]) >= len(
        jax.tree.leaves(saved.params))
