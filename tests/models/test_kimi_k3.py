"""Kimi K3 (Primus's model_type kimi_k3) against a torch reference: transformers' Kimi Linear
modules (its KDA recurrence, MLA, router, norms) with Kimi K3's changes as Primus's layer
makes them - the bounded KDA decay and full-rank output gate, MLA's sigmoid output gate,
attention residuals (its KimiK3Layer bookkeeping and eager mixer), SiTU and the stable latent
MoE - transcribed here. Logits in fp32 with wider-than-init weights, decoding, and each
change flipped (the logits move)."""
import dataclasses
import importlib.util
import os
import pathlib

import jax
import numpy as np
import pytest
import torch
import transformers as tr
from model_helpers import max_diff, random_params, tokens

from tests.conftest import trained_rows
from jaxtrain.config import ConfigError, load_config
from jaxtrain.models import ModelConfig, abstract, forward
from jaxtrain.models.hf import deepseek_v3
from jaxtrain.models.params import layer_tree

VOCAB = 97
# Primus's key names, as its kimi_k3 yamls write them (a 6-layer, 2-block shape)
KNOBS = ["model_type=kimi_k3", "num_layers=6", "hidden_size=32", "num_attention_heads=4",
         "kv_channels=8", "ffn_hidden_size=48", f"vocab_size={VOCAB}",
         "make_vocab_size_divisible_by=1", "seq_length=16", "max_position_embeddings=64",
         "normalization=RMSNorm", "swiglu=true", "bf16=false",
         "untie_embeddings_and_output_weights=true",
         "q_lora_rank=16", "kv_lora_rank=16", "qk_head_dim=8", "qk_pos_emb_head_dim=4",
         "v_head_dim=8", "linear_attention_freq=([1]*2+[0])*2", "linear_num_key_heads=2",
         "linear_num_value_heads=2", "linear_key_head_dim=8", "linear_value_head_dim=8",
         "linear_conv_kernel_dim=3", "kda_chunk_size=4", "attn_res_block_size=4",
         "use_te_activation_func=true", "activation_situ_beta=1.5",
         "activation_situ_linear_beta=2.0", "num_experts=4", "moe_router_topk=2",
         "moe_ffn_hidden_size=16", "moe_shared_expert_intermediate_size=16",
         "moe_layer_freq=[0]*1+[1]*5", "routed_expert_hidden_size=8",
         "latent_moe_use_norm=true", "moe_router_score_function=sigmoid",
         "moe_router_enable_expert_bias=true", "moe_router_topk_scaling_factor=1.7",
         "moe_router_dtype=fp32", "init_method_std=0.02", "layernorm_epsilon=1e-5"]


def k3_config(*extra) -> ModelConfig:
    return ModelConfig.from_config(load_config(None, [*KNOBS, *extra]))


def _t(a):
    return torch.from_numpy(np.array(a, np.float32))


