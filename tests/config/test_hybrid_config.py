"""Megatron's hybrid models from their knobs: the layer pattern (hybrid_layer_pattern, or the
ratios' allocation checked against megatron-core's own), num_layers derived from the pattern,
Primus's model_type mamba presets and their stack specs, the Mamba sizes, and what is refused
by name in the dry run."""
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig
from jaxtrain.models.from_knobs import pattern_from_ratios
from jaxtrain.models.params import abstract
from tests.megatron_ref import megatron_core

TINY = ["hidden_size=64", "num_attention_heads=4", "vocab_size=128", "seq_length=16",
        "max_position_embeddings=16", "mamba_head_dim=16", "mamba_state_dim=8",
        "mamba_num_groups=2", "bf16=false"]


def model(args, file=None):
    return ModelConfig.from_config(load_config(file, [*TINY, *args]))


@pytest.mark.parametrize("n", [1, 7, 24, 48, 52])
@pytest.mark.parametrize("attention, mlp", [(0.0, 0.0), (0.08, 0.0), (0.25, 0.0), (0.1, 0.5),
                                            (0.125, 0.4), (0.5, 0.5), (0.0, 0.3)])
def test_ratio_allocation_matches_megatron(n, attention, mlp):
    megatron_core()
    from megatron.core.ssm.mamba_hybrid_layer_allocation import _allocate_auto
    assert pattern_from_ratios(n, attention, mlp) == "".join(_allocate_auto(n, attention, mlp))


def test_pattern_gives_the_layers_and_num_layers():
    cfg = model(["hybrid_layer_pattern=M-M*-E", "num_experts=4", "moe_router_topk=2",
                 "moe_ffn_hidden_size=32"])
    assert cfg.hybrid_layers == "M-M*-E" and cfg.num_layers == 6
    assert cfg.mamba_heads == 2 * 64 // 16 and cfg.mamba_num_groups == 2
    tree = abstract(cfg)
    assert tree["mamba_layers"]["mamba"]["wx"].shape == (64, 2, 8, 16)   # [D, L, H, P]
    assert tree["mlp_layers"]["mlp"]["wo"].shape[1] == 2
    assert set(tree["attention_layers"]) == {"attn_norm", "attn"}
    assert set(tree["moe_mlp_layers"]) == {"mlp_norm", "moe"}


def test_ratios_without_a_pattern():
    cfg = model(["model_type=mamba", "num_layers=8", "hybrid_attention_ratio=0.25",
                 "hybrid_mlp_ratio=0.25"])
    assert cfg.hybrid_layers == pattern_from_ratios(8, 0.25, 0.25)
    assert set(cfg.hybrid_layers) == {"M", "*", "-"}
    assert model(["model_type=mamba", "num_layers=3"]).hybrid_layers == "MMM"


def test_pipe_cuts_are_dropped_and_mla_symbols_are_attention():
    assert model(["hybrid_layer_pattern=M-|M*"]).hybrid_layers == "M-M*"
    cfg = model(["hybrid_layer_pattern=M+", "multi_latent_attention=true", "q_lora_rank=32",
                 "kv_lora_rank=16", "qk_head_dim=16", "qk_pos_emb_head_dim=8", "v_head_dim=16"])
    assert cfg.hybrid_layers == "M*" and cfg.multi_latent_attention


def test_megatron_lm_command_line_without_num_layers():
    """Megatron-LM derives num_layers from --hybrid-layer-pattern (as its hybrid tests do)."""
    cfg = load_config(None, ["--hidden-size", "64", "--num-attention-heads", "4",
                             "--max-position-embeddings", "16", "--seq-length", "16",
                             "--hybrid-layer-pattern", "M-M*-", "--mamba-head-dim", "16",
                             "--spec", "megatron.core.models.hybrid.hybrid_layer_specs",
                             "hybrid_stack_spec", "--vocab-size", "128"])
    assert cfg["num_layers"] == 5
    assert ModelConfig.from_config(cfg).hybrid_layers == "M-M*-"


