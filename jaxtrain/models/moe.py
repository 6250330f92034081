"""Mixture-of-experts FFN: Megatron's top-k router in every mode, capacity and dropless token
dispatch with a grouped matmul, shared experts, and expert parallelism.

Formulas: shared/notes/knob-semantics.md §1.3. Router order (Megatron's): input jitter (router
input only) -> gating in ``router_dtype`` -> forced-uniform random logits (straight-through)
-> Primus soft-cap (differentiable here) -> z-loss -> routing (top-k, group limit, expert bias,
sinkhorn) -> capacity dropping -> aux losses -> expert-load counting -> forced-even round-robin
slots (Primus: the real top-k weights on slots (n·k + j) mod E). Capacity ``position`` keeps
each expert's earliest tokens (Megatron's tie order there is unspecified).

Where a statistic is "per rank" in Megatron (aux losses, z-loss, capacity, sinkhorn) it is
computed here over the tokens one data-parallel rank holds: the whole batch without a layout,
one device's tokens under a layout (context-parallel shards of a sequence are summed, so a rank
is sequence-complete), then averaged over the data-parallel ranks like the LM loss.

Dispatch: tokens are sorted by expert and the experts run as one grouped matmul
(:func:`grouped_matmul`, ``lax.ragged_dot`` or the Pallas kernel with ``grouped_gemm``), then
unsorted and combined with the routing weights. ``pad_to_capacity`` instead gathers a fixed
[E, capacity] buffer per expert (the same numbers, static shapes). Under a layout the routed
part runs in a ``shard_map`` over the whole mesh: each device routes its own tokens; with
expert parallelism the ``allgather`` dispatcher gathers the expert group's tokens, runs its
local experts on them and reduce-scatters the outputs back, the ``alltoall`` dispatcher sends
each token only to the devices owning its experts and back (``all_to_all`` with fixed slots of
the worst-case size, or capacity-sized slots with pad_to_capacity: ``ragged_all_to_all`` has no
CPU lowering).
The experts' FFN dimension is split over the tensor axis (expert tensor parallelism = TP),
with a psum after the down projection; ETP = 1 keeps whole experts on every tensor rank.

Expert bias (aux-loss-free balancing) is a float32 parameter leaf ``expert_bias`` that the
optimizer never sees (:data:`NON_TRAINABLE`); the train step adds
``rate * sign(mean(c) - c)`` once per global batch from the loads ``c`` counted by the forward
(:func:`update_expert_bias`). Keeping it among the parameters makes checkpoints, evaluation
and HF export (DeepSeek's ``e_score_correction_bias``) see it without extra state.

The aux and z losses join the objective averaged over microbatches (also with
calculate_per_token_loss, where Megatron's scaling divides them by the token count instead) and
are reported without their coefficients as ``moe_aux_loss``, ``moe_seq_aux_loss``,
``moe_global_aux_loss``, ``moe_z_loss`` (:func:`metrics`).

Legend: B batch, T length, D hidden, E experts, k top-k, F expert FFN hidden, N tokens.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")
FORCE_BALANCING = ("even", "uniform")
EXPERT_ACTIVATIONS = ("swiglu_oai",)   # beyond the model's own activation (GPT-OSS's clamped GLU)
NON_TRAINABLE = ("expert_bias",)       # parameter leaves the optimizer never updates

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
    ``router_bias``: a learned router bias (GPT-OSS); ``expert_bias``: Megatron's aux-free bias.
    ``activation`` None: the model's; 'swiglu_oai' is GPT-OSS's clamped GLU (``glu_limit``).
    ``expert_tensor_parallel``: split expert FFNs over the tensor axis (ETP = TP) or not (1).
    ``group_score_topk``: how group-limited routing scores a group: None is Megatron's rule (the
    sum of its top ``topk // group_topk`` scores); an int n sums its top n scores (Hugging
    Face's DeepSeek-V3/Kimi routers: 2, whatever topk).
    """

    num_experts: int
    topk: int = 2
    layer_freq: Any = 1
    ffn_hidden_size: int | None = None
    shared_expert_size: int | None = None
    score_function: str = "softmax"
    pre_softmax: bool = False
    router_dtype: str | None = None
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    group_score_topk: int | None = None
    router_bias: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
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
        need(1 <= k <= E, f"topk {k} must be in [1, num_experts={E}]")
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
        need(not self.expert_bias or self.score_function in ("sigmoid", "sqrtsoftplus"),
             "expert bias needs the sigmoid or sqrtsoftplus score function")
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


