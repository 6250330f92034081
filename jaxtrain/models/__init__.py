"""Dense decoder LMs as pure functions over parameter pytrees, with HF import/export and
KV-cached generation."""
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.decode import decode_step, generate, init_cache, prefill
from jaxtrain.models.hf import from_hf, to_hf
from jaxtrain.models.params import abstract, init, logical_axes, param_specs
from jaxtrain.models.transformer import forward

__all__ = ["ModelConfig", "abstract", "decode_step", "forward", "from_hf", "generate", "init",
           "init_cache", "logical_axes", "param_specs", "prefill", "to_hf"]
