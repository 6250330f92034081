"""The training loop's own small config, built once from the resolved flat config."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.config.errors import ConfigError
from jaxtrain.dpo import DPOConfig
from jaxtrain.loss import CE, TokenObjective
from jaxtrain.loss_scale import LossScaleConfig
from jaxtrain.optim.schedules import batch_ramp, rampup_batches


def _divisor_at_most(n: int, k: int) -> int:
    return max(d for d in range(1, max(1, min(n, k)) + 1) if n % d == 0)


def _eval_iters(cfg) -> int | tuple[int, ...]:
    """eval_iters as an int, or a tuple of per-set counts (multiple_validation_sets only)."""
    iters, interval = cfg["eval_iters"], cfg["eval_interval"]
    if interval is not None and interval < 0:
        raise ConfigError(f"eval_interval {interval}: give a positive step count (or null)")
    counts = [iters] if isinstance(iters, int) else list(iters)
    if not counts or any(n < 0 for n in counts):
        raise ConfigError(f"eval_iters {iters}: give non-negative counts of validation batches")
    if isinstance(iters, int):
        return iters
    if len(counts) == 1 and not cfg["multiple_validation_sets"]:
        return counts[0]
    if not cfg["multiple_validation_sets"]:
        raise ConfigError(f"eval_iters {iters}: a list gives one count per validation set and "
                          "needs multiple_validation_sets: true")
    return tuple(counts)


# the pipelines whose data runs out after num_epoch passes in MaxText (its synthetic data does
# not; Megatron's indexed data has its own epochs)
_FINITE_TEXT = ("hf", "grain", "olmo_grain")


def _data_epochs(cfg) -> int | None:
    """MaxText's num_epoch for its file pipelines (in MaxText configs, or when set)."""
    if cfg.get("dataset_type") not in _FINITE_TEXT or cfg.get("mock_data"):
        return None
    epochs = cfg.get("num_epoch")
    if epochs is None:
        return None
    if epochs is None or epochs < 1:
        raise ConfigError(f"num_epoch must be at least 1, got {epochs}")
    return epochs


# pgs plugins that choose the token-weighting objective (config/rules.py allows one)
_OBJECTIVE_KNOBS = ("dft", "deft", "cadft", "info_sft", "pre_rl")


def _objective(cfg) -> TokenObjective:
    """The training objective pgs's plugins.* choose (plain CE when none is on)."""
    on = [k for k in _OBJECTIVE_KNOBS if cfg[f"plugins.{k}"]]
    if len(on) > 1:
        raise ConfigError("choose one token-weighting objective, not "
                          + " and ".join(f"plugins.{k}" for k in on))
    if not on:
        return CE
    pbar = cfg["plugins.info_sft_pbar"]
    if on == ["info_sft"] and not 0.0 < pbar < 1.0:
        raise ConfigError(f"plugins.info_sft_pbar must lie strictly between 0 and 1, got {pbar}")
    if on == ["pre_rl"] and not cfg["model.name_or_path"]:
        raise ConfigError("plugins.pre_rl anchors training to the base model by KL: name it in "
                          "model.name_or_path (a Hugging Face model directory)")
    return TokenObjective(on[0], cadft_beta=float(cfg["plugins.cadft_beta"]),
                          info_sft_pbar=float(pbar),
                          entropy_coeff=float(cfg["plugins.pre_rl_entropy_coeff"]),
                          kl_coeff=float(cfg["plugins.pre_rl_kl_coeff"]))


def _ga_ramp_start(cfg) -> int:
    """pgs train.ga_ramp_start: 0 (off), or the micro-batch count of the first step when it is
    below the full count; the ramp needs the run's length given (pgs's rule)."""
    start, full = cfg["train.ga_ramp_start"] or 0, cfg.derived["num_microbatches"]
    if not 0 < start < full:
        return 0
    if cfg["rampup_batch_size"]:
        raise ConfigError("train.ga_ramp_start and rampup_batch_size both ramp the batch; "
                          "keep one")
    if cfg["train_iters"] is None:
        raise ConfigError("train.ga_ramp_start ramps accumulation with the run's progress: set "
                          "train.max_steps (the length the ramp spans)")
    return start


