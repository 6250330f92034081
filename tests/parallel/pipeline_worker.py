"""Subprocess for the pipeline tests: 8 CPU devices.

``python pipeline_worker.py WORKDIR MODE:NAME,NAME ...`` prints one JSON object per name:

- ``grads``: the executor's loss and gradients for case NAME (schedule, ranks, ...) against
  autodiff of the unpipelined loss over the same microbatches (max relative difference);
- ``train``: losses and gradient norms of a few training steps of layout NAME (the loop);
- ``resume``: a run saved at step 2 with one pipeline size and resumed with another.
"""
import json
import logging
import pathlib
import sys

import jax

if __name__ == "__main__":   # its own process; a test importing TINY must not set devices
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import loop  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))

TINY = ["mock_data=true", "vocab_size=128", "make_vocab_size_divisible_by=32", "seq_length=8",
        "max_position_embeddings=8", "num_layers=4", "hidden_size=32", "num_attention_heads=4",
        "group_query_attention=true", "num_query_groups=2", "micro_batch_size=1",
        "global_batch_size=16", "lr_warmup_iters=0", "bf16=false", "hidden_dropout=0",
        "attention_dropout=0", "log_interval=1", "exp_name=run", "train_iters=3",
        "use_distributed_optimizer=false"]
PP2, PP4 = "pipeline_model_parallel_size=2", "pipeline_model_parallel_size=4"
CP2 = "context_parallel_size=2"
# MoE and dense layers alternating, router statistics and expert bias as in Megatron
MOE = ["num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=32", "moe_layer_freq=2",
       "moe_router_score_function=sigmoid", "moe_router_enable_expert_bias=true",
       "moe_aux_loss_coeff=0.01", "moe_z_loss_coeff=0.001"]
# Gemma 4's layers: every second layer global, with heads of its own shape (a stack of its own)
GEMMA4 = ["window_size=[3,0]", "window_attn_skip_freq=2", "global_kv_channels=16",
          "global_num_query_groups=1", "attention_k_eq_v=true", "global_rotary_percent=0.5",
          "v_norm=plain", "layer_scalar=true", "qk_layernorm=true",
          "position_embedding_type=rope"]
# Megatron's hybrid stack: Mamba, attention, MLP, MoE sublayers (each a stack of its own)
HYBRID = ["model_type=hybrid", "hybrid_layer_pattern=M*EM", "mamba_num_heads=4",
          "mamba_head_dim=8", "mamba_num_groups=2", "mamba_state_dim=8", "mamba_chunk_size=4",
          *MOE[:3], "moe_router_score_function=sigmoid", "moe_aux_loss_coeff=0.01"]
# LFM2: gated short convolutions between attention layers (stacks of their own), MoE after
# the first layer
LFM = ["lfm_layer_types=[conv,full_attention,conv,conv]", "conv_L_cache=3", "conv_bias=true",
       "qk_layernorm=true", *MOE[:3], "moe_layer_freq=[0,1,1,1]",
       "moe_router_score_function=sigmoid", "moe_router_enable_expert_bias=true"]
# multi-token prediction: two depths after the last stage (an MoE layer's with MOE)
MTP = ["mtp_num_layers=2", "mtp_loss_scaling_factor=0.3"]
# FP8 with delayed scaling (emulated on CPU): a per-layer amax history each stage moves on
FP8 = ["fp8=hybrid", "fp8_recipe=delayed", "fp8_amax_history_len=4"]
# tensorwise FP8 with the first and last layers kept in bf16 (per-layer switches)
FP8_KEEP = ["fp8=hybrid", "fp8_recipe=tensorwise", "first_last_layers_bf16=true",
            "num_layers_at_start_in_bf16=1", "num_layers_at_end_in_bf16=1"]
# Megatron's batch-size ramp: 8 rows for the first 16 samples, then 16 (4 steps)
RAMP = ["train_iters=null", "train_samples=48", "rampup_batch_size=[8,8,16]"]
# Megatron's global_aux_loss: token counts running over the step's microbatches
MOE_GLOBAL = [*MOE[:-3], "moe_router_score_function=softmax",
              "moe_router_load_balancing_type=global_aux_loss", "moe_aux_loss_coeff=0.01",
              "micro_batch_size=1"]

