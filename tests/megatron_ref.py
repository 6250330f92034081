"""Megatron-LM's own code (the ``megatron-core`` package) as the reference in side-by-side
tests: ``pip install --no-deps megatron-core==0.16.1`` (torch CPU is enough). Tests that use it
skip cleanly when it cannot be imported."""
import warnings

import pytest


def megatron_core():
    """Import megatron.core (torch first), or skip the calling test/module."""
    pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core")


def single_process_group():
    """torch.distributed as one gloo process (Megatron's collectives then do nothing): the
    WORLD group, initialised once per test process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    return dist.group.WORLD
