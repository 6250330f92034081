"""HF import/export: logits parity with `transformers` per family, round trips, clear errors."""
import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import SEQ, VOCAB, max_diff, random_params, tiny, tokens
from safetensors.numpy import load_file, save_file

from jaxtrain.models import forward, from_hf, generate, to_hf
from jaxtrain.models.hf import config_from_hf, hf_config

TOL = 1e-4
_LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
_GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=0,
             eos_token_id=0)

CASES = {
    "llama": (tr.LlamaConfig, tr.LlamaForCausalLM, _LLAMA),
    "llama_tied_gelu_tanh": (tr.LlamaConfig, tr.LlamaForCausalLM,
                             {**_LLAMA, "tie_word_embeddings": True,
                              "hidden_act": "gelu_pytorch_tanh"}),
    "llama_bias": (tr.LlamaConfig, tr.LlamaForCausalLM,
                   {**_LLAMA, "attention_bias": True, "mlp_bias": True}),
    "llama3_rope_scaling": (tr.LlamaConfig, tr.LlamaForCausalLM, {**_LLAMA, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500.0}}),
    "llama_linear_rope": (tr.LlamaConfig, tr.LlamaForCausalLM, {**_LLAMA, "rope_parameters": {
        "rope_type": "linear", "factor": 3.0, "rope_theta": 1000.0}}),
    "llama_yarn": (tr.LlamaConfig, tr.LlamaForCausalLM, {**_LLAMA, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0}}),
    "llama_yarn_mscale": (tr.LlamaConfig, tr.LlamaForCausalLM, {**_LLAMA, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0,
        "beta_slow": 2.0, "truncate": False}}),
    "llama_yarn_attention_factor": (tr.LlamaConfig, tr.LlamaForCausalLM, {
        **_LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1000.0,
                                      "original_max_position_embeddings": 16,
                                      "attention_factor": 0.8}}),
    "mistral_sliding": (tr.MistralConfig, tr.MistralForCausalLM,
                        {**_LLAMA, "sliding_window": 5, "head_dim": 8}),
    "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM, _LLAMA),
    "qwen2_sliding": (tr.Qwen2Config, tr.Qwen2ForCausalLM,
                      {**_LLAMA, "use_sliding_window": True, "sliding_window": 5,
                       "max_window_layers": 0}),
    "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM, {**_LLAMA, "head_dim": 16}),
    "gpt2": (tr.GPT2Config, tr.GPT2LMHeadModel, _GPT2),
    "gpt2_untied_gelu": (tr.GPT2Config, tr.GPT2LMHeadModel,
                         {**_GPT2, "tie_word_embeddings": False, "activation_function": "gelu"}),
}


def _randomize(model, seed=0):
    """Replace HF's small init with larger random weights so mismatches are visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(1.0 + noise if ("norm" in name or ".ln_" in name) and p.ndim == 1
                    and name.endswith("weight") else noise)
    return model


def _hf_model(case, path, seed=0, cases=None):
    """The transformers model of ``cases[case]`` (default: this file's CASES), randomized and
    saved to ``path``."""
    config_cls, model_cls, kw = (cases or CASES)[case]
    model = _randomize(model_cls(config_cls(**kw, attn_implementation="eager")).eval(), seed)
    model.save_pretrained(path)
    return model


def _hf_logits(model, toks, positions=None):
    with torch.no_grad():
        kw = {} if positions is None else {"position_ids": torch.tensor(np.asarray(positions))}
        return model(torch.tensor(np.asarray(toks)), **kw).logits.numpy()


def _load(path):
    return tr.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def check_parity_and_round_trip(model, path, offset: bool = True):
    """from_hf of the saved ``model`` (in ``path``/hf) gives its logits (positions from 0 and,
    with ``offset``, from 5), and to_hf writes what transformers loads with the same logits and
    from_hf reads back to the same config and parameters. Returns the config."""
    cfg, params = from_hf(path / "hf")
    toks = tokens()
    ref = _hf_logits(model, toks)
    fwd = jax.jit(lambda p, x, pos: forward(p, x, cfg, positions=pos))
    ours = fwd(params, toks, np.tile(np.arange(SEQ), (2, 1)))
    assert ours.shape == ref.shape
    assert max_diff(ours, ref) <= TOL

    positions = np.tile(np.arange(5, 5 + SEQ), (2, 1))
    if offset:
        assert max_diff(fwd(params, toks, positions), _hf_logits(model, toks, positions)) <= TOL

    to_hf(params, cfg, path / "out")
    assert max_diff(_hf_logits(_load(path / "out"), toks), ref) <= TOL
    cfg2, params2 = from_hf(path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    return cfg


def check_greedy_decode(model, path, new_tokens: int = 8):
    """``generate`` of the checkpoint in ``path`` picks transformers' greedy tokens."""
    cfg, params = from_hf(path)
    prompt = tokens(2, 6)
    with torch.no_grad():
        ref = model.generate(torch.tensor(np.asarray(prompt)), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(params, cfg, prompt, new_tokens)),
                                  ref[:, prompt.shape[1]:].numpy())


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_and_round_trip(case, tmp_path):
    check_parity_and_round_trip(_hf_model(case, tmp_path / "hf"), tmp_path)