LAYOUTS = {
    "one": [],
    "pp2_table": [PP2, "debug_scheduler_table=true", "dump_pp_data=true", "train_iters=1"],
    "tp2": ["tensor_model_parallel_size=2"],
    "pp2": [PP2],
    "pp4": [PP4],
    "pp2_gpipe": [PP2, "pipeline_schedule=gpipe"],
    "pp2_vpp2": [PP2, "virtual_pipeline_model_parallel_size=2"],
    "pp4_zb": [PP4, "patch_zero_bubble=true"],
    "pp2_zb2": [PP2, "patch_zero_bubble=true", "zero_bubble_max_pending_backward=4"],
    "pp2_zbv": [PP2, "patch_primus_pipeline=true", "pp_algorithm=zbv-formatted"],
    "pp2_vhalf": [PP2, "patch_zero_bubble=true", "zero_bubble_v_schedule=true"],
    "pp2_1f1b_v": [PP2, "enable_1f1b_v=true"],
    "pp4_zbh_mem": [PP4, "patch_primus_pipeline=true", "pp_algorithm=zero-bubble-heuristic",
                    "pp_max_mem=2"],
    "pp2_tp2": [PP2, "tensor_model_parallel_size=2"],
    "pp2_tp2_sp": [PP2, "tensor_model_parallel_size=2", "sequence_parallel=true"],
    "pp2_vpp2_tp2": [PP2, "virtual_pipeline_model_parallel_size=2",
                     "tensor_model_parallel_size=2"],
    "pp2_fsdp": [PP2, "use_torch_fsdp2=true"],
    "pp2_zero1_recompute": [PP2, "use_distributed_optimizer=true", "recompute_granularity=full",
                            "recompute_method=uniform", "recompute_num_layers=1"],
    "pp4_uneven": [PP4, "decoder_first_pipeline_num_layers=2",
                   "decoder_last_pipeline_num_layers=0"],
    "pp2_layout": [PP2, "pipeline_model_parallel_layout=E|tt|t|tL"],
    "pp2_untied_gpipe": [PP2, "untie_embeddings_and_output_weights=true",
                         "pipeline_schedule=gpipe"],
    "one_untied": ["untie_embeddings_and_output_weights=true"],
    "moe": MOE,
    "moe_tp2": [*MOE, "tensor_model_parallel_size=2"],
    "moe_pp2": [*MOE, PP2],
    "moe_pp2_tp2_vpp2": [*MOE, PP2, "tensor_model_parallel_size=2",
                         "virtual_pipeline_model_parallel_size=2"],
    "moe_pp4_zb": [*MOE, PP4, "patch_zero_bubble=true"],
    "moe_ep2": [*MOE, "expert_model_parallel_size=2"],
    "moe_pp2_ep2": [*MOE, PP2, "expert_model_parallel_size=2"],
    "moe_pp2_ep2_a2a": [*MOE, PP2, "expert_model_parallel_size=2",
                        "moe_token_dispatcher_type=alltoall"],
    "moe_global": MOE_GLOBAL,
    # stages sharing one traced body that ends in an MoE layer (every layer, every second)
    "moe_global_all": [*MOE_GLOBAL, "moe_layer_freq=1"],
    "moe_global_all_pp2": [*MOE_GLOBAL, "moe_layer_freq=1", PP2, "micro_batch_size=2"],
    "moe_global_odd": [*MOE_GLOBAL, "moe_layer_freq=[0,1,0,1]"],
    "moe_global_odd_pp2": [*MOE_GLOBAL, "moe_layer_freq=[0,1,0,1]", PP2, "micro_batch_size=2"],
    "moe_global_pp2": [*MOE_GLOBAL, PP2, "micro_batch_size=2"],   # two microbatches, as PP 1
    "moe_global_pp4_zb": [*MOE_GLOBAL, PP4, "patch_zero_bubble=true", "micro_batch_size=4"],
    "moe_pp2_ep2_zbv": [*MOE, PP2, "expert_model_parallel_size=2",
                        "patch_primus_pipeline=true", "pp_algorithm=zbv-formatted"],
    "gemma4": GEMMA4,
    "gemma4_pp2": [*GEMMA4, PP2],
    "gemma4_pp2_vpp2_tp2": [*GEMMA4, PP2, "virtual_pipeline_model_parallel_size=2",
                            "tensor_model_parallel_size=2"],
    "hybrid": HYBRID,
    "hybrid_pp2": [*HYBRID, PP2],
    "hybrid_pp2_vpp2_tp2": [*HYBRID, PP2, "virtual_pipeline_model_parallel_size=2",
                            "tensor_model_parallel_size=2"],
    "mtp": MTP,
    "mtp_pp2": [*MTP, PP2],
    "mtp_pp2_vpp2_tp2": [*MTP, PP2, "virtual_pipeline_model_parallel_size=2",
                         "tensor_model_parallel_size=2"],
    "mtp_moe": [*MTP, *MOE[:-3], "moe_router_score_function=sigmoid",
                "moe_router_enable_expert_bias=true", "moe_aux_loss_coeff=0.01",
                "moe_layer_freq=1"],
}
LAYOUTS["mtp_moe_pp2"] = [*LAYOUTS["mtp_moe"], PP2]
# a layout giving the MTP layers rank 0's last stage (Megatron's mtp_standalone)
LAYOUTS["mtp_pp2_standalone"] = [*MTP, PP2, "pipeline_model_parallel_layout=Et|tt|tmm|L"]
# global_aux_loss over MoE MTP layers: the head carries their counts across microbatches
LAYOUTS["mtp_moe_global"] = [*MTP, *MOE_GLOBAL, "moe_layer_freq=1"]
LAYOUTS["mtp_moe_global_pp2"] = [*LAYOUTS["mtp_moe_global"], PP2, "micro_batch_size=2"]
LAYOUTS["lfm"] = LFM
# DeepSeek sparse attention: 4 of the 8 tokens kept per query, the indexer's KL loss trained
DSA = ["multi_latent_attention=true", "group_query_attention=false", "q_lora_rank=16",
       "kv_lora_rank=16", "qk_head_dim=8", "qk_pos_emb_head_dim=8", "v_head_dim=8",
       "experimental_attention_variant=dsa", "dsa_indexer_n_heads=4", "dsa_indexer_head_dim=16",
       "dsa_indexer_topk=4", "dsa_indexer_loss_coeff=0.1", "init_method_std=0.3"]
