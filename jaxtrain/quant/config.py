"""What the quantization knobs ask for, as one hashable :class:`QuantConfig`.

Megatron ``fp8`` / ``fp8_recipe`` / ``fp4``, MaxText ``quantization`` and pgs
``memory.float8_training`` each pick a recipe for the transformer layers' projections (the
matmuls that go through ``models.layers.dense``; the embedding and the output layer stay in the
compute dtype, as in Megatron and MaxText):

    recipe      scales                                     engine
    delayed     per tensor, from an amax history (state)   ours (matmul.py)
    tensorwise  per tensor, from the current amax           ours
    blockwise   per 1x128 block (activations, gradients) and 128x128 block (weights),
                powers of two (TE Float8BlockScaling)        ours
    mxfp8       per 1x32 block, E8M0                        ours, or jax.nn.scaled_dot_general
                                                            (cuDNN) on GPUs that have it
    nvfp4       per 1x16 block in e4m3 times a per-tensor float32 scale        ours
    qwix        per channel (int8/int4/fp8, current)        qwix dot_general_qt
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxtrain.config.errors import ConfigError

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "qwix")
FORMATS = ("e4m3", "e5m2", "e2m1", "int8", "int4")

# MaxText quantization value -> (recipe, x, w, g, fnuz, note). Without use_qwix_quantization
# (MaxText's default) fp8/nanoo_fp8 are Flax's delayed-scaling ops (history 1024, e4m3 forward,
# e5m2 gradients); the others exist only on MaxText's qwix path; te_* name TransformerEngine
# recipes, which map to the Megatron recipe of the same scaling.
MAXTEXT = {
    "fp8": ("delayed", "e4m3", "e4m3", "e5m2", False),
    "fp8_gpu": ("delayed", "e4m3", "e4m3", "e5m2", False),
    "nanoo_fp8": ("delayed", "e4m3", "e4m3", "e5m2", True),
    "fp8_nanoo": ("delayed", "e4m3", "e4m3", "e5m2", True),
    "fp8_full": ("qwix", "e4m3", "e4m3", "e5m2", False),
    "fp8_e4m3": ("qwix", "e4m3", "e4m3", "e4m3", False),
    "fp8_e5m2": ("qwix", "e5m2", "e5m2", "e5m2", False),
    "int8": ("qwix", "int8", "int8", None, False),
    "int4": ("qwix", "int4", "int4", None, False),
    "int8w": ("qwix", None, "int8", None, False),
    "int4w": ("qwix", None, "int4", None, False),
    "te_fp8_delayedscaling": ("delayed", "e4m3", "e4m3", "e5m2", False),
    "te_fp8_currentscaling": ("tensorwise", "e4m3", "e4m3", "e5m2", False),
    "te_mxfp8": ("mxfp8", "e4m3", "e4m3", "e4m3", False),
    "te_nvfp4_no_rht": ("nvfp4", "e2m1", "e2m1", "e2m1", False),
}
FLAX_HISTORY_LEN = 1024  # Flax's Fp8DotGeneralOp / MaxText's Fp8Einsum amax history


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the projections are quantized. ``x``/``w``/``g`` are the element formats of the
    activations, weights and output gradients (None: left in the compute dtype)."""

    recipe: str
    x: str | None
    w: str | None
    g: str | None
    fnuz: bool = False                  # AMD MI300 float8 variants (e4m3fnuz / e5m2fnuz)
    margin: int = 0                     # delayed: scale = fp8_max / amax / 2^margin
    history_len: int = 1024             # delayed: amax ring length
    amax_algo: str = "max"              # delayed: max of the ring, or most_recent
    wgrad: bool = True                  # quantize the weight-gradient GEMM's operands too
    bf16_start: int = 0                 # leading layers left unquantized
    bf16_end: int = 0                   # trailing layers left unquantized
    source: str = ""                    # the knob that chose it, for messages

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ConfigError(f"quantization recipe {self.recipe!r} is not one of {RECIPES}")
        for f in (self.x, self.w, self.g):
            if f is not None and f not in FORMATS:
                raise ConfigError(f"quantization format {f!r} is not one of {FORMATS}")
        if self.recipe == "delayed" and self.history_len < 1:
            raise ConfigError("fp8_amax_history_len must be at least 1")
        if self.recipe == "delayed" and (self.bf16_start or self.bf16_end):
            raise ConfigError("first_last_layers_bf16 is not allowed with delayed scaling "
                              "(Megatron's rule: the layers share one amax/scale schedule); "
                              "use fp8_recipe tensorwise, blockwise or mxfp8, or turn it off")
        if self.amax_algo not in ("max", "most_recent"):
            raise ConfigError(f"fp8_amax_compute_algo {self.amax_algo!r}: max or most_recent")

    @property
    def stateful(self) -> bool:
        """Whether training carries scaling state (amax histories and scales)."""
        return self.recipe == "delayed"

    def layer_quantized(self, num_layers: int) -> list[bool]:
        """Per 0-based layer: whether its projections are quantized (first_last_layers_bf16)."""
        return [self.bf16_start <= i < num_layers - self.bf16_end for i in range(num_layers)]