def _situ(g, u, beta, linear_beta):
    g, u = g.float(), u.float()
    if beta is None:
        return torch.nn.functional.silu(g) * u
    soft = linear_beta * torch.tanh(u / linear_beta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * soft


def _mix(cands, w, eps):
    """Primus's eager_attn_res_mix: scores from the RMS-normed candidates, mix of the raw."""
    v = torch.stack(cands, -2).float()
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    probs = (k * (_t(w["norm"]) * _t(w["proj"]))).sum(-1).softmax(-1).unsqueeze(-2)
    return torch.matmul(probs, v).squeeze(-2)


class _Gated(torch.nn.Module):
    """MLA's o_proj behind Kimi K3's gate: o_proj(out * sigmoid(g_proj(attention input)))."""

    def __init__(self, o_proj, g_proj, seen):
        super().__init__()
        self.o_proj, self.g_proj, self.seen = o_proj, g_proj, seen

    def forward(self, out):
        return self.o_proj(out * torch.sigmoid(self.g_proj(self.seen["x"])))


class K3Reference:
    """Kimi K3 in torch from our parameters (see the module docstring)."""

    def __init__(self, params, cfg):
        self.p, self.cfg = params, cfg
        m, D = cfg.moe, cfg.hidden_size
        self.hf = tr.KimiLinearConfig(
            vocab_size=cfg.vocab_size, hidden_size=D, intermediate_size=cfg.ffn_hidden_size,
            moe_intermediate_size=m.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
            q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
            qk_nope_head_dim=cfg.qk_head_dim, v_head_dim=cfg.v_head_dim, n_group=1,
            topk_group=1, num_experts_per_tok=m.topk, num_local_experts=m.num_experts,
            routed_scaling_factor=m.topk_scaling_factor, linear_head_dim=cfg.linear_key_head_dim,
            linear_num_heads=cfg.linear_num_key_heads,
            linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, first_k_dense_replace=1,
            rms_norm_eps=cfg.norm_epsilon, tie_word_embeddings=False, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention" if f else "full_attention"
                         for f in cfg.linear_attention_layers or [False] * cfg.num_layers],
            attn_implementation="eager")
        self.model = tr.KimiLinearForCausalLM(self.hf).eval()
        for i, layer in enumerate(self.model.model.layers):
            self._load_layer(layer_tree(params, cfg, i), layer)
        self.model.model.embed_tokens.weight.data = _t(params["embedding"])
        self.model.model.norm.weight.data = _t(params["final_norm"]["scale"])
        self.model.lm_head.weight.data = _t(params["output"]).T

    def _load_layer(self, lt, layer):
        cfg = self.cfg
        D = cfg.hidden_size
        lin = lambda w: _t(w).reshape(D, -1).T  # noqa: E731
        layer.input_layernorm.weight.data = _t(lt["attn_norm"]["scale"])
        layer.post_attention_layernorm.weight.data = _t(lt["mlp_norm"]["scale"])
        attn = layer.self_attn
        if "linear_attn" in lt:
            p = lt["linear_attn"]
            for n in "qkv":
                getattr(attn, n + "_proj").weight.data = lin(p["w" + n])
            attn.conv1d.weight.data = torch.cat(
                [_t(p["conv_" + n]).reshape(cfg.linear_conv_kernel_dim, -1).T
                 for n in "qkv"])[:, None, :]
            gate = attn.forget_gate
            gate.f_a_proj.weight.data = _t(p["wf_a"]).T
            gate.f_b_proj.weight.data = _t(p["wf_b"]).reshape(cfg.linear_key_head_dim, -1).T
            gate.dt_bias.data = _t(p["dt_bias"]).reshape(-1)
            gate.A_log.data = _t(p["A_log"]).reshape(1, 1, -1, 1)
            bound = cfg.kda_gate_lower_bound

            def bounded(x, gate=gate):   # Primus's kda_gate, lower_bound given
                z = gate.f_b_proj(gate.f_a_proj(x)).float() + gate.dt_bias.float()
                z = z.view(*x.shape[:2], -1, cfg.linear_key_head_dim)
                return bound * torch.sigmoid(gate.A_log.float().exp() * z)

            gate.forward = bounded
            attn.b_proj.weight.data = _t(p["wb"]).T
            attn.g_a_proj = torch.nn.Linear(D, attn.qkv_dim, bias=False)   # full rank
            attn.g_a_proj.weight.data = lin(p["wg"])
            attn.g_b_proj = torch.nn.Identity()
            attn.o_norm.weight.data = _t(p["norm"]["scale"])
            attn.o_proj.weight.data = _t(p["wo"]).reshape(-1, D).T
        else:
            p = lt["attn"]
            state = {k.split("self_attn.", 1)[1]: torch.from_numpy(np.array(v, np.float32))
                     for k, v in deepseek_v3.mla_out(p, "self_attn.", cfg).items()}
            attn.load_state_dict(state, strict=True)
            seen = {}
            attn.register_forward_pre_hook(
                lambda mod, args, kwargs, seen=seen: seen.update(x=kwargs["hidden_states"]),
                with_kwargs=True)
            g_proj = torch.nn.Linear(D, cfg.num_attention_heads * cfg.v_head_dim, bias=False)
            g_proj.weight.data = lin(p["wg"])
            attn.o_proj = _Gated(attn.o_proj, g_proj, seen)
        self.__dict__.setdefault("ffn", []).append(lt.get("mlp", lt.get("moe")))

    def _mlp(self, p, x):
        c = self.cfg
        h = _situ(x @ _t(p["wi_0"]), x @ _t(p["wi_1"]), c.situ_beta, c.situ_linear_beta)
        return h @ _t(p["wo"])

    def _moe(self, p, x):
        """Stable latent MoE: Kimi Linear's router on the full width, the experts in the
        latent space, the norm of their combination, back up, plus the shared expert."""
        c, m = self.cfg, self.cfg.moe
        router = tr.models.kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter(self.hf)
        router.weight.data = _t(p["router"]["w"]).T
        router.e_score_correction_bias.data = _t(p["router"]["expert_bias"])
        flat = x.reshape(-1, x.shape[-1])
        _, weights, idx = router(flat)
        h = flat @ _t(p["latent_in"]["w"])
        out = torch.zeros_like(h)
        e = p["experts"]
        for t in range(flat.shape[0]):
            for j in range(m.topk):
                k = int(idx[t, j])
                a = _situ(h[t] @ _t(e["wi_0"][k]), h[t] @ _t(e["wi_1"][k]), c.situ_beta,
                          c.situ_linear_beta)
                out[t] += weights[t, j] * (a @ _t(e["wo"][k]))
        norm = tr.models.kimi_linear.modeling_kimi_linear.KimiLinearRMSNorm(
            out.shape[-1], c.norm_epsilon)
        norm.weight.data = _t(p["latent_norm"]["scale"])
        y = norm(out) @ _t(p["latent_out"]["w"])
        return y.reshape(x.shape) + self._mlp(p["shared"], x)

    @torch.no_grad()
    def logits(self, ids):
        return self.model.lm_head(self.hidden(ids)).numpy()

    @torch.no_grad()
    def mtp_logits(self, ids):
        """Megatron's MTP depth 1 as Primus builds it for Kimi K3: the next tokens' normed
        embeddings beside the normed final hidden state, projected, through one layer of the
        last layer's kind with the plain residual (no attention residuals), normed."""
        c = self.cfg
        mtp = jax.tree.map(lambda a: np.asarray(a).take(0, axis=c.param_scan_axis),
                           self.p["mtp"])

        def norm(w, x):
            x = x.float()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_epsilon) * _t(
                w["scale"])

        ids = np.array(ids)
        shifted = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], 1)
        e = self.model.model.embed_tokens(torch.from_numpy(shifted).long())
        x = torch.cat([norm(mtp["enorm"], e), norm(mtp["hnorm"], self.hidden(ids))], -1)
        x = x @ _t(mtp["eh_proj"])
        linear = "linear_attn" in mtp["layer"]   # an HF layer of that mixer (all but 0 MoE)
        index = max(i for i, t in enumerate(self.hf.layer_types)
                    if (t == "linear_attention") == linear)
        layer = tr.models.kimi_linear.modeling_kimi_linear.KimiLinearDecoderLayer(
            self.hf, index).eval()
        self._load_layer(mtp["layer"], layer)
        f = self.ffn.pop()
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        u = layer.input_layernorm(x)
        x = x + (layer.self_attn(hidden_states=u) if linear else layer.self_attn(
            hidden_states=u, attention_mask=mask, position_ids=torch.arange(T)[None])[0])
        h = layer.post_attention_layernorm(x)
        x = x + (self._moe(f, h) if "router" in f else self._mlp(f, h))
        return self.model.lm_head(norm(mtp["final_norm"], x)).numpy()

    @torch.no_grad()
    def hidden(self, ids):
        """Primus's KimiK3Layer.forward for every layer, the head's mix, the final norm."""
        c, N = self.cfg, self.cfg.attn_res_block_size
        x = self.model.model.embed_tokens(torch.from_numpy(np.array(ids)).long())
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        pos = torch.arange(T)[None]
        blocks, ps = [], x
        for i, layer in enumerate(self.model.model.layers):
            lt = layer_tree(self.p, c, i)
            h = _mix(blocks + [ps], lt["attn_res"], c.norm_epsilon) if blocks else ps
            if N and i % N == 0:
                blocks, ps = blocks + [ps], None
            u = layer.input_layernorm(h)
            if "linear_attn" in lt:
                a = layer.self_attn(hidden_states=u)
            else:
                a, _ = layer.self_attn(hidden_states=u, attention_mask=mask, position_ids=pos)
            ps = a if ps is None else ps + a
            h = layer.post_attention_layernorm(
                _mix(blocks + [ps], lt["mlp_res"], c.norm_epsilon) if N else ps)
            f = self.ffn[i]
            ps = ps + (self._moe(f, h) if "router" in f else self._mlp(f, h))
        out = _mix(blocks + [ps], self.p["attn_res_head"], c.norm_epsilon) if N else ps
        return self.model.model.norm(out)


