"""A ring of fixed-size chunks in one segment: one writer, N readers, every reader reads
every chunk. Bytes, offsets and sequence numbers only; message_queue.py builds messages on
it. One segment holds one ring::

    [ header | chunk metadata | chunk data ]          (64-byte aligned parts)

header::

    0   magic          8s   b"SPMDMQ01"
    8   n_readers      u32
    12  n_chunks       u32
    16  chunk_bytes    u64
    24  writer_closed  u8   set by the writer's close(): readers stop waiting
    28  wake_seq       u32  futex word: bumped by the writer to wake sleepers
    32  attached       u8 * (1 + n_readers)   [0] writer, [1 + r] reader r
    ..  sleeping       u8 * n_readers   reader r is (about to be) in futex wait

chunk metadata, one 64-byte aligned record per chunk (u64 each)::

    seq                   1-based global number of the chunk write that filled
                          this chunk; 0 = never written
    read_seq[n_readers]   the ``seq`` each reader last consumed from this chunk

chunk data, ``chunk_bytes`` per chunk: a 16-byte header the message layer fills
(`CHUNK_HEADER`), then ``chunk_bytes - 16`` bytes of payload (``capacity``).

Sequence numbers instead of boolean flags mean nothing is ever reset: a reader waiting for
its ``k``-th chunk waits for ``seq == k`` in chunk ``(k - 1) % n_chunks``; the writer may
refill a chunk once every ``read_seq`` equals the chunk's current ``seq``. Each field has
exactly one writing process and is an aligned store of at most 8 bytes, so no atomic
read-modify-write is needed and no value is ever seen torn.

Memory ordering: the writer stores the payload, then the chunk's ``seq``; a reader loads
``seq``, then the payload, then stores its ``read_seq``; the writer loads every
``read_seq`` before overwriting the chunk. x86-64 (TSO) never reorders store/store,
load/load or load/store, so program order is enough there and `fence` is a no-op.
Elsewhere (ARM64) `fence` is a lock round trip (atomic instructions with barriers inside
glibc): the strongest ordering pure Python can ask for, not a formal C11 fence.

Sleeping: a reader that has polled for a while raises its ``sleeping`` flag and sleeps in
futex(2) on ``wake_seq``; the writer, after publishing a chunk, bumps ``wake_seq`` and
wakes the word only when some flag is up, so the busy path costs no system call. That
hand-shake (Dekker-style: each side stores its own word, then loads the other's) needs a
StoreLoad barrier on every architecture, so both sides use `full_fence` there; the futex
timeout bounds the damage of any missed wake-up.
"""

from __future__ import annotations

import mmap
import platform
import struct
import threading
from typing import Callable, Optional

from .futex import Futex

MAGIC = b"SPMDMQ01"
_GEOMETRY = struct.Struct("<8sIIQ")  # magic, n_readers, n_chunks, chunk_bytes
WRITER_CLOSED_OFF = 24
WAKE_SEQ_OFF = 28
ATTACHED_OFF = 32
CHUNK_HEADER = struct.Struct("<QII")  # filled by the message layer: msg_len, frag, n_buffers
ALIGN = 64

_fence_lock = threading.Lock()


def full_fence() -> None:
    """A lock round trip: atomic read-modify-write instructions inside glibc, which on x86
    (lock prefix) are full barriers, StoreLoad included."""
    _fence_lock.acquire()
    _fence_lock.release()


if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
    def fence() -> None:
        """No-op: x86 keeps the program order the ring relies on."""
else:
    fence = full_fence


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RingLayout:
    """Offsets of every field for a given geometry (pure arithmetic)."""

    def __init__(self, n_readers: int, n_chunks: int, chunk_bytes: int):
        if n_readers < 1 or n_chunks < 2:
            raise ValueError("need n_readers >= 1 and n_chunks >= 2")
        if chunk_bytes < 256 or chunk_bytes % 8:
            raise ValueError("chunk_bytes must be >= 256 and a multiple of 8")
        self.n_readers = n_readers
        self.n_chunks = n_chunks
        self.chunk_bytes = chunk_bytes
        self.capacity = chunk_bytes - CHUNK_HEADER.size  # payload per chunk
        self.sleeping_off = ATTACHED_OFF + 1 + n_readers
        self.meta_off = _align(self.sleeping_off + n_readers)
        self.meta_stride = _align(8 * (1 + n_readers))  # bytes per chunk record
        self.data_off = _align(self.meta_off + n_chunks * self.meta_stride)
        self.size = self.data_off + n_chunks * chunk_bytes

    def seq_index(self, chunk: int) -> int:
        """Index of ``seq`` of ``chunk`` in the u64 view of the metadata."""
        return chunk * self.meta_stride // 8

    def read_index(self, chunk: int, reader: int) -> int:
        return self.seq_index(chunk) + 1 + reader

    def chunk_off(self, chunk: int) -> int:
        """Byte offset of ``chunk``'s data header in the segment."""
        return self.data_off + chunk * self.chunk_bytes

    def write_geometry(self, mm: mmap.mmap) -> None:
        _GEOMETRY.pack_into(mm, 0, MAGIC, self.n_readers, self.n_chunks, self.chunk_bytes)

    @classmethod
    def read_geometry(cls, mm: mmap.mmap) -> "RingLayout":
        magic, n_readers, n_chunks, chunk_bytes = _GEOMETRY.unpack_from(mm, 0)
        if magic != MAGIC:
            raise ValueError(f"not a spmd_engine message queue (magic {magic!r})")
        return cls(n_readers, n_chunks, chunk_bytes)


