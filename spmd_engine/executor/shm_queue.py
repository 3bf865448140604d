"""Shared-memory message queue: one writer, N readers, for the mp executor.

The engine broadcasts every ``collective_rpc`` call to its workers through one
``MessageQueue`` (N readers) and each worker answers through its own queue
(one reader: the engine).  A ring of fixed-size chunks in POSIX shared memory
(layout in :mod:`.shm_ring`) avoids a kernel round trip per message: a reader
that is polling sees a message within microseconds, where a pipe needs a
scheduler wake-up on both sides.  A reader idle for longer than
``WaitPolicy.yield_s`` sleeps in ``futex(2)`` and the writer wakes it, so idle
workers cost no CPU and still wake promptly (see :class:`WaitPolicy`).

Usage::

    mq = MessageQueue.create(n_readers=2, label="rpc")   # engine (writer)
    h = mq.handle()                                       # pickle to workers
    rq = MessageQueue.attach(h, reader_index=i)           # in worker i
    mq.wait_attached(timeout=60)                          # then unlinks the name
    mq.enqueue(("execute_model", args, kwargs, 0)); rq.dequeue()

Payloads are pickled with protocol 5.  Out-of-band buffers (numpy arrays and
other PEP 574 objects) are copied straight into the ring instead of first into
the pickle.  A message larger than one chunk is split over consecutive chunks
(each chunk header carries the total length and the fragment index); the
reader reassembles it in a private buffer, so shared memory stays fixed at
``n_chunks * chunk_bytes`` whatever the message size.

Memory ordering: the writer stores the payload, then the chunk's ``seq``; a
reader loads ``seq``, then the payload, then stores its ``read_seq``; the
writer loads every ``read_seq`` before overwriting the chunk.  x86-64 (TSO)
never reorders store/store, load/load or load/store, so that program order is
enough there and ``_fence`` is a no-op.  Elsewhere (ARM64) ``_fence`` is a
lock round trip (atomic instructions with barriers inside glibc): the
strongest ordering pure Python can ask for, not a formal C11 fence.  Every
ring flag has exactly one writing process and is an aligned 8-byte store, so
no value is ever seen torn.  The futex hand-shake needs a StoreLoad barrier
and always uses the lock round trip (a ``lock``-prefixed instruction on x86).
"""

from __future__ import annotations

import os
import pickle
import platform
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from spmd_engine.shm_segment import ShmSegment as UntrackedSegment

from .shm_ring import (ATTACHED_OFF, CHUNK_HEADER, NAME_PREFIX, WAKE_SEQ_OFF,
                       WRITER_CLOSED_OFF, Futex, RingLayout, ShmSegment,
                       read_geometry, write_geometry)

__all__ = ["MessageQueue", "MessageQueueHandle", "WaitPolicy", "PeerGoneError",
           "UnpicklableError"]

_fence_lock = threading.Lock()


def _full_fence() -> None:
    """A lock round trip: atomic read-modify-write instructions inside glibc,
    which on x86 (lock prefix) are full barriers, StoreLoad included."""
    _fence_lock.acquire()
    _fence_lock.release()


if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    def _fence() -> None:
        """No-op: x86 keeps the program order the ring protocol relies on."""
else:
    _fence = _full_fence

_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_HDR = CHUNK_HEADER.size


class PeerGoneError(RuntimeError):
    """The ``alive`` callback said the other side of the queue has died."""


class UnpicklableError(TypeError):
    """``enqueue`` could not pickle the object; nothing was written, the queue
    is still usable.  ``__cause__`` is pickle's own error."""


@dataclass(frozen=True)
class WaitPolicy:
    """How a blocked ``enqueue``/``dequeue`` waits (local to one process).

    Busy-poll for ``busy_s`` (an active peer answers within microseconds),
    then poll with ``sched_yield`` until ``yield_s`` (hands the core to other
    runnable processes: engine and workers may share few cores), then sleep.
    A reader sleeps in ``futex(2)`` and the writer wakes it when it publishes
    (Linux); the writer waiting for a slow reader, or a reader without futex,
    sleeps with exponential back-off up to ``max_sleep_s``.  Either way an
    idle process costs no core.  ``alive`` callbacks, shutdown and timeouts
    are checked at least every ``alive_every_s`` once sleeping.

    Pure spinning is harmful when processes outnumber cores: a spinner holds
    the core its peer needs.  On the 2-core dev box, under load, even 5 us of
    pure spinning raised the 2-worker round trip from ~24 us to ~40 us (50 us:
    ~180 us), so the default polls with ``sched_yield`` from the start; that
    costs nothing when the core is otherwise idle (the call returns at once).
    """

    busy_s: float = 0.0
    yield_s: float = 5e-4
    max_sleep_s: float = 1e-3
    alive_every_s: float = 0.1


