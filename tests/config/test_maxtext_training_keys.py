"""MaxText's training, optimizer, schedule, checkpoint, parallelism and logging keys: MaxText
files take MaxText's defaults and meanings (configs/base.yml, create_learning_rate_schedule)."""
import json
import math

import jax
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.optim.optimizers import OptimConfig
from jaxtrain.optim.schedules import ScheduleConfig, make_lr_schedule

RECIPE = ["run_name=cmp", "hardware=cpu", "skip_jax_distributed_system=true",
          "dataset_type=synthetic", "per_device_batch_size=4", "max_target_length=32",
          "enable_checkpointing=false"]


def test_plain_maxtext_keys_mark_a_maxtext_config_with_its_defaults(write):
    path = write("mt.yml", "run_name: a\nsteps: 3\nper_device_batch_size: 2\n")
    cfg = load_config(path, world_size=1)  # Primus's lr_warmup_iters 40 no longer in the way
    assert cfg.dialect == "maxtext"
    assert cfg["lr"] == 3e-5 and cfg["adam_beta2"] == 0.95 and cfg["weight_decay"] == 0.1
    assert cfg["save_interval"] == 10_000 and cfg["enable_checkpointing"] is True
    assert cfg["async_save"] is True and cfg["log_interval"] == 100
    assert cfg["eval_interval"] is None and cfg["eval_iters"] == 0
    assert load_config("base.yml").dialect == "maxtext"  # MaxText's own base file
    assert load_config("base.yml")["train_iters"] == 150_001
    assert load_config(None)["lr"] == 2e-5 and load_config(None).dialect == "megatron"  # Megatron


@pytest.mark.parametrize("pdbs, world, accum, tp, micro, gbs", [
    (4, 8, 1, 1, 4, 32), (4, 8, 3, 1, 4, 96), (4, 8, 1, 2, 8, 32), (0.5, 8, 1, 2, 1, 4)])
def test_per_device_batch_times_devices_is_the_global_batch(pdbs, world, accum, tp, micro, gbs):
    cfg = load_config("base.yml", [f"per_device_batch_size={pdbs}",
                                   f"gradient_accumulation_steps={accum}",
                                   f"ici_tensor_parallelism={tp}"], world_size=world)
    assert cfg["global_batch_size"] == gbs and cfg["micro_batch_size"] == micro
    assert cfg["tensor_model_parallel_size"] == tp
    assert cfg.derived["data_parallel_size"] == world // tp
    assert cfg["data_parallel_sharding_strategy"] == "optim_grads_params"  # ici_fsdp = -1


def test_fractional_batch_that_cannot_be_shared_is_refused():
    with pytest.raises(ConfigError, match="per_device_batch_size 0.5"):
        load_config("base.yml", ["per_device_batch_size=0.5"], world_size=8)


def test_maxtext_lr_follows_maxtexts_schedule_step_by_step():
    cfg = load_config("base.yml", ["steps=14", "learning_rate=1e-3",
                                   "warmup_steps_fraction=0.2", "learning_rate_schedule_steps=10",
                                   "cosine_learning_rate_final_fraction=0.1"])
    lr = make_lr_schedule(ScheduleConfig.from_config(cfg))
    peak, final, warm, cos_len = 1e-3, 1e-4, 2, 8
    for k in range(14):  # MaxText: warmup from 0, cosine over S - W steps, 0 after S
        if k < warm:
            want = peak * k / warm
        elif k < 10:
            a = 0.5 * (math.cos(math.pi * (k - warm) / (cos_len - 1)) + 1)
            want = peak * a + final * (1 - a)
        else:
            want = 0.0
        assert float(lr(k)) == pytest.approx(want, rel=1e-5, abs=1e-10), k
    wsd = load_config("base.yml", ["steps=10", "learning_rate=1.0", "lr_schedule_type=wsd",
                                   "warmup_steps_fraction=0.2", "wsd_decay_steps_fraction=0.3",
                                   "learning_rate_final_fraction=0.0"])
    lr = make_lr_schedule(ScheduleConfig.from_config(wsd))
    assert [round(float(lr(k)), 4) for k in range(10)] == [0, 0.5, 1, 1, 1, 1, 1, 1, 0.5, 0]


