"""What the Hugging Face families share: the adapter record, checkpoint tensors in and out, the
RoPE fields of config.json, the per-expert MoE layout and the export check.

Legend: D hidden, N query heads, K kv heads, H head dim, F ffn hidden, E experts, R rotary dim.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import safetensors_files
from jaxtrain.models.layers import yarn_attention_factor
from jaxtrain.models.params import layer_slots

# jaxtrain activation -> HF hidden_act (the other direction is the config translation's,
# jaxtrain/config/dialects/hf.py).
ACT_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu",
          "quick_gelu": "quick_gelu", "squared_relu": "relu2"}
# Buffers some checkpoints carry that no model reads.
IGNORED_TENSORS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# jaxtrain's gated-MLP leaves and their checkpoint names.
GATED_MLP = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))
# Expert tensor order of jaxtrain's expert tree (gate, up, down).
EXPERT_LEAVES = ("wi_0", "wi_1", "wo")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One module's families: how a checkpoint of theirs becomes a jaxtrain model and back.

    ``architectures``: model_type -> the ``architectures`` class config.json names.
    ``picks(cfg)``: the family of these that reproduces ``cfg`` most directly, or None (the
    next adapter in :data:`jaxtrain.models.hf.ADAPTERS` is asked).
    ``params(t, cfg, hf)``: the parameter tree from checkpoint tensors (:class:`Tensors`).
    ``problems(cfg, family)``: ModelConfig fields -> True where the family has no equivalent.
    ``config(cfg, family)``: config.json entries beyond :func:`common_config`.
    ``tensors(params, cfg, family)``: checkpoint tensors (HF names -> numpy arrays).
    config.json -> ModelConfig is the config translation's (config/dialects/hf.py), shared with
    the pgs ``model.name_or_path`` dialect so that both read each field alike.
    """

    architectures: Mapping[str, str]
    picks: Callable[[ModelConfig], str | None]
    params: Callable[["Tensors", ModelConfig, dict], dict]
    problems: Callable[[ModelConfig, str], dict]
    config: Callable[[ModelConfig, str], dict]
    tensors: Callable[[dict, ModelConfig, str], dict]

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(self.architectures)


def check(problems: Mapping[str, bool], family: str):
    """Raise ValueError naming the fields ``family`` cannot express."""
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ValueError(f"cannot export to HF {family!r}: ModelConfig fields {bad} have no "
                         "equivalent there")


def common_config(cfg: ModelConfig, family: str, architecture: str) -> dict:
    """The config.json entries every family writes. No padding token: that is the tokenizer's,
    and some config classes' defaults (Phi-3's 32000, SmolLM3's 128004) lie past a smaller
    vocabulary, which transformers then refuses to load."""
    return {"model_type": family, "vocab_size": cfg.vocab_size, "pad_token_id": None,
            "initializer_range": cfg.init_method_std,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "architectures": [architecture]}


def size_config(cfg: ModelConfig) -> dict:
    """The config.json sizes the dense attention families (Llama, Gemma, OLMo) share."""
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_hidden_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_epsilon, "attention_dropout": cfg.attention_dropout}


# ---------------------------------------------------------------- checkpoint tensors in

def read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Tensor name -> memory-mapped array of the checkpoint in ``path`` (read lazily)."""
    return safetensors_files.read(pathlib.Path(path))


class Tensors:
    """Checkpoint tensors taken one by one; ``done()`` rejects any left unconsumed."""

    def __init__(self, tensors: dict):
        self.left = dict(tensors)

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.left:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        return self.left.pop(name)

    def drop(self, name: str):
        self.left.pop(name, None)

    def done(self):
        rest = [k for k in self.left if not k.endswith(IGNORED_TENSORS)]
        if rest:
            raise ValueError(f"checkpoint tensors not used by the model: {sorted(rest)[:8]}")


def stack_layers(make, cfg) -> dict:
    """Per-layer numpy trees stacked on ``param_scan_axis``."""
    per_layer = [make(i) for i in range(cfg.num_layers)]
    return jax.tree.map(lambda *xs: np.stack(xs, cfg.param_scan_axis), *per_layer)


def stacks(make, cfg) -> dict:
    """Per-layer numpy trees stacked on ``param_scan_axis``, dense and MoE layers apart
    ('layers', 'moe_layers'; see params.layer_kinds)."""
    per_kind: dict[str, list] = {}
    for i, (kind, _) in enumerate(layer_slots(cfg)):
        per_kind.setdefault(kind, []).append(make(i))
    return {kind: jax.tree.map(lambda *xs: np.stack(xs, cfg.param_scan_axis), *trees)
            for kind, trees in per_kind.items()}


def output_head(t: Tensors, cfg, params: dict) -> dict:
    """The untied output head [D, V], or the tied checkpoint's lm_head dropped."""
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = t("lm_head.weight").T
    else:
        t.drop("lm_head.weight")
    return params


