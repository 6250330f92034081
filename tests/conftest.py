"""Shared test setup: JAX on the CPU, and helpers to write configs and run the CLIs."""
import contextlib
import io
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":
    # On a GPU, JAX's fp32 matmuls (XLA's and Pallas' Triton dots) default to TF32, ~1e-3 apart:
    # the fp32 checks compare full fp32 there, as they do on the CPU.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    if "jax" in sys.modules:   # imported before this file (by a plugin): the variable came late
        sys.modules["jax"].config.update("jax_default_matmul_precision",
                                         os.environ["JAX_DEFAULT_MATMUL_PRECISION"])
# The test programs are tiny: compile them quickly (the backend optimises less, numerics hold).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# Runs in tests leave JAX's persistent compilation cache alone (one test turns it on)
os.environ.setdefault("JAXTRAIN_COMPILATION_CACHE", "off")
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def persistent_compilation_cache(tmp_path_factory):
    """A module whose runs compile the same steps again: cache the executables on disk for the
    module (use with ``pytestmark = pytest.mark.usefixtures(...)``)."""
    import jax

    settings = {"jax_compilation_cache_dir": str(tmp_path_factory.mktemp("xla_cache")),
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    before = {k: getattr(jax.config, k) for k in settings}
    for key, value in settings.items():
        jax.config.update(key, value)
    yield
    for key, value in before.items():
        jax.config.update(key, value)


@pytest.fixture(scope="session", autouse=True)
def _empty_hf_cache(tmp_path_factory):
    """Hugging Face models come from an empty cache: a machine's own downloads do not change
    what a test resolves (a test that needs one writes it; see write_hf_model)."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    os.environ["HF_HOME"], os.environ["HF_HUB_CACHE"] = str(home), str(home / "hub")
    os.environ.pop("HUGGINGFACE_HUB_CACHE", None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


TINY_HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                 "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64,
                 "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 10000.0,
                 "tie_word_embeddings": False}


def write_hf_model(path, config=None, weights: bool = False, **changes) -> pathlib.Path:
    """A Hugging Face model directory holding config.json (``config``, default a tiny Llama,
    with ``changes``): what model.name_or_path reads the architecture from; with ``weights``
    also random weights in model.safetensors, what a run starts from."""
    import json

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**(config or TINY_HF_LLAMA), **changes}
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        import jax
        from safetensors.numpy import save_file

        from jaxtrain.models import hf, init

        cfg = hf.config_from_hf(config)
        tensors = hf._hf_tensors(init(cfg, jax.random.key(0)), cfg, config["model_type"])
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(autouse=True)
def _fresh_jaxtrain_logger():
    """Undo what a CLI run's setup_logging did to the ``jaxtrain`` logger (own handlers, no
    propagation), so later tests' caplog sees jaxtrain's records."""
    yield
    logger = logging.getLogger("jaxtrain")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture
def write(tmp_path):
    """write("name.yml", "yaml text") -> path, with the text dedented."""

    def _write(name, text):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return _write


@pytest.fixture
def cli():
    """Run ``jaxtrain.train.main`` in-process: returns (exit code, stdout, stderr)."""
    from jaxtrain import train

    def _run(*args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train.main([str(a) for a in args])
        return code, out.getvalue(), err.getvalue()

    return _run


def trained_rows(cli, run, workspace, name: str = "run") -> list[dict]:
    """Dry-run, then train, the command line ``run`` through ``cli`` (both must exit 0): the
    metrics rows the run wrote under ``workspace/name``."""
    code, _, err = cli("--dry-run", *run)
    assert code == 0, err
    code, _, err = cli(*run)
    assert code == 0, err
    return [json.loads(r) for r in (workspace / name / "metrics.jsonl").read_text().splitlines()]


def run_module(module, *args, env=None, cwd=None):
    """Run ``python -m module args`` in a subprocess: the real exit code and streams."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          text=True, env=full_env, cwd=cwd or ROOT, timeout=300)