@pytest.fixture(scope="module")
def k3():
    cfg = k3_config()
    return cfg, random_params(cfg, seed=3, scale=0.3)


def test_knobs_build_kimi_k3(k3):
    cfg, _ = k3
    assert cfg.linear_attention_layers == (True, True, False, True, True, False)
    assert (cfg.kda_gate_lower_bound, cfg.kda_full_rank_gate, cfg.mla_nope) == (-5.0, True, True)
    assert (cfg.attention_output_gate, cfg.attn_res_block_size) == (True, 4)
    assert (cfg.situ_beta, cfg.situ_linear_beta, cfg.mla_latent_norm_epsilon) == (1.5, 2.0, 1e-6)
    assert (cfg.moe.latent_size, cfg.moe.latent_norm) == (8, True)


def test_logits_match_the_torch_reference(k3):
    cfg, params = k3
    ids = tokens(2, 11, vocab=VOCAB, seed=4)
    ours = jax.jit(lambda p, x: forward(p, x, cfg))(params, ids)
    ref = K3Reference(params, cfg).logits(ids)
    assert max_diff(ours, ref) < 1e-4, max_diff(ours, ref)


def _drop(params, name):
    """params without the MLA layers' ``name`` leaf (the KDA layers' kept)."""
    out = dict(params)
    for stack, tree in params.items():
        if isinstance(tree, dict) and "attn" in tree and name in tree["attn"]:
            out[stack] = {**tree, "attn": {k: v for k, v in tree["attn"].items() if k != name}}
    return out