def experts_in(t: Tensors, base: str, cfg, names: tuple[str, str, str]) -> dict:
    """One MoE layer's router and experts under ``base`` from either checkpoint layout: per
    expert (``experts.{e}.<gate/up/down>.weight``, what save_pretrained writes; ``names`` are
    the three) or fused (``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F])."""
    if base + "experts.gate_up_proj" in t.left:
        gate_up = t(base + "experts.gate_up_proj")
        F = gate_up.shape[1] // 2
        experts = {"wi_0": gate_up[:, :F].transpose(0, 2, 1),
                   "wi_1": gate_up[:, F:].transpose(0, 2, 1),
                   "wo": t(base + "experts.down_proj").transpose(0, 2, 1)}
    else:
        w = lambda e, n: t(f"{base}experts.{e}.{n}.weight").T  # noqa: E731
        experts = {ours: np.stack([w(e, n) for e in range(cfg.moe.num_experts)])
                   for ours, n in zip(EXPERT_LEAVES, names)}
    return {"router": {"w": t(base + "gate.weight").T}, "experts": experts}


def projections_in(t: Tensors, pre: str, cfg) -> dict:
    """A layer's bias-free q/k/v/o projections and gated MLP (``self_attn.*_proj``,
    ``mlp.{gate,up,down}_proj``) in jaxtrain's shapes: {attn: {wq, wk, wv, wo}, mlp}."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    w = lambda n: t(pre + n + ".weight").T  # noqa: E731  HF Linear [out, in] -> [in, out]
    return {"attn": {"wq": w("self_attn.q_proj").reshape(D, N, H),
                     "wk": w("self_attn.k_proj").reshape(D, K, H),
                     "wv": w("self_attn.v_proj").reshape(D, K, H),
                     "wo": w("self_attn.o_proj").reshape(N, H, D)},
            "mlp": {ours: w(f"mlp.{theirs}") for ours, theirs in GATED_MLP}}


# ---------------------------------------------------------------- checkpoint tensors out

def ends_out(params: dict, cfg, norm=None, embedding: str = "model.embed_tokens.weight",
             final_norm: str = "model.norm.weight") -> dict[str, np.ndarray]:
    """The embedding, the final norm (``norm(tree, cfg)``, default :func:`norm_scale`) and an
    untied output head, by default in the Llama-layout names."""
    out = {embedding: np.asarray(params["embedding"]),
           final_norm: (norm or norm_scale)(params["final_norm"], cfg)}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = np.asarray(params["output"]).T
    return out


def projections_out(p: dict, pre: str, cfg) -> dict[str, np.ndarray]:
    """The inverse of :func:`projections_in` for layer tree ``p``."""
    a, m = p["attn"], p["mlp"]
    out = {pre + f"self_attn.{n}_proj.weight": hf_linear(a[f"w{n}"]) for n in ("q", "k", "v")}
    out[pre + "self_attn.o_proj.weight"] = np.asarray(a["wo"]).reshape(-1, cfg.hidden_size).T
    out.update({pre + f"mlp.{theirs}.weight": hf_linear(m[ours]) for ours, theirs in GATED_MLP})
    return out


def hf_linear(w) -> np.ndarray:
    """[in, ...out] -> HF Linear [out, in]."""
    w = np.asarray(w)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def norm_scale(p: dict, cfg) -> np.ndarray:
    """A norm's HF weight: zero-centred scales (apply_layernorm_1p) are written as 1 + scale."""
    return np.asarray(p["scale"]) + 1 if cfg.apply_layernorm_1p else np.asarray(p["scale"])


def experts_out(p: dict, base: str, names: tuple[str, str, str]) -> dict[str, np.ndarray]:
    """One MoE layer in the per-expert layout that save_pretrained writes."""
    out = {base + "gate.weight": np.asarray(p["router"]["w"]).T}
    for ours, theirs in zip(EXPERT_LEAVES, names):
        for e, w in enumerate(np.asarray(p["experts"][ours])):
            out[f"{base}experts.{e}.{theirs}.weight"] = w.T
    return out


def rope_permutation(cfg) -> np.ndarray:
    """Head-dim order that turns interleaved RoPE pairs (2i, 2i+1) into HF's (i, i + R/2)."""
    R, H = cfg.rotary_dim, cfg.head_dim
    perm = np.arange(H)
    if cfg.rotary_interleaved:
        perm[:R] = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])
    return perm


# ---------------------------------------------------------------- config.json out

def rope_config(cfg) -> dict:
    """rope_theta and rope_scaling (llama3, yarn or linear) for ``cfg``."""
    out: dict[str, Any] = {"rope_theta": cfg.rotary_base, "rope_scaling": None}
    if cfg.use_rope_scaling:
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings":
                                   cfg.original_max_position_embeddings}
    elif cfg.rope_type == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.yarn_scaling_factor,
                               "original_max_position_embeddings":
                                   cfg.original_max_position_embeddings,
                               "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                               "truncate": cfg.yarn_truncate}
        if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
            out["rope_scaling"].update(mscale=cfg.yarn_mscale,
                                       mscale_all_dim=cfg.yarn_mscale_all_dim)
        elif cfg.yarn_mscale != 1.0:
            out["rope_scaling"]["attention_factor"] = yarn_attention_factor(
                cfg.yarn_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)
    elif cfg.rotary_seq_len_interpolation_factor:
        out["rope_scaling"] = {"rope_type": "linear",
                               "factor": cfg.rotary_seq_len_interpolation_factor}
    return out


