"""Sleeping on a 32-bit word in shared memory until another process changes it (Linux futex(2)).

Why: a reader that has nothing to read should cost no CPU, yet wake as soon as the
writer publishes. Polling with sleeps trades one against the other; a futex gives both:
the sleeper blocks in the kernel on the word's address, and the writer's wake call ends
the sleep at once. The operations are the shared (not PRIVATE) ones, so they work across
processes mapping the same memory.

`Futex.make` returns None where futex is unavailable (not Linux, an unknown syscall
number); callers then sleep with timed back-off instead. ctypes releases the GIL during
the call, so a thread blocked in `wait` does not stop the others (e.g. one calling
``shutdown``).
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98,
              "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


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
    """Wait for / wake a u32 word in a shared mapping."""

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
        del word  # drop the buffer export so mm.close() works; addr stays valid while mapped
        return cls(addr)

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep while the word equals ``expected``, at most ``timeout_s`` (returns early on
        a wake, a signal, or at once if the word already differs)."""
        timeout_s = max(timeout_s, 0.0)
        sec = int(timeout_s)
        ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
        _syscall(ctypes.c_long(_SYS_FUTEX), self._addr, ctypes.c_int(_FUTEX_WAIT),
                 ctypes.c_uint32(expected), ctypes.byref(ts), None, ctypes.c_int(0))

    def wake(self) -> None:
        """Wake every process sleeping on the word."""
        _syscall(*self._wake_args)
