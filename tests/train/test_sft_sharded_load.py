"""Hugging Face weights placed straight into a sharded train state (4 CPU devices, FSDP x TP):
each device holds only its slice, and the gathered values are the checkpoint's."""
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from sft_helpers import pair_task, write_chat_model, write_jsonl
    from jaxtrain import loop
    from jaxtrain.checkpoint import hf_init
    from jaxtrain.config import load_config
    from jaxtrain.models import from_hf

    root = pathlib.Path(sys.argv[1])
    model = write_chat_model(root / "model")
    data = write_jsonl(root / "chat.jsonl", pair_task(8))
    (root / "pgs.yml").write_text(
        f"model: {{name_or_path: {model}, torch_dtype: float32}}\\n"
        f"data: {{dataset: {data}, max_seq_length: 64}}\\n"
        "train: {max_steps: 2, per_device_batch_size: 1, gradient_accumulation_steps: 1}\\n"
        "parallel: {fsdp: true}\\n")
    cfg = load_config(root / "pgs.yml", ["tensor_model_parallel_size=2"], world_size=4)
    run = loop.build(cfg)
    on_device = jax.tree.map(lambda s: s, run.shardings)
    state = hf_init.start_from_hf(run.state, model, run.model_cfg, run.optimizer,
                                  run.abstract, run.shardings, on_device)
    _, want = from_hf(model)
    out = {"equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                        zip(jax.tree.leaves(state.params), jax.tree.leaves(want))),
           "split": sum(a.addressable_shards[0].data.size < a.size
                        for a in jax.tree.leaves(state.params)),
           "leaves": len(jax.tree.leaves(state.params))}
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_hf_weights_land_sharded(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{HERE}", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["equal"] and out["split"] == out["leaves"]   # every leaf split over devices
