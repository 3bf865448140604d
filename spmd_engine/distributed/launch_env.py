"""Where this process sits in a launch, read from the launcher's environment.

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
`srun` without torchrun exports only SLURM_* variables, so we derive the same
facts from those: the master host is the first node of the *step's* nodelist
(parsed here, since `scontrol` may be missing on compute nodes) and the port
comes from the job id and the step id, so two jobs sharing a node, and two srun
steps running at once in one allocation, do not collide. Everything
here is a pure function of the mapping passed in, so it is tested without
processes.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Mapping

from spmd_engine.config import ConfigError, launched_by_srun

# Derived ports land in [PORT_BASE, PORT_BASE + PORT_SPAN): above the privileged
# range and below Linux's default ephemeral range (32768+), where the kernel
# hands out client ports that could otherwise be taken already.
PORT_BASE = 15000
PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int
    source: str  # "torchrun" or "slurm"

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is missing")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(spec: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list to host names: 'node[01-02],gpu7' -> ['node01', 'node02', 'gpu7']."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            hosts.append(part)
            continue
        head, tail = part[: match.start()], part[match.end():]
        for value in _expand_range(match.group(1)):
            hosts.extend(expand_nodelist(head + value + tail))  # later bracket groups
    return hosts


def port_from_job_id(job_id: str, step_id: str | None = None) -> int:
    """A port every task of one srun step derives alike, different across most jobs and
    across the steps of one job. Step 0 (or no step) keeps 15000 + job id % 15000."""
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    if step_id:
        key += STEP_STRIDE * (int(step_id) if step_id.isdigit() else zlib.crc32(step_id.encode()))
    return PORT_BASE + key % PORT_SPAN


STEP_STRIDE = 7919  # steps 0, 1, 2 of a job land far apart, not on the next jobs' ports


def _tasks_on_node(tasks_per_node: str, node_rank: int) -> int | None:
    """SLURM_TASKS_PER_NODE '2(x3),1' -> tasks on node `node_rank`."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_rank] if node_rank < len(counts) else None


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    return LaunchEnv(
        rank=_int(environ, "RANK"),
        world_size=world,
        local_rank=_int(environ, "LOCAL_RANK"),
        local_world_size=local_world,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 29500),
        node_rank=_int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", 0)),
        source="torchrun",
    )


def _from_slurm(environ: Mapping[str, str]) -> LaunchEnv:
    world = _int(environ, "SLURM_NTASKS" if "SLURM_NTASKS" in environ else "SLURM_NPROCS")
    node_rank = _int(environ, "SLURM_NODEID", 0)
    local_world = None
    if environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        local_world = int(environ["SLURM_NTASKS_PER_NODE"])
    elif environ.get("SLURM_TASKS_PER_NODE"):
        local_world = _tasks_on_node(environ["SLURM_TASKS_PER_NODE"], node_rank)
    if local_world is None:
        nnodes = _int(environ, "SLURM_JOB_NUM_NODES", _int(environ, "SLURM_NNODES", 1))
        local_world = max(1, world // max(1, nnodes))
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                    or environ.get("SLURM_NODELIST"))
        if not nodelist:
            raise ConfigError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: "
                              "cannot tell which host serves the rendezvous")
        master_addr = expand_nodelist(nodelist)[0]
    if environ.get("MASTER_PORT"):
        master_port = _int(environ, "MASTER_PORT")
    elif environ.get("SLURM_JOB_ID"):
        master_port = port_from_job_id(environ["SLURM_JOB_ID"], environ.get("SLURM_STEP_ID"))
    else:
        raise ConfigError("SLURM launch without MASTER_PORT or SLURM_JOB_ID: "
                          "cannot choose a rendezvous port")
    return LaunchEnv(
        rank=_int(environ, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        master_addr=master_addr,
        master_port=master_port,
        node_rank=node_rank,
        source="slurm",
    )


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv | None:
    """The launch this process belongs to, or None when nothing launched it.

    torchrun's variables win over SLURM's (torchrun inside srun is common). A
    SLURM launch is recognised by SLURM_PROCID and SLURM_NTASKS (or SLURM_NPROCS)
    together with SLURM_STEP_ID, which only srun exports to its tasks: a plain
    command typed in an sbatch or salloc shell also sees the allocation's task
    count, and must not wait for ranks that will never come.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        env = _from_torchrun(environ)
    elif launched_by_srun(environ):
        env = _from_slurm(environ)
    else:
        return None
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        names = "RANK / WORLD_SIZE" if env.source == "torchrun" else "SLURM_PROCID / SLURM_NTASKS"
        raise ConfigError(f"{env.source} launch: rank {env.rank} is outside world size {env.world_size} ({names})")
    return env


def nccl_env_defaults(environ: Mapping[str, str], timeout_s: float) -> dict[str, str]:
    """NCCL watchdog settings so a hang still ends the job; a value the user set is kept.

    The collective timeout is enforced by NCCL's watchdog thread, not by the call:
    with async error handling on, a collective that exceeds it tears the process
    down (exit, so torchrun / srun end the rest) instead of leaving the rank stuck
    forever in a kernel. The heartbeat monitor kills a process whose watchdog itself
    is stuck (e.g. inside a CUDA call), after HEARTBEAT_TIMEOUT_SEC. Neither can see
    a hang that is not a timed-out NCCL collective (an infinite loop in Python on
    one rank shows up as its peers' collective timing out).
    """
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(480, int(timeout_s) + 60)),
    }
    return {k: v for k, v in wanted.items() if not environ.get(k)}


def launched_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's global rank from the launcher's variables (0 without a launcher),
    readable before any group exists: rank 0 alone prints errors and results."""
    return int(environ.get("RANK", environ.get("SLURM_PROCID", "0")))
