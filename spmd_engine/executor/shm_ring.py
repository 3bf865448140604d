"""POSIX shared-memory segment and ring layout under :mod:`.shm_queue`.

This module only knows bytes and offsets; pickling, waiting and the public
API live in ``shm_queue``.  One segment holds one ring::

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

chunk data, ``chunk_bytes`` per chunk::

    msg_len    u64   length of the whole serialized message this chunk carries
    frag       u32   index of this chunk within the message (0 = first); the
                     payload in it is min(capacity, msg_len - frag * capacity)
    n_buffers  u32   out-of-band pickle buffers in the message (see shm_queue)
    payload    chunk_bytes - 16  (= capacity)

Sequence numbers instead of boolean flags mean nothing is ever reset: a
reader waiting for its ``k``-th chunk waits for ``seq == k`` in chunk
``(k - 1) % n_chunks``; the writer may refill a chunk once every
``read_seq`` equals the chunk's current ``seq``.  Each flag has exactly one
writing process, so no atomic read-modify-write is needed.

A reader that has polled for a while sleeps in ``futex(2)`` on ``wake_seq``
after raising its ``sleeping`` flag; the writer, after publishing a chunk,
bumps ``wake_seq`` and wakes the word only when some flag is up, so the busy
path costs no system call.  (Dekker-style: both sides put a full fence between
their store and their load of the other's flag; the futex timeout bounds the
damage of any missed wake-up.)

The segment itself comes from :mod:`spmd_engine.shm_segment`,
shared with the all-reduce: a file in /dev/shm whose space is reserved with
posix_fallocate, so a full /dev/shm fails at creation instead of SIGBUS later.

Why not ``multiprocessing.shared_memory.SharedMemory``:
in Python 3.11 ``SharedMemory`` registers the name with the resource tracker
on *attach* too, so a reader launched outside ``multiprocessing`` (torchrun)
would unlink the segment at its exit and print "leaked shared_memory"
warnings.  Here only the creating process registers the name (so a crash
before ``unlink`` is still cleaned up by its tracker) and unregisters it
when it unlinks.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import struct
import sys
from multiprocessing import resource_tracker

from spmd_engine.shm_segment import ShmSegment as _Segment

MAGIC = b"SPMDMQ01"
NAME_PREFIX = "spmd_mq_"
_GEOMETRY = struct.Struct("<8sIIQ")  # magic, n_readers, n_chunks, chunk_bytes
WRITER_CLOSED_OFF = 24
WAKE_SEQ_OFF = 28
ATTACHED_OFF = 32
CHUNK_HEADER = struct.Struct("<QII")  # msg_len, frag, n_buffers
ALIGN = 64


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


class ShmSegment(_Segment):
    """A queue's segment: the shared helper plus a crash guard for the creator.

    Between creation and the moment every party has attached (start-up only),
    a SIGKILLed creator would leave the name behind; the creating process
    registers it with multiprocessing's resource tracker, which removes it then,
    and unregisters it once unlinked. Only processes that create queues (an mp
    engine; its spawned workers share its tracker) have one; torchrun ranks
    (external_launcher) make no queue and no tracker.
    """

    @classmethod
    def create(cls, size: int, label: str = "") -> "ShmSegment":
        seg = super().create(size, NAME_PREFIX, label, what=f"message queue {label!r}")
        resource_tracker.register(seg.name, "shared_memory")
        return seg

    @classmethod
    def attach(cls, name: str) -> "ShmSegment":
        return super().attach(name)

    def _after_unlink(self) -> None:
        if self.owner:
            resource_tracker.unregister(self.name, "shared_memory")


def write_geometry(mm: mmap.mmap, layout: RingLayout) -> None:
    _GEOMETRY.pack_into(mm, 0, MAGIC, layout.n_readers, layout.n_chunks,
                        layout.chunk_bytes)


def read_geometry(mm: mmap.mmap) -> RingLayout:
    magic, n_readers, n_chunks, chunk_bytes = _GEOMETRY.unpack_from(mm, 0)
    if magic != MAGIC:
        raise ValueError(f"not a spmd_engine message queue (magic {magic!r})")
    return RingLayout(n_readers, n_chunks, chunk_bytes)


# --------------------------------------------------------------------- futex
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
              "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): works across processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


class Futex:
    """Wait for / wake a u32 word in the shared mapping (Linux ``futex(2)``).

    ``Futex.make`` returns None where futex is unavailable; callers then fall
    back to timed sleeps.  ctypes releases the GIL during the call, so a
    thread blocked in :meth:`wait` does not stop others (e.g. ``shutdown``).
    """

    def __init__(self, addr: int):
        self._addr = ctypes.c_void_p(addr)
        # Converted once: the wake sits on the writer's publish path.
        self._wake_args = (ctypes.c_long(_SYS_FUTEX), self._addr,
                           ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(2 ** 31 - 1),
                           None, None, ctypes.c_int(0))

    @classmethod
    def make(cls, mm: mmap.mmap, offset: int) -> "Futex | None":
        if _syscall is None:
            return None
        word = ctypes.c_uint32.from_buffer(mm, offset)
        addr = ctypes.addressof(word)
        del word  # drop the buffer export so mm.close() works; addr stays valid
        return cls(addr)

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep while the word equals ``expected``, at most ``timeout_s``
        (returns early on wake, signal, or if the word already differs)."""
        timeout_s = max(timeout_s, 0.0)
        sec = int(timeout_s)
        ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
        _syscall(ctypes.c_long(_SYS_FUTEX), self._addr, ctypes.c_int(_FUTEX_WAIT),
                 ctypes.c_uint32(expected), ctypes.byref(ts), None,
                 ctypes.c_int(0))

    def wake(self) -> None:
        """Wake every process sleeping on the word."""
        _syscall(*self._wake_args)