LAYOUTS |= {"dsa": DSA, "dsa_tp2": [*DSA, "tensor_model_parallel_size=2"],
            "dsa_pp2": [*DSA, PP2],
            "dsa_pp2_vpp2_tp2": [*DSA, PP2, "virtual_pipeline_model_parallel_size=2",
                                 "tensor_model_parallel_size=2"],
            # index sharing: layers 2 and 4 attend with the selection of layers 1 and 3
            "dsa_shared": [*DSA, "dsa_indexer_topk_freq=2", "dsa_indexer_skip_topk_offset=1"]}
LAYOUTS["dsa_shared_pp2"] = [*LAYOUTS["dsa_shared"], PP2]
# DeepSeek-V4: 2 streams between layers (hyper-connections), a window layer and compressing
# ones (CSA with its indexer loss, HCA), hash-routed first two MoE layers, one MTP depth
V4 = ["model_type=deepseek_v4", "group_query_attention=true", "num_query_groups=1",
      "kv_channels=16", "qk_pos_emb_head_dim=8", "q_lora_rank=12", "o_groups=2",
      "o_lora_rank=8", "compress_ratios=[0,4,8,4]", "index_topk=2", "index_head_dim=12",
      "index_n_heads=4", "attn_sliding_window=6", "attn_sink=true", "hc_mult=2",
      "num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=16",
      "moe_router_score_function=sqrtsoftplus", "moe_router_enable_expert_bias=true",
      "moe_aux_loss_coeff=0.01", "num_hash_layers=2", "swiglu=true", "swiglu_limit=10.0",
      "position_embedding_type=rope", "normalization=RMSNorm", "init_method_std=0.3"]
