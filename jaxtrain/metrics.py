"""Throughput accounting and the metrics rows: console lines and ``metrics.jsonl``.

Model FLOPs per token (Megatron's convention, no causal discount, no recompute counted):

    6 * N_active + 6 * L * T * heads * (head_dim + v_head_dim)

N_active counts the weights of every matrix multiply a token goes through: attention
projections (MLA's down/up projections included), dense MLPs, the output layer (an embedding
lookup is not a matmul, a tied output layer is), and in MoE layers the router (D x E), the
shared expert and k of the E routed experts (each routed expert weight counts k/E of its
size); biases, norms and sinks are not matmuls. The second term is the attention scores
(q.k over head_dim, MLA's no-RoPE plus RoPE part) and the weighted sum of values
(v_head_dim; head_dim without MLA), forward and backward, for sequence length T: with
head_dim = v_head_dim it is Megatron's 12 * L * T * heads * head_dim. TFLOP/s per device =
FLOPs per token x tokens per second / devices; MFU = that / the device's peak.

Gemma 4's global layers count their own head width H_g in the second term (2 H_g per head).
On sliding-window and chunked (Llama 4) layers T is bounded by the window or the chunk: a query
there sees at most that many keys (still no causal discount).
Hybrid models: L counts only the softmax-attention layers (LFM2's short-convolution layers
count their projections only); each Gated DeltaNet layer instead
adds 6 * Hv * (3 C Dk + 2 C Dv + 3 Dk Dv) per token (C the chunk length, Hv value heads, Dk/Dv
head widths): within a chunk the key-key and query-key products (C Dk each), the triangular
inverse applied to values and keys (C (Dk + Dv)) and the scores times the values (C Dv); across
chunks the state read by queries and keys and its update (Dk Dv each); no causal discount.
Multi-token prediction: each depth's weights count (its projection [2D, D] and its layer,
of the last layer's kind, whose attention adds a score term), and the output layer counts once
more per depth. Each Mamba-2 layer adds 6 * (C (G N + H P) + 2 H P N): within a chunk the
C.B^T scores (G groups of state width N) and their product with the H heads' inputs of width
P, across chunks the state's write and read (H P N each).
Hyper-connections (n streams): each half's mapping [nD, 2n+R] counts as a weight, and each half
adds 3 * (4 n D + 2 n^2 D) for reading the streams, mixing them and spreading its output.
Attention residuals (Kimi K3): every mix over n candidates adds 3 * 7 n D (their norms, scores
and weighted sum); the gates (MLA's and KDA's output gates) and latent projections are weights.
"""
from __future__ import annotations

import json
import math
import pathlib
import time

import jax
import numpy as np

from jaxtrain.models import attn_res
from jaxtrain.models.hyper import mixing_flops
from jaxtrain.models.spec import (CONV_STACKS, FFN_ONLY_STACKS, LINEAR_STACKS, MAMBA_STACK,
                                  MIXER_ONLY_STACKS, layer_kinds, mtp_layer_kinds)
from jaxtrain.observe.progress import Rate, format_duration

# Layer stacks without softmax attention (no score term)
_NO_SCORES = LINEAR_STACKS + CONV_STACKS + (MAMBA_STACK,) + FFN_ONLY_STACKS
# Matmul weights not named w*: the output layer, MTP's projection, Gemma 4 small's per-layer
# input gates and projections (its per-layer embedding table is a gather)
_MATMULS = ("output", "eh_proj", "ple_gate", "ple_proj", "per_layer_projection")
# Dense bf16 peak TFLOP/s per device, by jax device_kind substring.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "MI300X": 1307.0, "MI325X": 1307.0,
               "MI355X": 2500.0, "B200": 2250.0, "L40S": 362.0}


def flop_terms(model_cfg, params) -> tuple[float, float]:
    """(6 * N_active, 6 * L * heads * (head_dim + v_head_dim)): FLOPs per token is the first
    plus the second times the sequence length when every layer attends to the whole sequence
    (the module docstring's formula; :func:`flops_per_token` bounds windowed layers). ``params``:
    the parameter tree or its shapes; matmul weights are the leaves named ``w*`` and
    ``output`` (``embedding`` when the output layer is tied)."""
    moe = getattr(model_cfg, "moe", None)
    routed = moe.topk / moe.num_experts if moe is not None else 1.0
    n_active = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", None) for k in path]
        name = keys[-1] if isinstance(keys[-1], str) else ""
        if name == "embedding":
            if model_cfg.untie_embeddings_and_output_weights:
                continue
        elif name not in _MATMULS and not name.startswith("w"):
            continue
        size = math.prod(leaf.shape) * (routed if "experts" in keys else 1.0)
        if "mtp" in keys and getattr(model_cfg, "mtp_repeated_layer", False):
            size *= model_cfg.mtp_num_layers   # one module run at every depth
        if name in ("output", "embedding"):   # the output layer runs once more per MTP depth
            size *= 1 + getattr(model_cfg, "mtp_num_layers", 0)
        n_active += size
    kinds = layer_kinds(model_cfg)
    halves = sum(1 if k in MIXER_ONLY_STACKS + FFN_ONLY_STACKS else 2 for k in kinds)
    if getattr(model_cfg, "mtp_hybrid_layers", None):   # a hybrid model's MTP sublayers
        kinds += mtp_layer_kinds(model_cfg) * model_cfg.mtp_num_layers
    linear = sum(k in LINEAR_STACKS for k in kinds)
    attn = sum(c for c, _ in _score_terms(model_cfg))
    return (6.0 * n_active + linear_mixing_flops(model_cfg) * linear
            + mamba_mixing_flops(model_cfg) * kinds.count(MAMBA_STACK)
            + 3.0 * mixing_flops(model_cfg) * halves
            + 3.0 * attn_res.mixing_flops(model_cfg), float(attn))


