"""Start ``jax.distributed`` from the launcher's environment, before any device is touched.

Where the process count, this process's id and the coordinator come from (first match wins):

``explicit``  ``JAX_COORDINATOR_ADDRESS=host:port``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
              (or the ``coordinator``/``num_processes``/``process_id`` arguments).
``torchrun``  ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (torchrun, Primus
              launch scripts); the coordinator listens on ``MASTER_ADDR:MASTER_PORT``, or on
              ``MASTER_PORT + 1`` under torchrun itself, whose agent holds ``MASTER_PORT``
              (``TORCHELASTIC_USE_AGENT_STORE=True``); ``JAX_COORDINATOR_PORT`` overrides.
``mpi``       Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``). The coordinator comes from JAX's
              own Open MPI detection (``OMPI_MCA_orte_hnp_uri``, Open MPI 4); Open MPI 5 does
              not set that, so there ``JAX_COORDINATOR_ADDRESS`` must be given.
``slurm``     ``srun`` job steps, through JAX's own SLURM detection (coordinator on the
              first node of the step, port from the job id or ``JAX_COORDINATOR_PORT``).
``single``    none of these, or a world of one process: ``jax.distributed`` is not started.

``JAX_COORDINATOR_ADDRESS`` also overrides the coordinator a launcher implies. On GPU, each
process sees all local GPUs when it is alone on its node, else the one GPU at its local rank
(``LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ``SLURM_LOCALID``); ``JAX_LOCAL_DEVICE_IDS``
(comma-separated) overrides both. On CPU, several processes talk through gloo.
``distributed_timeout_minutes`` is the initialization timeout.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.registry import registry
from jaxtrain.parallel.xla_flags import platform_kind


@dataclasses.dataclass(frozen=True)
class ProcessSetup:
    """This process's place in the job.

    ``source`` is explicit, torchrun, mpi, slurm, single, or existing (jax.distributed was
    already started by someone else); ``local_device_ids`` None means all local devices.
    """

    source: str
    process_id: int = 0
    num_processes: int = 1
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialized: bool = False


def _int(name: str, text: str | None = None, minimum: int = 0) -> int:
    text = os.environ.get(name) if text is None else text
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        kind = "a positive" if minimum > 0 else "a non-negative"
        raise ConfigError(f"{name} must be {kind} integer, got {text!r}")
    return value


def _address(name: str, text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name} must be host:port (e.g. 10.0.0.1:12345), got {text!r}")
    return text.strip()


def _jax_coordinator(given: str | None) -> str | None:
    """The coordinator argument, else JAX_COORDINATOR_ADDRESS, checked; None when neither."""
    if given:
        return _address("coordinator", given)
    text = os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    return _address("JAX_COORDINATOR_ADDRESS", text) if text else None


def _device_ids() -> tuple[int, ...] | None:
    text = os.environ.get("JAX_LOCAL_DEVICE_IDS")
    if not text:
        return None
    return tuple(_int("JAX_LOCAL_DEVICE_IDS", part) for part in text.split(","))


def _rank_in(name: str, rank: int, world: int, world_name: str) -> int:
    if rank >= world:
        raise ConfigError(f"{name}={rank} is out of range: {world_name}={world} means ids "
                          f"0..{world - 1}")
    return rank


def _explicit(coordinator, num_processes, process_id):
    env = os.environ
    count = num_processes if num_processes is not None else (
        _int("JAX_NUM_PROCESSES", minimum=1) if "JAX_NUM_PROCESSES" in env else None)
    pid = process_id if process_id is not None else (
        _int("JAX_PROCESS_ID") if "JAX_PROCESS_ID" in env else None)
    address = _jax_coordinator(coordinator)
    if count is None and pid is None:
        return None
    if count is None:
        raise ConfigError("JAX_PROCESS_ID is set but JAX_NUM_PROCESSES is not: set both (and "
                          "JAX_COORDINATOR_ADDRESS) for an explicit multi-process launch")
    if count > 1 and pid is None:
        raise ConfigError(f"JAX_NUM_PROCESSES={count} but JAX_PROCESS_ID is not set: give each "
                          f"process its id 0..{count - 1}")
    pid = _rank_in("JAX_PROCESS_ID", pid or 0, count, "JAX_NUM_PROCESSES")
    if count > 1 and not address:
        raise ConfigError(f"JAX_NUM_PROCESSES={count} but JAX_COORDINATOR_ADDRESS is not set: "
                          "set it to host:port of process 0 (a free port)")
    return ProcessSetup("explicit", pid, count, address, _device_ids())


def _torchrun(coordinator):
    env = os.environ
    if "WORLD_SIZE" not in env and "RANK" not in env:
        return None
    if "WORLD_SIZE" not in env:
        raise ConfigError("RANK is set but WORLD_SIZE is not: a torchrun-style launch sets "
                          "WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT")
    world = _int("WORLD_SIZE", minimum=1)
    if world > 1 and "RANK" not in env:
        raise ConfigError(f"WORLD_SIZE={world} but RANK is not set: give each process its rank "
                          f"0..{world - 1}")
    rank = _rank_in("RANK", _int("RANK") if "RANK" in env else 0, world, "WORLD_SIZE")
    address = _jax_coordinator(coordinator)
    if world > 1 and not address:
        host = env.get("MASTER_ADDR", "").strip()
        if not host:
            raise ConfigError(f"WORLD_SIZE={world} but MASTER_ADDR is not set: set MASTER_ADDR "
                              "and MASTER_PORT to process 0's host and a free port there (or "
                              "JAX_COORDINATOR_ADDRESS=host:port)")
        if "MASTER_PORT" not in env:
            raise ConfigError(f"WORLD_SIZE={world} but MASTER_PORT is not set: set it to a free "
                              f"port on MASTER_ADDR={host}")
        port = _int("MASTER_PORT", minimum=1)
        if "JAX_COORDINATOR_PORT" in env:
            port = _int("JAX_COORDINATOR_PORT", minimum=1)
        elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            port += 1  # torchrun's own TCPStore already listens on MASTER_PORT
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        address = f"{host}:{port}"
    local = _device_ids()
    if local is None and ("LOCAL_RANK" in env or "LOCAL_WORLD_SIZE" in env):
        local_rank = _int("LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = _int("LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else None
        if local_world is not None:
            _rank_in("LOCAL_RANK", local_rank, local_world, "LOCAL_WORLD_SIZE")
        if local_world != 1:
            local = (local_rank,)
    return ProcessSetup("torchrun", rank, world, address, local)


def _mpi(coordinator):
    env = os.environ
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    from jax._src.clusters import OmpiCluster

    world = _int("OMPI_COMM_WORLD_SIZE", minimum=1)
    rank = _rank_in("OMPI_COMM_WORLD_RANK", _int("OMPI_COMM_WORLD_RANK"), world,
                    "OMPI_COMM_WORLD_SIZE")
    address = _jax_coordinator(coordinator)
    if world > 1 and not address:
        if not OmpiCluster.is_env_present():
            raise ConfigError("this is an Open MPI launch without OMPI_MCA_orte_hnp_uri (Open "
                              "MPI 5 does not set it), so JAX cannot find a coordinator: set "
                              "JAX_COORDINATOR_ADDRESS=host:port (rank 0's host, a free port)")
        try:
            address = OmpiCluster.get_coordinator_address(
                timeout_secs=None, override_coordinator_port=env.get("JAX_COORDINATOR_PORT"))
        except RuntimeError as e:
            raise ConfigError(f"OMPI_MCA_orte_hnp_uri: {e} Set JAX_COORDINATOR_ADDRESS="
                              "host:port instead") from None
    local = _device_ids()
    alone = "OMPI_COMM_WORLD_LOCAL_SIZE" in env and _int("OMPI_COMM_WORLD_LOCAL_SIZE",
                                                         minimum=1) == 1
    if local is None and not alone:
        local = (_int("OMPI_COMM_WORLD_LOCAL_RANK"),)
    return ProcessSetup("mpi", rank, world, address, local)


def _slurm_tasks_on_node() -> int | None:
    """Tasks of this step on this node, from e.g. SLURM_STEP_TASKS_PER_NODE='4(x2),3'."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    counts: list[int] = []
    for part in (spec or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m[1])] * int(m[2] or 1)
    node = os.environ.get("SLURM_NODEID", "0")
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def _slurm(coordinator):
    from jax._src.clusters import SlurmCluster

    if not SlurmCluster.is_env_present():
        return None
    env = os.environ
    world = _int("SLURM_NTASKS", minimum=1)
    rank = _rank_in("SLURM_PROCID", _int("SLURM_PROCID"), world, "SLURM_NTASKS")
    address = _jax_coordinator(coordinator)
    if world > 1 and not address:
        address = SlurmCluster.get_coordinator_address(
            timeout_secs=None, override_coordinator_port=env.get("JAX_COORDINATOR_PORT"))
    local = _device_ids()
    if local is None and _slurm_tasks_on_node() != 1:
        local = (_int("SLURM_LOCALID"),)
    return ProcessSetup("slurm", rank, world, address, local)


