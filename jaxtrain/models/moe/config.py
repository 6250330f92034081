"""MoE configuration: :class:`MoEConfig` (one MoE layer's knobs, checked the way Megatron's
argument validation checks them), the ``moe_layer_freq`` parser, and which layers are MoE.

``moe_pattern`` is defined with the layer stacks in :mod:`jaxtrain.models.spec` (the parameter
tree needs it below the MoE package) and re-exported here.
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any

from jaxtrain.models.spec import moe_pattern


__all__ = ["BALANCING", "DISPATCHERS", "DROP_POLICIES", "EXPERT_ACTIVATIONS", "FORCE_BALANCING",
           "LOSS_METRICS", "MoEConfig", "NON_TRAINABLE", "SCORE_FUNCTIONS", "SINKHORN_MAX_ITERS",
           "SINKHORN_TOL", "moe_pattern", "parse_layer_freq"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing",
             "none")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")
FORCE_BALANCING = ("even", "uniform")
EXPERT_ACTIVATIONS = ("swiglu_oai",)   # beyond the model's own activation (GPT-OSS's clamped GLU)
# parameter leaves the optimizer never updates (Gemma 4's layer scalar is a checkpoint constant)
NON_TRAINABLE = ("expert_bias", "qb_beta", "k3_hist", "layer_scalar", "hash_routes")

# Metric name of each balancing loss (reported without its coefficient, as Megatron logs it).
LOSS_METRICS = {"aux_loss": "moe_aux_loss", "seq_aux_loss": "moe_seq_aux_loss",
                "global_aux_loss": "moe_global_aux_loss"}
SINKHORN_TOL, SINKHORN_MAX_ITERS = 1e-4, 1000


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's knobs (Megatron names without the ``moe_``/``moe_router_`` prefix).

    ``layer_freq``: int N (every Nth layer from layer 0) or a 0/1 tuple per layer.
    ``ffn_hidden_size`` None: the model's ffn_hidden_size (filled in by ModelConfig).
    ``load_balancing``/``aux_loss_coeff``: equal-length tuples (one coefficient per type).
    ``capacity_factor`` None (or negative): dropless. ``capacity_per_sequence``: MaxText's
    capacity, int(max(ceil(T·k/E)·factor, factor)) tokens per expert in each sequence of T
    tokens, kept in token order, instead of Megatron's ceil(N·k/E·factor) over a rank's N
    tokens. ``router_dtype`` None: compute dtype.
    ``shared_expert_gate``: the shared expert's output times sigmoid(x @ w) of a learned
    [D, 1] gate (Qwen2-MoE, Qwen3-Next).
    ``apply_probs_on_input``: each token enters its expert already multiplied by its routing
    probability and the expert's output is added with weight 1 (Llama 4; top-1 only).
    ``router_bias``: a learned router bias (GPT-OSS); ``expert_bias``: Megatron's aux-free bias;
    ``score_bias``: a learned bias added to the sigmoid/sqrtsoftplus scores, which both pick
    and weigh the experts (MaxText's DeepSeek block under names other than deepseek3*/4*,
    e.g. kimi-k2, with routed_bias).
    Gemma 4's layer: ``branch_norms`` gives the routed experts their own RMS norm of the
    residual stream as input and norms the shared expert's and the experts' outputs before
    they are summed; ``router_input_norm`` feeds the router the residual stream RMS-normalised
    without a scale, times a learned [D] scale and D^-0.5; ``per_expert_scale``: a learned
    scale per expert multiplies its routing weights.
    ``activation`` None: the model's; 'swiglu_oai' is GPT-OSS's clamped GLU (``glu_limit``);
    with the model's activation ``glu_limit`` clamps the experts' gated unit (MaxText
    deepseek4's mlp_activations_limit: not the shared expert).
    ``aux_softmax_biased``: the balancing losses' probabilities are softmax(score + expert
    bias) over the experts (MaxText's DeepSeek load_balance_loss_weight) instead of the
    normalised scores; hash-routed layers have no balancing loss.
    ``expert_tensor_parallel``: split expert FFNs over the tensor axis (ETP = TP) or not (1).
    ``hash_layers``: the first n layers pick each token's experts from a fixed table of its
    token id (DeepSeek-V4's hash routing; the model's ``hash_routes``), the router only
    weighing them.
    ``group_score_topk``: how group-limited routing scores a group: None is Megatron's rule (the
    sum of its top ``topk // group_topk`` scores); an int n sums its top n scores (Hugging
    Face's DeepSeek-V3/Kimi routers: 2, whatever topk).
    """

    num_experts: int
    topk: int = 2
    layer_freq: Any = 1
    ffn_hidden_size: int | None = None
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    apply_probs_on_input: bool = False
    branch_norms: bool = False
    router_input_norm: bool = False
    per_expert_scale: bool = False
    score_function: str = "softmax"
    pre_softmax: bool = False
    router_dtype: str | None = None
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    score_bias: bool = False
    bias_update_rate: float = 1e-3
    # the expert bias's update: "sign" (Megatron's aux-loss-free rule) or Kimi K3's
    # "quantile" rule, the bias set from a histogram of routing margins (``k3_bins`` bins over
    # ``k3_range``), centred with ``k3_center``, blended as an EMA with ``k3_ema`` (None: set),
    # every ``k3_interval`` global batches from their pooled histograms
    bias_rule: str = "sign"
    k3_bins: int = 1024
    k3_range: tuple[float, float] = (-1.0, 1.0)
    k3_center: bool = True
    k3_ema: float | None = None
    k3_interval: int = 1
    load_balancing: tuple[str, ...] = ("aux_loss",)
    aux_loss_coeff: tuple[float, ...] = (0.0,)
    z_loss_coeff: float | None = None
    input_jitter_eps: float | None = None
    router_softcap: float | None = None
    force_balancing: str | None = None
    capacity_factor: float | None = None
    capacity_per_sequence: bool = False
    pad_to_capacity: bool = False
    drop_policy: str = "probs"
    dispatcher: str = "allgather"
    grouped_gemm: bool = False
    per_layer_logging: bool = False
    expert_tensor_parallel: bool = True
    activation: str | None = None
    glu_limit: float | None = None
    latent_size: int | None = None
    # quantile balancing's EMA of its per-expert bias (Megatron's
    # moe_router_quantile_balancing_ema; 0 takes each global batch's quantile)
    qb_ema: float = 0.0
    # Kimi K3's stable latent MoE: the combined routed output RMS-normed in the latent space
    latent_norm: bool = False
    hash_layers: int = 0
    aux_softmax_biased: bool = False

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        types = (self.load_balancing,) if isinstance(self.load_balancing, str) else tuple(
            self.load_balancing)
        coeffs = self.aux_loss_coeff
        coeffs = (float(coeffs),) * len(types) if isinstance(coeffs, (int, float)) else tuple(
            float(c) for c in coeffs)
        put("load_balancing", types)
        put("aux_loss_coeff", coeffs)
        if self.capacity_factor is not None and self.capacity_factor < 0:
            put("capacity_factor", None)
        if isinstance(self.layer_freq, (list, tuple)):
            put("layer_freq", tuple(int(v) for v in self.layer_freq))
        if self.router_dtype is not None:
            put("router_dtype", {"fp32": "float32", "float32": "float32"}.get(
                self.router_dtype, self.router_dtype))
        problems = self.problems()
        if problems:
            raise ValueError("MoEConfig: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What Megatron's validation refuses in this combination (empty: fine). Megatron's
        "top-1 softmax needs pre_softmax" stays a config rule (config/rules.py): a top-1
        router with weight 1 is what HF Mixtral checkpoints with one expert per token do."""
        out, E, k = [], self.num_experts, self.topk

        def need(ok, msg):
            if not ok:
                out.append(msg)

        need(E >= 1, f"num_experts {E} must be positive")
        need(self.latent_size is None or self.latent_size > 0,
             f"moe_latent_size {self.latent_size} must be positive (null: no latent space)")
        need(not self.latent_norm or self.latent_size,
             "latent_moe_use_norm norms the routed experts' latent space, and there is none "
             "(routed_expert_hidden_size / moe_latent_size)")
        need(self.latent_size is None or not self.branch_norms,
             "moe_latent_size: Gemma 4's branch norms are not built with a latent space")
        need(not self.shared_expert_gate or self.shared_expert_size,
             "moe_shared_expert_gate gates the shared expert, and "
             "moe_shared_expert_intermediate_size gives none")
        need(1 <= k <= E, f"topk {k} must be in [1, num_experts={E}]")
        need(not self.branch_norms or self.shared_expert_size,
             "moe_branch_norms norms the shared expert's output beside the experts', and "
             "moe_shared_expert_intermediate_size gives no shared expert")
        need(not self.router_input_norm or self.branch_norms,
             "moe_router_input_norm normalises the residual stream that moe_branch_norms "
             "hands the MoE block; turn moe_branch_norms on")
        need(not self.apply_probs_on_input or k == 1,
             f"moe_apply_probs_on_input scales each token's one expert input; topk is {k} "
             "(Megatron allows it with top-1 routing only)")
        need(self.score_function in SCORE_FUNCTIONS,
             f"score_function {self.score_function!r} is not one of {SCORE_FUNCTIONS}")
        for t in self.load_balancing:
            need(t in BALANCING, f"load balancing type {t!r} is not one of {BALANCING}")
        need(len(self.aux_loss_coeff) == len(self.load_balancing),
             f"{len(self.load_balancing)} load balancing types need as many aux_loss_coeff "
             f"values, got {len(self.aux_loss_coeff)}")
        sinkhorn = "sinkhorn" in self.load_balancing
        if sinkhorn:
            need(set(self.load_balancing) <= {"sinkhorn", "none"},
                 "sinkhorn routing cannot be combined with aux-loss balancing types")
            need(not any(self.aux_loss_coeff), "sinkhorn needs moe_aux_loss_coeff 0")
            need(self.capacity_factor is None, "sinkhorn takes no capacity factor")
        need(self.bias_rule in ("sign", "quantile"), f"moe_router_bias_update_rule "
             f"{self.bias_rule!r} is not one of ('sign', 'quantile')")
        if self.bias_rule == "quantile":
            need(self.expert_bias and self.score_function == "sigmoid",
                 "Kimi K3's quantile rule sets the expert bias from sigmoid scores: it needs "
                 "moe_router_enable_expert_bias and moe_router_score_function sigmoid")
            need(self.k3_bins >= 2 and self.k3_range[1] > self.k3_range[0],
                 "quantile_balancing_num_bins must be at least 2 and quantile_balancing_"
                 "margin_max above quantile_balancing_margin_min")
            need(self.k3_ema is None or 0.0 <= self.k3_ema < 1.0,
                 f"quantile_balancing_ema_decay {self.k3_ema} must be in [0, 1) or null")
            need(self.k3_interval >= 1, f"quantile_balancing_update_interval "
                 f"{self.k3_interval} must be at least 1")
        if "quantile_balancing" in self.load_balancing:
            need(tuple(self.load_balancing) == ("quantile_balancing",),
                 "quantile balancing balances through its own bias: it is the only "
                 "moe_router_load_balancing_type (Megatron's)")
            need(self.group_topk is None and self.num_groups is None and not self.hash_layers,
                 "quantile balancing picks each token's experts itself: no group-limited or "
                 "hash routing (Megatron refuses group-limited routing with it)")
            need(self.capacity_factor is None and self.force_balancing is None,
                 "quantile balancing is built for dropless routing without forced balancing")
            need(0.0 <= self.qb_ema < 1.0, f"moe_router_quantile_balancing_ema {self.qb_ema} "
                 "must be in [0, 1)")
        need(not self.expert_bias or self.score_function in ("sigmoid", "sqrtsoftplus"),
             "expert bias needs the sigmoid or sqrtsoftplus score function")
        need(not self.score_bias or (self.score_function in ("sigmoid", "sqrtsoftplus")
                                     and not sinkhorn),
             "the learned score bias (moe_router_score_bias) is added to sigmoid or "
             "sqrtsoftplus scores: set moe_router_score_function to one of them")
        need(not (self.score_bias and (self.expert_bias or self.hash_layers)),
             "the learned score bias (moe_router_score_bias) weighs the experts it picks; "
             "it does not combine with the aux-loss-free expert bias or hash routing")
        need(not self.score_bias or not any(
            c for t, c in zip(self.load_balancing, self.aux_loss_coeff) if t in LOSS_METRICS),
             "the balancing losses score the experts without the learned score bias "
             "(moe_router_score_bias); MaxText's block that has it trains none: set the aux "
             "loss coefficients to 0")
        need(self.hash_layers >= 0, f"num_hash_layers {self.hash_layers} must not be negative")
        need(not self.hash_layers or (self.score_function in ("sigmoid", "sqrtsoftplus")
                                      and not sinkhorn),
             "hash routing (num_hash_layers) weighs its fixed experts by sigmoid or "
             "sqrtsoftplus scores: set moe_router_score_function to one of them")
        if self.group_topk is not None or self.num_groups is not None:
            G, g = self.num_groups, self.group_topk
            need(G is not None and g is not None, "group-limited routing needs both num_groups "
                 "and group_topk")
            if G and g:
                need(E % G == 0, f"num_experts {E} must be divisible by num_groups {G}")
                need(g <= G, f"group_topk {g} must not exceed num_groups {G}")
                n = self.group_score_topk
                if n is None:
                    need(k >= g and g * (E // G) >= k, f"topk {k} must be at least group_topk "
                         f"{g} and fit in {g} groups of {E // max(G, 1)} experts")
                else:
                    need(g * (E // G) >= k, f"topk {k} must fit in {g} groups of "
                         f"{E // max(G, 1)} experts")
                    need(1 <= n <= E // max(G, 1), f"group_score_topk {n} must be in [1, "
                         f"experts per group = {E // max(G, 1)}]")
        need(not self.pad_to_capacity or self.capacity_factor is not None,
             "pad_to_capacity needs a capacity factor")
        need(self.drop_policy in DROP_POLICIES,
             f"drop_policy {self.drop_policy!r} is not one of {DROP_POLICIES}")
        need(self.dispatcher in DISPATCHERS,
             f"dispatcher {self.dispatcher!r} is not one of {DISPATCHERS}")
        need(self.force_balancing in (None,) + FORCE_BALANCING,
             f"force_balancing {self.force_balancing!r} is not one of {FORCE_BALANCING}")
        need(self.router_dtype in (None, "float32"), f"router_dtype {self.router_dtype!r}: "
             "only fp32 (or null, the compute dtype)")
        need(self.activation in (None,) + EXPERT_ACTIVATIONS,
             f"activation {self.activation!r} is not one of {EXPERT_ACTIVATIONS}")
        return out

    @property
    def quantile_balancing(self) -> bool:
        return "quantile_balancing" in self.load_balancing

    @property
    def objective_types(self) -> tuple[tuple[str, float], ...]:
        """(balancing type, coefficient) pairs that add a loss (coefficient > 0)."""
        return tuple((t, c) for t, c in zip(self.load_balancing, self.aux_loss_coeff)
                     if t in LOSS_METRICS and c > 0)


# ----------------------------------------------------------------------------- layer pattern

def parse_layer_freq(value) -> int | tuple[int, ...]:
    """``moe_layer_freq`` as an int or a 0/1 tuple; strings are list expressions such as
    ``"[0]*3+[1]*58"`` (list literals, ``*`` by an int, ``+``), evaluated without ``eval``."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = _list_expr(ast.parse(text, mode="eval").body) if text.startswith(
                "[") or "*" in text or "+" in text else int(text)
        except (ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"moe_layer_freq {text!r}: expected an int or a list expression "
                             f"like [0]*3+[1]*5 ({e})") from None
    if isinstance(value, (list, tuple)):
        bad = [v for v in value if v not in (0, 1)]
        if bad:
            raise ValueError(f"moe_layer_freq list entries must be 0 or 1, got {bad[:4]}")
        return tuple(int(v) for v in value)
    return int(value)


def _list_expr(node):
    if isinstance(node, ast.List):
        return [_list_expr(e) for e in node.elts]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        a, b = _list_expr(node.left), _list_expr(node.right)
        return a * b if isinstance(node.op, ast.Mult) else a + b
    raise ValueError(f"unsupported element {ast.dump(node)[:40]}")