@pytest.mark.parametrize("layer_type, stack", [("mirror_last", "moe_layers"),
                                               ("kda", "linear_moe_layers")])
def test_multi_token_prediction(layer_type, stack):
    """num_nextn_predict_layers 1: Megatron's MTP depth with a Kimi K3 layer of the last
    layer's kind (mtp_layer_type mirror_last; kda: KDA with the last layer's FFN) and the plain
    residual, its logits equal to the torch reference's."""
    from jaxtrain.models.mtp import mtp_hidden_states
    from jaxtrain.models.spec import mtp_layer_kinds
    from jaxtrain.models.transformer import decoder, logits_head

    cfg = k3_config("num_nextn_predict_layers=1", f"mtp_layer_type={layer_type}")
    assert cfg.mtp_num_layers == 1 and mtp_layer_kinds(cfg) == (stack,)
    params = random_params(cfg, seed=3, scale=0.3)
    assert "attn_res" not in params["mtp"]["layer"] and "mlp_res" not in params["mtp"]["layer"]
    ids = tokens(2, 11, vocab=VOCAB, seed=4)

    @jax.jit
    def mtp_logits(params, ids):
        hidden, _, ctx = decoder(params, ids, cfg)
        (h1,), _ = mtp_hidden_states(params, hidden, ids, ctx, cfg)
        return logits_head(params, h1, cfg)

    ref = K3Reference(params, cfg)
    assert max_diff(mtp_logits(params, ids), ref.mtp_logits(ids)) < 1e-4


