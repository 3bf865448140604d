"""Bring-up and teardown of the default process group and the per-axis groups.

The launched world is laid out by `topology` (row-major over [external_dp, dp,
pp, pcp, tp]); this module only turns those tables into GroupCoordinators, in
the same order on every rank, and keeps one per axis in a registry for the
getters. Model code should still receive its groups explicitly.

One timeout applies to the default group and to every group made here, since
torch does not carry the default group's timeout over to new_group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from spmd_engine import envs, topology
from spmd_engine.config import ConfigError, ParallelConfig
from spmd_engine.distributed.group_coordinator import GroupCoordinator
from spmd_engine.distributed.launch_env import nccl_env_defaults, read_launch_env

logger = logging.getLogger("spmd_engine")

TIMEOUT_ENV = envs.TIMEOUT_S
DEFAULT_TIMEOUT_S = envs.DEFAULT_TIMEOUT_S
AXES_IN_ORDER = ("world", "tp", "dcp", "pcp", "pp", "dp", "ep")


@dataclass
class _State:
    owns_default_group: bool = False
    reused_default_group: bool = False
    timeout: timedelta = field(default_factory=lambda: timedelta(seconds=DEFAULT_TIMEOUT_S))
    device_backend: str = "gloo"
    local_rank: int = 0
    layout: topology.Layout | None = None
    groups: dict[str, GroupCoordinator] = field(default_factory=dict)
    launch_store: dist.Store | None = None  # the launcher's store, kept for the process's life
    worlds_made: int = 0  # default groups made on it: each world's keys get their own prefix


_STATE = _State()


def default_timeout_s() -> float:
    return envs.timeout_s()


def _device_backend(default_backend: str) -> str:
    """NCCL for tensors when the default group speaks it and CUDA is here; gloo otherwise."""
    return "nccl" if "nccl" in default_backend and torch.cuda.is_available() else "gloo"


def init_distributed_environment(world_size: int = -1, rank: int = -1, local_rank: int = -1,
                                 distributed_init_method: str = "env://",
                                 backend: str | None = None,
                                 timeout_s: float | None = None) -> None:
    """Join (or reuse) the default process group.

    Already initialised (a trainer did it): reuse it and never destroy it.
    Explicit rank and world_size (the mp executor): use `distributed_init_method`.
    Otherwise the launch env decides: torchrun's env://, or SLURM's derived
    tcp:// address. With no launcher at all, a private world of one.
    """
    _STATE.timeout = timedelta(seconds=timeout_s if timeout_s is not None else default_timeout_s())
    launch = read_launch_env(os.environ)
    if local_rank < 0:
        local_rank = launch.local_rank if launch is not None else 0
    _STATE.local_rank = local_rank
    if dist.is_initialized():
        if (world_size > 0 and world_size != dist.get_world_size()) or (rank >= 0 and rank != dist.get_rank()):
            raise ConfigError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but rank {rank} of {world_size} was requested")
        _STATE.reused_default_group = not _STATE.owns_default_group
        _STATE.device_backend = _device_backend(str(dist.get_backend()))
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:  # a hang must still end the job: NCCL's watchdog enforces the timeout
        os.environ.update(nccl_env_defaults(os.environ, _STATE.timeout.total_seconds()))
    kwargs: dict = {}
    if rank >= 0 and world_size > 0:
        kwargs = dict(init_method=distributed_init_method, rank=rank, world_size=world_size)
    elif launch is not None:
        method = "env://" if launch.source == "torchrun" else (
            launch.init_method if distributed_init_method == "env://" else distributed_init_method)
        kwargs = dict(store=_launch_store(method, launch.rank, launch.world_size),
                      rank=launch.rank, world_size=launch.world_size)
    else:  # nothing launched us: a world of one needs no rendezvous or port
        kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=_STATE.timeout, **kwargs)
    _STATE.owns_default_group, _STATE.reused_default_group = True, False
    _STATE.device_backend = _device_backend(backend)


def _launch_store(method: str, rank: int, world_size: int) -> dist.Store:
    """The launcher's store, met once per process and kept, under a fresh key prefix for each
    world made on it. Keys outlive a world: torchrun's agent keeps its store across restart
    attempts, and an engine built after another one in the same processes would read the
    first world's keys (gloo's addresses) and fail to connect. Keeping the store also keeps
    its server (rank 0's, outside torchrun) in place, so no rank can reach a server that is
    about to close."""
    if _STATE.launch_store is None:
        _STATE.launch_store, _, _ = next(dist.rendezvous(method, rank=rank, world_size=world_size,
                                                         timeout=_STATE.timeout))
    _STATE.worlds_made += 1
    attempt = envs.restart_attempt()
    return dist.PrefixStore(f"spmd_engine/attempt{attempt}/world{_STATE.worlds_made}/", _STATE.launch_store)


def layout_for_world(parallel_config: ParallelConfig, launched_world: int) -> topology.Layout:
    """The grid of this torch world; the surplus over TP x PP x PCP x DP is external DP.

    Under a launcher the world must hold every DP replica; so must the one world
    that engine-spawned workers (mp / uni) of all DP replicas join.
    """
    try:
        return topology.Layout.of(parallel_config, launched_world)
    except topology.TopologyError as exc:
        raise ConfigError(str(exc)) from None


def model_parallel_is_initialized() -> bool:
    return bool(_STATE.groups)


def initialize_model_parallel(parallel_config: ParallelConfig,
                              launched_world_size: int | None = None, dp_waves: bool = False) -> None:
    """Create every axis's groups (world, TP, DCP, PCP, PP, DP, EP) on every rank.

    The EP-shaped group (DP x PCP x TP) exists with expert parallelism, or when a mixture
    of experts spans DP replicas without it (`dp_waves`: each expert's width split over
    those ranks, as vLLM does)."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel() needs init_distributed_environment() first")
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups already exist; call destroy_model_parallel() first")
    world = dist.get_world_size()
    if launched_world_size is not None and launched_world_size != world:
        raise ConfigError(f"launched world size {launched_world_size} does not match "
                          f"torch.distributed's world size {world}")
    layout = layout_for_world(parallel_config, world)  # raises before any collective
    axes = [a for a in AXES_IN_ORDER if a != "ep" or parallel_config.enable_expert_parallel or dp_waves]
    for axis in axes:
        _STATE.groups[axis] = GroupCoordinator(
            topology.group_table(layout, axis), _STATE.local_rank, _STATE.device_backend,
            axis, _STATE.timeout)
    _STATE.layout = layout
    rank = dist.get_rank()
    c = topology.rank_to_coord(layout, rank)
    groups = " ".join(f"{a}={_STATE.groups[a].ranks}" for a in axes if a != "world")
    logger.info("rank %d coord (edp=%d dp=%d pp=%d pcp=%d tp=%d) %s", rank,
                c.external_dp, c.dp, c.pp, c.pcp, c.tp, groups)