def _base_merge_ratio(cfg) -> float | None:
    """pgs train.base_merge: the merge ratio r, or None (off); the base weights are
    model.name_or_path's."""
    if not cfg["train.base_merge"]:
        return None
    if not cfg["model.name_or_path"]:
        raise ConfigError("train.base_merge pulls the weights back toward the pretrained ones: "
                          "name them in model.name_or_path (a Hugging Face model directory)")
    return float(cfg["train.base_merge_ratio"])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    # rampup_batch_size (start, increment, samples) or step_batch_size_schedule
    # (optim.schedules.StepSchedule); None: every step takes global_batch_size
    rampup: Any
    decrease_batch_size_if_needed: bool
    num_microbatches: int
    data_parallel_size: int
    train_iters: int | None
    train_samples: int | None
    epochs: int | None
    per_token_loss: bool
    loss_chunks: int
    half_precision_loss: bool
    accum_dtype: str
    loss_scale: LossScaleConfig | None
    check_nan: bool
    check_spiky_loss: bool
    check_large_grads: bool
    spike_detection: bool
    spike_z_threshold: float
    log_interval: int
    log_avg_skip_iterations: int
    log_avg_reset_interval: int
    log_params_norm: bool
    log_num_zeros_in_grad: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    manual_gc: bool
    manual_gc_interval: int
    seed: int
    eval_interval: int | None = None
    eval_iters: int | tuple[int, ...] = 0
    target_eval_loss: float = 0.0    # MaxText: stop once an evaluation's loss reaches it
    full_validation: bool = False
    multiple_validation_sets: bool = False
    skip_train: bool = False
    reuse_example_batch: bool = False     # MaxText benchmark aid: train on the first batch again
    manual_gc_eval: bool = False
    weight_hash_interval: int | None = None
    # MaxText num_epoch: the run ends when the text data has been read this many times
    data_epochs: int | None = None
    # the per-token training loss: plain CE or a pgs token-weighting objective (plugins.*)
    objective: TokenObjective = CE
    # pgs sym_noise: alpha of the ±alpha/sqrt(T·D) input-embedding noise in training; 0 off
    embed_noise: float = 0.0
    # pgs freeze_non_attention: no gradient through the Gated DeltaNet layers (optim/freeze.py)
    freeze_linear: bool = False
    # pgs ga_ramp_start: micro-batches per step at step 1, growing to num_microbatches; 0 off
    ga_ramp_start: int = 0
    # Megatron iterations_to_skip: steps whose batch is read and dropped
    iterations_to_skip: frozenset = frozenset()
    # pgs train.ema: the EMA's decay cap (None: off), updated every ema_every steps
    ema_decay: float | None = None
    ema_every: int = 10
    # pgs train.base_merge: the ratio r of the merge toward the base weights (None: off)
    base_merge_ratio: float | None = None
    base_merge_every: int = 500
    base_merge_method: str = "lerp"
    # pgs memory.gradient_release: each parameter updated during the backward (jaxtrain.release)
    gradient_release: bool = False
    # pgs memory.seco: the chunk length of SeCO's chunk-wise step (jaxtrain.seco; 0 off), with
    # memory.spaco_budget (SpaCO's backpropagated chunks; 0 exact) and memory.seco_kv_offload
    seco_chunk: int = 0
    spaco_budget: int = 0
    seco_kv_offload: bool = False
    # pgs dpo.enabled: the preference loss (jaxtrain.dpo.DPOConfig); None trains on tokens.
    # micro_batch_size/global_batch_size then count rows, two per pair
    dpo: Any = None
    # pipeline parallelism: the stages and schedule (jaxtrain.parallel.stages.PipelinePlan;
    # None without). Set by the loop, which knows the model's layer count
    pipeline: Any = None

    def microbatch_counts(self) -> tuple[int, ...]:
        """Every microbatch count a step of this run can have (a batch-size or accumulation
        ramp gives several; the last is the full one), in the order the run meets them."""
        if self.ga_ramp_start:
            return tuple(range(self.ga_ramp_start, self.num_microbatches + 1))
        if self.rampup is None:
            return (self.num_microbatches,)
        per = self.micro_batch_size * self.data_parallel_size
        batches = rampup_batches(self.global_batch_size, self.rampup,
                                 per if self.decrease_batch_size_if_needed else None)
        counts = [b // per for b in batches] + [self.num_microbatches]
        return tuple(dict.fromkeys(c for c in counts if c > 0))

    @classmethod
    def from_config(cls, cfg) -> "TrainConfig":
        """From a config resolved with a world size (so the batch arithmetic is done)."""
        if "num_microbatches" not in cfg.derived:
            raise ValueError("resolve the config with world_size to build a TrainConfig")
        seq = cfg["seq_length"]
        loss_scale = LossScaleConfig.from_config(cfg)
        accum = ("bfloat16" if cfg["grad_reduce_in_bf16"] else
                 "float16" if cfg["fp16"] and not cfg["accumulate_allreduce_grads_in_fp32"]
                 else "float32")
        chunks = _divisor_at_most(seq, cfg["memory.loss_num_chunks"]) \
            if cfg["memory.chunked_loss"] else 0
        eval_iters = _eval_iters(cfg)
        if cfg["train_iters"] is None and cfg["train_samples"] is None and not cfg["train.epochs"]:
            raise ConfigError("set train_iters (steps), train_samples or train.epochs: the run "
                              "has no length")
        dpo_cfg = DPOConfig.from_config(cfg)
        rows = 2 if dpo_cfg is not None else 1   # pgs: per_device_batch_size counts pairs
        return cls(
            seq_length=seq, micro_batch_size=cfg["micro_batch_size"] * rows,
            global_batch_size=cfg["global_batch_size"] * rows, dpo=dpo_cfg,
            rampup=batch_ramp(lambda k: cfg[k]),
            decrease_batch_size_if_needed=cfg["decrease_batch_size_if_needed"],
            num_microbatches=cfg.derived["num_microbatches"],
            data_parallel_size=cfg.derived["data_parallel_size"],
            train_iters=cfg["train_iters"], train_samples=cfg["train_samples"],
            data_epochs=_data_epochs(cfg),
            epochs=cfg["train.epochs"], per_token_loss=cfg["calculate_per_token_loss"],
            loss_chunks=chunks, half_precision_loss=cfg["fp16_lm_cross_entropy"],
            accum_dtype=accum, loss_scale=loss_scale,
            check_nan=cfg["check_for_nan_in_loss_and_grad"] and not (
                loss_scale is not None and loss_scale.dynamic),
            check_spiky_loss=cfg["check_for_spiky_loss"],
            check_large_grads=cfg["check_for_large_grads"],
            spike_detection=cfg["train.spike_detection"],
            spike_z_threshold=cfg["train.spike_z_threshold"],
            log_interval=cfg["log_interval"],
            log_avg_skip_iterations=cfg["log_avg_skip_iterations"],
            log_avg_reset_interval=cfg["log_avg_reset_interval"], log_params_norm=cfg["log_params_norm"],
            log_num_zeros_in_grad=cfg["log_num_zeros_in_grad"],
            exit_interval=cfg["exit_interval"], exit_duration_in_mins=cfg["exit_duration_in_mins"],
            exit_signal_handler=cfg["exit_signal_handler"], manual_gc=cfg["manual_gc"],
            manual_gc_interval=cfg["manual_gc_interval"], seed=cfg["seed"],
            eval_interval=cfg["eval_interval"] or None, eval_iters=eval_iters,
            full_validation=cfg["full_validation"],
            target_eval_loss=float(cfg["target_eval_loss"] or 0.0),
            multiple_validation_sets=cfg["multiple_validation_sets"],
            skip_train=cfg["skip_train"], manual_gc_eval=cfg["manual_gc_eval"],
            reuse_example_batch=bool(cfg["reuse_example_batch"]),
            weight_hash_interval=cfg["check_weight_hash_across_dp_replicas_interval"],
            objective=_objective(cfg),
            embed_noise=float(cfg["plugins.sym_noise_alpha"]) if cfg["plugins.sym_noise"]
            else 0.0,
            ga_ramp_start=_ga_ramp_start(cfg),
            freeze_linear=bool(cfg["train.freeze_non_attention"]),
            iterations_to_skip=frozenset(cfg["iterations_to_skip"] or ()),
            ema_decay=float(cfg["train.ema_decay"]) if cfg["train.ema"] else None,
            ema_every=cfg["train.ema_every"], base_merge_ratio=_base_merge_ratio(cfg),
            base_merge_every=cfg["train.base_merge_every"],
            base_merge_method=cfg["train.base_merge_method"],
            gradient_release=bool(cfg["memory.gradient_release"]),
            seco_chunk=int(cfg["memory.seco_chunk_size"]) if cfg["memory.seco"] else 0,
            spaco_budget=int(cfg["memory.spaco_budget"]) if cfg["memory.seco"] else 0,
            seco_kv_offload=bool(cfg["memory.seco"] and cfg["memory.seco_kv_offload"]))