def _fnuz(cfg: Mapping[str, Any], accelerator: str) -> bool:
    variant = cfg.get("fp8_format_variant") or "auto"
    return variant == "fnuz" or (variant == "auto" and accelerator == "rocm")


def from_config(cfg: Mapping[str, Any], accelerator: str = "cpu") -> QuantConfig | None:
    """The quantization the flat config asks for, or None. ``accelerator`` ('cuda', 'rocm',
    'cpu') picks AMD's fnuz FP8 formats on ROCm unless ``fp8_format_variant`` says otherwise."""
    g = cfg.get
    fp8, fp4 = g("fp8"), g("fp4")
    maxtext = g("quantization") or ""
    pgs = bool(g("memory.float8_training"))
    chosen = [k for k, on in (("fp8", fp8), ("fp4", fp4), ("quantization", maxtext),
                              ("memory.float8_training", pgs)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} each choose how the projections are "
                          "quantized; set only one")
    if not chosen:
        return None
    bf16 = (int(g("num_layers_at_start_in_bf16", 1)), int(g("num_layers_at_end_in_bf16", 1))) \
        if g("first_last_layers_bf16") else (0, 0)
    common = {"bf16_start": bf16[0], "bf16_end": bf16[1], "source": chosen[0]}
    if fp8:
        recipe = g("fp8_recipe") or "delayed"
        if recipe == "custom":
            raise ConfigError("fp8_recipe custom needs a Python quantizer factory "
                              "(fp8_quantizer_factory), which a JAX trainer cannot load; use "
                              "delayed, tensorwise, blockwise or mxfp8")
        return QuantConfig(
            recipe, "e4m3", "e4m3", "e5m2" if fp8 == "hybrid" else "e4m3",
            fnuz=_fnuz(cfg, accelerator), margin=int(g("fp8_margin", 0)),
            history_len=int(g("fp8_amax_history_len", 1024)),
            amax_algo=g("fp8_amax_compute_algo") or "max", wgrad=bool(g("fp8_wgrad", True)),
            **common)
    if fp4:
        recipe = g("fp4_recipe") or "nvfp4"
        if recipe != "nvfp4":
            raise ConfigError(f"fp4_recipe {recipe!r}: only nvfp4 is built (custom needs a "
                              "Python quantizer factory)")
        return QuantConfig("nvfp4", "e2m1", "e2m1", "e2m1", **common)
    if pgs:  # torchao Float8 "rowwise": e4m3 everywhere, one dynamic scale per row
        return QuantConfig("qwix", "e4m3", "e4m3", "e4m3", **common)
    if maxtext not in MAXTEXT:
        raise ConfigError(f"quantization {maxtext!r} is not built; use one of "
                          f"{sorted(MAXTEXT)}")
    recipe, x, w, grad, fnuz = MAXTEXT[maxtext]
    fnuz = fnuz or (x in ("e4m3", "e5m2") and _fnuz(cfg, accelerator))
    return QuantConfig(recipe, x, w, grad, fnuz=fnuz, history_len=FLAX_HISTORY_LEN, **common)
