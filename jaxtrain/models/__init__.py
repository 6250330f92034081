"""Dense decoder LMs as pure functions over parameter pytrees, with HF import/export."""
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.hf import from_hf, to_hf
from jaxtrain.models.params import abstract, init, logical_axes, param_specs
from jaxtrain.models.transformer import forward

__all__ = ["ModelConfig", "abstract", "forward", "from_hf", "init", "logical_axes",
           "param_specs", "to_hf"]