def moe_pattern(moe: MoEConfig | None, num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE (Megatron: int N -> layer i is MoE when i % N == 0)."""
    if moe is None:
        return (False,) * num_layers
    freq = moe.layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq {freq} must be positive")
        return tuple(i % freq == 0 for i in range(num_layers))
    if len(freq) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(bool(v) for v in freq)


# ----------------------------------------------------------------------------- grouped matmul

def grouped_matmul(lhs, rhs, group_sizes, *, kernel: bool = False):
    """``lax.ragged_dot`` semantics: rows of lhs [M, K] in consecutive groups of
    ``group_sizes`` [G] times rhs [G, K, N]; rows past the groups give zeros. ``kernel`` takes
    the Pallas grouped GEMM (``kernels.grouped_gemm``, Megatron's moe_grouped_gemm)."""
    if kernel:
        from kernels.grouped_gemm import grouped_matmul as pallas_grouped_matmul
        return pallas_grouped_matmul(lhs, rhs, group_sizes)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


# ----------------------------------------------------------------------------- collectives

@dataclasses.dataclass(frozen=True)
class Comm:
    """Mesh axes seen from inside the MoE's shard_map (all empty without a layout).

    ``seq``: axes splitting one rank's sequences (summed for per-rank statistics); ``batch``:
    data-parallel axes splitting the batch (averaged over); ``expert``: the expert-parallel
    axis when the experts are split over it (``ep`` ways), ``tokens_split`` whether the tokens
    are split over it too; ``tensor``: the axis splitting each expert's FFN.
    """

    seq: tuple[str, ...] = ()
    batch: tuple[str, ...] = ()
    expert: str | None = None
    ep: int = 1
    tokens_split: bool = False
    tensor: str | None = None

    def sum_seq(self, x):
        return jax.lax.psum(x, self.seq) if self.seq else x

    def mean_ranks(self, x):
        return jax.lax.pmean(x, self.batch) if self.batch else x

    def sum_all(self, x):
        axes = self.seq + self.batch
        return jax.lax.psum(x, axes) if axes else x

    def rank(self):
        return jax.lax.axis_index(self.expert) if self.expert else 0


LOCAL = Comm()


# ----------------------------------------------------------------------------- router

def _score(fn: str, logits):
    x = logits.astype(jnp.float32)
    if fn == "softmax":
        return jax.nn.softmax(x, axis=-1)
    if fn == "sigmoid":
        return jax.nn.sigmoid(x)
    return jnp.sqrt(jax.nn.softplus(x))


def group_score_topk(m: MoEConfig) -> int:
    """How many of a group's best scores make its score (Megatron: topk // group_topk)."""
    return m.group_score_topk if m.group_score_topk is not None else m.topk // m.group_topk


def _select(scores, m: MoEConfig):
    """Top-k (values, indices) of scores [N, E], group-limited when num_groups is set: group
    score = sum of its top :func:`group_score_topk` scores; only the best group_topk groups
    stay."""
    if not m.num_groups:
        return jax.lax.top_k(scores, m.topk)
    N, E = scores.shape
    G = m.num_groups
    grouped = scores.reshape(N, G, E // G)
    group_score = jax.lax.top_k(grouped, group_score_topk(m))[0].sum(-1)
    _, kept = jax.lax.top_k(group_score, m.group_topk)
    keep = jnp.any(jax.nn.one_hot(kept, G, dtype=jnp.bool_), axis=1)          # [N, G]
    masked = jnp.where(jnp.repeat(keep, E // G, axis=1), scores, -jnp.inf)
    return jax.lax.top_k(masked, m.topk)


def topk_routing(logits, m: MoEConfig, bias=None):
    """(probs [N, k] float32, experts [N, k]) from router logits [N, E] (Megatron's
    topk_routing_with_score_function). Softmax: top-k on the logits then softmax over the k
    (``pre_softmax``: softmax over all, then top-k). Sigmoid/sqrtsoftplus: scores in fp32,
    selection on score + expert bias, unbiased scores as probs, renormalised when k > 1."""
    if m.score_function == "softmax":
        if m.pre_softmax:
            probs, idx = _select(_score("softmax", logits), m)
        else:
            vals, idx = _select(logits, m)
            probs = jax.nn.softmax(vals.astype(jnp.float32), axis=-1)
    else:
        scores = _score(m.score_function, logits)
        if bias is not None:
            _, idx = _select(scores + jax.lax.stop_gradient(bias.astype(jnp.float32)), m)
            probs = jnp.take_along_axis(scores, idx, axis=1)
        else:
            probs, idx = _select(scores, m)
        if m.topk > 1:
            probs = probs / (probs.sum(-1, keepdims=True) + 1e-20)
    if m.topk_scaling_factor:
        probs = probs * m.topk_scaling_factor
    return probs.astype(jnp.float32), idx


def sinkhorn(cost, tol: float = SINKHORN_TOL, max_iters: int = SINKHORN_MAX_ITERS):
    """Megatron's Sinkhorn on exp(cost) [N, E]: alternate d0 = 1/(N·Σ_e d1·C),
    d1 = 1/(E·Σ_n d0·C) until mean|Δd1| < tol; returns d1·C·d0 (float32, no gradient)."""
    c = jnp.exp(jax.lax.stop_gradient(cost).astype(jnp.float32))
    N, E = c.shape
    eps = 1e-8

    def body(state):
        d0, d1, _, it = state
        d0 = (1.0 / N) / (jnp.sum(d1[None, :] * c, axis=1) + eps)
        new = (1.0 / E) / (jnp.sum(d0[:, None] * c, axis=0) + eps)
        return d0, new, jnp.mean(jnp.abs(new - d1)), it + 1

    def cond(state):
        return (state[2] > tol) & (state[3] < max_iters)

    d0, d1, _, _ = jax.lax.while_loop(
        cond, body, (jnp.ones(N, jnp.float32), jnp.ones(E, jnp.float32), jnp.float32(1e9), 0))
    return d1[None, :] * c * d0[:, None]


def sinkhorn_routing(logits, m: MoEConfig, train: bool):
    """Training: top-k of sinkhorn(logits); probs = sigmoid (k = 1) or softmax of the raw
    logits at those experts. Evaluation: plain top-k of those probs."""
    act = jax.nn.sigmoid(logits.astype(jnp.float32)) if m.topk == 1 else jax.nn.softmax(
        logits.astype(jnp.float32), axis=-1)
    _, idx = jax.lax.top_k(sinkhorn(logits) if train else act, m.topk)
    return jnp.take_along_axis(act, idx, axis=1), idx


def aux_scores(logits, m: MoEConfig):
    """(scores [N, E], 0/1 routing map [N, E]) for the aux losses: unbiased scores over all
    experts (softmax, or sigmoid/sqrtsoftplus sum-normalised over the experts whatever topk,
    as Megatron's compute_routing_scores_for_aux_loss) with their own top-k map."""
    s = _score(m.score_function, logits)
    if m.score_function != "softmax":
        s = s / (s.sum(-1, keepdims=True) + 1e-20)
    _, idx = jax.lax.top_k(s, m.topk)
    return s, jax.nn.one_hot(idx, s.shape[-1], dtype=jnp.float32).sum(1)


def switch_loss(probs_sum, counts, tokens, m: MoEConfig):
    """E/(k·T²)·Σ_i P_i·c_i: P_i summed probs, c_i routed counts of expert i over T tokens."""
    return jnp.sum(probs_sum * counts) * (m.num_experts / (m.topk * tokens * tokens))


def capacity(num_tokens: int, m: MoEConfig) -> int:
    """Megatron's ceil(T·k/E·factor), at most T (nothing is dropped then)."""
    cap = math.ceil(num_tokens * m.topk / m.num_experts * m.capacity_factor)
    return max(1, min(cap, num_tokens))


def sequence_capacity(seq_tokens: int, m: MoEConfig) -> int:
    """MaxText's per-sequence capacity int(max(ceil(T·k/E)·factor, factor)), at most T."""
    cap = int(max(math.ceil(seq_tokens * m.topk / m.num_experts) * m.capacity_factor,
                  m.capacity_factor))
    return max(1, min(cap, seq_tokens))


def capacity_slots(probs, idx, m: MoEConfig, seqs: int = 1):
    """Each expert's kept tokens [E, cap] (token ids) and their weights [E, cap]: the top-cap
    tokens by routing probability (``probs``) or the first cap routed tokens (``position``).
    Unrouted tokens can fill spare slots with weight 0 (what pad_to_capacity computes). With
    ``capacity_per_sequence`` each of the ``seqs`` sequences keeps its own capacity."""
    N, k = idx.shape
    if m.capacity_per_sequence and seqs > 1:
        T = N // seqs
        slots, weights = jax.vmap(lambda p, i: capacity_slots(p, i, m))(
            probs.reshape(seqs, T, k), idx.reshape(seqs, T, k))          # [S, E, cap]
        slots = slots + (jnp.arange(seqs) * T)[:, None, None]
        return (slots.transpose(1, 0, 2).reshape(m.num_experts, -1),
                weights.transpose(1, 0, 2).reshape(m.num_experts, -1))
    E = m.num_experts
    rows = jnp.arange(N)[:, None]
    dense = jnp.zeros((N, E), jnp.float32).at[rows, idx].add(probs)
    routed = jnp.zeros((N, E), jnp.bool_).at[rows, idx].set(True)
    if m.drop_policy == "probs":
        key = jnp.where(routed, dense, -1.0)
    else:
        key = jnp.where(routed, (N - jnp.arange(N, dtype=jnp.float32))[:, None], 0.0)
    cap = sequence_capacity(N, m) if m.capacity_per_sequence else capacity(N, m)
    _, slots = jax.lax.top_k(key.T, cap)                                  # [E, cap]
    weights = jnp.take_along_axis(dense.T, slots, axis=1)
    return slots, weights


def route(logits, m: MoEConfig, *, train: bool, bias=None, rand_logits=None,
          prev_aux_counts=None, prev_steps=None, comm: Comm = LOCAL, seqs: int = 1):
    """Routing for one rank's tokens. logits [N, E] (N = seqs sequences of N/seqs tokens).

    Returns (probs [N, k], experts [N, k], keep [N, k] bool, slots, stats): ``slots`` is
    capacity_slots' (token ids, weights) with a capacity factor, else None; ``stats`` holds
    the raw losses (``lb`` per balancing type, ``z``), the weighted ``objective``, ``counts``
    (tokens kept per expert, all ranks) and ``aux_counts`` (global_aux_loss's map).
    """
    N, E = logits.shape
    if rand_logits is not None:   # forced balancing 'uniform': random logits, straight-through
        logits = logits + jax.lax.stop_gradient(rand_logits.astype(logits.dtype) - logits)
    if m.router_softcap:
        logits = m.router_softcap * jnp.tanh(logits / m.router_softcap)
    f32 = jnp.float32
    stats = {"lb": jnp.zeros((len(m.load_balancing),), f32), "z": f32(0.0),
             "objective": f32(0.0)}
    if train and m.z_loss_coeff:
        lse = jax.nn.logsumexp(logits.astype(f32), axis=-1)
        z = comm.mean_ranks(comm.sum_seq(jnp.sum(lse * lse)) / comm.sum_seq(f32(N)))
        stats["z"], stats["objective"] = z, m.z_loss_coeff * z

    if "sinkhorn" in m.load_balancing:
        probs, idx = sinkhorn_routing(logits, m, train)
    else:
        probs, idx = topk_routing(logits, m, bias)
    keep = jnp.ones(idx.shape, jnp.bool_)
    slots = None
    if m.capacity_factor is not None:
        slots = capacity_slots(probs, idx, m, seqs)
        kept = jnp.zeros((E, N), jnp.bool_).at[jnp.arange(E)[:, None], slots[0]].set(True)
        keep = kept.T[jnp.arange(N)[:, None], idx]

    if train and any(t in LOSS_METRICS for t in m.load_balancing):
        s, amap = aux_scores(logits, m)
        lbs = []
        for t, c in zip(m.load_balancing, m.aux_loss_coeff):
            if t == "aux_loss":
                tokens = comm.sum_seq(f32(N))
                loss = comm.mean_ranks(switch_loss(comm.sum_seq(s.sum(0)),
                                                   comm.sum_seq(amap.sum(0)), tokens, m))
            elif t == "seq_aux_loss":
                per = lambda a: comm.sum_seq(a.reshape(seqs, N // seqs, E).sum(1))  # noqa: E731
                tokens = comm.sum_seq(f32(N // seqs))
                losses = jax.vmap(lambda p, n: switch_loss(p, n, tokens, m))(per(s), per(amap))
                loss = comm.mean_ranks(jnp.mean(losses))
            elif t == "global_aux_loss":
                counts = comm.sum_all(amap.sum(0))
                stats["aux_counts"] = counts
                prev = prev_aux_counts if prev_aux_counts is not None else jnp.zeros_like(counts)
                steps = prev_steps if prev_steps is not None else 0
                mean_counts = (prev + counts) / (steps + 1.0)
                loss = switch_loss(comm.sum_all(s.sum(0)), mean_counts, comm.sum_all(f32(N)), m)
            else:
                loss = f32(0.0)
            lbs.append(loss)
            stats["objective"] = stats["objective"] + c * loss
        stats["lb"] = jnp.stack(lbs).astype(f32)
    if "global_aux_loss" in m.load_balancing and "aux_counts" not in stats:
        stats["aux_counts"] = jnp.zeros((E,), f32)

    onehot = jax.nn.one_hot(idx, E, dtype=f32) * keep[..., None]
    stats["counts"] = comm.sum_all(onehot.sum((0, 1)))
    if m.force_balancing == "even":  # Primus: round-robin slots carry the real top-k weights
        idx = ((jnp.arange(N)[:, None] * m.topk + jnp.arange(m.topk)[None]) % E).astype(idx.dtype)
        slots = None
    return probs, idx, keep, slots, stats


# ----------------------------------------------------------------------------- experts

def _glu(h0, h1, act, m: MoEConfig):
    if m.activation == "swiglu_oai":
        limit = m.glu_limit if m.glu_limit is not None else 7.0
        h0 = jnp.minimum(h0, limit)
        h1 = jnp.clip(h1, -limit, limit)
        return h0 * jax.nn.sigmoid(1.702 * h0) * (h1 + 1.0)
    return act(h0) * h1


def _ffn_rows(pe, xs, key, sizes, cfg, m: MoEConfig):
    """Rows xs [M, D] sorted by local expert (``key`` [M], E_loc for none; ``sizes`` [E_loc])
    through their experts: grouped matmuls, activation, down projection -> [M, D]."""
    from jaxtrain.models.layers import activation

    dt = cfg.compute_dtype
    gmm = _expert_matmul(pe, sizes, cfg, m)
    act = functools.partial(activation, cfg.activation)
    E_loc = sizes.shape[0]
    live = key < E_loc
    safe = jnp.where(live, key, 0)

    def bias(name):
        b = pe.get(name)
        return 0.0 if b is None else jnp.where(live[:, None], b.astype(dt)[safe], 0.0)

    xs = xs.astype(dt)
    if cfg.gated_linear_unit:
        h0 = gmm(xs, "wi_0") + bias("bi_0")
        h1 = gmm(xs, "wi_1") + bias("bi_1")
        h = _maybe_remat_act(lambda a, b: _glu(a, b, act, m), cfg)(h0, h1)
    else:
        h = _maybe_remat_act(act, cfg)(gmm(xs, "wi") + bias("bi"))
    return gmm(h.astype(dt), "wo")


def _expert_matmul(pe, sizes, cfg, m: MoEConfig):
    """(rows, weight name) -> the grouped matmul with that expert weight, quantized when the
    config quantizes the projections (jaxtrain.quant)."""
    dt = cfg.compute_dtype
    if getattr(cfg, "quant", None) is not None:
        from jaxtrain import quant
        return lambda x, name: quant.grouped_project(x, pe[name], sizes, cfg,
                                                     kernel=m.grouped_gemm)
    return lambda x, name: grouped_matmul(x.astype(dt), pe[name].astype(dt), sizes,
                                          kernel=m.grouped_gemm)


def _ffn_buffers(pe, xe, cfg, m: MoEConfig):
    """Fixed buffers xe [E_loc, C, D] through their experts (pad_to_capacity) -> [E_loc, C, D]."""
    from jaxtrain.models.layers import activation

    dt = cfg.compute_dtype
    E, C, _ = xe.shape
    if getattr(cfg, "quant", None) is not None:   # the buffers as E groups of C rows
        gmm = _expert_matmul(pe, jnp.full((E,), C, jnp.int32), cfg, m)
        mm = lambda x, n: gmm(x.reshape(E * C, -1), n).reshape(E, C, -1)  # noqa: E731
    else:
        mm = lambda x, n: jnp.einsum("ecd,edf->ecf", x.astype(dt),  # noqa: E731
                                     pe[n].astype(dt))
    bias = lambda n: 0.0 if n not in pe else pe[n].astype(dt)[:, None, :]  # noqa: E731
    act = functools.partial(activation, cfg.activation)
    if cfg.gated_linear_unit:
        h0, h1 = mm(xe, "wi_0") + bias("bi_0"), mm(xe, "wi_1") + bias("bi_1")
        h = _maybe_remat_act(lambda a, b: _glu(a, b, act, m), cfg)(h0, h1)
    else:
        h = _maybe_remat_act(act, cfg)(mm(xe, "wi") + bias("bi"))
    return mm(h, "wo")


def _maybe_remat_act(fn, cfg):
    return jax.checkpoint(fn) if "moe_act" in cfg.recompute_modules else fn


def _down_bias(pe, ids, live, dt):
    """Each row's expert down-projection bias (``bo``), 0 for rows without a local expert."""
    if "bo" not in pe:
        return 0.0
    return jnp.where(live[:, None], pe["bo"].astype(dt)[jnp.where(live, ids, 0)], 0.0)


def _sorted_ffn(pe, x, ids, weights, E_loc, cfg, m, tensor):
    """Token rows x [M, D] with one local expert id each (ids [M]; ids >= E_loc: none) and
    routing weights [M]: sort by expert, grouped FFN (summed over ``tensor``), unsort ->
    weighted outputs [M, D]."""
    live = ids < E_loc
    key = jnp.where(live, ids, E_loc)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(key, E_loc, dtype=jnp.int32), axis=0)
    y = _psum(_ffn_rows(pe, x[order], key[order], sizes, cfg, m), tensor)
    y = y[jnp.argsort(order)] + _down_bias(pe, ids, live, y.dtype)
    return y * (weights * live).astype(y.dtype)[:, None]


def _combine(y_slots, N, k):
    """Sum the k expert outputs of each token: [N*k, D] -> [N, D] (fixed order)."""
    return y_slots.reshape(N, k, -1).sum(1)


def _buffer_ffn(pe, x, slots, weights, cfg, m, tensor):
    """pad_to_capacity compute: x [M, D], slots [E_loc, C] token ids, weights [E_loc, C]
    -> the weighted outputs scattered back to [M, D]."""
    dt = cfg.compute_dtype
    y = _psum(_ffn_buffers(pe, x[slots], cfg, m), tensor)
    if "bo" in pe:
        y = y + pe["bo"].astype(dt)[:, None, :]
    y = y * weights.astype(dt)[..., None]
    return jnp.zeros((x.shape[0], y.shape[-1]), dt).at[slots.reshape(-1)].add(
        y.reshape(-1, y.shape[-1]))


def _psum(x, axis):
    return jax.lax.psum(x, axis) if axis else x


def experts_local(pe, x, probs, idx, keep, slots, cfg, comm: Comm = LOCAL):
    """The routed experts' output [N, D] for one device's tokens x [N, D] (the whole batch
    without a layout), dispatching over ``comm.expert`` when the experts are split."""
    m = cfg.moe
    N, D = x.shape
    k = idx.shape[1]
    E, ep = m.num_experts, comm.ep
    E_loc = E // ep
    dt = cfg.compute_dtype
    w = (probs * keep).astype(jnp.float32)
    if ep == 1 or not comm.tokens_split:
        # every expert rank holds all of its tokens: run the local experts, sum over ranks
        e0 = comm.rank() * E_loc
        if slots is not None and m.pad_to_capacity:
            s, sw = (jax.lax.dynamic_slice_in_dim(a, e0, E_loc) for a in slots)
            y = _buffer_ffn(pe, x, s, sw, cfg, m, comm.tensor)
        else:
            ids = (idx - e0).reshape(-1)
            ids = jnp.where((ids >= 0) & keep.reshape(-1), ids, E_loc)
            y = _sorted_ffn(pe, x[jnp.arange(N * k) // k], ids, w.reshape(-1), E_loc, cfg, m,
                            comm.tensor)
            y = _combine(y, N, k)
        return _psum(y, comm.expert).astype(dt) if ep > 1 else y.astype(dt)
    if m.dispatcher == "alltoall":
        return _alltoall(pe, x, w, idx, keep, slots, cfg, comm).astype(dt)
    return _allgather(pe, x, w, idx, keep, slots, cfg, comm).astype(dt)


def _allgather(pe, x, w, idx, keep, slots, cfg, comm: Comm):
    """Gather the expert group's tokens, run the local experts on all of them, reduce-scatter
    the partial outputs back to their devices (Megatron's allgather dispatcher)."""
    m = cfg.moe
    N, k = idx.shape
    E_loc = m.num_experts // comm.ep
    e0 = comm.rank() * E_loc
    gather = lambda a: jax.lax.all_gather(a, comm.expert, tiled=True)  # noqa: E731
    X = gather(x)
    if slots is not None and m.pad_to_capacity:
        s, sw = slots                                                        # [E, C]
        offset = jnp.arange(comm.ep)[:, None, None] * N
        S = jax.lax.all_gather(s, comm.expert) + offset                      # [ep, E, C]
        SW = jax.lax.all_gather(sw, comm.expert)
        take = lambda a: jnp.moveaxis(jax.lax.dynamic_slice_in_dim(a, e0, E_loc, axis=1),
                                      1, 0).reshape(E_loc, -1)  # noqa: E731
        y = _buffer_ffn(pe, X, take(S), take(SW), cfg, m, comm.tensor)
    else:
        ids = (gather(idx) - e0).reshape(-1)
        ids = jnp.where((ids >= 0) & gather(keep).reshape(-1), ids, E_loc)
        M = X.shape[0]
        y = _sorted_ffn(pe, X[jnp.arange(M * k) // k], ids, gather(w).reshape(-1), E_loc, cfg, m,
                        comm.tensor)
        y = _combine(y, M, k)
    return jax.lax.psum_scatter(y, comm.expert, scatter_dimension=0, tiled=True)


def _alltoall(pe, x, w, idx, keep, slots, cfg, comm: Comm):
    """Send each (token, expert) pair to the device owning the expert in fixed-size slots
    (all_to_all), run the experts there, send the outputs back and combine them."""
    m = cfg.moe
    N, k = idx.shape
    ep, E_loc = comm.ep, m.num_experts // comm.ep
    a2a = lambda a: jax.lax.all_to_all(a, comm.expert, 0, 0, tiled=False)  # noqa: E731
    if slots is not None and m.pad_to_capacity:
        s, sw = slots                                                        # [E, C]
        C = s.shape[1]
        recv = a2a(x[s].reshape(ep, E_loc, C, -1))                           # [ep_src, E_loc, C, D]
        xe = jnp.moveaxis(recv, 0, 1).reshape(E_loc, ep * C, -1)
        y = _psum(_ffn_buffers(pe, xe, cfg, m), comm.tensor)
        if "bo" in pe:
            y = y + pe["bo"].astype(y.dtype)[:, None, :]
        back = a2a(jnp.moveaxis(y.reshape(E_loc, ep, C, -1), 1, 0))          # [ep_dst, E_loc, C, D]
        y = back.reshape(m.num_experts, C, -1) * sw.astype(y.dtype)[..., None]
        return jnp.zeros((N, y.shape[-1]), y.dtype).at[s.reshape(-1)].add(
            y.reshape(-1, y.shape[-1]))
    # dropless: pair p = (token p // k, expert idx); slot = rank among pairs for that device
    flat, live = idx.reshape(-1), keep.reshape(-1)
    dest = jnp.where(live, flat // E_loc, ep)
    order = jnp.argsort(dest, stable=True)
    sent = jnp.sum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0)       # pairs per device
    start = jnp.cumsum(sent) - sent
    S = N * k                                                                # worst case
    d_sorted = dest[order]
    pos = jnp.arange(S) - start[jnp.minimum(d_sorted, ep - 1)]
    buf = jnp.zeros((ep + 1, S), jnp.int32).at[d_sorted, pos].set(order, mode="drop")[:ep]
    used = jnp.zeros((ep + 1, S), jnp.bool_).at[d_sorted, pos].set(True, mode="drop")[:ep]
    xs = jnp.where(used[..., None], x[buf // k], 0).astype(cfg.compute_dtype)  # [ep, S, D]
    ids = jnp.where(used, flat[buf] % E_loc, E_loc)
    rx, rids = a2a(xs), a2a(ids)                                             # from each source
    y = _sorted_ffn(pe, rx.reshape(ep * S, -1), rids.reshape(-1),
                    jnp.ones((ep * S,), jnp.float32), E_loc, cfg, m, comm.tensor)
    y = a2a(y.reshape(ep, S, -1))                                            # back to sources
    pairs = jnp.zeros((N * k + 1, y.shape[-1]), y.dtype).at[
        jnp.where(used, buf, N * k).reshape(-1)].add(y.reshape(ep * S, -1))[:N * k]
    return _combine(pairs * w.reshape(-1)[:, None].astype(y.dtype), N, k)


# ----------------------------------------------------------------------------- the block

def _gate(p, x, m: MoEConfig, cfg):
    dt = jnp.dtype(m.router_dtype) if m.router_dtype else cfg.compute_dtype
    logits = jnp.einsum("nd,de->ne", x.astype(dt), p["w"].astype(dt))
    if "bias" in p:
        logits = logits + p["bias"].astype(dt)
    return logits


def _routed_local(p, x, xr, rand, prev, steps, cfg, train, comm: Comm):
    """Router + experts on one device's tokens x [b, t, D] -> (y [b, t, D], stats)."""
    m = cfg.moe
    b, t, D = x.shape
    logits = _gate(p["router"], xr.reshape(b * t, D), m, cfg)
    probs, idx, keep, slots, stats = route(
        logits, m, train=train, bias=p["router"].get("expert_bias") if m.expert_bias else None,
        rand_logits=None if rand is None else rand.reshape(b * t, -1), prev_aux_counts=prev,
        prev_steps=steps, comm=comm, seqs=b)
    y = experts_local(p["experts"], x.reshape(b * t, D), probs, idx, keep, slots, cfg, comm)
    return y.reshape(b, t, D), stats


def moe_block(p: dict, x, cfg, *, train: bool, rng=None, prev_aux_counts=None,
              prev_steps=None):
    """The MoE FFN on x [B, T, D] -> (y [B, T, D], stats); ``p`` holds router, experts and
    optionally shared (the always-on expert). ``rng`` feeds input jitter and
    random-logit forced balancing; ``prev_*`` carry global_aux_loss's running counts."""
    from jaxtrain.models import layers as L
    from jaxtrain.parallel.sharding import active_layout, constrain, spec_for

    m = cfg.moe
    x = constrain(x, "act_batch", "act_seq", "act_embed")
    B, T, D = x.shape
    key = rng if rng is not None else jax.random.key(0)
    xr = x
    if train and m.input_jitter_eps and rng is not None:
        eps = m.input_jitter_eps
        noise = jax.random.uniform(jax.random.fold_in(key, 0), x.shape, jnp.float32,
                                   1.0 - eps, 1.0 + eps)
        xr = (x * noise).astype(x.dtype)
    rand = (jax.random.normal(jax.random.fold_in(key, 1), (B, T, m.num_experts), jnp.float32)
            if m.force_balancing == "uniform" else None)
    routed = {"router": p["router"], "experts": p["experts"]}
    layout = active_layout()
    if layout is None or layout.mesh.size == 1:
        y, stats = _routed_local(routed, x, xr, rand, prev_aux_counts, prev_steps, cfg, train,
                                 LOCAL)
    else:
        y, stats = _sharded(layout, routed, x, xr, rand, prev_aux_counts, prev_steps, cfg,
                            train, spec_for)
    if "shared" in p:
        shared = L.mlp
        if "shared_experts" in cfg.recompute_modules:
            shared = jax.checkpoint(shared, static_argnums=(2,))
        y = y + shared(p["shared"], x, cfg).astype(y.dtype)
    return y, stats


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _sharded(layout, routed, x, xr, rand, prev, steps, cfg, train, spec_for):
    """The routed part in a shard_map over the whole mesh (see the module docstring)."""
    m = cfg.moe
    rules, shape = layout.rules, layout.mesh_shape
    xs = spec_for(("act_batch", "act_seq", "act_embed"), x.shape, rules, shape)
    batch, seq = _axes(xs[0]), _axes(xs[1])
    wnames = {"wi": ("exp", "embed", "mlp"), "wi_0": ("exp", "embed", "mlp"),
              "wi_1": ("exp", "embed", "mlp"), "wo": ("exp", "mlp", "embed"),
              "bi": ("exp", "mlp"), "bi_0": ("exp", "mlp"), "bi_1": ("exp", "mlp"),
              "bo": ("exp", "embed")}

    def wspec(name, a):
        from jaxtrain.quant import QWeight
        names = tuple(None if n == "mlp" and not m.expert_tensor_parallel else n
                      for n in wnames[name])
        spec = spec_for(names, a.shape, rules, shape)
        if isinstance(a, QWeight):   # quantized: its scaling state and switch are replicated
            return QWeight(spec, jax.tree.map(lambda _: P(), a.meta),
                           None if a.on is None else P())
        return spec

    espec = {n: wspec(n, a) for n, a in routed["experts"].items()}
    wo = getattr(espec["wo"], "w", espec["wo"])
    ep_axes, tensor = _axes(wo[0]), _axes(wo[1])
    if len(ep_axes) > 1:
        raise ValueError(f"experts split over several mesh axes {ep_axes}; expected one")
    expert = ep_axes[0] if ep_axes else None
    comm = Comm(seq=seq, batch=batch, expert=expert,
                ep=shape[expert] if expert else 1, tokens_split=expert in batch,
                tensor=tensor[0] if tensor else None)
    tok = P(*xs)
    rspec = jax.tree.map(lambda _: P(), routed["router"])
    in_specs = ({"router": rspec, "experts": espec}, tok, tok,
                None if rand is None else P(xs[0], xs[1], None),
                None if prev is None else P(), None if steps is None else P())

    def body(routed, x, xr, rand, prev, steps):
        return _routed_local(routed, x, xr, rand, prev, steps, cfg, train, comm)

    args = (routed, x, xr, rand, prev, steps)
    keep = [i for i, a in enumerate(args) if a is not None]
    fn = jax.shard_map(
        lambda *live: body(*_fill(live, keep, len(args))), mesh=layout.mesh,
        in_specs=tuple(in_specs[i] for i in keep), out_specs=(tok, P()))
    return fn(*(args[i] for i in keep))


def _fill(live, keep, n):
    out = [None] * n
    for i, a in zip(keep, live):
        out[i] = a
    return out


# ----------------------------------------------------------------------------- train step side

def trainable(tree):
    """``tree`` (params, grads or their logical axes) without the non-trainable leaves."""
    if isinstance(tree, dict):
        return {k: trainable(v) for k, v in tree.items() if k not in NON_TRAINABLE}
    return tree


def merge_trainable(full, part):
    """``full`` with the leaves of ``part`` (a :func:`trainable` subtree) put back in."""
    if isinstance(full, dict):
        return {k: (merge_trainable(v, part[k]) if k in part else v) for k, v in full.items()}
    return part


def update_expert_bias(params: dict, counts, cfg) -> dict:
    """Megatron's aux-free update, once per global batch: bias += rate·sign(mean(c) − c) per
    MoE layer, so under-loaded experts rise. counts [L_moe, E]: tokens kept per expert."""
    m = cfg.moe
    if m is None or not m.expert_bias or "moe_layers" not in params:
        return params
    c = counts.astype(jnp.float32)
    delta = m.bias_update_rate * jnp.sign(c.mean(-1, keepdims=True) - c)      # [L_moe, E]
    layers = params["moe_layers"]
    router = layers["moe"]["router"]
    bias = router["expert_bias"]
    axis = cfg.param_scan_axis if bias.ndim == 2 else 0
    new = bias + jnp.moveaxis(delta, 0, axis).astype(bias.dtype)
    return {**params, "moe_layers": {**layers, "moe": {**layers["moe"], "router": {
        **router, "expert_bias": new}}}}


def metrics(stats: dict, cfg, moe_layer_ids) -> dict:
    """Metrics rows from stats averaged over microbatches ([L_moe, ...] leaves): each balancing
    loss and the z-loss without their coefficients, averaged over MoE layers (and per layer,
    named by the global layer index, with per_layer_logging)."""
    m = cfg.moe
    out = {}
    named = [(LOSS_METRICS[t], stats["lb"][:, j]) for j, (t, c) in
             enumerate(zip(m.load_balancing, m.aux_loss_coeff)) if t in LOSS_METRICS and c > 0]
    if m.z_loss_coeff:
        named.append(("moe_z_loss", stats["z"]))
    for name, per_layer in named:
        out[name] = jnp.mean(per_layer)
        if m.per_layer_logging:
            for j, layer in enumerate(moe_layer_ids):
                out[f"{name}_layer_{layer}"] = per_layer[j]
    return out


def moe_layer_ids(cfg) -> tuple[int, ...]:
    """Global indices of the MoE layers, in the order their statistics are stacked."""
    return tuple(i for i, on in enumerate(moe_pattern(cfg.moe, cfg.num_layers)) if on)


def zero_stats(cfg):
    """Zeros shaped like the forward's stacked MoE statistics (None without MoE layers): the
    train step's accumulator over microbatches."""
    m = cfg.moe
    n = len(moe_layer_ids(cfg)) if m is not None else 0
    if not n:
        return None
    f32 = jnp.float32
    stats = {"lb": jnp.zeros((n, len(m.load_balancing)), f32), "z": jnp.zeros((n,), f32),
             "objective": jnp.zeros((n,), f32), "counts": jnp.zeros((n, m.num_experts), f32)}
    if "global_aux_loss" in m.load_balancing:
        stats["aux_counts"] = jnp.zeros((n, m.num_experts), f32)
    return stats


def upcycle(dense_params: dict, cfg, key) -> dict:
    """MoE parameters for ``cfg`` from those of its dense counterpart (``cfg.replace(moe=None)``):
    Megatron's upcycling (moe_use_upcycling; the train loop calls it at the start of a run).

    Granularity g = ffn_hidden_size / moe ffn_hidden_size: each dense FFN's hidden units are cut
    into g consecutive slices and expert e starts as slice e mod g. Expert weights (both
    up-projections, their biases, the down projection) are multiplied by s^(1/3) for gated or
    squared-ReLU units, s^(1/2) otherwise, with s = E·g/k under pre_softmax and s = g without
    (Megatron's compensation for the routing weights, arXiv:2410.07524); the down bias is
    copied. The router is freshly initialised from ``key`` with experts e and e' sharing a
    column when e // g = e' // g; router bias, expert bias and the shared expert keep their
    fresh initial values (Megatron copies nothing into them). Attention, norms, embeddings and
    the layers that stay dense are copied.

    With g = 1, no pre_softmax, no shared expert, no topk_scaling_factor and routing weights
    that sum to 1 (softmax over the top k; sigmoid/sqrtsoftplus renormalised, k > 1) every
    expert is the dense FFN and the MoE model computes exactly what the dense one did.
    """
    from jaxtrain.models.params import ParamSpec, _leaf_key, layer_slots, param_specs

    m = cfg.moe
    F, Fe, E = cfg.ffn_hidden_size, m.ffn_hidden_size, m.num_experts
    if F % Fe or E % (F // Fe):
        raise ValueError(f"upcycling cuts the dense FFN ({F} hidden units) into experts of "
                         f"moe_ffn_hidden_size {Fe}: it must divide ffn_hidden_size, and "
                         f"num_experts ({E}) must be a multiple of the {F // max(Fe, 1)} slices")
    g = F // Fe
    act_scale = E * g / m.topk if m.pre_softmax else float(g)
    cube = cfg.gated_linear_unit or cfg.activation == "squared_relu"
    w_scale = act_scale ** (1 / 3 if cube else 1 / 2)
    slice_of = jnp.arange(E) % g                  # expert -> dense slice
    column_of = jnp.arange(E) // g                # expert -> router column

    specs = param_specs(cfg)["moe_layers"]["moe"]
    fresh = jax.tree_util.tree_map_with_path(
        lambda path, s: s.make(_leaf_key(key, path)),
        {k: specs[k] for k in ("router", "shared") if k in specs},
        is_leaf=lambda x: isinstance(x, ParamSpec))
    fresh["router"]["w"] = jnp.take(fresh["router"]["w"], column_of, axis=-1)

    def expert_leaf(name, a):   # a: one dense leaf, layers first -> [L, E, ...]
        if name == "bo":
            return jnp.broadcast_to(a[:, None], (a.shape[0], E, *a.shape[1:]))
        a = a * jnp.asarray(w_scale, a.dtype)
        if name == "wo":                                                    # [L, F, D]
            return jnp.take(a.reshape(a.shape[0], g, Fe, -1), slice_of, axis=1)
        if name.startswith("bi"):                                           # [L, F]
            return jnp.take(a.reshape(a.shape[0], g, Fe), slice_of, axis=1)
        a = a.reshape(*a.shape[:2], g, Fe)                                  # [L, D, g, Fe]
        return jnp.moveaxis(jnp.take(a, slice_of, axis=2), 2, 1)

    ax = cfg.param_scan_axis
    dense = dense_params["layers"]
    out = {k: v for k, v in dense_params.items() if k != "layers"}
    for kind in ("layers", "moe_layers"):
        ids = [i for i, (k, _) in enumerate(layer_slots(cfg)) if k == kind]
        if not ids:
            continue
        take = jax.tree.map(lambda a: jnp.take(a, jnp.asarray(ids), axis=ax), dense)
        if kind == "layers":
            out[kind] = take
            continue
        experts = {}
        for name, a in take["mlp"].items():
            a = expert_leaf(name, jnp.moveaxis(a, ax, 0))                   # [L, E, ...]
            experts[name] = a if ax == 0 else jnp.swapaxes(a, 0, 1)        # L at ax of [E, ...]
        rest = {k: v for k, v in take.items() if k != "mlp"}
        out[kind] = {**rest, "moe": {**fresh, "experts": experts}}
    return out
