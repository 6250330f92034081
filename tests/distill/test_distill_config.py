"""pgs distill files at the command line: what the dry run checks (exit 2 naming the key), the
settings read from the named sections, and the real published files accepted."""
import pathlib

import pytest
import transformers
from distill_helpers import number_task, prompt_rows, write_jsonl, write_pair

from jaxtrain import train
from jaxtrain.config import load_config
from jaxtrain.config.errors import ConfigError
from jaxtrain.distill.settings import settings
from sft_helpers import pair_task, write_chat_model

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "pgs"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_cfg")
    write_pair(root)
    # a teacher with another tokenizer (trained on other text): no shared vocabulary
    write_chat_model(root / "other", family="qwen3", rows=pair_task(32), seed=3)
    rows = prompt_rows(number_task(32))
    write_jsonl(root / "train.jsonl", rows)
    write_jsonl(root / "nomessages.jsonl", [{"prompt": "what follows red?"}])
    big = transformers.AutoTokenizer.from_pretrained(root / "student")
    big.add_tokens([f"extra{i}" for i in range(400)])
    big.save_pretrained(root / "big_tok")
    write_jsonl(root / "pool.jsonl", [
        {"question": f"which colour is {w}?", "options": [["A", w], ["B", "none"]],
         "answer": "A", "category": "colours"} for w in ("red", "blue", "green", "gold")])
    return root


BASE = """\
model: {{student: {root}/student}}
teachers:
  main: {{model: {root}/{teacher}{teacher_opts}}}
sources:
  s1: {{path: {root}/{path}, dev_size: 2{source_opts}}}
rollout: {{batch_prompts: 4}}
train: {{output_dir: {root}/out, steps: 2, warmup_steps: 1}}
"""


def _write(folder, name="d.yaml", teacher="teacher", path="train.jsonl", teacher_opts="",
           source_opts=""):
    file = folder / name
    file.write_text(BASE.format(root=folder, teacher=teacher, path=path,
                                teacher_opts=teacher_opts, source_opts=source_opts))
    return file


def _dry(capsys, file, *extra):
    code = train.main([str(file), *extra, "--dry-run"])
    return code, capsys.readouterr().err


def test_a_good_file_passes_the_dry_run(folder, capsys):
    code, err = _dry(capsys, _write(folder))
    assert code == 0, err


def test_differing_vocabularies_with_a_shared_vocabulary_loss(folder, capsys):
    code, err = _dry(capsys, _write(folder, teacher="other", teacher_opts=", loss: full_rkl"))
    assert code == 2 and "teachers.main" in err and "xtok" in err and "Traceback" not in err
    # left to choose, the pair takes xtok and runs
    code, err = _dry(capsys, _write(folder, teacher="other"))
    assert code == 0, err


def test_a_source_file_without_the_messages_field(folder, capsys):
    code, err = _dry(capsys, _write(folder, path="nomessages.jsonl"))
    assert code == 2 and "nomessages.jsonl:1" in err and "sources.s1" in err
    assert "'messages'" in err


@pytest.mark.parametrize("template, needle", [
    ("'Q: {options}'", "{question}"), ("'{question} {options} {when}'", "{when}"),
    ("'{question} {options'", "not a valid template")])
def test_mcqa_templates_are_checked(folder, capsys, template, needle):
    code, err = _dry(capsys, _write(folder, path="pool.jsonl",
                                    source_opts=f", format: mcqa, fast_template: {template}"))
    assert code == 2 and "sources.s1.fast_template" in err and needle in err, err


@pytest.mark.parametrize("opts, needle", [
    (", backend: vllm", "teachers.main.url"),
    (", backend: vllm, url: 'http://127.0.0.1:9', loss: full_rkl", "backend hf"),
    (", device: 'cuda:1'", "teachers.main.device is not supported"),
])
def test_teacher_options_refused(folder, capsys, opts, needle):
    code, err = _dry(capsys, _write(folder, teacher_opts=opts))
    assert code == 2 and needle in err, err


def test_teacher_weights_and_tokenizer_checked(folder, capsys, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder / "teacher", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    file = folder / "broken.yaml"
    file.write_text(_write(folder).read_text().replace(f"{folder}/teacher", str(broken)))
    code, err = _dry(capsys, file)
    assert code == 2 and "teachers.main.model" in err and "broken" in err, err
    # a tokenizer with more tokens than the teacher embeds
    code, err = _dry(capsys, _write(folder, teacher_opts=f", tokenizer: {folder}/big_tok"))
    assert code == 2 and "teachers.main: its tokenizer has" in err, err


def test_names_that_refer_to_each_other(folder, capsys):
    code, err = _dry(capsys, _write(folder, source_opts=", teacher: nobody"))
    assert code == 2 and "sources.s1.teacher 'nobody'" in err
    code, err = _dry(capsys, _write(
        folder, source_opts=", topic_field: t, topic_teachers: {main: [x], ghost: [x]}"))
    assert code == 2 and "'ghost' is not one of the teachers" in err and "both" in err


def test_named_sections_take_defaults(folder):
    cfg = load_config(_write(folder, source_opts=", weight: 2.5"), [], world_size=1)
    s = settings(cfg)
    assert list(s.teachers) == ["main"] and s.sources["s1"].teacher == "main"
    assert s.sources["s1"].weight == 2.5 and s.sources["s1"].max_new_tokens == 512
    assert s.teachers["main"].backend == "hf" and s.loss.top_k == 8
    assert s.rollout.batch_prompts == 4 and s.score_micro_seqs == 16
    assert cfg["global_batch_size"] == 4
    with pytest.raises(ConfigError, match="rollout.temperature must be > 0"):
        settings(load_config(_write(folder), ["--rollout.temperature", "0"], world_size=1))


@pytest.mark.parametrize("name", ["distill_math.yaml", "distill_multi.yaml"])
def test_published_files_pass_the_dry_run(tmp_path, monkeypatch, capsys, name):
    """palingenesis configs/distill_{math,multi}.yaml, unchanged, in a folder holding the
    models and data they name (tiny stand-ins: Qwen/Qwen3-1.7B is a tiny random teacher)."""
    import shutil

    write_pair(tmp_path / "Qwen", "Qwen3-1.7B", "Qwen3-0.6B")
    write_chat_model(tmp_path / "HuggingFaceTB" / "SmolLM2-360M-Instruct", family="llama",
                     rows=pair_task(32), seed=4)
    rows = prompt_rows(number_task(32))
    for f in ("gsm8k_train.jsonl", "gsm8k_test200.jsonl", "chat_train.jsonl"):
        write_jsonl(tmp_path / "data" / f, rows if f != "chat_train.jsonl" else [
            {"messages": [{"role": "user", "content": f"say something about {i}"}]}
            for i in range(150)])
    shutil.copy(DATA / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    code, err = _dry(capsys, name)
    assert code == 0, err
    cfg = load_config(name, [], world_size=1)
    s = settings(cfg)
    assert cfg["rollout.backend"] == "vllm" and s.rollout.batch_prompts == 64
