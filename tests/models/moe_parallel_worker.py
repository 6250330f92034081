"""Subprocess for test_moe_parallel.py: the MoE model's loss, router statistics and gradients
under meshes of 8 CPU devices, for several dispatch variants. Prints one JSON object."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models import ModelConfig, init
from jaxtrain.models.moe import MoEConfig
from jaxtrain.models.quant_state import init_state
from jaxtrain.models.transformer import hidden_states
from jaxtrain.parallel.mesh import MeshConfig, make_mesh
from jaxtrain.parallel.sharding import Layout
from jaxtrain.quant import QuantConfig

MOE = dict(num_experts=8, topk=2, shared_expert_size=16, z_loss_coeff=1e-3,
           load_balancing=("aux_loss", "seq_aux_loss", "global_aux_loss"),
           aux_loss_coeff=(0.01, 0.01, 0.01))
VARIANTS = {"dropless": {}, "alltoall": dict(dispatcher="alltoall"),
            "capacity": dict(capacity_factor=1.0),
            "padded": dict(capacity_factor=1.0, pad_to_capacity=True),
            "padded_alltoall": dict(capacity_factor=1.0, pad_to_capacity=True,
                                    dispatcher="alltoall"),
            "position": dict(capacity_factor=0.5, drop_policy="position"),
            "etp1": dict(expert_tensor_parallel=False),
            "fp8": {}, "fp8_alltoall": dict(dispatcher="alltoall"),
            "fp8_padded": dict(capacity_factor=1.0, pad_to_capacity=True),
            "latent": dict(latent_size=16, dispatcher="alltoall"),
            "qb": dict(load_balancing=("quantile_balancing",), aux_loss_coeff=(0.0,),
                       dispatcher="alltoall")}
# fp8 variants: hybrid delayed scaling with its state (the new state is compared too)
FP8 = QuantConfig("delayed", "e4m3", "e4m3", "e5m2", history_len=4)
MESHES = {"dp8": dict(data=8), "ep2": dict(data=4, expert=2), "ep4": dict(data=2, expert=4),
          "ep8": dict(expert=8), "tp2": dict(data=4, tensor=2),
          "ep2_tp2": dict(data=2, expert=2, tensor=2),
          "ep2_cp2": dict(data=2, expert=2, context=2)}


# DeepSeek-V4 (compressed attention of every kind, hash routing, mHC with its head, clamps)
V4 = dict(num_layers=4, num_query_groups=1, kv_channels=16, q_lora_rank=12,
          qk_pos_emb_head_dim=8, compress_ratios=(0, 4, 8, 4), o_groups=2, o_lora_rank=8,
          compress_index_heads=4, compress_index_head_dim=12, compress_index_topk=2,
          sliding_window=6, attention_sinks=True, hc_streams=2, hc_head=True, glu_clamp=2.0,
          norm_epsilon=1e-6)


# Kimi K3 (KDA layers with the bounded decay and full-rank gate, gated NoPE MLA, attention
# residuals over blocks of 2 layers, SiTU, the stable latent MoE)
K3 = dict(num_layers=4, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16,
          qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, mla_nope=True, qk_layernorm=True,
          mla_latent_norm_epsilon=1e-6, attention_output_gate=True,
          position_embedding_type="none", linear_attention_layers=(True, False, True, False),
          linear_attention_kind="kda", linear_num_key_heads=2, linear_num_value_heads=2,
          linear_key_head_dim=8, linear_value_head_dim=8, linear_chunk_size=4,
          kda_gate_lower_bound=-5.0, kda_full_rank_gate=True, attn_res_block_size=2,
          situ_beta=1.5, situ_linear_beta=2.0)


def run(variant: str, mesh: str) -> dict:
    v4, serial, k3 = variant == "v4", variant == "serial", variant.startswith("k3")
    moe = dict(MOE, score_function="sqrtsoftplus", expert_bias=True, hash_layers=2,
               load_balancing=("seq_aux_loss",), aux_loss_coeff=(0.01,)) if v4 else dict(
        MOE, shared_expert_size=None) if serial else dict(
        MOE, score_function="sigmoid", expert_bias=True, latent_size=16, latent_norm=True,
        layer_freq=(0, 1, 1, 1), bias_rule="quantile" if variant == "k3_qb" else "sign",
        k3_bins=32) if k3 else dict(MOE, **VARIANTS[variant])
    cfg = ModelConfig(num_layers=4 if k3 else 2, hidden_size=32, num_attention_heads=4,
                      ffn_hidden_size=64,
                      vocab_size=97, moe=MoEConfig(**moe),
                      quant=FP8 if variant.startswith("fp8") else None)
    if v4:
        cfg = cfg.replace(**V4)
    if k3:
        cfg = cfg.replace(**K3)
    if serial:   # MaxText's qwen3_custom_moe layer: attention into the MoE layer at width 24
        cfg = cfg.replace(attention_output_dim=24, qk_layernorm=True)
    params, qstate = init(cfg, jax.random.key(0)), init_state(cfg)
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 97, (8, 16)), jnp.int32)
    mc = MeshConfig(**MESHES[mesh])
    layout = Layout(make_mesh(mc), mc)

    def loss(p, q):
        h, st = hidden_states(p, toks, cfg, deterministic=False, rng=jax.random.key(3),
                              with_moe_stats=True, quant_state=q)
        return jnp.mean(h * h) + jnp.sum(st["objective"]), st

    def step(p, q):
        with layout.activations():
            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, q)

    (value, stats), grads = jax.jit(step)(params, qstate)
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(t)])  # noqa: E731
    return {"value": float(value), "stats": flat(stats).tolist(), "grads": flat(grads).tolist()}


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_default_matmul_precision", "highest")
    out = {}
    for pair in sys.argv[1:]:
        variant, mesh = pair.split(":")
        out[pair] = run(variant, mesh)
    print(json.dumps(out))