def model_parallel_layout() -> topology.Layout:
    if _STATE.layout is None:
        raise RuntimeError("model parallel groups are not initialised; call initialize_model_parallel()")
    return _STATE.layout


def model_parallel_groups() -> dict[str, GroupCoordinator]:
    """This rank's group on every axis made, keyed by axis name, in creation order."""
    return dict(_STATE.groups)


def _get(axis: str, what: str) -> GroupCoordinator:
    group = _STATE.groups.get(axis)
    if group is None:
        if axis == "ep" and _STATE.groups:
            raise RuntimeError("expert parallel group was not created: enable_expert_parallel is off")
        raise RuntimeError(f"{what} group is not initialised; call initialize_model_parallel() first")
    return group


def get_world_group() -> GroupCoordinator:
    return _get("world", "world")


def get_tp_group() -> GroupCoordinator:
    return _get("tp", "tensor parallel")


def get_dcp_group() -> GroupCoordinator:
    return _get("dcp", "decode context parallel")


def get_pcp_group() -> GroupCoordinator:
    return _get("pcp", "prefill context parallel")


def get_pp_group() -> GroupCoordinator:
    return _get("pp", "pipeline parallel")


def get_dp_group() -> GroupCoordinator:
    return _get("dp", "data parallel")


def get_ep_group() -> GroupCoordinator:
    return _get("ep", "expert parallel")


def destroy_model_parallel() -> None:
    """Destroy every group made by initialize_model_parallel; safe to call twice."""
    for axis in reversed(list(_STATE.groups)):
        _STATE.groups.pop(axis).destroy()
    _STATE.layout = None


def destroy_distributed_environment() -> None:
    """Tear down our groups, and the default group only if we created it; safe twice."""
    destroy_model_parallel()
    if _STATE.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.owns_default_group = _STATE.reused_default_group = False


def reused_default_group() -> bool:
    """True when init_distributed_environment found a default group someone else made."""
    return _STATE.reused_default_group