V4_KL = [*V4, "v4_indexer_distill_loss_coeff=0.1"]   # (the MTP layer has no indexer loss)
V4_MTP = [*V4, "mtp_num_layers=1"]
# Megatron's mHC: 3 streams averaged at the end
MHC = ["enable_mhc_connections=true", "mhc_num_residual_streams=3"]
LAYOUTS |= {"v4": V4_KL, "v4_pp2": [*V4_KL, PP2],
            "v4_pp2_vpp2_tp2": [*V4_KL, PP2, "virtual_pipeline_model_parallel_size=2",
                                "tensor_model_parallel_size=2"],
            "v4_mtp": V4_MTP, "v4_mtp_pp2_zb": [*V4_MTP, PP2, "patch_zero_bubble=true"],
            # Primus's launcher's kind of layout: the MTP layer on the last stage, uneven split
            "v4_mtp_pp2_layout": [*V4_MTP, PP2, "pipeline_model_parallel_layout=Et|tttmL"],
            "mhc": MHC, "mhc_pp2_vpp2": [*MHC, PP2, "virtual_pipeline_model_parallel_size=2"]}
# Qwen3-Next's layers: Gated DeltaNet and gated full attention alternating, MoE with a gated
# shared expert, packed sequences (the recurrent state resets at each document)
GDN = ["experimental_attention_variant=gdn", "linear_attention_freq=2",
       "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8",
       "linear_value_head_dim=8", "linear_conv_kernel_dim=3", "gdn_chunk_size=4",
       "attention_output_gate=true", "rotary_percent=0.5", "position_embedding_type=rope",
       *MOE[:3], "moe_layer_freq=1", "moe_shared_expert_intermediate_size=16",
       "moe_shared_expert_gate=true", "moe_aux_loss_coeff=0.01",
       "reset_attention_mask=true", "reset_position_ids=true", "eod_mask_loss=true"]
LAYOUTS |= {"gdn": GDN,
            "gdn_pp2_vpp2_tp2": [*GDN, PP2, "virtual_pipeline_model_parallel_size=2",
                                 "tensor_model_parallel_size=2"]}
# Kimi K3: KDA and gated NoPE MLA layers, attention residuals over blocks of 4 layers (the
# stages send the running sum and the summaries folded), SiTU, the stable latent MoE
K3 = ["model_type=kimi_k3", "num_layers=6", "group_query_attention=false",
      "num_query_groups=null", "kv_channels=8",
      "q_lora_rank=16", "kv_lora_rank=16", "qk_head_dim=8", "qk_pos_emb_head_dim=4",
      "v_head_dim=8", "linear_attention_freq=([1]*2+[0])*2", "linear_num_key_heads=2",
      "linear_num_value_heads=2", "linear_key_head_dim=8", "linear_value_head_dim=8",
      "linear_conv_kernel_dim=3", "kda_chunk_size=4", "attn_res_block_size=4",
      "use_te_activation_func=true", "activation_situ_beta=1.5",
      "activation_situ_linear_beta=2.0", "normalization=RMSNorm", "swiglu=true", *MOE[:3],
      "moe_layer_freq=[0]*1+[1]*5", "routed_expert_hidden_size=8", "latent_moe_use_norm=true",
      "moe_router_score_function=sigmoid", "moe_router_enable_expert_bias=true",
      "moe_aux_loss_coeff=0.01", "untie_embeddings_and_output_weights=true",
      "init_method_std=0.3"]
K3_QB = [*K3, "moe_router_bias_update_rule=quantile", "quantile_balancing_num_bins=32"]
K3_MTP = [*K3, "num_nextn_predict_layers=1"]
# stages [0,1) [1,4) [4,5) [5,6): one opens a block at its first layer
K3_LAYOUT = "pipeline_model_parallel_layout=Et|ttt|t|tL"
LAYOUTS |= {"k3": K3,
            "k3_pp2_layout_tp2": [*K3, PP2, K3_LAYOUT, "tensor_model_parallel_size=2"],
            "k3_qb": K3_QB, "k3_qb_pp2_zb": [*K3_QB, PP2, "patch_zero_bubble=true"],
            "k3_mtp": K3_MTP, "k3_mtp_pp2_layout": [*K3_MTP, PP2,
                                                    "pipeline_model_parallel_layout=Et|ttt|t|tmL"]}
# Megatron's quantile balancing: experts by logits - qb_beta, qb_beta from the quantiles
QB = [*MOE[:3], "moe_layer_freq=1", "moe_router_load_balancing_type=quantile_balancing",
      "moe_aux_loss_coeff=0", "moe_router_quantile_balancing_ema=0.5"]
LAYOUTS |= {"qb": QB, "qb_pp2_vpp2_tp2": [*QB, PP2, "virtual_pipeline_model_parallel_size=2",
                                          "tensor_model_parallel_size=2"],
            "qb_slow": [*QB, "moe_router_quantile_balancing_ema=0.9"]}   # the bias moves less