def dense_problems(cfg: ModelConfig, *, rope: bool, qk_norm: bool, qkv_only_bias: bool,
                   bias_linear: bool | None, windows: bool, mha: bool, moe: bool) -> dict:
    """Fields a dense-attention family cannot express: ``rope`` (RoPE, RMSNorm, gated MLP) or
    learned positions with LayerNorm and a plain MLP; the family's q/k norm, q/k/v-only bias,
    all-linear bias (None: either), whether it has sliding windows, multi-head attention only
    (``mha``) and MoE layers."""
    qkv_only = cfg.add_qkv_bias and not cfg.add_bias_linear
    return {
        "position_embedding_type": cfg.position_embedding_type != ("rope" if rope else
                                                                   "learned_absolute"),
        "normalization": cfg.normalization != ("RMSNorm" if rope else "LayerNorm"),
        "gated_linear_unit": cfg.gated_linear_unit != rope,
        "activation": cfg.activation not in ACT_HF,
        "rotary_percent": rope and cfg.rotary_percent != 1.0,
        "rotary_seq_len_interpolation_factor": bool(cfg.rotary_seq_len_interpolation_factor)
        and (cfg.use_rope_scaling or cfg.rope_type == "yarn"),
        "qk_l2_norm": cfg.qk_l2_norm,
        "qk_layernorm": cfg.qk_layernorm != qk_norm,
        "attn_logit_softcapping": bool(cfg.attn_logit_softcapping),
        "final_logit_softcapping": bool(cfg.final_logit_softcapping),
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "sliding_window": bool(cfg.sliding_window) and not windows,
        "add_bias_linear": bias_linear is not None and cfg.add_bias_linear != bias_linear,
        "add_qkv_bias": qkv_only != qkv_only_bias,
        "num_query_groups": mha and cfg.num_kv_heads != cfg.num_attention_heads,
        "kv_channels": mha and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size,
        "multi_latent_attention": cfg.multi_latent_attention,
        "attention_sinks": cfg.attention_sinks,
        "sliding_window_layers": cfg.sliding_window_layers is not None,
        "moe": (cfg.moe is not None) != moe,
        **gemma_problems(cfg), **llama4_problems(cfg),
        "attention_output_gate": cfg.attention_output_gate,
        "linear_attention_layers": cfg.linear_attention_layers is not None,
        "hybrid_layers": cfg.hybrid_layers is not None,
        "residual_multiplier": cfg.residual_multiplier != 1.0,   # Granite's (granite*.py)
        "logits_scaling": cfg.logits_scaling != 1.0,
        "short_conv_layers": cfg.short_conv_layers is not None,
        "moe.shared_expert_gate": cfg.moe is not None and cfg.moe.shared_expert_gate,
    }


def gemma_problems(cfg: ModelConfig) -> dict:
    """The Gemma and OLMo fields, which only those families express (gemma.py and olmo.py
    clear theirs)."""
    return {"pre_norm": not cfg.pre_norm, "qk_norm_across_heads": cfg.qk_norm_across_heads,
            "embedding_multiplier": cfg.embedding_multiplier is not None,
            "post_attention_norm": cfg.post_attention_norm, "post_mlp_norm": cfg.post_mlp_norm,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar not in (None, cfg.head_dim),
            "local_rotary_base": cfg.local_rotary_base is not None}


def llama4_problems(cfg: ModelConfig) -> dict:
    """The Llama 4 fields, which only llama4.py expresses (it clears them)."""
    return {"no_rope_layers": cfg.no_rope_layers is not None,
            "qk_norm_rope_layers_only": cfg.qk_norm_rope_layers_only,
            "attention_chunk_size": cfg.attention_chunk_size is not None,
            "attn_temperature_tuning": cfg.attn_temperature_tuning
            and cfg.no_rope_layers is not None,
            "moe.apply_probs_on_input": cfg.moe is not None and cfg.moe.apply_probs_on_input}


def plain_router_problems(m) -> dict:
    """Router settings of MoEConfig ``m`` that the plain-router families (Qwen3-Next/3.5,
    Llama 4) cannot express: groups, scaling, biases, soft-cap, a special expert activation,
    sinkhorn."""
    return {"moe.num_groups": bool(m.num_groups),
            "moe.topk_scaling_factor": bool(m.topk_scaling_factor),
            "moe.router_bias": m.router_bias, "moe.expert_bias": m.expert_bias,
            "moe.router_softcap": bool(m.router_softcap),
            "moe.activation": m.activation is not None,
            "moe.load_balancing": "sinkhorn" in m.load_balancing}