def detect(platform: str = "gpu", *, coordinator: str | None = None,
           num_processes: int | None = None, process_id: int | None = None) -> ProcessSetup:
    """Read the environment (and the explicit arguments) into a :class:`ProcessSetup`.

    Touches nothing. A one-process world is ``single``; local device ids are kept only on GPU.
    Raises ConfigError naming the variable when the environment is partial or inconsistent.
    """
    setup = (_explicit(coordinator, num_processes, process_id) or _torchrun(coordinator)
             or _mpi(coordinator) or _slurm(coordinator))
    if setup is None and _jax_coordinator(coordinator):
        raise ConfigError("a coordinator address (JAX_COORDINATOR_ADDRESS) is set but nothing "
                          "says how many processes there are: set JAX_NUM_PROCESSES and "
                          "JAX_PROCESS_ID too, or launch with srun, mpirun or torchrun")
    if setup is None or setup.num_processes == 1:
        return ProcessSetup("single")
    if platform_kind(platform=platform) != "gpu":
        setup = dataclasses.replace(setup, local_device_ids=None)
    return setup


def _timeout_seconds(cfg: Mapping[str, Any] | None) -> int:
    minutes = (cfg or {}).get("distributed_timeout_minutes")
    if minutes is None:
        minutes = registry().knobs["distributed_timeout_minutes"].default
    if minutes < 1:
        raise ConfigError(f"distributed_timeout_minutes must be at least 1, got {minutes}")
    return int(minutes * 60)


