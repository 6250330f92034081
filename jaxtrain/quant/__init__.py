"""Quantized training: FP8 (delayed, tensorwise, blockwise, MXFP8; NVIDIA and AMD formats),
NVFP4 emulation, and MaxText's int8/int4/fp8 modes through qwix. See config.py for the recipes
and matmul.py for the numerics."""
from jaxtrain.quant.config import QuantConfig, from_config
from jaxtrain.quant.matmul import native_block_scaled, qeinsum
from jaxtrain.quant.state import (QWeight, attach, grouped_project, init_state, project,
                                  quantized_paths)

__all__ = ["QWeight", "QuantConfig", "attach", "from_config", "grouped_project", "init_state",
           "native_block_scaled", "project", "qeinsum", "quantized_paths"]