def test_each_kimi_k3_change_is_read(k3):
    """Flip one of Kimi K3's changes at a time (parameters dropped where they go): the logits
    move every time."""
    cfg, params = k3
    ids = tokens(1, 9, vocab=VOCAB, seed=5)
    run = jax.jit(forward, static_argnums=2)  # one compile per change beats running op by op
    base = run(params, ids, cfg)
    no_latent_norm = {k: ({**v, "moe": {n: t for n, t in v["moe"].items() if n != "latent_norm"}}
                          if isinstance(v, dict) and "moe" in v else v)
                      for k, v in params.items()}
    for change, changed in (
            (dict(kda_gate_lower_bound=None), params),
            (dict(attention_output_gate=False), _drop(params, "wg")),
            (dict(situ_linear_beta=None), params),
            (dict(situ_beta=None, situ_linear_beta=None), params),
            (dict(attn_res_block_size=2), params),
            (dict(moe=dataclasses.replace(cfg.moe, latent_norm=False)), no_latent_norm)):
        assert max_diff(base, run(changed, ids, cfg.replace(**change))) > 1e-3, change


def test_decoding_continues_the_full_forward(k3):
    """Prefill then one token at a time: each step's logits are the full forward's (the
    summaries of a step's tokens come from the same step)."""
    from jaxtrain.models import decode

    cfg, params = k3
    ids = tokens(2, 10, vocab=VOCAB, seed=6)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, ids, cfg))
    cache = decode.init_cache(cfg, 2, 12)
    logits, cache = decode.prefill(params, cfg, ids[:, :6], cache)
    assert max_diff(logits, full[:, 5]) < 1e-4
    for t in range(6, 8):
        logits, cache = decode.decode_step(params, cfg, ids[:, t:t + 1], cache)
        assert max_diff(logits, full[:, t]) < 1e-4


def test_pipeline_stages_pass_the_folded_state(k3):
    """Layer ranges [0,1) [1,4) [4,6) run one after another as pipeline stages do (the running
    sum and the summaries folded into one [B,T,1+n,D] tensor between them; a stage starting
    mid-block, one opening a block at its first layer) give the full forward's logits."""
    from jaxtrain.models import attn_res
    from jaxtrain.models.spec import layer_kinds
    from jaxtrain.models.transformer import (_run_layers, final_hidden, layer_inputs,
                                             layer_stacks, logits_head)

    cfg, params = k3
    ids = tokens(2, 8, vocab=VOCAB, seed=7)
    kinds = layer_kinds(cfg)

    @jax.jit
    def staged(params, ids):
        x, ctx = layer_inputs(params, ids, cfg)
        stacks = layer_stacks(params, cfg)
        x = attn_res.fold(x, None, cfg)
        assert x.shape[2] == attn_res.width(cfg) == 3   # the sum, the summaries of layers 0, 4
        for lo, hi in ((0, 1), (1, 4), (4, 6)):
            mine = {k: jax.tree.map(lambda a, k=k: a[kinds[:lo].count(k):kinds[:hi].count(k)],
                                    stack) for k, stack in stacks.items() if k in kinds[lo:hi]}
            x, _ = _run_layers(mine, x, ctx, cfg, layers=(lo, hi))
        return logits_head(params, final_hidden(params, x, ctx, cfg), cfg)

    assert max_diff(staged(params, ids), forward(params, ids, cfg)) < 1e-5


def test_quantile_rule_knobs():
    """Kimi K3's quantile rule and its histogram settings reach the MoE config (their effects:
    tests/models/test_quantile_balancing.py, against Primus's own functions)."""
    m = k3_config("moe_router_bias_update_rule=quantile", "quantile_balancing_num_bins=8",
                  "quantile_balancing_margin_min=-0.25", "quantile_balancing_margin_max=0.75",
                  "quantile_balancing_center_bias=false",
                  "quantile_balancing_ema_decay=0.5").moe
    assert (m.bias_rule, m.k3_bins, m.k3_range, m.k3_center, m.k3_ema) == (
        "quantile", 8, (-0.25, 0.75), False, 0.5)
    assert k3_config().moe.bias_rule == "sign"


