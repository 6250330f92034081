"""Subprocess for the context-parallel CLI test: 8 CPU devices, each named run trained for a few
steps through ``jaxtrain.train.main`` (the command line's entry), printing one JSON object of
their losses and gradient norms per step.

Models: ``plain`` (causal, grouped-query: 8 heads, 2 K/V groups), ``packed`` (multi-head,
documents packed with their own segments and positions, a sliding window of 5 and learnable
softmax sinks), ``moe`` (8 experts, top-2, expert bias), ``mla`` (multi-latent attention),
``hybrid`` (Mamba-2 and attention sublayers), ``gdn`` (Gated DeltaNet layers) and ``conv``
(LFM2's gated short convolutions), on packed documents, and ``v4`` (DeepSeek-V4's compressed
attention, hash routing and hyper-connections).
Each is trained with context parallelism off (the reference) and with every exchange at CP 2,
4, 8, with TP, FSDP and EP, with each token order, per-layer kinds and the flash kernel
(interpreted here).

``python context_cli_worker.py WORKDIR NAME,NAME,...``
"""
import contextlib
import io
import json
import pathlib
import sys

import jax

BASE = ["vocab_size=60", "tokenizer_type=NullTokenizer", "split=100,0,0", "seq_length=16",
        "max_position_embeddings=16", "num_layers=2", "hidden_size=64",
        "num_attention_heads=8", "micro_batch_size=1", "global_batch_size=16",
        "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0", "attention_dropout=0",
        "log_interval=1", "exp_name=run", "train_iters=4", "use_distributed_optimizer=false"]
MODELS = {
    "plain": ["group_query_attention=true", "num_query_groups=2"],
    "moe": ["num_experts=8", "moe_router_topk=2", "moe_ffn_hidden_size=32",
            "moe_aux_loss_coeff=0.01", "moe_z_loss_coeff=0.001",
            "moe_router_enable_expert_bias=true", "moe_router_score_function=sigmoid"],
    "mla": ["multi_latent_attention=true", "kv_lora_rank=16", "qk_head_dim=8",
            "qk_pos_emb_head_dim=4", "v_head_dim=8"],
    "packed": ["reset_attention_mask=true", "reset_position_ids=true", "window_size=[5,0]",
               "softmax_type=learnable"],
    # recurrent mixers (run in the tokens' natural order), on packed documents
    "hybrid": ["model_type=mamba", "num_layers=4", "hybrid_layer_pattern=M*-M",
               "mamba_num_heads=4", "mamba_head_dim=8", "mamba_num_groups=2",
               "mamba_state_dim=8", "mamba_chunk_size=4", "position_embedding_type=none",
               "reset_attention_mask=true", "reset_position_ids=true"],
    "gdn": ["experimental_attention_variant=gdn", "linear_attention_freq=2",
            "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8",
            "linear_value_head_dim=8", "linear_conv_kernel_dim=3", "gdn_chunk_size=4",
            "reset_attention_mask=true", "reset_position_ids=true"],
    "conv": ["num_layers=4", "lfm_layer_types=[conv,full_attention,conv,full_attention]",
             "conv_L_cache=3", "reset_attention_mask=true", "reset_position_ids=true"],
    "v4": ["model_type=deepseek_v4", "num_layers=4", "group_query_attention=true",
           "num_query_groups=1", "kv_channels=16", "qk_pos_emb_head_dim=8", "q_lora_rank=12",
           "o_groups=2", "o_lora_rank=8", "compress_ratios=[0,4,8,4]", "index_topk=2",
           "index_head_dim=12", "index_n_heads=4", "attn_sliding_window=6", "attn_sink=true",
           "hc_mult=2", "num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=16",
           "moe_router_score_function=sqrtsoftplus", "moe_router_enable_expert_bias=true",
           "num_hash_layers=2", "swiglu=true", "swiglu_limit=10.0",
           "position_embedding_type=rope", "normalization=RMSNorm"],
}


TP2 = "tensor_model_parallel_size=2"   # pads the vocabulary further: its own reference
HIER = "hierarchical_context_parallel_sizes"


def _cp(n, kind=None, *extra):
    return [f"context_parallel_size={n}", *([f"cp_comm_type={kind}"] if kind else []), *extra]