def flops_per_token(model_cfg, params, seq_length: int) -> float:
    """Model FLOPs per token at ``seq_length``: :func:`flop_terms` with each softmax layer's
    score term counting the keys a query sees, the sequence length or, on sliding-window and
    chunked (Llama 4) layers, at most the window or chunk."""
    dense, _ = flop_terms(model_cfg, params)
    return dense + sum(c * min(seq_length, limit or seq_length)
                       for c, limit in _score_terms(model_cfg))


def _score_terms(cfg) -> list[tuple[float, int | None]]:
    """Per softmax-attention layer: (6 * heads * (q/k width + v width), the most keys a query
    sees or None for the whole sequence). DeepSeek-V4's compressing layers add their entries,
    (that coefficient / ratio, the most tokens the kept entries cover) and on indexed layers the
    indexer's scores (2 * its heads * width / ratio, forward only: no gradient reaches it)."""
    v_dim = cfg.v_head_dim if cfg.multi_latent_attention else cfg.head_dim
    kinds = layer_kinds(cfg)
    wide = getattr(cfg, "global_layers", None) or (False,) * cfg.num_layers
    chunk = getattr(cfg, "attention_chunk_size", None)
    ratios = getattr(cfg, "compress_ratios", None) or (0,) * cfg.num_layers
    per_layer = []
    for i in range(cfg.num_layers):
        if kinds[i] in _NO_SCORES:
            per_layer.append([])
            continue
        width = 2 * cfg.attention_shape(True)[1] if wide[i] else cfg.head_dim + v_dim
        limits = [w for w in (cfg.window_of_layer(i),
                              None if chunk is None or cfg.is_nope(i) else chunk) if w]
        coef = 6.0 * cfg.num_attention_heads * width
        terms = [(coef, min(limits) if limits else None)]
        m = ratios[i]
        if m and m == cfg.compress_sparse_ratio:
            terms += [(coef / m, m * cfg.compress_index_topk),
                      (2.0 * cfg.compress_index_heads * cfg.compress_index_head_dim / m, None)]
        elif m:
            terms.append((coef / m, None))
        per_layer.append(terms)
    out = [t for terms in per_layer for t in terms]
    mtp = [k for k in mtp_layer_kinds(cfg) if k not in _NO_SCORES]
    if mtp and getattr(cfg, "mtp_num_layers", 0):   # MTP layers: the last one's shape
        last = per_layer[-1] if per_layer and per_layer[-1] else [
            (6.0 * cfg.num_attention_heads * (cfg.head_dim + v_dim), None)]
        out += last * (len(mtp) * cfg.mtp_num_layers)
    return out


def linear_mixing_flops(cfg) -> float:
    """Per token and Gated DeltaNet layer, forward and backward: the chunked rule's matmuls
    6 * Hv * (3 C Dk + 2 C Dv + 3 Dk Dv) (module docstring); 0 without such layers."""
    if not any(k in LINEAR_STACKS for k in layer_kinds(cfg)):
        return 0.0
    C, Dk, Dv = cfg.linear_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return 6.0 * cfg.linear_num_value_heads * (3 * C * Dk + 2 * C * Dv + 3 * Dk * Dv)


def mamba_mixing_flops(cfg) -> float:
    """Per token and Mamba-2 layer, forward and backward: the chunked scan's C.B^T scores and
    their use over a chunk of C tokens, the state's write and read:
    6 * (C * (G N + H P) + 2 H P N); 0 without such layers."""
    if MAMBA_STACK not in layer_kinds(cfg):
        return 0.0
    C, G, N = cfg.mamba_chunk_size, cfg.mamba_num_groups, cfg.mamba_state_dim
    H, P = cfg.mamba_heads, cfg.mamba_head_dim
    return 6.0 * (C * (G * N + H * P) + 2 * H * P * N)