def test_primus_mamba_preset_with_its_stack_spec(write):
    write("primus/primus/configs/models/megatron/hybrid_tiny.yaml", """
        model_type: mamba
        num_layers: 4
        hidden_size: 64
        ffn_hidden_size: 128
        num_attention_heads: 4
        is_hybrid_model: true
        hybrid_override_pattern: "*-M-"
        mamba_state_dim: 8
        mamba_head_dim: 16
        mamba_num_groups: 2
        swiglu: true
        position_embedding_type: none
    """)
    exp = write("primus/examples/megatron/configs/MI300X/hybrid_tiny-pretrain.yaml", """
        work_group: amd
        user_name: root
        exp_name: hybrid
        workspace: ./output
        modules:
          pre_trainer:
            framework: megatron
            config: pre_trainer.yaml
            model: hybrid_tiny.yaml
            overrides:
              vocab_size: 128
              seq_length: 16
              max_position_embeddings: 16
              spec: ['primus.backends.megatron.core.models.hybrid.hybrid_mamba_mla_layer_specs',
                     'mamba_hybrid_stack_spec_no_te']
    """)
    write("primus/primus/configs/modules/megatron/pre_trainer.yaml", "train_iters: 100\n")
    cfg = ModelConfig.from_config(load_config(exp))
    assert cfg.hybrid_layers == "*-M-" and cfg.mamba_state_dim == 8


@pytest.mark.parametrize("args, says", [
    (["model_type=mamba", "num_layers=4", "use_short_conv=false",
      "spec=[primus.backends.megatron.core.models.hybrid.hybrid_mamba_mla_layer_specs,"
      "kda_hybrid_stack_spec]"], "Primus's KDA layers (kda_hybrid_stack_spec) always convolve"),
    (["model_type=mamba", "num_layers=4", "spec=[my.module,my_spec]"],
     "jaxtrain reads the hybrid stack specs"),
    (["num_layers=2", "spec=[megatron.core.models.gpt.gpt_layer_specs,x]"],
     "names a PyTorch module spec"),
    (["hybrid_layer_pattern=M*M*/MM/M*"], "every MTP depth after '/' must have the same"),
    (["hybrid_layer_pattern=MD"], "layers need multi_latent_attention and experimental"),
    (["hybrid_layer_pattern=MX"], "the symbols are M (Mamba)"),
    (["hybrid_layer_pattern=M*", "num_layers=3"], "names 2 layers and num_layers is 3"),
    (["hybrid_layer_pattern=M*E"], "has MoE layers (E) and the model has no MoE settings"),
    (["model_type=mamba", "num_layers=2", "mamba_num_groups=3"],
     "does not divide the 8 Mamba heads"),
])
def test_what_cannot_be_built_is_named(args, says):
    with pytest.raises((ConfigError, ValueError)) as e:
        model(args)
    assert says in str(e.value)


@pytest.mark.parametrize("extra, says", [
    ("tensor_model_parallel_size: 4\nmamba_num_groups: 2\n",
     "mamba_num_groups (2) must be divisible by tensor_model_parallel_size (4)"),
    ("hybrid_layer_pattern: 'M-|M*'\npipeline_model_parallel_size: 2\nnum_layers: 4\n",
     "its '|' pipeline cuts are not followed"),
    ("memory.seco: true\n", "not implemented yet: memory.seco with a hybrid model"),
])
def test_dry_run_refuses_what_cannot_run(write, cli, extra, says):
    path = write("run.yml", "model_type: mamba\nnum_layers: 4\nhidden_size: 64\n"
                 "num_attention_heads: 4\nvocab_size: 128\nseq_length: 16\n"
                 "max_position_embeddings: 16\nmock_data: true\nmicro_batch_size: 1\n"
                 "global_batch_size: 8\nmamba_head_dim: 16\nmamba_state_dim: 8\n"
                 "hardware: cpu\n" + extra)
    code, _, err = cli(path, "--dry-run", "--world-size", "8")
    assert code == 2 and says in err, err
    assert "Traceback" not in err


