"""Which MLP activation the knobs choose: Megatron's exclusive switches and MaxText's
``mlp_activations``.

Megatron's switches (``swiglu``, ``quick_geglu``, ``openai_gelu``, ``squared_relu``; none: GELU,
the tanh approximation with ``add_bias_linear`` and ``bias_gelu_fusion``) are the canonical
knobs. MaxText's ``mlp_activations`` lists one input projection per entry ('linear': the
identity), so [act, linear] is a gated MLP and [act] a plain one. The MaxText rules
(config/dialects/maxtext_model.py) turn it into the switches where one names the same MLP;
what no switch names ([silu], [relu], [gelu, linear], [relu, linear]; the HF dialect writes
these too) stays in ``mlp_activations``, which the model builder (jaxtrain/models/from_knobs.py)
reads before the switches. Config code and the models both import this module (config never
imports the models).
"""
from __future__ import annotations

from typing import Any, Mapping

SWITCHES = ("swiglu", "quick_geglu", "openai_gelu", "squared_relu")
# switch -> (ModelConfig.activation, gated_linear_unit)
_SWITCHED = {"swiglu": ("silu", True), "quick_geglu": ("quick_gelu", True),
             "openai_gelu": ("gelu_tanh", False), "squared_relu": ("squared_relu", False)}
# MaxText activation names (flax.linen functions) -> jaxtrain activation. flax's gelu is the
# tanh approximation.
_MAXTEXT = {"silu": "silu", "swish": "silu", "gelu": "gelu_tanh", "relu": "relu"}


def megatron_activation(values: Mapping[str, Any]) -> tuple[str, bool]:
    """(activation, gated) from Megatron's exclusive activation switches in ``values`` (a
    complete mapping of canonical knobs); ValueError when more than one is on."""
    flags = [k for k in SWITCHES if values[k]]
    if len(flags) > 1:
        raise ValueError(f"activation knobs {flags} are exclusive; set only one")
    activation, gated = _SWITCHED.get(flags[0] if flags else None, ("gelu", False))
    if activation == "gelu" and values["add_bias_linear"] and values["bias_gelu_fusion"]:
        activation = "gelu_tanh"  # Megatron's fused bias-GeLU is the tanh approximation
    return activation, gated


def mlp_from_activations(acts) -> tuple[str, bool]:
    """(activation, gated) for MaxText's mlp_activations; ValueError names what is unsupported.

    MaxText multiplies one projection per entry; 'linear' is the identity. So [act, linear]
    (either order) is a gated MLP with act on the gate, [act] a plain MLP."""
    acts = list(acts)
    known = [a for a in acts if a != "linear"]
    if len(acts) not in (1, 2) or len(known) != 1 or known[0] not in _MAXTEXT:
        raise ValueError(
            f"mlp_activations {acts!r} is not supported: jaxtrain builds [act] (plain MLP) or "
            f"[act, 'linear'] (gated MLP) with act one of {sorted(_MAXTEXT)}")
    return _MAXTEXT[known[0]], len(acts) == 2


def switches_for(activation: str, gated: bool) -> dict[str, bool] | None:
    """The switch values that choose (activation, gated), or None when no switch does."""
    for name, chosen in _SWITCHED.items():
        if chosen == (activation, gated):
            return {k: k == name for k in SWITCHES}
    return None

