"""Intra-node CPU all-reduce (and all-gather) through one shared-memory segment per group.

Why: a gloo all-reduce between processes on one host still goes through sockets, a few
system calls and scheduler wake-ups per call, and TP decode makes two per layer. Ranks on
one host can instead write their input into a shared slot, raise a counter, wait for
everyone's counter and sum the slots themselves, all in user space.

Protocol. The segment holds one line of counters per rank, then two buffers of one slot
per rank. Operation number g (1, 2, ...) writes this rank's chunk into buffer g % 2,
publishes counter = g, waits until every counter is >= g, and sums the slots in rank order
(0 + 1 + ... + n-1), so every rank produces the same bits. Two alternating buffers make one
wait per operation enough: a rank can only start operation g + 1 after everyone published
g, i.e. after everyone finished reading operation g - 1, the last user of the buffer it is
about to overwrite. Tensors larger than a slot go chunk by chunk.

Every slot is stamped, and the stamp is the counter (stamp.py): after its data a rank
writes, in its own line for buffer g % 2, (g, operation and dtype, this chunk's bytes, the
whole tensor's bytes) with one store call, and waits until one read of every rank's line
shows each rank's stamp equal to its own. Ranks that disagree on what operation g is (one
rank aborted a step and the others did not, a caller passed different sizes) raise
CollectiveError instead of summing unrelated bytes. A rank that fails (timeout, dead peer,
mismatch) is broken for good (broken.py) and raises its own `broken` word, next to its
stamps: the same read shows it to its peers, which fail too, within their wait.

Stores are ordered by x86's TSO memory model (data before stamp), which this protocol
relies on without fences; on other architectures the gloo path is used instead.

Lifetime (segment.py). The group's first rank creates the segment; when every member can
be watched (one pid namespace, the usual case) it is NAMELESS, so a SIGKILL at any moment,
even mid set-up, leaves nothing in /dev/shm; across pid namespaces it is UNTIL_ATTACHED.
The mapping lives until destroy().
"""

from __future__ import annotations

import logging
import os
import platform
import time

import numpy as np
import torch
import torch.distributed as dist

from spmd_engine import envs
from spmd_engine.distributed.errors import CollectiveError

from . import stamp
from .broken import Broken
from .peers import handshake
from .segment import SHM_DIR, Lifetime, Segment, SegmentRef
from .stamp import BROKEN, LINE, RECORD, SUPPORTED_DTYPES
from .waiter import Waiter, WaitPolicy, weak

logger = logging.getLogger("spmd_engine")

SHM_PREFIX = "spmd_ar_"
DEFAULT_SLOT_BYTES = 1 << 20
_HALF = (torch.bfloat16, torch.float16)