def test_mla_switches(k3):
    """mla_use_output_gate false: no gate projection; mla_use_nope false: the MLA layers
    rotate their qk_pos_emb_head_dim part (the logits move)."""
    cfg, params = k3
    gate_off = k3_config("mla_use_output_gate=false")
    assert not gate_off.attention_output_gate
    assert "wg" not in abstract(gate_off)["moe_layers"]["attn"]
    rotated = k3_config("mla_use_nope=false")
    assert not rotated.mla_nope and rotated.position_embedding_type == "rope"
    ids = tokens(1, 9, vocab=VOCAB, seed=5)
    run = jax.jit(forward, static_argnums=2)
    assert max_diff(run(params, ids, cfg), run(params, ids, rotated)) > 1e-3


def test_flops_count_the_mixes(k3):
    """Attention residuals add 3 x 7 D per candidate of every mix (hand count: 29 candidates
    over the 6 layers' 12 mixes and the head); the gates are counted as weights."""
    from jaxtrain.metrics import flop_terms

    cfg, _ = k3
    plain = cfg.replace(attn_res_block_size=0)
    (with_res, _), (without, _) = flop_terms(cfg, abstract(cfg)), flop_terms(plain,
                                                                              abstract(plain))
    assert with_res - without == 3 * 7 * 32 * 29
    no_gate = cfg.replace(attention_output_gate=False)
    gate = 2 * cfg.hidden_size * cfg.num_attention_heads * cfg.v_head_dim   # two MLA layers
    assert with_res - flop_terms(no_gate, abstract(no_gate))[0] == 6 * gate


def test_no_hugging_face_export(k3):
    """No transformers model has Kimi K3's changes: export names them instead of writing a
    Kimi Linear checkpoint that would load wrong."""
    from jaxtrain.models.hf import check_exportable

    with pytest.raises(ValueError, match="attn_res_block_size.*kda_gate_lower_bound"):
        check_exportable(k3[0], "kimi_linear")


def test_plain_swiglu_without_primus_module_slot():
    """Primus builds SiTU only through the activation module slot (use_te_activation_func);
    without it the K3 layers take plain SwiGLU and the betas are not read."""
    cfg = k3_config("use_te_activation_func=false")
    assert cfg.situ_beta is None and cfg.activation == "silu"


@pytest.mark.parametrize("args, match", [
    (["model_type=gpt", "attn_res_block_size=4"], "Kimi K3's settings"),
    (["kda_use_full_rank_gate=false"], "low-rank output gate"),
    (["mtp_num_layers=1", "mtp_loss_scaling_factor=0"], "mtp_loss_scaling_factor must be"),
    (["mtp_num_layers=1", "mtp_layer_type=kda", "linear_attention_freq=null"], "mtp_mixer"),
    (["multi_latent_attention=true"], "multi_latent_attention false"),
    (["moe_latent_size=4"], "name the same latent width"),
])
def test_refused_by_name(args, match):
    base = [a for a in KNOBS if not a.startswith(tuple(k.split("=")[0] + "=" for k in args))]
    with pytest.raises((ConfigError, ValueError), match=match):
        ModelConfig.from_config(load_config(None, [*base, *args]))


@pytest.mark.slow
def test_cli_trains_a_tiny_kimi_k3(tmp_path, cli):
    """Primus's Kimi K3 keys from the command line, with Kimi K3's quantile rule for the
    expert bias and an MTP depth: the dry run passes and three steps train (the loss moves)."""
    run = ["mock_data=true", "micro_batch_size=2", "global_batch_size=2", "lr_warmup_iters=0",
           "log_interval=1", "exp_name=run", f"workspace={tmp_path}", "train_iters=3",
           "lr=0.01", "moe_router_load_balancing_type=seq_aux_loss", "moe_aux_loss_coeff=1e-3",
           "moe_router_bias_update_rule=quantile", "quantile_balancing_num_bins=64",
           "num_nextn_predict_layers=1", *KNOBS]
    rows = trained_rows(cli, run, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] != rows[0]["loss"]
    assert all(np.isfinite(r["mtp_1_loss"]) for r in rows)