def test_dry_run_accepts_a_hybrid_config_with_tensor_and_pipeline_parallelism(write, cli):
    path = write("run.yml", "hybrid_layer_pattern: M-M*-E-M\nhidden_size: 64\n"
                 "num_attention_heads: 4\nvocab_size: 128\nseq_length: 16\n"
                 "max_position_embeddings: 16\nmock_data: true\nmicro_batch_size: 1\n"
                 "global_batch_size: 8\nmamba_head_dim: 16\nmamba_state_dim: 8\n"
                 "num_experts: 4\nmoe_router_topk: 2\ntensor_model_parallel_size: 2\n"
                 "pipeline_model_parallel_size: 2\nhardware: cpu\n")
    code, out, err = cli(path, "--dry-run", "--world-size", "8")
    assert code == 0, err


def test_mamba_knobs_reach_the_model():
    cfg = model(["model_type=mamba", "num_layers=2", "mamba_num_heads=4", "mamba_chunk_size=32",
                 "mamba_conv_kernel_dim=3", "mamba_norm_epsilon=1e-6",
                 "mamba_time_step_floor=0.01"])
    assert (cfg.mamba_heads, cfg.mamba_chunk_size, cfg.mamba_conv_kernel_dim) == (4, 32, 3)
    assert (cfg.mamba_norm_epsilon, cfg.mamba_dt_floor) == (1e-6, 0.01)
    assert abstract(cfg)["mamba_layers"]["mamba"]["conv_x"].shape[0] == 3


def test_training_ssm_states_dtype_reaches_the_scan():
    """mamba_training_ssm_states_dtype bf16 in an fp32 model rounds the states entering each
    chunk (training only); unset follows the compute dtype (Megatron's params dtype)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.models import forward, init

    base = ["model_type=mamba", "num_layers=2", "mamba_num_heads=4", "mamba_chunk_size=4",
            "hidden_dropout=0", "attention_dropout=0"]
    plain, bf16 = model(base), model([*base, "mamba_training_ssm_states_dtype=bf16"])
    assert plain.mamba_state_dtype is None and bf16.mamba_state_dtype == "bfloat16"
    assert model([*base, "mamba_training_ssm_states_dtype=fp32"]).mamba_state_dtype == "float32"
    params = init(plain, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    rng = jax.random.key(1)
    out = {name: np.asarray(forward(params, tokens, cfg, deterministic=False, rng=rng))
           for name, cfg in (("plain", plain), ("bf16", bf16))}
    assert 0 < np.abs(out["bf16"] - out["plain"]).max() < 0.05 * np.abs(out["plain"]).max()


def test_moe_statistics_count_the_moe_sublayers_only():
    """The train step's MoE accumulator holds one row per E sublayer (not per layer)."""
    from jaxtrain.models.moe.step import moe_layer_ids, zero_stats
    cfg = model(["hybrid_layer_pattern=M-E*EM", "num_experts=4", "moe_router_topk=2",
                 "moe_ffn_hidden_size=32", "moe_aux_loss_coeff=0.01"])
    assert moe_layer_ids(cfg) == (2, 4)
    assert zero_stats(cfg)["objective"].shape == (2,)


def test_lfm2_layer_kinds_from_primus_knobs():
    cfg = model(["num_layers=3", "lfm_layer_types=[conv,full_attention,conv]",
                 "conv_L_cache=4", "conv_bias=true"])
    assert cfg.short_conv_layers == (True, False, True)
    assert (cfg.short_conv_kernel, cfg.short_conv_bias) == (4, True)
    tree = abstract(cfg)
    assert tree["conv_layers"]["short_conv"]["conv"].shape == (4, 2, 64)   # [W, L, D]
    assert "b_in" in tree["conv_layers"]["short_conv"]
    with pytest.raises(ConfigError, match="are not layer kinds"):
        model(["num_layers=2", "lfm_layer_types=[conv,mamba]"])
    with pytest.raises(ValueError, match="names 2 layers of 3"):
        model(["num_layers=3", "lfm_layer_types=[conv,conv]"])


def test_lfm2_refuses_what_does_not_run_yet(write, cli):
    path = write("run.yml", "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                 "vocab_size: 128\nseq_length: 16\nmax_position_embeddings: 16\n"
                 "mock_data: true\nmicro_batch_size: 1\nglobal_batch_size: 8\nhardware: cpu\n"
                 "lfm_layer_types: [conv, full_attention]\nmemory.seco: true\n")
    code, _, err = cli(path, "--dry-run", "--world-size", "8")
    assert code == 2 and "with LFM2's short-convolution layers" in err, err