def test_aliases_reach_the_canonical_knobs():
    cfg = load_config("base.yml", [
        "adam_b1=0.8", "adam_b2=0.9", "adam_eps_root=1e-9", "adam_weight_decay=0.05",
        "gradient_clipping_threshold=0.5", "mu_dtype=bfloat16", "opt_type=sgd",
        "checkpoint_period=7", "max_num_checkpoints_to_keep=2", "load_parameters_path=/w",
        "async_checkpointing=false", "enable_tensorboard=false", "base_output_directory=/o",
        "eval_interval=5", "eval_steps=-1", "steps=-1", "learning_rate_schedule_steps=40",
        "enable_single_replica_ckpt_restoring=true", "ici_expert_parallelism=2"], world_size=4)
    assert (cfg["adam_beta1"], cfg["adam_beta2"], cfg["adam_eps_root"]) == (0.8, 0.9, 1e-9)
    assert cfg["optimizer"] == "sgd" and cfg["weight_decay"] == 0.05 and cfg["clip_grad"] == 0.5
    assert cfg["exp_avg_dtype"] == "bf16" and cfg["use_precision_aware_optimizer"] is True
    assert cfg["save_interval"] == 7 and cfg["train.keep_checkpoints"] == 2
    assert cfg["pretrained_checkpoint"] == "/w" and cfg["async_save"] is False
    assert cfg["disable_tensorboard"] is True and cfg["workspace"] == "/o"
    assert cfg["eval_interval"] == 5 and cfg["full_validation"] and cfg["eval_iters"] == 0
    assert cfg["train_iters"] == 40 and cfg["lr_decay_iters"] == 40
    assert cfg["ckpt_fully_parallel_load"] is True and cfg["expert_model_parallel_size"] == 2
    opt = OptimConfig.from_config(cfg)
    assert opt.name == "sgd" and opt.sgd_momentum == 0.0 and opt.decay_all
    assert load_config("base.yml", ["opt_type=sgd"])["weight_decay"] == 0.0  # no Adam decay
    assert load_config("base.yml", ["max_num_checkpoints_to_keep=None"])[
        "train.keep_checkpoints"] == 0


def test_adam_eps_root_and_maxtext_decay_change_the_update():
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxtrain.optim.optimizers import build_optimizer
    params = {"norm": {"scale": jnp.ones(3)}}
    axes = {"norm": {"scale": P("norm")}}
    grads = {"norm": {"scale": jnp.full(3, 1e-4)}}

    def update(*overrides):
        cfg = load_config("base.yml", ["adam_weight_decay=0.5", *overrides])
        opt = build_optimizer(OptimConfig.from_config(cfg), 1.0, axes)
        return float(opt.update(grads, opt.init(params), params)[0]["norm"]["scale"][0])

    base = update()
    assert base == pytest.approx(-(1.0 + 0.5), rel=1e-3)  # MaxText decays norms too
    assert update("adam_eps_root=1e-4") > base + 0.5  # sqrt(v + eps_root) shrinks the step


def test_mesh_keys_map_refuse_and_check_the_device_count():
    with pytest.raises(ConfigError, match="sequence parallelism of activations"):
        load_config("base.yml", ["ici_sequence_parallelism=2"], world_size=4)
    with pytest.raises(ConfigError, match="not implemented yet: diloco parallelism"):
        load_config("base.yml", ["ici_diloco_parallelism=2"])
    with pytest.raises(ConfigError, match="has 6 devices"):
        load_config("base.yml", ["ici_fsdp_parallelism=3", "ici_tensor_parallelism=2"],
                    world_size=4)
    with pytest.raises(ConfigError, match="ici/dcn_tensor_parallelism x ici/dcn_tensor_sequence_parallelism implies"):
        load_config("base.yml", ["ici_tensor_parallelism=2", "tensor_model_parallel_size=4"],
                    world_size=8)


@pytest.mark.parametrize("key, value, words", [
    ("opt_type", "muon", "contrib Muon"), ("compile_topology", "v5e-256", "compiles for"),
    ("gcs_metrics", "true", "Cloud Storage"), ("enable_emergency_checkpoint", "true", "emergency"),
    ("mesh_axes", "[data]", "leaves out")])
def test_refused_keys_name_the_reason(key, value, words):
    with pytest.raises(ConfigError, match=words):
        load_config("base.yml", [f"{key}={value}"])


def test_megatron_and_maxtext_spellings_together_are_the_two_names_error(write):
    path = write("both.yml", "lr: 1.0e-3\nlearning_rate: 2.0e-3\nadam_beta2: 0.9\nadam_b2: 0.9\n")
    with pytest.raises(ConfigError, match="lr and learning_rate both set"):
        load_config(path)


@pytest.fixture
def keep_cache_dir():
    """The run sets JAX's global compilation-cache folder: put it back afterwards."""
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_recipe_trains_three_steps_into_base_output_directory_run_name(tmp_path, cli,
                                                                        keep_cache_dir):
    out = tmp_path / "mt-out"
    code, _, err = cli("base.yml", *RECIPE, f"base_output_directory={out}", "steps=3",
                       f"jax_cache_dir={tmp_path / 'cache'}", "log_period=1",
                       "enable_tensorboard=false", "base_num_decoder_layers=2",
                       "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4",
                       "head_dim=16", "base_mlp_dim=128", "vocab_size=256",
                       "dtype=float32", "weight_dtype=float32", "learning_rate=1e-3",
                       "warmup_steps_fraction=0.34", f"metrics_file={tmp_path / 'm.txt'}")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "cmp" / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / "m.txt").read_text() == (out / "cmp" / "metrics.jsonl").read_text()
    steps = [r for r in rows if "lm_loss" in r or "loss" in r]
    assert len(steps) == 3
    lrs = [r.get("lr", r.get("learning_rate")) for r in steps]
    assert lrs == pytest.approx([0.0, 1e-3, 1e-3 * 0.1], abs=1e-9)  # warmup 1 step, cosine 2
    # jax_cache_dir reached JAX's persistent compilation cache (in a fresh process the cache
    # then fills that folder; in this test process JAX may have opened its cache already)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