LAYOUTS["lfm_pp2_vpp2_tp2"] = [*LFM, PP2, "virtual_pipeline_model_parallel_size=2",
                               "tensor_model_parallel_size=2"]
LAYOUTS |= {
    "fp8": FP8,
    "fp8_pp2": [*FP8, PP2, "micro_batch_size=2"],          # two microbatches, as at PP 1
    "fp8_keep": FP8_KEEP,
    "fp8_keep_pp2": [*FP8_KEEP, PP2, "micro_batch_size=2"],
    "fp8_keep_pp4_zb": [*FP8_KEEP, PP4, "patch_zero_bubble=true", "micro_batch_size=4"],
    # every layer kept out of FP8: the pipelined run of the plain model
    "fp8_keep_all_pp2": [*FP8_KEEP[:3], "num_layers_at_start_in_bf16=2",
                         "num_layers_at_end_in_bf16=2", PP2],
    "dft": ["plugins.dft=true"],
    "dft_pp2": ["plugins.dft=true", PP2, "micro_batch_size=2"],
    "cadft_pp2_vpp2": ["plugins.cadft=true", PP2, "virtual_pipeline_model_parallel_size=2",
                       "micro_batch_size=2"],
    "cadft": ["plugins.cadft=true"],
    "ramp": RAMP,
    "pp2_ramp": [*RAMP, PP2],
    "pp2_vpp2_ramp": [*RAMP, PP2, "virtual_pipeline_model_parallel_size=2"],
    "tp2_dropout": ["tensor_model_parallel_size=2", "hidden_dropout=0.1",
                    "attention_dropout=0.1"],
    "pp2_dropout": [PP2, "hidden_dropout=0.1", "attention_dropout=0.1"],
    # context parallelism inside the stages (ranks in lockstep), each exchange strategy
    "pp2_cp2": [PP2, CP2],
    "pp2_vpp2_cp2_tp2": [PP2, "virtual_pipeline_model_parallel_size=2", CP2,
                         "tensor_model_parallel_size=2"],
    "pp2_cp2_a2a_zb": [PP2, CP2, "cp_comm_type=a2a", "patch_zero_bubble=true"],
    "pp2_cp2_allgather_gpipe": [PP2, CP2, "cp_comm_type=all_gather", "pipeline_schedule=gpipe"],
    "moe_pp2_cp2": [*MOE, PP2, CP2],
    # attention dropout: CP draws the unsplit attention's mask (the same rows per microbatch)
    "cp2_attn_dropout": [CP2, "attention_dropout=0.1"],
    "tp2_attn_dropout": ["tensor_model_parallel_size=2", "attention_dropout=0.1"],
    "pp2_cp2_attn_dropout": [PP2, CP2, "attention_dropout=0.1"],
    "pp2_tp2_attn_dropout": [PP2, "tensor_model_parallel_size=2", "attention_dropout=0.1"],
}

# in-process cases: (schedule, ranks, chunks, untied, hidden dropout, attention dropout,
# tensor-parallel size); the rest of the 8 devices split the batch
GRADS = {
    "1f1b_p2": ("1f1b", 2, 1, False, 0.0, 0.0, 1),
    "gpipe_p4_untied": ("gpipe", 4, 1, True, 0.0, 0.0, 1),
    "interleaved_p2": ("1f1b-interleaved", 2, 2, False, 0.0, 0.0, 1),
    "interleaved_p4": ("1f1b-interleaved", 4, 2, True, 0.0, 0.0, 1),
    "zbh1_p4": ("zb-h1", 4, 1, False, 0.0, 0.0, 1),
    "zbh2_p2": ("zb-h2", 2, 1, True, 0.0, 0.0, 1),
    "zbv_p2": ("zbv", 2, 2, False, 0.0, 0.0, 1),
    "zbv_p4": ("zbv", 4, 2, True, 0.0, 0.0, 1),
    "v1f1b_p2": ("1f1b-v", 2, 2, False, 0.0, 0.0, 1),
    "v1f1b_p4": ("1f1b-v", 4, 2, True, 0.0, 0.0, 1),
    "1f1b_p2_dropout": ("1f1b", 2, 1, True, 0.1, 0.1, 1),
    "zbh1_p2_tp2_dropout": ("zb-h1", 2, 1, False, 0.1, 0.1, 2),
    # MoE layers alternating with dense ones: the load-balancing objective joins the loss
    "moe_1f1b_p2": ("1f1b", 2, 1, False, 0.0, 0.0, 1),
    "moe_zbh1_p4": ("zb-h1", 4, 1, True, 0.0, 0.0, 1),
    "moe_interleaved_p2_tp2": ("1f1b-interleaved", 2, 2, False, 0.0, 0.0, 2),
    "moe_gpipe_p4": ("gpipe", 4, 1, False, 0.0, 0.0, 1),
    "moe_zbh2_p2_tp2": ("zb-h2", 2, 1, True, 0.0, 0.0, 2),
    "moe_zbv_p2": ("zbv", 2, 2, False, 0.0, 0.0, 1),
}
MOE_MODEL = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 moe_layer_freq=2, moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01,
                 moe_z_loss_coeff=0.001)