def test_primus_gdn_stack_spec_makes_the_m_layers_gated_deltanet():
    """Primus's gdn_hybrid_stack_spec fills the pattern's M slots with Gated DeltaNet layers,
    beside MLA attention (Zebra-Llama's GDN hybrids); it trains and decodes like the rest."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.models import decode, forward, init
    cfg = model(["model_type=mamba", "hybrid_layer_pattern=*-M-", "linear_num_key_heads=2",
                 "linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=8",
                 "gdn_chunk_size=4", "multi_latent_attention=true", "q_lora_rank=32",
                 "kv_lora_rank=16", "qk_head_dim=16", "qk_pos_emb_head_dim=8", "v_head_dim=16",
                 "spec=[primus.backends.megatron.core.models.hybrid."
                 "hybrid_mamba_mla_layer_specs,gdn_hybrid_stack_spec_no_te]"])
    assert cfg.hybrid_layers == "*-G-" and cfg.qk_layernorm
    params = init(cfg, jax.random.key(0))
    toks = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % 100
    logits = forward(params, toks, cfg)
    cache = decode.init_cache(cfg, 1, 16)
    last, cache = decode.prefill(params, cfg, toks[:, :8], cache)
    assert float(jnp.abs(last - logits[:, 7]).max()) < 1e-4
    for t in range(8, 12):
        last, cache = decode.decode_step(params, cfg, toks[:, t:t + 1], cache)
        assert float(jnp.abs(last - logits[:, t]).max()) < 1e-4



@pytest.mark.parametrize("n, ratio, want", [
    (32, 0.25, "*-M-M-M-" * 4), (24, 0.25, "*-M-M-M-" * 3), (32, 0.0, "M-" * 16),
    (20, 0.3, "*-M-M-" * 3 + "M-"), (12, 0.75, "*-*-" + "*-M-" * 2)])
def test_primus_hybrid_stack_allocation(n, ratio, want):
    """Primus's HybridStack (hybrid_mamba_mla_layer_specs) pairs every mixer with an MLP and
    leads each block with its attention pair (primus/backends/.../hybrid_block.py)."""
    from jaxtrain.models.from_knobs import primus_hybrid_pattern
    assert primus_hybrid_pattern(n, ratio) == want
    spec = ("spec=[primus.backends.megatron.core.models.hybrid.hybrid_mamba_mla_layer_specs,"
            "mamba_hybrid_stack_spec_no_te]")
    cfg = model(["model_type=mamba", f"num_layers={n}", f"hybrid_attention_ratio={ratio}",
                 spec])
    assert cfg.hybrid_layers == want


def test_fla_data_needs_its_cache_directory(monkeypatch):
    """use_fla_data alone leaves Megatron's dataset, as in Primus (its Zebra-Llama files set it
    with fla_cache_dir commented out); a cache directory, in the file or in the launcher's
    PRIMUS_FLA_CACHE_DIR (which Primus reads first, like PRIMUS_FLA_DATA), stops the run."""
    for name in ("PRIMUS_FLA_DATA", "PRIMUS_FLA_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert load_config(None, [*TINY, "use_fla_data=true"])["use_fla_data"] is True
    with pytest.raises(ConfigError, match="not implemented yet: fla_cache_dir"):
        load_config(None, [*TINY, "use_fla_data=true", "fla_cache_dir=/data/fla"])
    monkeypatch.setenv("PRIMUS_FLA_CACHE_DIR", "/data/fla")
    with pytest.raises(ConfigError, match="FLA-ordered data.*PRIMUS_FLA_CACHE_DIR='/data/fla'"):
        load_config(None, [*TINY, "use_fla_data=true"])
    load_config(None, [*TINY])
    monkeypatch.setenv("PRIMUS_FLA_DATA", "0")
    load_config(None, [*TINY, "use_fla_data=true"])
    monkeypatch.setenv("PRIMUS_FLA_DATA", "1")
    with pytest.raises(ConfigError, match="FLA-ordered data"):
        load_config(None, [*TINY])
