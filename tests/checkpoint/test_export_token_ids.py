"""An exported model keeps the special token ids (bos, eos, pad) of the model it started from."""
import json

import jax
import transformers

from jaxtrain import models
from jaxtrain.checkpoint import export


def test_exported_config_carries_the_source_token_ids(tmp_path):
    cfg = models.ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_attention_heads=2,
                             ffn_hidden_size=32)
    params = models.init(cfg, jax.random.key(0))
    tok_dir, source = tmp_path / "tok", tmp_path / "source"
    tok_dir.mkdir()
    source.mkdir()
    ids = {"bos_token_id": 3, "eos_token_id": [5, 9], "pad_token_id": 0}
    (source / "config.json").write_text(json.dumps({"model_type": "llama", **ids}))
    out = export.write_model(params, cfg, tmp_path / "final", side_dirs=(tok_dir, source))
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in ids} == ids
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (3, [5, 9], 0)
    plain = export.write_model(params, cfg, tmp_path / "plain", side_dirs=(tok_dir,))
    assert json.loads((plain / "config.json").read_text()).get("eos_token_id") != [5, 9]