def grads(name: str) -> dict:
    """The executor's loss and gradients against autodiff of the unpipelined loss on the same
    mesh (max relative difference per parameter)."""
    from model_helpers import random_params, tiny, tokens

    from jaxtrain.loss import model_loss
    from jaxtrain.models import moe
    from jaxtrain.parallel import pipeline, schedules, stages
    from jaxtrain.parallel.mesh import MeshConfig, make_mesh
    from jaxtrain.parallel.sharding import Layout

    schedule, p, v, untied, hd, ad, tp = GRADS[name]
    dp = 8 // p // tp
    L, M, B, T = 8, 4, 4, 16
    if name.startswith("moe"):
        from jaxtrain import models

        cfg = models.ModelConfig.from_config(dict(
            hidden_size=32, num_attention_heads=4, num_layers=L, vocab_size=97, seq_length=T,
            max_position_embeddings=T, normalization="RMSNorm", hidden_dropout=hd,
            attention_dropout=ad, make_vocab_size_divisible_by=1, bf16=False, dtype="float32",
            weight_dtype="float32",
            untie_embeddings_and_output_weights=untied, **MOE_MODEL))
    else:
        cfg = tiny(num_layers=L, hidden_dropout=hd, attention_dropout=ad,
                   untie_embeddings_and_output_weights=untied)
    params = random_params(cfg)
    batch = {"tokens": jnp.stack([tokens(B, T, seed=i) for i in range(M)]),
             "targets": jnp.stack([tokens(B, T, seed=10 + i) for i in range(M)])}
    w = jnp.ones((M, B, T), jnp.float32) / (M * B * T)
    rng = jax.random.key(0)

    mcfg = MeshConfig(pipeline=p, data=dp, tensor=tp)
    layout = Layout(make_mesh(mcfg, jax.devices()[:p * dp * tp]), mcfg)
    # the reference runs on the same mesh, unpipelined (GSPMD): the batch split as the
    # pipeline's ranks split it (the MoE dispatch runs per data-parallel shard)
    ref_layout = layout

    def plain(params):
        """Σ over microbatches of the loss plus the MoE objective / M, as the train step."""
        with ref_layout.activations():
            return _plain(params)

    def _plain(params):
        total = 0.0
        for i in range(M):
            lm, stats = model_loss(params, jax.tree.map(lambda a: a[i], batch), w[i], cfg,
                                   train=True, rng=jax.random.fold_in(rng, i),
                                   grad_in_forward=True)
            total = total + lm + (0.0 if stats is None else jnp.sum(stats["objective"]) / M)
        return total

    bounds = stages.bounds(stages.stage_layers({}, L, p, v))
    prog = pipeline.lower(schedules.build(schedule, p, M, v), cfg, bounds)

    def piped(params):
        def split(q):
            return pipeline.split_params(q, cfg, prog.schedule, bounds)

        sp, shared = split(params)
        with layout.activations():
            gst, gsh, loss, _, _, _, _ = pipeline.accumulate(
                prog, layout, cfg, stacks=sp, shared=shared, batch=batch, weights_MBT=w,
                step_rng=rng, scale=1.0, num_chunks=1, half_precision=False,
                accum_dtype=jnp.float32, moe0=moe.zero_stats(cfg))
        (g,) = jax.linear_transpose(split, params)((gst, gsh))
        return loss, g

    want_loss, want = jax.jit(jax.value_and_grad(plain))(params)
    loss, got = jax.jit(piped)(params)
    if name.startswith("moe"):   # compare the language-model loss alone

        def lm(params):
            with ref_layout.activations():
                return sum(model_loss(params, jax.tree.map(lambda a: a[i], batch), w[i], cfg,
                                      train=True, rng=jax.random.fold_in(rng, i))[0]
                           for i in range(M))

        want_loss = jax.jit(lm)(params)
    rel = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30)),
                       jax.device_get(want), jax.device_get(got))
    return {"loss": float(loss), "want_loss": float(want_loss),
            "max_rel": max(jax.tree.leaves(rel)), "ticks": prog.ticks,
            "x_slots": prog.x_slots}


