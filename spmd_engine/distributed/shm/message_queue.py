"""Shared-memory message queue: one writer, N readers, every reader gets every message.

The mp executor broadcasts every ``collective_rpc`` call to its workers through one
``MessageQueue`` (N readers) and each worker answers through its own queue (one reader:
the engine); the PP hand-off sends each stage's tensors to the next through one. A ring
of chunks in shared memory (ring.py) avoids a kernel round trip per message: a reader
that is polling sees a message as soon as it is written, where a pipe needs a scheduler
wake-up on both sides. A reader idle for longer than ``WaitPolicy.yield_s`` sleeps in
futex(2) and the writer wakes it, so idle workers cost no CPU and still wake promptly.

Usage::

    mq = MessageQueue.create(n_readers=2, label="rpc")   # engine (writer)
    h = mq.handle()                                       # pickle to workers
    rq = MessageQueue.attach(h, reader_index=i)           # in worker i
    mq.wait_attached(timeout=60)                          # then no one else can attach
    mq.enqueue(("execute_model", args, kwargs, 0)); rq.dequeue()

Payloads are pickled with protocol 5. Out-of-band buffers (numpy arrays and other PEP 574
objects) are copied straight into the ring instead of first into the pickle. A message
larger than one chunk is split over consecutive chunks (each chunk header carries the
total length and the fragment index); the reader reassembles it in a private buffer, so
shared memory stays fixed at ``n_chunks * chunk_bytes`` whatever the message size. A wait
broken off inside such a message (timeout, cancellation, dead peer) leaves the ring
mid-message, so the queue is then unusable for good (broken.py).
"""

from __future__ import annotations

import pickle
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .broken import Broken
from .ring import CHUNK_HEADER, RingEnd, RingLayout
from .segment import Lifetime, Segment, SegmentRef
from .waiter import Waiter, WaitPolicy, weak

__all__ = ["MessageQueue", "MessageQueueHandle", "WaitPolicy", "PeerGoneError",
           "UnpicklableError"]

NAME_PREFIX = "spmd_mq_"
_HDR = CHUNK_HEADER.size


class PeerGoneError(RuntimeError):
    """The ``alive`` callback said the other side of the queue has died."""


class UnpicklableError(TypeError):
    """``enqueue`` could not pickle the object; nothing was written, the queue is still
    usable. ``__cause__`` is pickle's own error."""


@dataclass(frozen=True)
class MessageQueueHandle:
    """What another process needs to attach: small and picklable."""

    segment: SegmentRef
    n_readers: int
    label: str

    @property
    def shm_name(self) -> str:
        return self.segment.name