class RingEnd:
    """One party's end of a ring: the writer (``reader`` None) or reader ``reader``.

    ``pos`` counts the chunks this end has written or consumed; the chunk it works on next
    is ``pos % n_chunks``. Not safe for concurrent use by several threads, except `wake`.
    """

    def __init__(self, mm: mmap.mmap, layout: RingLayout, reader: Optional[int]):
        self.layout, self.reader, self.pos = layout, reader, 0
        self._n, self._n_readers = layout.n_chunks, layout.n_readers
        self._mm = mm
        self.mv = memoryview(mm)
        self._meta = self.mv[layout.meta_off:layout.data_off].cast("Q")
        chunks = range(layout.n_chunks)
        self._off = [layout.chunk_off(c) for c in chunks]
        self._seq_i = [layout.seq_index(c) for c in chunks]
        r = 0 if reader is None else reader
        self._read_i = [layout.read_index(c, r) for c in chunks]
        self.futex = Futex.make(mm, WAKE_SEQ_OFF)
        self._wake_seq = self.mv[WAKE_SEQ_OFF:WAKE_SEQ_OFF + 4].cast("I")
        self._sleeping = (layout.sleeping_off, layout.sleeping_off + layout.n_readers)
        self._sleep_flag = layout.sleeping_off + r
        self._slot = ATTACHED_OFF + (0 if reader is None else 1 + reader)

    def claim_slot(self) -> bool:
        """Mark this end attached; False when another process already holds it."""
        if self._mm[self._slot]:
            return False
        self._mm[self._slot] = 1
        return True

    def all_attached(self) -> bool:
        n = 1 + self.layout.n_readers
        return self._mm[ATTACHED_OFF:ATTACHED_OFF + n] == b"\x01" * n

    # ------------------------------------------------------------- writer
    def claim(self) -> int:
        """Writer: the offset of the chunk to fill next, once every reader has consumed what
        it holds; -1 until then (wait with `chunk_free`)."""
        pos, n = self.pos, self._n
        prev = pos + 1 - n  # the seq that chunk holds now
        if prev > 0:
            meta, i = self._meta, self._read_i[pos % n]
            for j in range(i, i + self._n_readers):
                if meta[j] != prev:
                    return -1
        return self._off[pos % n]

    def chunk_free(self) -> bool:
        """Writer: whether `claim` would give a chunk now (the condition a full ring waits on)."""
        return self.claim() >= 0

    def publish(self) -> None:
        """Writer: make the chunk just filled visible (payload first), then wake readers
        sleeping in futex, if any (no system call otherwise)."""
        chunk = self.pos % self._n
        fence()
        self.pos += 1
        self._meta[self._seq_i[chunk]] = self.pos
        if self.futex is not None:
            full_fence()  # seq store before the sleeping-flag loads
            if self._mm.find(b"\x01", *self._sleeping) >= 0:
                self.wake()

    def close_writer(self) -> None:
        """Writer: readers waiting on an empty ring stop waiting (they see EOF)."""
        self._mm[WRITER_CLOSED_OFF] = 1
        if self.futex is not None:
            self.wake()

    # ------------------------------------------------------------- reader
    def chunk_ready(self) -> bool:
        """Reader: the writer has published the chunk this reader reads next."""
        return self._meta[self._seq_i[self.pos % self._n]] == self.pos + 1

    def poll(self) -> int:
        """Reader: the offset of the chunk to read next, once the writer has published it;
        -1 until then (wait with `chunk_ready`)."""
        pos = self.pos
        chunk = pos % self._n
        if self._meta[self._seq_i[chunk]] != pos + 1:
            return -1
        fence()  # the seq load before the payload loads
        return self._off[chunk]

    def consumed(self) -> None:
        """Reader: hand the chunk just read back to the writer."""
        chunk = self.pos % self._n
        fence()
        self.pos += 1
        self._meta[self._read_i[chunk]] = self.pos

    def writer_closed(self) -> bool:
        return bool(self._mm[WRITER_CLOSED_OFF])

    def nap(self, timeout_s: float, done: Callable[[], bool]) -> None:
        """Reader: sleep in futex until the writer bumps ``wake_seq`` or ``timeout_s`` passes.
        The word is read before the flag goes up, so a bump in between makes the call
        return at once; `done` and the closed flag are checked after it is up."""
        mm, flag = self._mm, self._sleep_flag
        expected = self._wake_seq[0]
        mm[flag] = 1
        try:
            full_fence()  # flag store before the done() loads
            if done() or self.writer_closed():
                return
            self.futex.wait(expected, timeout_s)
        finally:
            mm[flag] = 0

    # --------------------------------------------------------------- both
    def wake(self) -> None:
        """Bump ``wake_seq`` and wake every sleeper (they re-check and sleep again if need be).
        Normally only the writer bumps; a concurrent bump from another thread's shutdown may
        lose one increment, but the word still moves, which is all a sleeper compares."""
        self._wake_seq[0] = (self._wake_seq[0] + 1) & 0xFFFFFFFF
        self.futex.wake()

    def release(self) -> None:
        """Drop every view into the mapping (so it can be unmapped)."""
        self._wake_seq.release()
        self._meta.release()
        self.mv.release()
