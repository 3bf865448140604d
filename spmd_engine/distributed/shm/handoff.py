"""The pipeline hand-off (each stage's hidden state and residual to the next) through shared
memory, when the stages are processes on one host.

Why: gloo's send/recv of one hand-off is four messages (size, metadata, two tensors), each
a socket round trip that now and then stalls for milliseconds, and a stage waiting for its
input idles for all of it. A shared-memory queue hands the whole dict over in one message
and wakes the receiver at once.

Each rank writes to its next rank through one MessageQueue (message_queue.py: one writer,
one reader), so a group of n ranks holds n queues, each rank the writer of one and the
reader of another. The queues are NAMELESS (segment.py): nothing can be left in /dev/shm,
and no resource tracker is needed. Every message carries a sequence number per direction;
a receiver that gets another number than it expects (a sender that gave up mid-step and
went on, a retry) raises instead of using the tensors. The peer process is watched while
waiting (peers.py). Any failure (timeout, a dead peer, a mismatch) breaks the hand-off for
good (broken.py): every later send or receive raises, and nobody falls back to gloo.

Set-up is collective over the group (every member's first default-neighbour send or
receive, which the PP forward makes on every stage in its first step). It returns None on
every member when one is on another host, has the hand-off switched off
(SPMD_ENGINE_DISABLE_SHM_HANDOFF; the all-reduce's switch does not concern it), or cannot
make or attach its queue (another pid namespace): the group then uses gloo.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from spmd_engine import envs
from spmd_engine.distributed.errors import CollectiveError

from .broken import Broken
from .message_queue import MessageQueue, PeerGoneError
from .peers import Peer, handshake
from .segment import SHM_DIR, Lifetime

logger = logging.getLogger("spmd_engine")

CHUNK_BYTES = 1 << 20  # a decode hand-off is tens of KiB: one chunk; a long prefill spans several
N_CHUNKS = 8


def shm_handoff_enabled() -> bool:
    """Whether this process may use the shared-memory hand-off at all: its own switch
    (envs.py) and /dev/shm. Not the all-reduce's: the queue orders its stores itself (ring.py)
    and needs no x86, and switching the all-reduce off says nothing about the hand-off."""
    return envs.shm_handoff_enabled() and os.path.isdir(SHM_DIR)


class ShmHandoff:
    """This rank's two queues of its group's ring: to the next rank and from the previous."""

    def __init__(self, outbound: MessageQueue, inbound: MessageQueue, label: str, timeout_s: float,
                 next_peer: Peer | None, prev_peer: Peer | None):
        self.outbound, self.inbound, self.label, self.timeout_s = outbound, inbound, label, timeout_s
        self._next_alive = None if next_peer is None else next_peer.alive
        self._prev_alive = None if prev_peer is None else prev_peer.alive
        self._sent = self._received = 0
        self.broken = Broken()

    @classmethod
    def create(cls, cpu_group, ranks: list[int], label: str, timeout_s: float) -> "ShmHandoff | None":
        """Collective over `cpu_group`: every member gets its hand-off, or every member gets None."""
        members = handshake(cpu_group, ranks, shm_handoff_enabled())
        if members is None:
            return None
        n, me = len(ranks), members.index
        outbound = inbound = None
        try:
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
        return cls(outbound, inbound, label, timeout_s, members.peers[(me + 1) % n],
                   members.peers[(me - 1) % n])

    # ---- the hand-off --------------------------------------------------------
    def send(self, meta: list, tensors: list[torch.Tensor]) -> None:
        """`meta` (picklable, tensors replaced by their TensorMeta) and the CPU tensors, in order."""
        self._check_usable("send_tensor_dict")
        self._sent += 1
        payload = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in tensors]
        self._fail_on_error("send_tensor_dict", lambda: self.outbound.enqueue(
            (self._sent, meta, payload), timeout=self.timeout_s, alive=self._next_alive))

    def recv(self) -> tuple[list, list[np.ndarray]]:
        """The next message from the previous rank: (meta, one byte array per tensor)."""
        self._check_usable("recv_tensor_dict")
        self._received += 1
        seq, meta, payload = self._fail_on_error("recv_tensor_dict", lambda: self.inbound.dequeue(
            timeout=self.timeout_s, alive=self._prev_alive))
        if seq != self._received:
            raise CollectiveError(self.broken.set(
                f"recv_tensor_dict on group {self.label}: hand-off number {seq} arrived where "
                f"{self._received} was expected (the stages disagree on the step)"))
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
            raise CollectiveError(self.broken.set(
                f"{op} on group {self.label} {why} (shared-memory hand-off)")) from exc

    def _check_usable(self, op: str) -> None:
        if self.broken.why is not None:
            raise CollectiveError(f"{op} on group {self.label}: the hand-off is broken since an earlier "
                                  f"failure ({self.broken.why})")

    def destroy(self) -> None:
        for q in (self.outbound, self.inbound):
            q.close()