def initialize(cfg: Mapping[str, Any] | None = None, platform: str | None = None, *,
               coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> ProcessSetup:
    """Start ``jax.distributed`` when the environment describes a multi-process job.

    Call once per process, before anything touches a device. ``cfg`` gives
    ``distributed_timeout_minutes`` (the initialization timeout) and ``hardware``;
    ``platform`` (cpu, gpu, cuda, rocm) defaults to ``JAX_PLATFORMS``, else ``hardware``.
    Everything is passed to ``jax.distributed.initialize`` explicitly with JAX's own cluster
    detection turned off, so what is returned is what was used. On CPU the collectives go
    through gloo. A single process returns ``source="single"`` and starts nothing.
    """
    import jax

    kind = platform_kind(cfg, platform)
    timeout = _timeout_seconds(cfg)
    if jax.distributed.is_initialized():
        from jax._src.distributed import global_state

        return ProcessSetup("existing", global_state.process_id, global_state.num_processes,
                            global_state.coordinator_address, None, True)
    setup = detect(kind, coordinator=coordinator, num_processes=num_processes,
                   process_id=process_id)
    if (cfg or {}).get("skip_jax_distributed_system"):  # MaxText: one process, whatever the env
        setup = ProcessSetup("single", 0, 1, None, None, False)
    if setup.source == "single":
        if (cfg or {}).get("hardware") == "gpu_multiprocess":
            raise ConfigError("hardware=gpu_multiprocess asks for a multi-process run, but no "
                              "launcher environment was found: launch with srun, mpirun or "
                              "torchrun, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
                              "JAX_PROCESS_ID in each process")
        return setup
    if kind == "cpu" and jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local: Sequence[int] | None = list(setup.local_device_ids) if setup.local_device_ids \
        else None
    jax.distributed.initialize(
        coordinator_address=setup.coordinator, num_processes=setup.num_processes,
        process_id=setup.process_id, local_device_ids=local,
        cluster_detection_method="deactivate", initialization_timeout=timeout)
    return dataclasses.replace(setup, initialized=True)