class MessageQueue:
    """One end of a queue: the writer or one reader. Build with :meth:`create`,
    :meth:`attach` or :meth:`attach_writer`.

    Not safe for concurrent ``enqueue``/``dequeue`` from several threads; :meth:`shutdown`
    may be called from any thread.
    """

    def __init__(self, seg: Segment, layout: RingLayout, label: str,
                 reader_index: Optional[int], wait: Optional[WaitPolicy]):
        self._seg, self.label = seg, label
        self.reader_index = reader_index  # None: this end is the writer
        self.wait_policy = wait or WaitPolicy()
        self._closed = False
        self._broken = Broken()
        self._ring = ring = RingEnd(seg.mm, layout, reader_index)
        self._mv, self._cap = ring.mv, layout.capacity
        self._waiter = Waiter(self.wait_policy, timed_out=weak(self._timed_out), watch=weak(self._watch),
                              between=weak(self._between),
                              nap=None if ring.futex is None else weak(self._nap), cancellable=True)
        if not self._ring.claim_slot():
            self._release()
            raise ValueError(f"{self._name()}: {self._role()} is already attached")

    # ----------------------------------------------------------- construction
    @classmethod
    def create(cls, n_readers: int, *, chunk_bytes: int = 1 << 20, n_chunks: int = 8,
               label: str = "mq", reader_index: Optional[int] = None,
               wait: Optional[WaitPolicy] = None,
               lifetime: Lifetime = Lifetime.TRACKED) -> "MessageQueue":
        """Create a new segment and return this process's end of it: the writer, or reader
        ``reader_index`` when another process will write (a worker's response queue).

        ``lifetime`` (segment.py): TRACKED by default, the mp engine's case. NAMELESS for
        peers in this pid namespace that run no resource tracker (the PP hand-off)."""
        layout = RingLayout(n_readers, n_chunks, chunk_bytes)
        if reader_index is not None and not 0 <= reader_index < n_readers:
            raise ValueError(f"reader_index {reader_index} not in [0, {n_readers})")
        seg = Segment.create(layout.size, NAME_PREFIX, lifetime=lifetime, label=label,
                             what=f"message queue {label!r}")
        layout.write_geometry(seg.mm)
        return cls(seg, layout, label, reader_index, wait)

    @classmethod
    def attach(cls, handle: MessageQueueHandle, reader_index: int, *,
               wait: Optional[WaitPolicy] = None) -> "MessageQueue":
        """Attach as reader ``reader_index`` (0 <= index < n_readers)."""
        if not 0 <= reader_index < handle.n_readers:
            raise ValueError(f"reader_index {reader_index} not in [0, {handle.n_readers})")
        seg = Segment.attach(handle.segment)
        return cls(seg, RingLayout.read_geometry(seg.mm), handle.label, reader_index, wait)

    @classmethod
    def attach_writer(cls, handle: MessageQueueHandle, *,
                      wait: Optional[WaitPolicy] = None) -> "MessageQueue":
        """Attach as the writer of a queue another process created."""
        seg = Segment.attach(handle.segment)
        return cls(seg, RingLayout.read_geometry(seg.mm), handle.label, None, wait)

    def handle(self) -> MessageQueueHandle:
        return MessageQueueHandle(self._seg.ref(), self._ring.layout.n_readers, self.label)

    # ---------------------------------------------------------------- cleanup
    def all_attached(self) -> bool:
        """True once the writer and every reader have attached."""
        return self._ring.all_attached()

    def wait_attached(self, timeout: Optional[float] = None,
                      alive: Optional[Callable[[], bool]] = None) -> None:
        """Block until every party attached, then (creator only) close the attach window,
        so that a crash from then on leaves nothing in /dev/shm. The creator also does this
        by itself in any enqueue/dequeue/wait once everyone is there."""
        self._wait(self.all_attached, self._deadline(timeout), alive,
                   "every party to attach", timeout)
        self.unlink()

    def unlink(self) -> None:
        """Creator: no party attaches from now on (the name, or the descriptor peers open,
        goes); idempotent."""
        self._seg.unlink()

    def shutdown(self) -> None:
        """Make every blocked or later ``enqueue``/``dequeue`` on this end raise
        ``RuntimeError("cancelled")``. Safe from any thread."""
        self._waiter.cancel()
        if self._ring.futex is not None and not self._closed:
            # Wakes our futex sleeper at once. Also a spurious wake-up for other
            # processes' readers, which re-check and sleep again.
            self._ring.wake()

    def close(self) -> None:
        """Detach (idempotent). A closing writer marks the queue closed so readers waiting
        on an empty queue get ``EOFError``; a closing creator unlinks if it had not yet."""
        if self._closed:
            return
        self.shutdown()
        if self.reader_index is None:
            self._ring.close_writer()
        self._closed = True
        self._release()

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort for a creator that never closed: drop the name.
        seg = getattr(self, "_seg", None)
        if seg is not None and seg.attachable:
            try:
                seg.unlink()
            except Exception:
                pass

    # ------------------------------------------------------------- messaging
    def enqueue(self, obj: Any, timeout: Optional[float] = None,
                alive: Optional[Callable[[], bool]] = None) -> None:
        """Send ``obj`` to every reader; blocks while the ring is full.

        Raises ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError("cancelled")``
        after :meth:`shutdown`, and :class:`PeerGoneError` when ``alive()`` (checked
        periodically while blocked) returns False, e.g. because a reader process died.
        """
        self._check_usable(writer=True)
        buffers: list = []
        try:
            main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        except Exception as e:
            raise UnpicklableError(f"{type(e).__name__}: {e}") from e
        deadline = self._deadline(timeout)
        ring, mv, cap = self._ring, self._mv, self._cap
        if not buffers and len(main) <= cap:  # common case: one chunk
            off = ring.claim()
            if off < 0:
                off = self._claim_chunk(deadline, alive, timeout, False)
            CHUNK_HEADER.pack_into(mv, off, len(main), 0, 0)
            mv[off + _HDR:off + _HDR + len(main)] = main
            ring.publish()
            return
        parts = _frame(main, buffers)
        total = sum(len(p) for p in parts)
        src = _PartReader(parts)
        frag = 0
        while src.done < total:
            off = self._claim_chunk(deadline, alive, timeout, frag > 0)
            n = min(cap, total - src.done)
            CHUNK_HEADER.pack_into(mv, off, total, frag, len(buffers))
            src.read_into(mv[off + _HDR:off + _HDR + n])
            ring.publish()
            frag += 1

    def dequeue(self, timeout: Optional[float] = None,
                alive: Optional[Callable[[], bool]] = None) -> Any:
        """Return the next message for this reader; blocks until one comes.

        Raises ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError("cancelled")``
        after :meth:`shutdown`, :class:`PeerGoneError` when ``alive()`` (checked
        periodically while blocked) returns False, e.g. because the writer process died,
        and ``EOFError`` when the writer closed the queue and it is empty.
        """
        self._check_usable(writer=False)
        deadline = self._deadline(timeout)
        ring, mv, cap = self._ring, self._mv, self._cap
        off = ring.poll()
        if off < 0:
            off = self._await_chunk(deadline, alive, timeout, False)
        total, frag, n_buffers = CHUNK_HEADER.unpack_from(mv, off)
        if frag != 0:
            self._corrupt(f"message starts with fragment {frag}")
        if total <= cap:  # common case: one chunk
            try:
                if n_buffers == 0:  # unpickle in place: loads copies out
                    return pickle.loads(mv[off + _HDR:off + _HDR + total])
                body = bytearray(mv[off + _HDR:off + _HDR + total])
            finally:
                ring.consumed()
            return _unframe(body, n_buffers)
        body, got = bytearray(total), 0
        while True:
            n = min(cap, total - got)
            try:
                body[got:got + n] = mv[off + _HDR:off + _HDR + n]
            finally:
                ring.consumed()
            got += n
            if got == total:
                return _unframe(body, n_buffers)
            off = self._await_chunk(deadline, alive, timeout, True)
            t, f, _ = CHUNK_HEADER.unpack_from(mv, off)
            frag += 1
            if (t, f) != (total, frag):
                self._corrupt(f"expected fragment {frag} of {total} B, got {f} of {t} B")

    def has_message(self) -> bool:
        """Reader: True when the next message (its first chunk) is already published, so a
        ``dequeue`` would not wait for it to start."""
        return self._ring.chunk_ready()

    # -------------------------------------------------------------- internals
    def _claim_chunk(self, deadline, alive, timeout, mid_message) -> int:
        """Writer: wait until the next chunk has been read by every reader; its offset."""
        self._wait(self._ring.chunk_free, deadline, alive, "a free chunk (readers slow or gone?)",
                   timeout, mid_message)
        return self._ring.claim()

    def _await_chunk(self, deadline, alive, timeout, mid_message) -> int:
        """Reader: wait until the writer published our next chunk; its offset."""
        self._wait(self._ring.chunk_ready, deadline, alive, "a message", timeout, mid_message,
                   futex=True)
        return self._ring.poll()

    def _wait(self, ready: Callable[[], bool], deadline: Optional[float],
              alive: Optional[Callable[[], bool]], what: str, timeout: Optional[float],
              mid_message: bool = False, futex: bool = False) -> None:
        """Return once ``ready()`` (waiter.py), napping on the futex when ``futex`` (a reader
        waiting for the writer)."""
        try:
            self._waiter.wait(ready, deadline, (what, timeout, alive), futex)
        except BaseException as e:
            if mid_message:  # half a message is in the ring: cannot resync
                self._broken.set(f"interrupted inside a multi-chunk message ({e!r})")
            raise

    # The waiter's checks; ``about`` is (what is awaited, the timeout, the alive callback).
    def _timed_out(self, about) -> BaseException:
        what, timeout, _ = about
        return TimeoutError(f"{self._name()}: timed out after {timeout}s waiting for {what}")

    def _watch(self, about) -> None:
        what, _, alive = about
        if alive is not None and not alive():
            raise PeerGoneError(f"{self._name()}: peer process gone while waiting for {what}")

    def _between(self, ready: Callable[[], bool], about) -> None:
        self._maybe_unlink()
        if self.reader_index is not None and self._ring.writer_closed() and not ready():
            raise EOFError(f"{self._name()}: writer closed the queue")

    def _nap(self, seconds: float, ready: Callable[[], bool]) -> None:
        waiter = self._waiter
        self._ring.nap(seconds, lambda: waiter.cancelled or ready())

    def _maybe_unlink(self) -> None:
        if self._seg.attachable and self.all_attached():
            self._seg.unlink()

    def _check_usable(self, writer: bool) -> None:
        if self._waiter.cancelled:
            raise RuntimeError("cancelled")
        if (self.reader_index is None) != writer:
            raise RuntimeError(f"{self._name()}: this end is the {self._role()}")
        if self._broken.why is not None:
            raise RuntimeError(f"{self._name()} is unusable: {self._broken.why}")
        if self._seg.attachable:  # plain attribute reads: this runs on every message
            self._maybe_unlink()

    def _corrupt(self, why: str) -> None:
        self._broken.set(why)
        raise RuntimeError(f"{self._name()}: corrupt ring ({why})")

    @staticmethod
    def _deadline(timeout: Optional[float]) -> Optional[float]:
        return None if timeout is None else time.monotonic() + timeout

    def _role(self) -> str:
        return "writer" if self.reader_index is None else f"reader {self.reader_index}"

    def _name(self) -> str:
        return f"MessageQueue {self.label!r} ({self._seg.name.lstrip('/')})"

    def _release(self) -> None:
        self._ring.release()
        self._seg.close()