def peak_tflops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def device_memory_gib(device) -> float | None:
    """Peak bytes in use on the device, where the backend reports it (GPUs do; CPUs don't)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    peak = stats.get("peak_bytes_in_use") or stats.get("bytes_in_use")
    return peak / 2**30 if peak else None


class Meter:
    """Turns step times and token counts into the throughput columns of a metrics row."""

    def __init__(self, model_cfg, params, seq_length: int, devices, peak: float | None = None):
        self.flops_per_token = flops_per_token(model_cfg, params, seq_length)
        self.devices = list(devices)
        self.peak = peak if peak is not None else peak_tflops(self.devices[0])

    def row(self, step_time_s: float, tokens: float) -> dict:
        tokens_per_s = tokens / step_time_s
        tflops = self.flops_per_token * tokens_per_s / len(self.devices) / 1e12
        return {"step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
                "tflops_per_device": tflops,
                "mfu": tflops / self.peak if self.peak else None,
                "memory_gib": device_memory_gib(self.devices[0])}


class MetricsLog:
    """Appends one JSON row per logged step to ``metrics.jsonl`` and prints a console line
    (step/total, loss, lr, timing, tokens/s, TFLOP/s, MFU, memory, ETA); with ``observers``
    (:class:`jaxtrain.observe.Observers`) each row also goes to the experiment trackers.

    ``grad_norm=False`` (pgs ``logging.log_grad_norm: false``) leaves the gradient norm out of
    the rows. ``copy_to`` (MaxText ``metrics_file``) is a second file that gets every row. The
    ETA uses the rate measured from the first written row on, so the compile step and the steps
    before a resume do not skew it.
    """

    def __init__(self, directory: pathlib.Path, logger, total_steps: int | None,
                 throughput: bool = True, observers=None, grad_norm: bool = True,
                 main: bool = True, copy_to: pathlib.Path | None = None):
        self.main = main  # only process 0 of a multi-process job writes
        if main:
            directory.mkdir(parents=True, exist_ok=True)
            if copy_to is not None:
                copy_to.parent.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.jsonl"
        self.paths = [self.path] + ([copy_to] if copy_to is not None else [])
        self.logger, self.total, self.throughput = logger, total_steps, throughput
        self.observers, self.grad_norm = observers, grad_norm
        self.start = time.perf_counter()
        self.rate = Rate(total_steps)

    @classmethod
    def from_config(cls, cfg, directory: pathlib.Path, logger, total_steps: int | None,
                    observers=None, main: bool = True) -> MetricsLog:
        copy_to = cfg.get("metrics_file") or None
        return cls(directory, logger, total_steps, throughput=cfg["log_throughput"],
                   observers=observers, grad_norm=cfg["logging.log_grad_norm"], main=main,
                   copy_to=pathlib.Path(copy_to) if copy_to else None)

    def _clean(self, row: dict) -> dict:
        return {k: (float(v) if isinstance(v, (np.floating, np.integer, float)) and
                    not isinstance(v, bool) else v) for k, v in row.items()
                if self.grad_norm or k != "grad_norm"}

    def _append(self, row: dict):
        if self.main:
            line = json.dumps(row) + "\n"
            for path in self.paths:
                with path.open("a") as f:
                    f.write(line)
        if self.observers is not None:
            self.observers.write(row)

    def write(self, row: dict):
        """A training row: metrics.jsonl, the console line and the trackers."""
        clean = self._clean(row)
        self.rate.observe(clean["step"])
        if self.main:
            self.logger.info(self._line(clean))
        self._append(clean)

    def write_eval(self, row: dict):
        """A validation/test row (``val_loss``, ``val_ppl``, ...): metrics.jsonl and the
        trackers; the evaluator prints its own console line."""
        self._append(self._clean(row))

    def _line(self, r: dict) -> str:
        parts = [f"step {r['step']}" + (f"/{self.total}" if self.total else ""),
                 f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}"]
        if r.get("grad_norm") is not None:
            parts.append(f"grad_norm {r['grad_norm']:.3f}")
        if r.get("indexer_loss") is not None:   # DeepSeek sparse attention (Megatron logs it)
            parts.append(f"indexer loss {r['indexer_loss']:.4e}")
        parts.append(f"step {r['step_time_s'] * 1e3:.0f} ms")
        if self.throughput:
            parts += [f"{r['tokens_per_s']:.0f} tok/s (avg {r['tokens_per_s_avg']:.0f})",
                      f"{r['tflops_per_device']:.3f} TFLOP/s/dev"]
            if r.get("mfu") is not None:
                parts.append(f"MFU {100 * r['mfu']:.1f}%")
        if r.get("memory_gib") is not None:
            parts.append(f"mem {r['memory_gib']:.2f} GiB")
        mem = [(name, r[key]) for name, key in (("used", "mem_bytes_in_use"),
                                                ("peak", "mem_peak_bytes_in_use"),
                                                ("limit", "mem_bytes_limit"))
               if r.get(key) is not None]
        if mem:
            parts.append("device mem " + "/".join(f"{v / 2**30:.2f}" for _, v in mem)
                         + " GiB (" + "/".join(name for name, _ in mem) + ")")
        if r.get("skipped"):
            parts.append("SKIPPED")
        if self.total and r["step"] > 0:
            eta = self.rate.eta_s(r["step"])
            if eta is None:  # one row so far: elapsed time per step, compile step included
                eta = (time.perf_counter() - self.start) / r["step"] * (self.total - r["step"])
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)