# name -> (model, options); each is compared with its model's CP 1 run, with tp2 in it
# (``reference``)
RUNS = {
    "plain_cp1": ("plain", []),
    "plain_cp2_p2p": ("plain", _cp(2, "p2p")),
    "plain_cp4_p2p": ("plain", _cp(4, "p2p")),
    "plain_cp8_p2p": ("plain", _cp(8, "p2p")),
    "plain_cp4_allgather": ("plain", _cp(4, "all_gather")),
    "plain_cp8_allgather": ("plain", _cp(8, "all_gather")),
    "plain_cp2_a2a": ("plain", _cp(2, "a2a")),
    "plain_tp2": ("plain", [TP2]),
    "plain_cp2_tp2_p2p": ("plain", _cp(2, "p2p", TP2, "sequence_parallel=false")),
    "plain_cp2_tp2_sp_allgather": ("plain", _cp(2, "all_gather", TP2, "sequence_parallel=true")),
    "plain_cp4_natural": ("plain", _cp(4, "p2p", "context_parallel_load_balance=false")),
    "plain_cp4_striped": ("plain", _cp(4, "p2p", "context_parallel_reorder_strategy=striped")),
    "plain_cp4_flash": ("plain", _cp(4, "p2p", "attention_backend=flash")),   # interpreted
    "moe_cp1": ("moe", []),
    "moe_cp4_p2p": ("moe", _cp(4, "p2p")),
    "moe_cp2_ep2_a2a": ("moe", _cp(2, "a2a", "expert_model_parallel_size=2")),
    "mla_cp1": ("mla", []),
    "mla_cp4_p2p": ("mla", _cp(4, "p2p")),
    "mla_cp2_a2a": ("mla", _cp(2, "a2a")),
    "packed_cp1": ("packed", []),
    "packed_cp2_p2p": ("packed", _cp(2, "p2p")),
    "packed_cp4_p2p": ("packed", _cp(4, "p2p")),
    "packed_cp8_p2p": ("packed", _cp(8, "p2p")),
    "packed_cp2_allgather": ("packed", _cp(2, "all_gather")),
    "packed_cp8_allgather": ("packed", _cp(8, "all_gather")),
    "packed_cp4_a2a": ("packed", _cp(4, "a2a")),
    "packed_cp8_a2a": ("packed", _cp(8, "a2a")),
    "packed_cp4_a2a_p2p": ("packed", _cp(4, "a2a+p2p", f"{HIER}=[2,2]")),
    "packed_cp8_a2a_p2p_2x4": ("packed", _cp(8, "a2a+p2p", f"{HIER}=[2,4]")),
    "packed_cp8_a2a_p2p_4x2": ("packed", _cp(8, "a2a+p2p", f"{HIER}=[4,2]")),
    "packed_cp2_fsdp": ("packed", _cp(2, "all_gather", "use_torch_fsdp2=true")),
    "packed_tp2": ("packed", [TP2]),
    "packed_cp2_tp2_a2a": ("packed", _cp(2, "a2a", TP2)),
    "packed_cp4_per_layer": ("packed", _cp(4, "[p2p,a2a]")),
    "hybrid_cp1": ("hybrid", []),
    "hybrid_cp2_p2p": ("hybrid", _cp(2, "p2p")),
    "hybrid_cp4_p2p": ("hybrid", _cp(4, "p2p")),
    "hybrid_cp4_natural": ("hybrid", _cp(4, "p2p", "context_parallel_load_balance=false")),
    "gdn_cp1": ("gdn", []),
    "gdn_cp4_p2p": ("gdn", _cp(4, "p2p")),
    "gdn_cp2_a2a": ("gdn", _cp(2, "a2a")),
    "conv_cp1": ("conv", []),
    "conv_cp4_p2p": ("conv", _cp(4, "p2p")),
    "v4_cp1": ("v4", []),
    "v4_cp2_p2p": ("v4", _cp(2, "p2p")),
    "v4_cp4_p2p": ("v4", _cp(4, "p2p")),
}


def reference(name: str) -> str:
    """The run a CP run must reproduce: its model without CP, with its tensor parallelism."""
    return f"{RUNS[name][0]}_{'tp2' if TP2 in RUNS[name][1] else 'cp1'}"


def _data(workdir: pathlib.Path) -> str:
    """An indexed dataset of short documents (1-11 tokens), so a 16-token sample packs several."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from tests.data import helpers

    prefix = workdir / "docs"
    if not prefix.with_suffix(".bin").exists():
        helpers.write_indexed(prefix, helpers.random_docs(400, vocab=60, lo=1, hi=12, seed=4))
    return str(prefix)


def run(workdir: pathlib.Path, name: str) -> dict:
    from jaxtrain.train import main

    model, extra = RUNS[name]
    args = [*BASE, *MODELS[model], f"data_path={_data(workdir)}",
            f"workspace={workdir / name}", *extra]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    if code != 0:
        raise SystemExit(f"{name}: exit {code}\n{err.getvalue()[-3000:]}")
    rows = [json.loads(r) for r in
            (workdir / name / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    work = pathlib.Path(sys.argv[1])
    print(json.dumps({n: run(work, n) for n in sys.argv[2].split(",")}))