def _rows(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(r) for r in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]


def train(workdir: pathlib.Path, name: str) -> dict:
    """Losses and gradient norms, and the sharding of the stacked query weights (layer axis
    split over the pipeline ranks when there are several)."""
    delayed = "fp8_recipe=delayed" in LAYOUTS[name]
    ckpt = workdir / name / "ckpt"
    saving = [f"save={ckpt}", "save_interval=3"] if delayed else []
    cfg = load_config(None, [*TINY, f"workspace={workdir / name}", *LAYOUTS[name], *saving],
                      world_size=8)
    run = loop.build(cfg, jax.devices(), materialize=False)
    stack = next(k for k in ("layers", "attention_layers", "moe_layers", "conv_layers")
                 if k in run.shardings.params)
    attn = run.shardings.params[stack]["attn"]
    spec = attn.get("wq", attn.get("wq_b")).spec
    loop.train(cfg, devices=jax.devices())
    rows = (_rows(workdir / name) if not delayed else   # saving: the run directory is ckpt
            [json.loads(r) for r in (ckpt / "metrics.jsonl").read_text().splitlines()])
    dump = workdir / name / "run" / "pp_schedule.json"
    history = None
    if delayed:   # the FP8 amax histories the run saved: per layer, the entries filled
        import orbax.checkpoint as ocp
        state = ocp.PyTreeCheckpointer().restore(ckpt / "step_3" / "fp8")
        amax = np.asarray(state["layers"]["attn"]["wq"]["x"]["amax_history"])
        history = (amax > 0).sum(axis=1).tolist()
    return {"pp_schedule": json.loads(dump.read_text()) if dump.exists() else None,
            "fp8_history": history,
            "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
            "moe_aux_loss": [r.get("moe_aux_loss") for r in rows],
            "moe_global_aux_loss": [r.get("moe_global_aux_loss") for r in rows],
            "mtp_losses": [[r.get("mtp_1_loss"), r.get("mtp_2_loss")] for r in rows],
            "indexer_loss": [r.get("indexer_loss") for r in rows],
            "wq_spec": [list(a) if isinstance(a, tuple) else a for a in spec],
            "mesh": dict(run.layout.mesh.shape)}


def resume(workdir: pathlib.Path, name: str) -> dict:
    """NAME = SAVED-LOADED layouts: train 2 of 4 steps with SAVED, then 2 more with LOADED."""
    saved, loaded = name.split("-")
    ckpt = workdir / name / "ckpt"
    common = ["train_iters=4", f"save={ckpt}", "save_interval=2", "finetune=false"]
    first = load_config(None, [*TINY, f"workspace={workdir / name / 'a'}", *LAYOUTS[saved],
                               *common, "exit_interval=2"], world_size=8)
    loop.train(first, devices=jax.devices())
    second = load_config(None, [*TINY, f"workspace={workdir / name / 'b'}", *LAYOUTS[loaded],
                                *common, f"load={ckpt}"], world_size=8)
    loop.train(second, devices=jax.devices())
    rows = [json.loads(r) for r in (ckpt / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "steps": [r["step"] for r in rows]}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
    out = {}
    root = pathlib.Path(sys.argv[1])
    for arg in sys.argv[2:]:
        mode, names = arg.split(":")
        for name in names.split(","):
            if mode == "grads":
                out[name] = grads(name)
            elif mode == "train":
                out[name] = train(root, name)
            else:
                out[name] = resume(root, name)
    print(json.dumps(out))
