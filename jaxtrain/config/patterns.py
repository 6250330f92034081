"""Per-layer patterns that the config translations, the pipeline plan and the model share,
computed without JAX (the dry run and the HF translation import no JAX)."""


def dsa_shared_pattern(freq: int, offset: int, num_layers: int) -> tuple[bool, ...]:
    """Megatron's index sharing (dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset): per
    layer, True where it reuses the selection of the last computing layer before it. 1-based
    layer L computes when max(L - max(offset, 1), 0) is a multiple of freq."""
    if freq < 1 or offset < 0:
        raise ValueError(f"dsa_indexer_topk_freq {freq} must be positive and "
                         f"dsa_indexer_skip_topk_offset {offset} not negative")
    start = max(offset, 1)
    return tuple(max(n - start, 0) % freq != 0 for n in range(1, num_layers + 1))


# Primus's stack specs for model_type mamba: what their 'M' layers are ('K': Kimi Delta
# Attention, built as 'G' layers of kind kda).
PRIMUS_SPECS = {"mamba_stack_spec": "M", "hybrid_stack_spec": "M",
                "mamba_hybrid_stack_spec_no_te": "M", "gdn_hybrid_stack_spec": "G",
                "gdn_hybrid_stack_spec_no_te": "G", "kda_hybrid_stack_spec": "K",
                "kda_hybrid_stack_spec_no_te": "K"}


def spec_name(spec) -> str | None:
    """The spec's own name: the last entry of Primus's [module, name] list (None: no spec)."""
    return spec[-1] if isinstance(spec, list | tuple) and spec else spec