# ------------------------------------------------------------ serialization
# Body of a message with n_buffers > 0: u64 length of the pickle and of each buffer, the
# pickle, the buffers. With n_buffers == 0 the body is the pickle.

def _frame(main: bytes, buffers: list) -> list:
    if not buffers:
        return [main]
    raws = [b.raw() for b in buffers]  # 1-D unsigned-byte views, no copy
    lengths = struct.pack(f"<{len(raws) + 1}Q", len(main), *(r.nbytes for r in raws))
    return [lengths, main, *raws]


def _unframe(body: bytearray, n_buffers: int) -> Any:
    view = memoryview(body)
    if n_buffers == 0:
        return pickle.loads(view)
    lengths = struct.unpack_from(f"<{n_buffers + 1}Q", view, 0)
    off, parts = 8 * (n_buffers + 1), []
    for n in lengths:
        parts.append(view[off:off + n])
        off += n
    # Buffers alias ``body`` (private, writable): arrays come back writable.
    return pickle.loads(parts[0], buffers=parts[1:])


class _PartReader:
    """Copies a list of byte parts, in order, into consecutive chunks."""

    def __init__(self, parts: list):
        self.parts = [memoryview(p) for p in parts]  # slices without copies
        self.i, self.off, self.done = 0, 0, 0

    def read_into(self, dst: memoryview) -> None:
        pos, n = 0, len(dst)
        while pos < n:
            part = self.parts[self.i]
            take = min(len(part) - self.off, n - pos)
            dst[pos:pos + take] = part[self.off:self.off + take]
            pos += take
            self.off += take
            if self.off == len(part):
                self.i, self.off = self.i + 1, 0
        self.done += n
