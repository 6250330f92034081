"""pgs (palingenesis) files: ``section: {key: value}`` for training and distillation runs.

A file with pgs sections (``train:``, ``data:``, ``model:`` ...) is a pgs file and takes pgs's
defaults; one with distillation's sections (``teachers:``, ``sources:``, ``rollout:``, ``loss:``)
or a ``model.student`` is a ``pgs distill`` file.
"""
from __future__ import annotations

from jaxtrain.config.sources import NAMED_SECTIONS, PGS_SECTIONS

DISTILL_MARKERS = ("teachers", "sources", "rollout", "loss")


def dialect_of(mapping: dict) -> str | None:
    """"pgs-train", "pgs-distill", or None for a file without pgs sections."""
    sections = {k for k, v in mapping.items() if isinstance(v, dict)
                and k in PGS_SECTIONS + NAMED_SECTIONS}
    if not sections:
        return None
    if sections & set(DISTILL_MARKERS) or "student" in (mapping.get("model") or {}):
        return "pgs-distill"
    return "pgs-train"
