"""One rank's view of one parallel axis: its group, and the collectives on it.

Every rank builds a GroupCoordinator over the axis's whole table (new_group is
collective, so every rank creates every group, in the same order) and keeps
the one entry holding itself. Each entry gets a device group (NCCL on CUDA,
gloo on CPU) for tensors and a gloo CPU group for control messages; when the
device backend is gloo anyway, one group serves both, halving sockets and
start-up work.

Every blocking call is bounded by the group's timeout and fails with an error
that names the operation and the group, never by hanging.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from spmd_engine.distributed.errors import CollectiveError
from spmd_engine.distributed.shm.allreduce import ShmAllReduce
from spmd_engine.distributed.shm.handoff import ShmHandoff

_name_counters: dict[str, Iterator[int]] = defaultdict(itertools.count)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a tensor before the data arrives."""

    device_type: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _short(exc: BaseException) -> str:
    """gloo's message without its source-file prefix and boilerplate advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^(\[[^\]]*\]\s*)+", "", text)
    return text.split(". This is typically")[0][:200]


class GroupCoordinator:
    """This rank's group on one axis.

    group_ranks: the axis's whole table (every rank passes the same one);
    local_rank: the accelerator index of this rank on its node; device_backend:
    "nccl" or "gloo"; group_name: the axis ("tp", "pp", ...); timeout: seconds
    or timedelta, applied to every group made here and to the shared-memory path.
    `rank` and the neighbour attributes are global ranks; `src`/`dst` arguments
    are ranks within the group.
    """

    def __init__(self, group_ranks: list[list[int]], local_rank: int, device_backend: str,
                 group_name: str, timeout: timedelta | float):
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.group_name = group_name
        self.unique_name = f"{group_name}:{next(_name_counters[group_name])}"
        self.timeout = timeout
        self.device_backend = device_backend
        self._owned: list[dist.ProcessGroup] = []
        self.ranks: list[int] | None = None
        for ranks in group_ranks:
            try:
                cpu_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
                device_group = cpu_group
                if device_backend != "gloo":
                    device_group = dist.new_group(ranks, timeout=timeout, backend=device_backend)
            except RuntimeError as exc:
                raise CollectiveError(f"new_group for {group_name} {list(ranks)} failed "
                                      f"(timeout {timeout.total_seconds():g}s): {_short(exc)}") from exc
            if self.rank in ranks:
                self.ranks = list(ranks)
                self.cpu_group, self.device_group = cpu_group, device_group
                self._owned = [cpu_group] if device_group is cpu_group else [cpu_group, device_group]
        if self.ranks is None:
            raise ValueError(f"rank {self.rank} is in no {group_name} group of {group_ranks}")
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.device = (torch.device("cuda", local_rank) if device_backend == "nccl"
                       else torch.device("cpu"))
        self._shm: ShmAllReduce | None | bool = None  # None: not tried yet; False: unavailable
        self._handoff: ShmHandoff | None | bool = None  # the same, for send/recv_tensor_dict

    # ---- neighbours ---------------------------------------------------
    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def label(self) -> str:
        return f"{self.group_name} {self.ranks}"

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, rank={self.rank})"

    # ---- error handling -------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, op: str):
        """Turn backend errors into one line naming the operation and this group."""
        start = time.monotonic()
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as exc:  # gloo/NCCL errors, incl. DistBackendError
            first = _short(exc)
            limit = self.timeout.total_seconds()
            if "timed out" in first.lower() or "timeout" in first.lower():
                msg = f"{op} on group {self.label} timed out after {limit:g}s"
            else:
                elapsed = time.monotonic() - start
                msg = (f"{op} on group {self.label} failed after {elapsed:.1f}s "
                       f"(timeout {limit:g}s): a peer is gone ({first})")
            raise CollectiveError(msg) from exc

    def _group_for(self, t: torch.Tensor):
        return self.cpu_group if t.device.type == "cpu" else self.device_group

    # ---- collectives ----------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `t` (the input itself at size 1)."""
        if self.world_size == 1:
            return t
        if t.is_cpu:  # not t.device: building a device object costs more than the rest of this check
            shm = self._shared_memory()
            if shm and shm.supports(t):
                return shm.all_reduce(t)
        with self._guard("all_reduce"):
            dist.all_reduce(t, group=self._group_for(t))
        return t

    def _shared_memory(self) -> ShmAllReduce | None:
        """Set up on the first CPU all-reduce or all-gather, so groups that never use it cost no memory."""
        if self._shm is None:
            with self._guard("all_reduce (shared-memory setup)"):
                made = ShmAllReduce.create(self.cpu_group, self.ranks, self.label,
                                           self.timeout.total_seconds())
            self._shm = made if made is not None else False
        return self._shm or None

    @property
    def uses_shared_memory(self) -> bool:
        return bool(self._shm)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t`, concatenated along `dim` in rank order."""
        if self.world_size == 1:
            return t
        if t.is_cpu:
            shm = self._shared_memory()
            if shm and shm.supports(t):
                return torch.cat(shm.all_gather(t).unbind(0), dim=dim)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        with self._guard("all_gather"):
            dist.all_gather(parts, t, group=self._group_for(t))
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over the group, then keep this rank's equal slice along `dim`."""
        if self.world_size == 1:
            return t
        dim = dim % t.dim()
        if t.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter on group {self.label}: size {t.shape[dim]} of dim "
                             f"{dim} is not divisible by the group size {self.world_size}")
        if t.device.type == "cpu":  # gloo has no reduce_scatter; all-reduce is cheap here
            full = self.all_reduce(t.clone())
            return full.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // self.world_size, *moved.shape[1:]),
                          dtype=t.dtype, device=t.device)
        with self._guard("reduce_scatter"):
            dist.reduce_scatter_tensor(out, moved, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `t` concatenated along `dim` on group rank `dst`; None elsewhere."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        with self._guard("gather"):
            dist.gather(t, parts, dst=self.ranks[dst], group=self._group_for(t))
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank `src`'s `t` into every rank's `t`, in place."""
        if self.world_size == 1:
            return t
        with self._guard("broadcast"):
            dist.broadcast(t, src=self.ranks[src], group=self._group_for(t))
        return t

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from group rank `src`, over the CPU group."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        with self._guard("broadcast_object"):
            dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order, over the CPU group."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._guard("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        with self._guard("barrier"):
            dist.barrier(group=self.cpu_group)

    # ---- tensor dictionaries ----------------------------------------------
    @staticmethod
    def _split(d: dict) -> tuple[list, list[torch.Tensor]]:
        """Metadata list (tensors replaced by TensorMeta) and the tensors in order."""
        meta, tensors = [], []
        for key, value in d.items():
            if isinstance(value, torch.Tensor):
                meta.append((key, TensorMeta(value.device.type, value.dtype, tuple(value.shape))))
                tensors.append(value.contiguous())
            else:
                meta.append((key, value))
        return meta, tensors

    def _empty(self, m: TensorMeta) -> torch.Tensor:
        """Receive buffers live on this rank's current device of the sender's device type."""
        device = torch.device("cpu")
        if m.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        elif m.device_type != "cpu":
            device = self.device
        return torch.empty(m.shape, dtype=m.dtype, device=device)

    def _join(self, meta: list, make) -> dict:
        out = {}
        for key, value in meta:
            out[key] = make(value) if isinstance(value, TensorMeta) else value
        return out

    def broadcast_tensor_dict(self, d: dict | None = None, src: int = 0) -> dict:
        """`d` from group rank `src` to every rank: metadata over the CPU group, tensors over the device group."""
        if self.world_size == 1:
            return d
        if self.rank_in_group == src:
            meta, tensors = self._split(d)
            self.broadcast_object(meta, src=src)
            for t in tensors:
                if t.numel():
                    self.broadcast(t, src=src)
            return d
        meta = self.broadcast_object(None, src=src)
        out = self._join(meta, self._empty)
        for t in out.values():
            if isinstance(t, torch.Tensor) and t.numel():
                self.broadcast(t, src=src)
        return out

    def _peer(self, given: int | None, step: int, op: str) -> int:
        if self.world_size == 1:
            raise ValueError(f"{op} needs a peer, but group {self.label} has one rank")
        peer = (self.rank_in_group + step) % self.world_size if given is None else given
        if not 0 <= peer < self.world_size or peer == self.rank_in_group:
            raise ValueError(f"{op} on group {self.label}: invalid peer {peer}")
        return self.ranks[peer]

    def _shared_handoff(self, op: str) -> ShmHandoff | None:
        """The shared-memory ring for default-neighbour hand-offs on a CPU (gloo) group, set
        up on the first one: collective, so every member's first default send or receive
        must come (the PP forward's first step makes one on every stage). None: gloo."""
        if self._handoff is None:
            self._handoff = False
            if self.device_backend == "gloo":
                with self._guard(f"{op} (shared-memory set-up)"):
                    made = ShmHandoff.create(self.cpu_group, self.ranks, self.label, self.timeout.total_seconds())
                self._handoff = made or False
        return self._handoff or None

    @property
    def uses_shared_handoff(self) -> bool:
        return bool(self._handoff)

    def send_tensor_dict(self, d: dict, dst: int | None = None) -> None:
        """`d` to group rank `dst` (default: the next rank, the PP hand-off): metadata, then tensors.
        Default-neighbour calls pair with default-neighbour receives (on one host they go
        through shared memory, shm/handoff.py); explicit ranks go through gloo."""
        peer = self._peer(dst, 1, "send_tensor_dict")
        meta, tensors = self._split(d)
        handoff = self._shared_handoff("send_tensor_dict") if dst is None else None
        if handoff is not None:
            handoff.send(meta, tensors)
            return
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        with self._guard("send_tensor_dict"):
            dist.send(torch.tensor([blob.numel()], dtype=torch.int64), dst=peer, group=self.cpu_group)
            dist.send(blob, dst=peer, group=self.cpu_group)
            for t in tensors:
                if t.numel():
                    dist.send(t, dst=peer, group=self._group_for(t))

    def recv_tensor_dict(self, src: int | None = None) -> dict:
        """The dict sent by group rank `src` (default: the previous rank)."""
        peer = self._peer(src, -1, "recv_tensor_dict")
        handoff = self._shared_handoff("recv_tensor_dict") if src is None else None
        if handoff is not None:
            meta, payload = handoff.recv()
            arrays = iter(payload)
            return self._join(meta, lambda m: ShmHandoff.tensor_from(next(arrays), m.dtype, m.shape))
        with self._guard("recv_tensor_dict"):
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, src=peer, group=self.cpu_group)
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(blob, src=peer, group=self.cpu_group)
            out = self._join(pickle.loads(blob.numpy().tobytes()), self._empty)
            for t in out.values():
                if isinstance(t, torch.Tensor) and t.numel():
                    dist.recv(t, src=peer, group=self._group_for(t))
        return out

    # ---- teardown ---------------------------------------------------------
    def destroy(self) -> None:
        """Free the shared segment and every process group this rank holds; safe twice."""
        if self._shm:
            self._shm.destroy()
        self._shm = False
        if self._handoff:
            self._handoff.destroy()
        self._handoff = False
        if dist.is_initialized():
            for group in self._owned:
                with contextlib.suppress(Exception):  # already gone with the default group
                    dist.destroy_process_group(group)
        self._owned = []
