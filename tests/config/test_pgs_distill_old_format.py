"""pgs distill's first config format (model.teacher, bridge:, data:, sampling:, train.loss_fn)
is refused with where each option moved, exit 2, as pgs refuses it; the current format is not."""
import pytest

from jaxtrain.config.dialects import pgs
from jaxtrain.config.errors import ConfigError

OLD = """\
model: {student: s, teacher: t, teacher_device: "cuda:1"}
bridge: {eos_map: {"<|im_end|>": "<|eot_id|>"}, extra_stop_tokens: ["</s>"]}
data: {prompts_path: data/prompts.jsonl, dev_size: 100}
sampling: {batch_prompts: 8, max_new_tokens: 16, gen_micro_seqs: 32}
train: {steps: 10, loss_fn: full_kl, eval_dev_samples: 50}
"""


def test_old_format_is_refused_naming_every_move(tmp_path, capsys):
    from jaxtrain import train

    path = tmp_path / "old.yaml"
    path.write_text(OLD)
    assert train.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    for line in ("model.teacher is now teachers.<name>.model",
                 "model.teacher_device is now teachers.<name>.device",
                 "bridge.eos_map is now teachers.<name>.eos_map",
                 "bridge.extra_stop_tokens is now model.stop_tokens",
                 "data.prompts_path is now sources.<name>.path",
                 "data.dev_size is now sources.<name>.dev_size",
                 "sampling.batch_prompts is now rollout.batch_prompts",
                 "sampling.max_new_tokens is now sources.<name>.max_new_tokens",
                 "sampling.gen_micro_seqs is now rollout.micro_seqs",
                 "train.loss_fn is now teachers.<name>.loss (full_kl is now full_rkl)",
                 "train.eval_dev_samples is now train.eval_samples"):
        assert line in err, (line, err)
    assert "first config format" in err and "Traceback" not in err


def test_current_format_passes_the_check():
    pgs.refuse_old_distill({"model": {"student": "s"}, "teachers": {"big": {"model": "t"}},
                            "sources": {"chat": {"path": "p.jsonl"}},
                            "train": {"steps": 3}}, "new.yaml")
    with pytest.raises(ConfigError, match="first config format"):
        pgs.refuse_old_distill({"sampling": {"temperature": 1.0}}, "x.yaml")
