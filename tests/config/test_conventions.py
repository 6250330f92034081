"""Convention knobs: the dialect sets them, an explicit value switches them, and subsystems read
them instead of asking which system a config came from."""
import pytest

from jaxtrain.checkpoint import Checkpointer
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig
from jaxtrain.optim import schedules as S
from jaxtrain.optim.optimizers import OptimConfig
from jaxtrain.optim.schedules import ScheduleConfig

SMALL = ["num_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=128",
         "seq_length=16", "max_position_embeddings=16", "train_iters=100",
         "lr_warmup_iters=0"]


def cfg(*args, path=None):
    return load_config(path, [*SMALL, *args], enforce_status=False)


def test_optimizer_family_follows_the_dialect_and_can_be_chosen(write):
    assert OptimConfig.from_config(cfg()).flavour == "megatron"
    pgs = write("sft.yaml", "model: {name_or_path: null}\ntrain: {max_steps: 50}\n")
    assert OptimConfig.from_config(load_config(pgs, enforce_status=False)).flavour == "pgs"
    chosen = cfg("optimizer_family=pgs")
    assert OptimConfig.from_config(chosen).flavour == "pgs"
    assert OptimConfig.from_config(chosen).name == "adamw"   # train.optimizer's default


def test_lr_schedule_family_picks_the_formula():
    assert ScheduleConfig.from_config(cfg()).family == "megatron"
    assert ScheduleConfig.from_config(cfg("lr_schedule_family=maxtext")).family == "maxtext"
    assert ScheduleConfig.from_config(cfg("lr_schedule_family=pgs")).family == "pgs"
    with pytest.raises(ConfigError, match="both choose the LR schedule"):
        cfg("lr_schedule_type=wsd", "train.lr_scheduler=linear")


def test_lr_warmup_offset_shifts_the_pgs_warmup():
    plain = ScheduleConfig.from_config(cfg("lr_schedule_family=pgs", "lr_warmup_iters=10"))
    shifted = ScheduleConfig.from_config(cfg("lr_schedule_family=pgs", "lr_warmup_iters=10",
                                             "lr_warmup_offset=1"))
    assert S.pgs_lr_at(plain, 0) != S.pgs_lr_at(shifted, 0)


def test_decay_all_params_is_maxtexts_adamw(write):
    assert not OptimConfig.from_config(cfg()).decay_all
    assert OptimConfig.from_config(cfg("decay_all_params=true")).decay_all
    assert OptimConfig.from_config(load_config("base.yml", ["run_name=x"])).decay_all


def test_wsd_decay_style_shapes_maxtexts_decay():
    base = ["lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.5"]
    linear = ScheduleConfig.from_config(cfg(*base, "wsd_decay_style=linear"))
    cosine = ScheduleConfig.from_config(cfg(*base, "wsd_decay_style=cosine"))
    assert S.maxtext_lr_at(linear, 75) != S.maxtext_lr_at(cosine, 75)


def test_use_rotary_position_embeddings_forces_rope():
    assert ModelConfig.from_config({**cfg()}).position_embedding_type == "learned_absolute"
    assert ModelConfig.from_config({**cfg("use_rotary_position_embeddings=true")}
                                   ).position_embedding_type == "rope"


def test_non_persistent_global_ckpt_dir_places_the_global_checkpoints(tmp_path):
    args = ["non_persistent_save_interval=3", "non_persistent_ckpt_type=global"]
    own = Checkpointer.from_config(cfg(*args, f"save={tmp_path}/run"), tmp_path / "run")
    there = Checkpointer.from_config(cfg(*args, f"save={tmp_path}/run",
                                         f"non_persistent_global_ckpt_dir={tmp_path}/np"),
                                     tmp_path / "run")
    assert own.non_persistent_root(tmp_path / "run") != there.non_persistent_root(tmp_path / "run")
    assert str(there.non_persistent_root(tmp_path / "run")) == f"{tmp_path}/np"
