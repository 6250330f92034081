"""jaxtrain: a JAX-native trainer for decoder language models on XLA GPUs."""

__version__ = "0.1.0"
