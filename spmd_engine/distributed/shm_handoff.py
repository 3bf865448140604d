"""The pipeline hand-off (each stage's hidden state and residual to the next) through shared
memory, when the stages are processes on one host.

Why: gloo's send/recv of one hand-off (four messages: size, metadata, two tensors) costs
about 0.4 ms at the median on this 2-core box and stalls for 3-8 ms in one hand-off in ten
(measured with two processes alternating 8 ms of matmuls and a hand-off, as PP stages do:
p90 of the receiver's wait 11.8 ms against 8.5 ms through a shared-memory queue). In a PP=2
decode each stage's step is about 10 ms, so those stalls idled both stages a third of the time.

Each rank writes to its next rank through one MessageQueue (distributed/shm/message_queue.py: a ring
with futex wake-ups, one writer, one reader), so a group of n ranks holds n queues, each
rank the writer of one and the reader of another. Every message carries a sequence number
per direction; a receiver that gets another number than it expects (a sender that gave up
mid-step and went on, a retry) raises instead of using the tensors. Any failure (timeout,
a dead peer, a mismatch) breaks the hand-off for good: every later send or receive raises,
and nobody falls back to gloo (a rank on gloo and its peer on shared memory would wait for
each other until the timeout).

Set-up is collective over the group (every member's first default-neighbour send or
receive, which the PP forward makes on every stage in its first step), like the
shared-memory all-reduce. It returns None on every member when one is on another host, has
shared memory disabled, or cannot make or attach its queue: the group then uses gloo.
"""

from __future__ import annotations

import logging
import os
import socket

import numpy as np
import torch
import torch.distributed as dist

from spmd_engine.distributed.errors import CollectiveError
from spmd_engine.distributed.shm.message_queue import MessageQueue, PeerGoneError
from spmd_engine.distributed.shm.segment import Lifetime
from spmd_engine.distributed.shm_allreduce import _process_identity, shm_allreduce_enabled

logger = logging.getLogger("spmd_engine")

DISABLE_ENV = "SPMD_ENGINE_DISABLE_SHM_HANDOFF"
CHUNK_BYTES = 1 << 20  # a decode hand-off is tens of KiB: one chunk; a long prefill spans several
N_CHUNKS = 8


def shm_handoff_enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0") in ("", "0") and shm_allreduce_enabled()


