"""The device mesh, built from the parallelism knobs of all three dialects.

Mesh axes, slowest-varying first (Megatron's rank order ``tp-cp-ep-dp-pp`` read backwards)::

    pipeline, replica, data, expert, context, tensor

``tensor`` is the last axis, so a tensor-parallel group is a run of consecutive devices: on a
GPU host (devices numbered by process, then local index) it stays inside one node, on NVLink
or Infinity Fabric, where its per-layer collectives need the bandwidth. ``context`` and
``expert`` come next; ``data`` and ``replica`` (the outer data-parallel split of
``num_distributed_optimizer_instances``) span nodes, whose gradient reduction happens once per
step. ``use_tp_pp_dp_mapping`` moves ``pipeline`` inside ``data`` (Megatron's
``tp-cp-ep-pp-dp``).

Sizes: TP, CP and PP come from their knobs; data parallelism is the rest of the world
(``world / (TP*CP*PP)``). Expert parallelism is carved out of data parallelism as Megatron
does: the ``expert`` axis is part of the data-parallel group of dense layers and shards the
experts of MoE layers; ``data`` holds ``DP / (EP * instances)``.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxtrain.config.errors import ConfigError

AXES = ("pipeline", "replica", "data", "expert", "context", "tensor")
# Data-parallel axes of dense layers: the batch is split over them.
BATCH_AXES = ("replica", "data", "expert")

# What is sharded over the data-parallel devices (ZeRO stages; Megatron's
# data_parallel_sharding_strategy names).
NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS = ("no_shard", "optim", "optim_grads",
                                                    "optim_grads_params")
_STAGE = {NO_SHARD: 0, OPTIM: 1, OPTIM_GRADS: 2, OPTIM_GRADS_PARAMS: 3}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees and what data parallelism shards.

    ``sharding`` is one of no_shard / optim (ZeRO-1) / optim_grads (ZeRO-2) /
    optim_grads_params (FSDP, ZeRO-3). ``reshard_after_forward`` False keeps FSDP-gathered
    weights from the forward for the backward; ``offload_params`` keeps parameters in host
    memory between steps (pgs ``parallel.cpu_offload``); ``distribute_saved_activations``
    splits each layer's input (what full recompute saves) over the tensor axis.
    """

    tensor: int = 1
    context: int = 1
    pipeline: int = 1
    expert: int = 1
    data: int = 1
    instances: int = 1
    sequence_parallel: bool = False
    sharding: str = NO_SHARD
    reshard_after_forward: bool = True
    offload_params: bool = False
    pipeline_inside_data: bool = False
    distribute_saved_activations: bool = False

    @property
    def data_parallel(self) -> int:
        """Devices that split the batch (dense layers): DP in Megatron's sense."""
        return self.data * self.expert * self.instances

    @property
    def world(self) -> int:
        return self.data_parallel * self.tensor * self.context * self.pipeline

    @property
    def stage(self) -> int:
        """ZeRO stage 0-3 of ``sharding``."""
        return _STAGE[self.sharding]

    @property
    def axis_names(self) -> tuple[str, ...]:
        if not self.pipeline_inside_data:
            return AXES
        return ("replica", "data", "pipeline") + AXES[3:]

    @property
    def shape(self) -> dict[str, int]:
        sizes = {"pipeline": self.pipeline, "replica": self.instances, "data": self.data,
                 "expert": self.expert, "context": self.context, "tensor": self.tensor}
        return {name: sizes[name] for name in self.axis_names}

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "MeshConfig":
        """The mesh for ``world_size`` devices; a layout that cannot be built is a ConfigError."""
        tp = cfg["tensor_model_parallel_size"]
        cp, pp = cfg["context_parallel_size"], cfg["pipeline_model_parallel_size"]
        ep, instances = cfg["expert_model_parallel_size"], cfg[
            "num_distributed_optimizer_instances"]
        if world_size % (tp * cp * pp):
            raise ConfigError(f"{world_size} devices cannot be split into tensor x context x "
                              f"pipeline parallel groups of {tp} x {cp} x {pp}; make "
                              f"tensor_model_parallel_size x context_parallel_size x "
                              f"pipeline_model_parallel_size divide the device count")
        dp = world_size // (tp * cp * pp)
        if dp % (ep * instances):
            raise ConfigError(f"data-parallel size {dp} (= {world_size} devices / "
                              f"TP x CP x PP) must be divisible by expert_model_parallel_size "
                              f"({ep}) x num_distributed_optimizer_instances ({instances})")
        return cls(tensor=tp, context=cp, pipeline=pp, expert=ep, instances=instances,
                   data=dp // (ep * instances),
                   sequence_parallel=bool(cfg["sequence_parallel"]) and tp > 1,
                   sharding=sharding_strategy(cfg),
                   reshard_after_forward=bool(cfg["parallel.reshard_after_forward"]),
                   offload_params=bool(cfg["parallel.cpu_offload"]),
                   pipeline_inside_data=bool(cfg["use_tp_pp_dp_mapping"]),
                   distribute_saved_activations=bool(cfg["distribute_saved_activations"]))


def sharding_strategy(cfg) -> str:
    """What data parallelism shards, from whichever dialect's switch is on.

    Megatron-FSDP (``use_megatron_fsdp``) follows ``data_parallel_sharding_strategy``;
    ``use_torch_fsdp2`` and pgs ``parallel.fsdp`` (on by default in pgs files only) shard
    everything (FSDP2 semantics); the
    distributed optimizer (``use_distributed_optimizer``) shards the optimizer state. The
    strongest requested stage wins.
    """
    stages = [NO_SHARD]
    if cfg["use_megatron_fsdp"] or cfg.is_set("data_parallel_sharding_strategy"):
        stages.append(cfg["data_parallel_sharding_strategy"])
    if cfg["use_torch_fsdp2"]:
        stages.append(OPTIM_GRADS_PARAMS)
    if cfg["parallel.fsdp"]:
        stages.append(OPTIM_GRADS_PARAMS)
    if cfg["use_distributed_optimizer"]:
        stages.append(OPTIM)
    return max(stages, key=_STAGE.__getitem__)


def make_mesh(mcfg: MeshConfig, devices=None) -> Mesh:
    """A Mesh over ``devices`` (default: all, in process-then-local order) shaped by ``mcfg``."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != mcfg.world:
        raise ConfigError(f"the parallel layout needs {mcfg.world} devices, {len(devices)} are "
                          f"present")
    shape = tuple(mcfg.shape.values())
    return Mesh(np.array(devices, dtype=object).reshape(shape), mcfg.axis_names)