def shm_allreduce_enabled() -> bool:
    """Whether this process may use the shared-memory all-reduce at all: its switch
    (envs.py), /dev/shm, and x86's store order (see above)."""
    return (envs.shm_allreduce_enabled() and os.path.isdir(SHM_DIR)
            and platform.machine().lower() in ("x86_64", "amd64"))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class ShmAllReduce:
    """One group's shared segment; build it with `ShmAllReduce.create` (collective)."""

    def __init__(self, seg: Segment, nranks: int, rank: int, slot_bytes: int, label: str,
                 timeout_s: float, peers: list):
        self.name = seg.name.lstrip("/")
        self.nranks, self.rank, self.slot_bytes = nranks, rank, slot_bytes
        self.label, self.timeout_s, self.peers = label, timeout_s, peers
        self._seg = seg
        self._mm = mm = seg.mm
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        self._lines = np.frombuffer(mm, dtype=np.int64, count=nranks * LINE // 8).reshape(nranks, LINE // 8)
        self._data_offset = nranks * LINE
        # Per (operation, buffer, dtype, shape): every rank's slot viewed as that shape, the
        # stamp's code and chunk bytes. Sizes repeat, so an operation builds no view.
        self._views: dict[tuple, tuple[list[torch.Tensor], int, int]] = {}
        self._mine = (stamp.record_offset(rank, 0), stamp.record_offset(rank, 1))
        self._read = tuple(stamp.header(nranks, buf).unpack_from for buf in (0, 1))
        self._gen = max(RECORD.unpack_from(mm, at)[0] >> 8 for at in self._mine)
        self.broken = Broken()
        # More ranks than cores: a polling rank holds the core the rank it waits for needs,
        # so wait politely (yield at once) instead of polling first.
        self._spins = 0 if nranks > _usable_cores() else 200
        policy = WaitPolicy(yield_s=0.002, first_sleep_s=0.0, max_sleep_s=1e-3, alive_every_s=0.1)
        self._waiter = Waiter(policy, timed_out=weak(self._timed_out),
                              watch=weak(self._watch) if any(peers) else None)

    # ---- construction -------------------------------------------------
    @classmethod
    def create(cls, cpu_group, ranks: list[int], label: str, timeout_s: float,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> "ShmAllReduce | None":
        """Collective over `cpu_group`: every member gets a handle, or every member gets None.

        None when a member disabled the path, the members are on different hosts, or the
        segment cannot be made or attached (e.g. /dev/shm full).
        """
        members = handshake(cpu_group, ranks, shm_allreduce_enabled())
        if members is None:
            return None
        nranks, me = len(ranks), members.index
        size = nranks * LINE + 2 * nranks * slot_bytes
        # Peers we see as they see themselves can open our descriptor through /proc, so the
        # segment needs no name at all; otherwise a name lives until all attached.
        watch = members.all_watchable
        made = cls._make_segment(size, label, Lifetime.NAMELESS if watch else Lifetime.UNTIL_ATTACHED) \
            if me == 0 else None
        where = [None if made is None else made.ref()]
        seg = made
        try:
            dist.broadcast_object_list(where, src=ranks[0], group=cpu_group)
            if where[0] is None:
                return None
            if seg is None:
                seg = cls._attach(where[0])
            attached: list = [None] * nranks
            dist.all_gather_object(attached, seg is not None, group=cpu_group)
        finally:
            if made is not None:
                made.unlink()  # everyone attached, gave up or failed
        if not all(attached):
            if seg is not None:
                seg.close()
            return None
        return cls(seg, nranks, me, slot_bytes, label, timeout_s,
                   members.peers if watch else [None] * nranks)

    @staticmethod
    def _attach(ref: SegmentRef) -> Segment | None:
        try:
            return Segment.attach(ref)
        except OSError:
            return None

    @staticmethod
    def _make_segment(size: int, label: str, lifetime: Lifetime) -> Segment | None:
        """Reserved up front (a full tmpfs fails here, not with SIGBUS later); None: use gloo."""
        try:
            return Segment.create(size, SHM_PREFIX, lifetime=lifetime,
                                  what=f"the all-reduce of group {label}")
        except OSError as exc:
            logger.warning("group %s: no shared-memory all-reduce, using gloo: %s", label, exc)
            return None

    # ---- the operation ----------------------------------------------
    def supports(self, t: torch.Tensor) -> bool:
        """Whether `t` goes through shared memory. A broken group still says yes for the
        tensors it used to take, so the caller gets the error instead of a gloo fallback."""
        return t.is_cpu and t.dtype in SUPPORTED_DTYPES

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place, identical bits on every rank; returns `t`."""
        if self.broken.why is not None:
            raise self._unusable("all_reduce")
        nbytes = t.numel() * t.element_size()
        if 0 < nbytes <= self.slot_bytes and t.is_contiguous():  # decode's case: no view, no copy
            self._reduce_chunk(t, nbytes)
            return t
        work = t if t.is_contiguous() else t.contiguous()
        flat = work.view(-1)
        step = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce_chunk(flat[start:start + step], nbytes)
        if work is not t:
            t.copy_(work)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape on all ranks), stacked in rank order: [nranks, *t.shape].

        Same protocol as the all-reduce, reading the slots instead of summing them (TP's
        LM head gathers its vocabulary slices this way every step).
        """
        if self.broken.why is not None:
            raise self._unusable("all_gather")
        flat = t.contiguous().view(-1)
        out = torch.empty((self.nranks, flat.numel()), dtype=t.dtype)
        step = self.slot_bytes // flat.element_size()
        total = flat.numel() * flat.element_size()
        for start in range(0, flat.numel(), step):
            chunk = flat[start:start + step]
            for rank, view in enumerate(self._exchange(chunk, "all_gather", total)):
                out[rank, start:start + chunk.numel()].copy_(view)
        return out.view(self.nranks, *t.shape)

    def _unusable(self, op: str) -> CollectiveError:
        return CollectiveError(f"{op} on group {self.label} unusable: {self.broken.why} (shared-memory path)")

    def _slots(self, key: tuple) -> tuple[list[torch.Tensor], int, int]:
        """Every rank's slot in buffer `buf` as `shape` of `dtype`, the stamp's code, the bytes."""
        op, buf, dtype, shape = key
        views = []
        for rank in range(self.nranks):
            offset = self._data_offset + (buf * self.nranks + rank) * self.slot_bytes
            views.append(self._bytes[offset:offset + self.slot_bytes].view(dtype)[:shape.numel()].view(shape))
        if len(self._views) > 256:
            self._views.clear()
        entry = self._views[key] = (views, stamp.code(op, dtype), shape.numel() * views[0].element_size())
        return entry

    def _exchange(self, chunk: torch.Tensor, op: str, total: int) -> list[torch.Tensor]:
        """Publish `chunk` as operation number gen, wait for every rank's; their slots, in rank order."""
        gen = self._gen + 1
        buf = gen & 1
        key = (op, buf, chunk.dtype, chunk.shape)
        views, code, nbytes = self._views.get(key) or self._slots(key)
        views[self.rank].copy_(chunk)
        tag = stamp.tag(gen)
        words = (gen << 8 | code, tag | nbytes, tag | total)
        RECORD.pack_into(self._mm, self._mine[buf], *words)  # the stamp, after the data (TSO)
        self._gen = gen
        want = (0, *words) * self.nranks
        if self._read[buf](self._mm) != want:
            self._wait(buf, want, gen, op)
        return views

    def _reduce_chunk(self, chunk: torch.Tensor, total: int) -> None:
        views = self._exchange(chunk, "all_reduce", total)
        if chunk.dtype in _HALF and self.nranks > 2:
            # accumulate in fp32, round once: more accurate, still rank-order fixed. (With two
            # ranks torch's half add below already computes in fp32 and rounds once.)
            acc = views[0].float()
            for view in views[1:]:
                acc.add_(view)
            chunk.copy_(acc)
        else:
            torch.add(views[0], views[1], out=chunk)
            for view in views[2:]:
                chunk.add_(view)

    def _wait(self, buf: int, want: tuple, gen: int, op: str) -> None:
        """Until every rank's stamp of operation `gen` reads `want`; fail on a mismatch, a
        timeout, a dead peer or a peer that declared the group broken."""
        read, mm = self._read[buf], self._mm
        for _ in range(self._spins):  # the common case, a peer just behind: no set-up at all
            if read(mm) == want:
                return
        self._waiter.wait(lambda: stamp.settled(read(mm), gen, want), time.monotonic() + self.timeout_s,
                          (buf, gen, op))
        got = read(mm)  # settled stays settled until this rank publishes gen + 1
        if got == want:
            return
        for peer in range(self.nranks):
            if got[4 * peer + BROKEN]:  # it gave up: so does everyone
                raise self._failure(op, f"failed: rank {peer} in group declared it broken")
        mine = want[1:4]
        for peer in range(self.nranks):
            theirs = got[4 * peer + 1:4 * peer + 4]
            if theirs != mine:
                raise self._failure(op, f"failed: operation mismatch: this rank's operation {gen} is "
                                        f"{stamp.describe(mine)}, rank {peer}'s is {stamp.describe(theirs)}")

    # The waiter's checks; ``about`` is (buffer, operation number, operation).
    def _behind(self, about) -> list[int]:
        buf, gen, _ = about
        return stamp.behind(self._read[buf](self._mm), gen)

    def _timed_out(self, about) -> BaseException:
        peers = self._behind(about) or ["?"]
        return self._failure(about[2], f"timed out after {self.timeout_s:g}s waiting for rank "
                                       f"{', '.join(map(str, peers))} in group")

    def _watch(self, about) -> None:
        for peer in self._behind(about):
            watched = self.peers[peer]
            if watched is not None and not watched.alive():
                raise self._failure(about[2], f"failed: rank {peer} in group (pid {watched.pid}) died")

    def _failure(self, op: str, why: str) -> CollectiveError:
        """Declare the group broken (peers see it in their wait); the error to raise."""
        self.broken.set(why)
        if self._lines is not None:
            self._lines[self.rank, BROKEN] = 1
        return CollectiveError(f"{op} on group {self.label} {why} (shared-memory path)")

    # ---- teardown ---------------------------------------------------
    def destroy(self) -> None:
        """Drop every view into the mapping, then unmap; safe to call twice."""
        if self._seg is None:
            return
        self._views.clear()
        self._bytes = self._lines = self._mm = None
        self._seg.close()  # a caller still holding a view: the OS unmaps at exit
        self._seg = None
        self.broken.set("destroyed")

