"""Who the other members of a shared-memory group are, and whether they are still alive.

Set-up of a group's shared-memory path (the all-reduce slots, the PP hand-off) starts with
one hand-shake over the group's gloo CPU group: every member tells its host, whether it
has the path switched on, and its pid with that process's start time. The path is used
only when every member is on one host and has it on; otherwise every member learns so
from the same gather and all of them use gloo (a rank on gloo and a peer on shared memory
would wait for each other until the timeout).

A peer is watched through /proc/<pid>/stat: a process with the pid and the start time the
peer reported is that peer (a reused pid cannot fake the start time), and a zombie counts
as gone. A peer in another pid namespace reports a pid that means something else here, so
it is not watchable; the hand-shake finds that out by looking the pid up at once, while
every member is known to be alive (it has just joined the gather): a peer looked up later
may already be done and gone, and would wrongly count as unwatchable.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


def process_identity(pid: int) -> Optional[str]:
    """Start time of a live process; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass(frozen=True)
class Peer:
    """A member process this one can watch."""

    pid: int
    start: str

    def alive(self) -> bool:
        return process_identity(self.pid) == self.start


@dataclass(frozen=True)
class Members:
    """The outcome of a hand-shake that found the path usable."""

    index: int  # this process's place in the group
    peers: list  # per member: a Peer when watchable from here, else None

    @property
    def all_watchable(self) -> bool:
        """Every member shares this pid namespace: it can open their /proc/<pid>/fd too."""
        return all(p is not None for p in self.peers)


def handshake(cpu_group, ranks: list, enabled: bool) -> Optional[Members]:
    """Collective over ``cpu_group`` (global ``ranks``): the members, or None on every
    member when they are not all on one host or one of them has ``enabled`` False."""
    me = ranks.index(dist.get_rank())
    info = (socket.gethostname(), enabled, os.getpid(), process_identity(os.getpid()))
    infos: list = [None] * len(ranks)
    dist.all_gather_object(infos, info, group=cpu_group)
    if len({i[0] for i in infos}) != 1 or not all(i[1] for i in infos):
        return None
    peers = [Peer(pid, start) if start is not None and process_identity(pid) == start else None
             for _, _, pid, start in infos]
    return Members(me, peers)