class ShmHandoff:
    """This rank's two queues of its group's ring: to the next rank and from the previous."""

    def __init__(self, outbound: MessageQueue, inbound: MessageQueue, label: str, timeout_s: float,
                 next_peer: tuple[int, str] | None, prev_peer: tuple[int, str] | None):
        self.outbound, self.inbound, self.label, self.timeout_s = outbound, inbound, label, timeout_s
        self._next_peer, self._prev_peer = next_peer, prev_peer
        self._sent = self._received = 0
        self.broken: str | None = None

    @classmethod
    def create(cls, cpu_group, ranks: list[int], label: str, timeout_s: float) -> "ShmHandoff | None":
        """Collective over `cpu_group`: every member gets its hand-off, or every member gets None."""
        n, me = len(ranks), ranks.index(dist.get_rank())
        info = (socket.gethostname(), shm_handoff_enabled(), os.getpid(), _process_identity(os.getpid()))
        infos: list = [None] * n
        dist.all_gather_object(infos, info, group=cpu_group)
        if len({i[0] for i in infos}) != 1 or not all(i[1] for i in infos):
            return None
        # A peer we see as it sees itself (one pid namespace) is watched while we wait on it.
        # Checked now, while every member is known to be alive (it just joined the gather): a
        # peer may be done and gone before the set-up below returns here.
        peers = [(i[2], i[3]) if i[3] is not None and _process_identity(i[2]) == i[3] else None for i in infos]
        outbound = inbound = None
        try:
            # No name from the start (a rank SIGKILLed mid set-up leaves nothing in /dev/shm, and
            # no resource tracker is needed): the next rank attaches through /proc/<pid>/fd.
            outbound = MessageQueue.create(n_readers=1, chunk_bytes=CHUNK_BYTES, n_chunks=N_CHUNKS,
                                           label=f"handoff {label}", lifetime=Lifetime.NAMELESS)
        except OSError as exc:
            logger.warning("group %s: no shared-memory hand-off, using gloo: %s", label, exc)
        handles: list = [None] * n
        dist.all_gather_object(handles, None if outbound is None else outbound.handle(), group=cpu_group)
        prev = handles[(me - 1) % n]
        if prev is not None:
            try:
                inbound = MessageQueue.attach(prev, reader_index=0)
            except (OSError, ValueError) as exc:  # e.g. another pid namespace: /proc/<pid>/fd is not ours
                logger.warning("group %s: cannot attach the shared-memory hand-off, using gloo: %s", label, exc)
        attached: list = [None] * n
        dist.all_gather_object(attached, inbound is not None and outbound is not None, group=cpu_group)
        if not all(attached):
            for q in (outbound, inbound):
                if q is not None:
                    q.close()
            return None
        outbound.wait_attached(timeout=timeout_s)  # everyone attached: the descriptor goes now
        return cls(outbound, inbound, label, timeout_s, peers[(me + 1) % n], peers[(me - 1) % n])

    # ---- the hand-off --------------------------------------------------------
    def send(self, meta: list, tensors: list[torch.Tensor]) -> None:
        """`meta` (picklable, tensors replaced by their TensorMeta) and the CPU tensors, in order."""
        self._check_usable("send_tensor_dict")
        self._sent += 1
        payload = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in tensors]
        self._fail_on_error("send_tensor_dict", lambda: self.outbound.enqueue(
            (self._sent, meta, payload), timeout=self.timeout_s, alive=self._alive(self._next_peer)))

    def recv(self) -> tuple[list, list[np.ndarray]]:
        """The next message from the previous rank: (meta, one byte array per tensor)."""
        self._check_usable("recv_tensor_dict")
        self._received += 1
        seq, meta, payload = self._fail_on_error("recv_tensor_dict", lambda: self.inbound.dequeue(
            timeout=self.timeout_s, alive=self._alive(self._prev_peer)))
        if seq != self._received:
            self.broken = (f"recv_tensor_dict on group {self.label}: hand-off number {seq} arrived where "
                           f"{self._received} was expected (the stages disagree on the step)")
            raise CollectiveError(self.broken)
        return meta, payload

    @staticmethod
    def tensor_from(buf: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
        """A received byte array as a tensor, without another copy: dequeue already copied the
        message out of the ring into memory of its own (a read-only view is copied once)."""
        if buf.size == 0:
            return torch.empty(shape, dtype=dtype)
        if not buf.flags.writeable:
            buf = buf.copy()
        return torch.from_numpy(buf).view(dtype).view(shape)

    def _alive(self, peer: tuple[int, str] | None):
        if peer is None:
            return None
        pid, ident = peer
        return lambda: _process_identity(pid) == ident

    def _fail_on_error(self, op: str, call):
        try:
            return call()
        except (TimeoutError, PeerGoneError, EOFError, RuntimeError) as exc:
            if isinstance(exc, TimeoutError):
                why = f"timed out after {self.timeout_s:g}s"
            elif isinstance(exc, (PeerGoneError, EOFError)):
                why = "its peer is gone"
            else:
                why = f"failed ({exc})"
            self.broken = f"{op} on group {self.label} {why} (shared-memory hand-off)"
            raise CollectiveError(self.broken) from exc

    def _check_usable(self, op: str) -> None:
        if self.broken is not None:
            raise CollectiveError(f"{op} on group {self.label}: the hand-off is broken since an earlier "
                                  f"failure ({self.broken})")

    def destroy(self) -> None:
        for q in (self.outbound, self.inbound):
            q.close()
