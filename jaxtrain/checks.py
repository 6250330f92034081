"""Host-side checks on each step's metrics, with Megatron's semantics.

- ``check_for_nan_in_loss_and_grad``: a NaN/Inf loss or gradient norm stops the run (off under
  dynamic fp16 loss scaling, where overflows are expected and skipped).
- ``check_for_spiky_loss`` / ``check_for_large_grads``: the largest |value| over the first 100
  steps sets a reference; later values of 10x that or more are reported (not fatal).
"""
from __future__ import annotations

import math

REFERENCE_STEPS, FACTOR = 100, 10.0


class TrainingError(RuntimeError):
    """A fatal problem found during training (the CLI reports it and exits 1)."""


class BuildError(RuntimeError):
    """An unexpected exception while building the run from a config the checks accepted: a bug
    (the dry run should have refused the config); the CLI reports it without a traceback."""


class SpikeWatch:
    """Megatron's spiky-value check for one series (loss or gradient norm)."""

    def __init__(self, name: str):
        self.name, self.seen, self.reference = name, 0, 0.0

    def __call__(self, step: int, value: float) -> str | None:
        if not math.isfinite(value):
            return None
        self.seen += 1
        if self.seen <= REFERENCE_STEPS:
            self.reference = max(self.reference, abs(value))
            return None
        if self.reference > 0 and abs(value) >= FACTOR * self.reference:
            return (f"step {step}: {self.name} {value:.4g} is {abs(value) / self.reference:.1f}x "
                    f"the largest of the first {REFERENCE_STEPS} steps ({self.reference:.4g})")
        return None


class Checks:
    def __init__(self, tcfg, logger):
        self.tcfg, self.logger = tcfg, logger
        self.loss = SpikeWatch("loss") if tcfg.check_spiky_loss else None
        self.grads = SpikeWatch("gradient norm") if tcfg.check_large_grads else None

    def __call__(self, step: int, metrics: dict):
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if self.tcfg.check_nan and not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainingError(f"step {step}: loss {loss} / gradient norm {norm} is NaN or Inf "
                                f"(check_for_nan_in_loss_and_grad)")
        for watch, value in ((self.loss, loss), (self.grads, norm)):
            message = watch(step, value) if watch else None
            if message:
                self.logger.warning("spike: %s", message)
        if metrics.get("spike"):
            self.logger.warning("step %d: gradient-norm spike (%.4g), update skipped "
                                "(train.spike_detection)", step, norm)