@pytest.mark.parametrize("extra, match", [
    (["memory.seco=true"], "memory.seco with Kimi K3"),
    (["moe_router_bias_update_rule=quantile", "quantile_balancing_update_interval=0"],
     "quantile_balancing_update_interval 0 must be at least 1"),
    (["tensor_model_parallel_size=4", "linear_num_key_heads=2"], "linear_num_key_heads"),
])
def test_dry_run_refuses_what_does_not_run_it_yet(cli, extra, match):
    code, _, err = cli("--dry-run", "mock_data=true", "micro_batch_size=1",
                       "global_batch_size=8", *KNOBS, *extra)
    assert code == 2 and match in err and "Traceback" not in err, err


UPSTREAM = pathlib.Path(os.environ.get("JAXTRAIN_UPSTREAM", "/nonexistent"))
K3_SRC = UPSTREAM / "primus/primus/backends/megatron/core/transformer/kimi_k3"


def _primus(rel: str):
    """A pure-torch module of Primus's Kimi K3 code, loaded from its file."""
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_"), K3_SRC / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not K3_SRC.is_dir(), reason="JAXTRAIN_UPSTREAM has no Primus")
def test_pieces_against_primus_own_eager_code():
    """Primus's own eager references, side by side: the attention-residual mix, SiTU, the
    bounded KDA gate and the KDA recurrence (fp32)."""
    from jaxtrain.models import attn_res
    from jaxtrain.models.layers import glu
    from jaxtrain.models.linear_attention import log_decay
    from kernels.gated_delta import chunked_gated_delta_rule

    mixer = _primus("attn_res_kernels/_eager/reference.py")
    situ = _primus("situ_activation.py")
    kda = _primus("kda_kernels/_eager/reference.py")
    cfg = k3_config()
    r = np.random.default_rng(0)
    ps, blocks = r.normal(size=(2, 5, 32)) * 3, r.normal(size=(2, 5, 3, 32)) * 3
    w = {"norm": r.normal(size=32), "proj": r.normal(size=32)}
    want = mixer.eager_attn_res_mix(_t(ps), _t(blocks), _t(w["norm"]), _t(w["proj"])[None],
                                    cfg.norm_epsilon)
    assert max_diff(attn_res.mix(w, blocks, ps.astype(np.float32), cfg), want.numpy()) < 1e-5
    g, u = r.normal(size=(4, 16)) * 6, r.normal(size=(4, 16)) * 6
    want = situ.situ_pre_mul(_t(g), _t(u), beta=1.5, linear_beta=2.0)
    assert max_diff(glu(g.astype(np.float32), u.astype(np.float32), cfg), want.numpy()) < 1e-6
    B, T, H, D = 2, 9, 2, 8
    z, A_log, dt = r.normal(size=(B, T, H, D)), r.normal(size=H), r.normal(size=H * D)
    g_ours = log_decay(z, A_log, dt.reshape(H, D), cfg)
    g_ref = kda.kda_gate(_t(z), _t(A_log), _t(dt), -5.0)
    assert max_diff(g_ours, g_ref.numpy()) < 1e-6
    q, k, v = (r.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, H)))).astype(np.float32)
    out, _ = chunked_gated_delta_rule(q, k, v, g_ours, beta, chunk_size=4, l2_qk=True)
    ref, _ = kda.eager_chunk_kda(_t(q), _t(k), _t(v), g_ref, _t(beta), chunk_size=4,
                                 use_qk_l2norm_in_kernel=True)
    assert max_diff(out, ref.numpy()) < 1e-4


@pytest.mark.skipif(not K3_SRC.is_dir(), reason="JAXTRAIN_UPSTREAM has no Primus")
def test_primus_kimi_k3_experiment_dry_runs(cli):
    """Primus's 8-layer official-width Kimi K3 experiment, as its launcher passes it."""
    exp = UPSTREAM / "primus/examples/megatron/configs/MI355X/kimi_k3-BF16-8L-official.yaml"
    code, _, err = cli("--dry-run", str(exp))
    assert code == 0, err
