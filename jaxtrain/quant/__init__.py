"""Quantized training: FP8 (delayed, tensorwise, blockwise, MXFP8; NVIDIA and AMD formats),
NVFP4 emulation, and MaxText's int8/int4/fp8 modes through qwix. See config.py for the recipes,
matmul.py for the numerics and hooks.py for what the model layers call. Which of a model's
weights are quantized, and their delayed-scaling state, live with the model
(jaxtrain.models.quant_state): this package does not know the parameter tree."""
from jaxtrain.quant.config import QuantConfig, from_config
from jaxtrain.quant.hooks import QWeight, grouped_project, project
from jaxtrain.quant.matmul import native_block_scaled, qeinsum

__all__ = ["QWeight", "QuantConfig", "from_config", "grouped_project", "native_block_scaled",
           "project", "qeinsum"]