@pytest.mark.slow
def test_sharded_checkpoint_and_scan_axis_0(tmp_path):
    config_cls, model_cls, kw = CASES["qwen3"]
    model = _randomize(model_cls(config_cls(**kw, attn_implementation="eager")).eval())
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, params = from_hf(tmp_path, param_scan_axis=0, scan_layers=False)
    assert params["layers"]["attn"]["wq"].shape == (2, 32, 4, 16)
    assert max_diff(forward(params, tokens(), cfg), _hf_logits(model, tokens())) <= TOL


@pytest.mark.parametrize("changes", [
    dict(rotary_interleaved=True, apply_layernorm_1p=True),
    dict(rotary_interleaved=True, qk_layernorm=True, kv_channels=16),
    dict(add_qkv_bias=True, rotary_interleaved=True, sliding_window=4),
    dict(add_bias_linear=True, use_rope_scaling=True, original_max_position_embeddings=16),
    dict(position_embedding_type="learned_absolute", normalization="LayerNorm",
         activation="gelu_tanh", gated_linear_unit=False, add_bias_linear=True,
         num_query_groups=4, untie_embeddings_and_output_weights=False, apply_layernorm_1p=True),
], ids=["interleaved_1p", "qwen3_interleaved", "qwen2_sliding", "llama_bias_llama3", "gpt2"])
def test_export_native_config(changes, tmp_path):
    """Configs built in jaxtrain export exactly, including layouts HF lacks (converted)."""
    cfg = tiny(**changes)
    params = random_params(cfg)
    to_hf(params, cfg, tmp_path)
    toks = tokens()
    ours = jax.jit(lambda p, x: forward(p, x, cfg))(params, toks)
    assert max_diff(ours, _hf_logits(_load(tmp_path), toks)) <= TOL


@pytest.mark.parametrize("field", ["qk_l2_norm", "final_logit_softcapping",
                                   "apply_residual_connection_post_layernorm"])
def test_export_rejects_unrepresentable(field):
    value = {"final_logit_softcapping": 30.0}.get(field, True)
    with pytest.raises(ValueError, match=field):
        hf_config(tiny(**{field: value}))


_BAD_CONFIGS = [
    ("llama", {"model_type": "falcon"}, "model_type"),
    ("llama", {"hidden_act": "xielu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 1.0,
                                   "attention_factor": 3.0}}, "attention_factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
               "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"activation_function": "tanh"}, "activation_function"),
    ("gpt2", {"embd_pdrop": 0.0, "resid_pdrop": 0.1}, "embd_pdrop"),
]


@pytest.mark.parametrize("case,patch,field", _BAD_CONFIGS,
                         ids=[f"{c}-{f}" for c, _, f in _BAD_CONFIGS])
def test_unsupported_config_values_raise(case, patch, field):
    config_cls, _, kw = CASES[case]
    hf = {**config_cls(**kw).to_dict(), **patch}
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf)


def test_unused_or_missing_tensors_raise(tmp_path):
    _hf_model("llama", tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)},
              tmp_path / "a" / "model.safetensors")
    with pytest.raises(ValueError, match="not used"):
        from_hf(tmp_path / "a")
    tensors.pop("model.norm.weight")
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        from_hf(tmp_path / "b")


def test_legacy_rope_scaling_field(tmp_path):
    """Pre-v5 config.json (rope_theta + rope_scaling) reads the same as rope_parameters."""
    hf = {**CASES["llama3_rope_scaling"][0](**CASES["llama3_rope_scaling"][2]).to_dict()}
    rp = hf.pop("rope_parameters")
    legacy = {**hf, "rope_theta": rp.pop("rope_theta"), "rope_scaling": rp}
    assert config_from_hf(legacy) == config_from_hf({**hf, "rope_parameters": {
        **rp, "rope_theta": legacy["rope_theta"]}})
    written = json.loads(json.dumps(legacy))
    assert config_from_hf(written).use_rope_scaling