@dataclass(frozen=True)
class MessageQueueHandle:
    """What another process needs to attach: small and picklable."""

    shm_name: str
    n_readers: int
    label: str
    # A queue created `unlinked` has no name: peers open the creator's descriptor instead.
    creator_pid: Optional[int] = None
    fd: Optional[int] = None
    size: Optional[int] = None


class MessageQueue:
    """One writer, ``n_readers`` readers; every reader gets every message, in
    order.  Build with :meth:`create`, :meth:`attach` or :meth:`attach_writer`.

    One instance is one end (the writer or one reader) and is not safe for
    concurrent ``enqueue``/``dequeue`` from several threads; :meth:`shutdown`
    may be called from any thread.
    """

    def __init__(self, seg: ShmSegment, layout: RingLayout, label: str,
                 reader_index: Optional[int], wait: Optional[WaitPolicy]):
        self._seg, self._layout, self.label = seg, layout, label
        self.reader_index = reader_index  # None: this end is the writer
        self.wait_policy = wait or WaitPolicy()
        self._closed = False
        self._cancelled = False
        self._cancel_event = threading.Event()
        self._broken: Optional[str] = None
        self._pos = 0  # chunks written (writer) or consumed (reader) so far
        self._mv = memoryview(seg.mm)
        self._meta = self._mv[layout.meta_off:layout.data_off].cast("Q")
        chunks = range(layout.n_chunks)
        self._off = [layout.chunk_off(c) for c in chunks]
        self._seq_i = [layout.seq_index(c) for c in chunks]
        r = 0 if reader_index is None else reader_index
        self._read_i = [layout.read_index(c, r) for c in chunks]
        self._futex = Futex.make(seg.mm, WAKE_SEQ_OFF)
        self._wake_seq = self._mv[WAKE_SEQ_OFF:WAKE_SEQ_OFF + 4].cast("I")
        self._sleeping = (layout.sleeping_off, layout.sleeping_off + layout.n_readers)
        self._sleep_flag = layout.sleeping_off + r
        slot = ATTACHED_OFF + (0 if reader_index is None else 1 + reader_index)
        if seg.mm[slot]:
            self._release()
            raise ValueError(f"{self._name()}: "
                             f"{self._role()} is already attached")
        seg.mm[slot] = 1

    # ----------------------------------------------------------- construction
    @classmethod
    def create(cls, n_readers: int, *, chunk_bytes: int = 1 << 20,
               n_chunks: int = 8, label: str = "mq",
               reader_index: Optional[int] = None,
               wait: Optional[WaitPolicy] = None,
               unlinked: bool = False) -> "MessageQueue":
        """Create a new segment and return this process's end of it: the
        writer, or reader ``reader_index`` when another process will write
        (a worker's response queue).  The creator owns the /dev/shm name.

        ``unlinked``: no name at all, from the start (so nothing can be left
        in /dev/shm, and no resource tracker is needed): peers in this pid
        namespace attach through ``/proc/<creator>/fd`` (the handle says
        which); the creator drops that descriptor once everyone attached."""
        layout = RingLayout(n_readers, n_chunks, chunk_bytes)
        if reader_index is not None and not 0 <= reader_index < n_readers:
            raise ValueError(f"reader_index {reader_index} not in [0, {n_readers})")
        if unlinked:
            seg = UntrackedSegment.create(layout.size, NAME_PREFIX, label, what=f"message queue {label!r}",
                                          unlinked=True)
        else:
            seg = ShmSegment.create(layout.size, label)
        write_geometry(seg.mm, layout)
        return cls(seg, layout, label, reader_index, wait)

    @classmethod
    def attach(cls, handle: MessageQueueHandle, reader_index: int, *,
               wait: Optional[WaitPolicy] = None) -> "MessageQueue":
        """Attach as reader ``reader_index`` (0 <= index < n_readers)."""
        if not 0 <= reader_index < handle.n_readers:
            raise ValueError(f"reader_index {reader_index} not in "
                             f"[0, {handle.n_readers})")
        if handle.fd is not None:
            seg = UntrackedSegment.attach_fd(handle.creator_pid, handle.fd, handle.size)
        else:
            seg = ShmSegment.attach(handle.shm_name)
        return cls(seg, read_geometry(seg.mm), handle.label, reader_index, wait)

    @classmethod
    def attach_writer(cls, handle: MessageQueueHandle, *,
                      wait: Optional[WaitPolicy] = None) -> "MessageQueue":
        """Attach as the writer of a queue another process created."""
        seg = ShmSegment.attach(handle.shm_name)
        return cls(seg, read_geometry(seg.mm), handle.label, None, wait)

    def handle(self) -> MessageQueueHandle:
        fd = getattr(self._seg, "fd", None)
        return MessageQueueHandle(self._seg.name, self._layout.n_readers, self.label,
                                  os.getpid() if fd is not None else None, fd,
                                  self._layout.size if fd is not None else None)

    # ---------------------------------------------------------------- cleanup
    def all_attached(self) -> bool:
        """True once the writer and every reader have attached."""
        n = 1 + self._layout.n_readers
        return self._seg.mm[ATTACHED_OFF:ATTACHED_OFF + n] == b"\x01" * n

    def wait_attached(self, timeout: Optional[float] = None,
                      alive: Optional[Callable[[], bool]] = None) -> None:
        """Block until every party attached, then (creator only) unlink the
        name, so that a crash from then on leaves nothing in /dev/shm.  The
        creator also does this by itself in any enqueue/dequeue/wait."""
        self._wait(self.all_attached, self._deadline(timeout), alive,
                   "every party to attach", timeout)
        self.unlink()
        self._seg.close_fd()  # an unlinked creator's descriptor: nobody else attaches now

    def unlink(self) -> None:
        """Remove the /dev/shm name now (creator only; idempotent).  Parties
        that have not attached yet can no longer attach."""
        if self._seg.owner:
            self._seg.unlink()

    def shutdown(self) -> None:
        """Make every blocked or later ``enqueue``/``dequeue`` on this end
        raise ``RuntimeError("cancelled")``.  Safe from any thread."""
        self._cancelled = True
        self._cancel_event.set()
        if self._futex is not None and not self._closed:
            # Wakes our futex sleeper at once.  Also a spurious wake-up for
            # other processes' readers, which re-check and sleep again.
            self._bump_wake_seq()

    def close(self) -> None:
        """Detach (idempotent).  A closing writer marks the queue closed so
        readers waiting on an empty queue get ``EOFError``; a closing creator
        unlinks the name if that had not happened yet."""
        if self._closed:
            return
        self.shutdown()
        if self.reader_index is None:
            self._seg.mm[WRITER_CLOSED_OFF] = 1
            if self._futex is not None:
                self._bump_wake_seq()  # sleeping readers see EOF now
        self._closed = True
        self.unlink()
        self._release()

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Last resort for a creator that never closed: drop the name.
        seg = getattr(self, "_seg", None)
        if seg is not None and seg.owner and not seg.unlinked:
            try:
                seg.unlink()
            except Exception:
                pass

    # ------------------------------------------------------------- messaging
    def enqueue(self, obj: Any, timeout: Optional[float] = None,
                alive: Optional[Callable[[], bool]] = None) -> None:
        """Send ``obj`` to every reader; blocks while the ring is full.

        Raises ``TimeoutError`` after ``timeout`` seconds,
        ``RuntimeError("cancelled")`` after :meth:`shutdown`, and
        :class:`PeerGoneError` when ``alive()`` (checked periodically while
        blocked) returns False, e.g. because a reader process died.
        """
        self._check_usable(writer=True)
        buffers: list = []
        try:
            main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        except Exception as e:
            raise UnpicklableError(f"{type(e).__name__}: {e}") from e
        deadline = self._deadline(timeout)
        mv, cap = self._mv, self._layout.capacity
        if not buffers and len(main) <= cap:  # common case: one chunk
            off = self._off[self._claim_chunk(deadline, alive, timeout, False)]
            CHUNK_HEADER.pack_into(mv, off, len(main), 0, 0)
            mv[off + _HDR:off + _HDR + len(main)] = main
            self._publish()
            return
        parts = _frame(main, buffers)
        total = sum(len(p) for p in parts)
        src = _PartReader(parts)
        frag = 0
        while src.done < total:
            off = self._off[self._claim_chunk(deadline, alive, timeout, frag > 0)]
            n = min(cap, total - src.done)
            CHUNK_HEADER.pack_into(mv, off, total, frag, len(buffers))
            src.read_into(mv[off + _HDR:off + _HDR + n])
            self._publish()
            frag += 1

    def dequeue(self, timeout: Optional[float] = None,
                alive: Optional[Callable[[], bool]] = None) -> Any:
        """Return the next message for this reader; blocks until one comes.

        Raises ``TimeoutError`` after ``timeout`` seconds,
        ``RuntimeError("cancelled")`` after :meth:`shutdown`,
        :class:`PeerGoneError` when ``alive()`` (checked periodically while
        blocked) returns False, e.g. because the writer process died, and
        ``EOFError`` when the writer closed the queue and it is empty.
        """
        self._check_usable(writer=False)
        deadline = self._deadline(timeout)
        mv, cap = self._mv, self._layout.capacity
        off = self._off[self._await_chunk(deadline, alive, timeout, False)]
        total, frag, n_buffers = CHUNK_HEADER.unpack_from(mv, off)
        if frag != 0:
            self._corrupt(f"message starts with fragment {frag}")
        if total <= cap:  # common case: one chunk
            try:
                if n_buffers == 0:  # unpickle in place: loads copies out
                    return pickle.loads(mv[off + _HDR:off + _HDR + total])
                body = bytearray(mv[off + _HDR:off + _HDR + total])
            finally:
                self._consumed()
            return _unframe(body, n_buffers)
        body, got = bytearray(total), 0
        while True:
            n = min(cap, total - got)
            try:
                body[got:got + n] = mv[off + _HDR:off + _HDR + n]
            finally:
                self._consumed()
            got += n
            if got == total:
                return _unframe(body, n_buffers)
            off = self._off[self._await_chunk(deadline, alive, timeout, True)]
            t, f, _ = CHUNK_HEADER.unpack_from(mv, off)
            frag += 1
            if (t, f) != (total, frag):
                self._corrupt(f"expected fragment {frag} of {total} B, "
                              f"got {f} of {t} B")

    def has_message(self) -> bool:
        """Reader: True when the next message (its first chunk) is already
        published, so a ``dequeue`` would not wait for it to start."""
        chunk = self._pos % self._layout.n_chunks
        return self._meta[self._seq_i[chunk]] == self._pos + 1

    # ------------------------------------------------------ ring bookkeeping
    def _claim_chunk(self, deadline, alive, timeout, mid_message) -> int:
        """Writer: wait until the next chunk has been read by every reader."""
        chunk = self._pos % self._layout.n_chunks
        prev = self._pos + 1 - self._layout.n_chunks  # seq it holds now
        if prev > 0:
            r0, r1, meta = self._read_i[chunk], self._read_i[chunk] + \
                self._layout.n_readers, self._meta

            def free() -> bool:
                for j in range(r0, r1):
                    if meta[j] != prev:
                        return False
                return True

            if not free():
                self._wait(free, deadline, alive,
                           "a free chunk (readers slow or gone?)", timeout,
                           mid_message)
        return chunk

    def _publish(self) -> None:
        """Writer: make the chunk just filled visible (payload first), then
        wake readers sleeping in futex, if any (no system call otherwise)."""
        chunk = self._pos % self._layout.n_chunks
        _fence()
        self._pos += 1
        self._meta[self._seq_i[chunk]] = self._pos
        if self._futex is not None:
            _full_fence()  # seq store before the sleeping-flag loads
            if self._seg.mm.find(b"\x01", *self._sleeping) >= 0:
                self._bump_wake_seq()

    def _bump_wake_seq(self) -> None:
        # Normally only the writer bumps; a concurrent bump from shutdown()
        # may lose one increment, but the word still moves forward, which is
        # all a sleeper compares against.
        self._wake_seq[0] = (self._wake_seq[0] + 1) & 0xFFFFFFFF
        self._futex.wake()

    def _await_chunk(self, deadline, alive, timeout, mid_message) -> int:
        """Reader: wait until the writer published our next chunk."""
        chunk = self._pos % self._layout.n_chunks
        meta, i, expect = self._meta, self._seq_i[chunk], self._pos + 1
        if meta[i] != expect:
            self._wait(lambda: meta[i] == expect, deadline, alive,
                       "a message", timeout, mid_message, futex=True)
        _fence()
        return chunk

    def _consumed(self) -> None:
        """Reader: hand the chunk just read back to the writer."""
        chunk = self._pos % self._layout.n_chunks
        _fence()
        self._pos += 1
        self._meta[self._read_i[chunk]] = self._pos

    # -------------------------------------------------------------- internals
    def _wait(self, ready: Callable[[], bool], deadline: Optional[float],
              alive: Optional[Callable[[], bool]], what: str,
              timeout: Optional[float], mid_message: bool = False,
              futex: bool = False) -> None:
        """Return once ``ready()``: busy-poll, then yield, then sleep (on the
        futex when ``futex`` and available: reader waiting for the writer)."""
        futex = futex and self._futex is not None
        pol = self.wait_policy
        start = time.monotonic()
        next_alive = start + pol.alive_every_s
        sleep = 50e-6
        try:
            while not ready():
                if self._cancelled:
                    raise RuntimeError("cancelled")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"{self._name()}: timed out after "
                                       f"{timeout}s waiting for {what}")
                waited = now - start
                if waited < pol.busy_s:
                    continue
                if waited < pol.yield_s:
                    _sched_yield()
                    continue
                self._maybe_unlink()
                if alive is not None and now >= next_alive:
                    if not alive():
                        raise PeerGoneError(f"{self._name()}: peer process "
                                            f"gone while waiting for {what}")
                    next_alive = now + pol.alive_every_s
                pause = pol.alive_every_s if futex else sleep
                if deadline is not None:
                    pause = min(pause, deadline - now)
                if futex:
                    self._futex_sleep(ready, pause)
                    continue
                if self.reader_index is not None and self._writer_closed(ready):
                    raise EOFError(f"{self._name()}: writer closed the queue")
                self._cancel_event.wait(pause)
                sleep = min(sleep * 2, pol.max_sleep_s)
        except BaseException as e:
            if mid_message:  # half a message is in the ring: cannot resync
                self._broken = f"interrupted inside a multi-chunk message ({e!r})"
            raise

    def _futex_sleep(self, ready: Callable[[], bool], pause: float) -> None:
        """Reader: raise our sleeping flag and sleep until the writer bumps
        ``wake_seq`` (or ``pause`` passes).  The word is read before the flag
        goes up, so a bump in between makes the futex call return at once."""
        mm, flag = self._seg.mm, self._sleep_flag
        expected = self._wake_seq[0]
        mm[flag] = 1
        try:
            _full_fence()  # flag store before the ready() loads
            if ready() or self._cancelled:
                return
            if self._writer_closed(ready):
                raise EOFError(f"{self._name()}: writer closed the queue")
            self._futex.wait(expected, pause)
        finally:
            mm[flag] = 0

    def _writer_closed(self, ready: Callable[[], bool]) -> bool:
        return bool(self._seg.mm[WRITER_CLOSED_OFF]) and not ready()

    def _maybe_unlink(self) -> None:
        if not self._seg.unlinked and self.all_attached():
            self._seg.unlink()

    def _check_usable(self, writer: bool) -> None:
        if self._cancelled:
            raise RuntimeError("cancelled")
        if (self.reader_index is None) != writer:
            raise RuntimeError(f"{self._name()}: this end is the {self._role()}")
        if self._broken:
            raise RuntimeError(f"{self._name()} is unusable: {self._broken}")
        if not self._seg.unlinked:
            self._maybe_unlink()

    def _corrupt(self, why: str) -> None:
        self._broken = why
        raise RuntimeError(f"{self._name()}: corrupt ring ({why})")

    @staticmethod
    def _deadline(timeout: Optional[float]) -> Optional[float]:
        return None if timeout is None else time.monotonic() + timeout

    def _role(self) -> str:
        return "writer" if self.reader_index is None else f"reader {self.reader_index}"

    def _name(self) -> str:
        return f"MessageQueue {self.label!r} ({self._seg.name.lstrip('/')})"

    def _release(self) -> None:
        self._wake_seq.release()
        self._meta.release()
        self._mv.release()
        self._seg.close()


# ------------------------------------------------------------ serialization
# Body of a message with n_buffers > 0: u64 length of the pickle and of each
# buffer, the pickle, the buffers.  With n_buffers == 0 the body is the pickle.

def _frame(main: bytes, buffers: list) -> list:
    if not buffers:
        return [main]
    raws = [b.raw() for b in buffers]  # 1-D unsigned-byte views, no copy
    lengths = struct.pack(f"<{len(raws) + 1}Q", len(main),
                          *(r.nbytes for r in raws))
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
