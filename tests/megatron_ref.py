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
    WORLD group, initialised on first use; :func:`process_group_fixture` ends it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    return dist.group.WORLD


@pytest.fixture(scope="module")
def process_group_fixture():
    """Use (autouse) in a module that calls :func:`single_process_group`: the group is
    destroyed after the module, so later tests in the worker see no torch.distributed."""
    yield
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


SAMPLERS = "megatron/training/datasets/data_samplers.py"


def megatron_samplers():
    """Megatron-LM's ``megatron.training.datasets.data_samplers`` (its pretraining samplers),
    which the megatron-core package does not ship: imported when installed, else read from a
    Megatron-LM checkout named by ``$MEGATRON_LM_PATH`` (or /work/corpus/megatron-lm) with the
    two training-side imports it makes (get_args, DistributedSignalHandler) stubbed; skips the
    caller when neither is there."""
    import importlib.util
    import os
    import sys
    import types

    megatron_core()
    try:
        from megatron.training.datasets import data_samplers
        return data_samplers
    except Exception:  # noqa: BLE001 - not installed, or its training package cannot import
        pass
    roots = [os.environ.get("MEGATRON_LM_PATH"), "/work/corpus/megatron-lm"]
    path = next((os.path.join(r, SAMPLERS) for r in roots
                 if r and os.path.isfile(os.path.join(r, SAMPLERS))), None)
    if path is None:
        pytest.skip("Megatron-LM's data_samplers.py is not available (set MEGATRON_LM_PATH)")
    stubs = {"megatron.training": types.ModuleType("megatron.training"),
             "megatron.training.dist_signal_handler":
                 types.ModuleType("megatron.training.dist_signal_handler")}
    stubs["megatron.training"].get_args = lambda: None
    stubs["megatron.training.dist_signal_handler"].DistributedSignalHandler = object
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("megatron_data_samplers", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module
