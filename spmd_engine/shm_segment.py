"""One helper for every shared-memory segment we make: the mp executor's message
queues and the all-reduce's segments.

A segment is a file in /dev/shm (tmpfs; the same object shm_open(3) names)
created with O_EXCL under a name that carries a random token (two jobs on one
host never collide) and the creator's pid (a person can tell whose it is).

Space is reserved up front with posix_fallocate: tmpfs allocates pages lazily,
so a segment made with ftruncate alone on a nearly full /dev/shm is created
fine and the process dies of SIGBUS at the first store to a page that cannot
be backed, possibly minutes later. Reserving makes a full /dev/shm a clear
error (ShmSpaceError) at start-up instead.

Names are unlinked as soon as every party has attached (the callers decide
when); from then on the memory lives exactly as long as its mappings, and a
SIGKILL of any process leaves nothing behind. A segment made with
``create(..., unlinked=True)`` has no name from the start: the creator keeps
its descriptor open and peers open it through ``/proc/<creator pid>/fd/<fd>``
(same user, same pid namespace), so not even a SIGKILL of the creator while
peers are still attaching can leave a name behind.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the segment: a clear error at creation, never a SIGBUS later."""


def _free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class ShmSegment:
    """One mapped segment; ``owner`` created it (and unlinks its name)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, fd: int | None = None):
        self.name = name  # with a leading "/", as shm_open(3) spells it
        self.mm = mm
        self.owner = owner
        self.unlinked = not owner
        self.fd = fd  # kept open only by an unlinked creator, until its peers have attached

    @property
    def path(self) -> str:
        return SHM_DIR + self.name

    @classmethod
    def create(cls, size: int, prefix: str, label: str = "", what: str = "a shared-memory segment",
               with_pid: bool = True, unlinked: bool = False) -> "ShmSegment":
        """Create ``/<prefix>[<label>_][<pid>_]<token>`` of ``size`` bytes, reserved and mapped.

        With ``unlinked`` the name is removed before this returns and the descriptor
        stays open (``fd``) for peers to attach with ``attach_fd``; ``close_fd`` once they have.
        Raises ShmSpaceError (one clear line) when /dev/shm cannot hold it.
        """
        tag = re.sub(r"[^A-Za-z0-9]", "", label)[:16]
        pid = f"{os.getpid()}_" if with_pid else ""
        for _ in range(100):
            name = f"/{prefix}{tag + '_' if tag else ''}{pid}{secrets.token_hex(8)}"
            try:
                fd = os.open(SHM_DIR + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            break
        else:  # pragma: no cover - 100 collisions of 64-bit tokens
            raise FileExistsError("could not pick a free shared-memory name")
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    free = _free_bytes()
                    raise ShmSpaceError(
                        exc.errno, f"cannot reserve {size} bytes in {SHM_DIR} for {what}"
                        + (f" ({free} bytes free)" if free is not None else "")
                        + ": free space there, or enlarge it (docker: --shm-size)") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a filesystem without fallocate: size it at least
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(SHM_DIR + name)
            os.close(fd)
            raise
        if not unlinked:
            os.close(fd)
            return cls(name, mm, owner=True)
        os.unlink(SHM_DIR + name)
        seg = cls(name, mm, owner=True, fd=fd)
        seg.unlinked = True
        return seg

    @classmethod
    def attach_fd(cls, pid: int, fd: int, size: int) -> "ShmSegment":
        """Map the segment another process (``pid``) holds open as ``fd``, name or no name.

        OSError when that process is gone, has closed it, or we may not read its
        descriptors (another user, another pid namespace).
        """
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            if os.fstat(own).st_size != size:
                raise OSError(f"/proc/{pid}/fd/{fd} is not the expected {size}-byte segment")
            mm = mmap.mmap(own, size)
        finally:
            os.close(own)
        return cls("", mm, owner=False)

    def close_fd(self) -> None:
        """Drop the descriptor peers attached through; the mappings stay."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> "ShmSegment":
        fd = os.open(SHM_DIR + name, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size if size is not None else os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until every party closes."""
        if self.unlinked:
            return
        self.unlinked = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._after_unlink()

    def _after_unlink(self) -> None:
        """Hook for subclasses (the queue's crash guard)."""

    def close(self) -> None:
        self.close_fd()
        try:
            self.mm.close()
        except BufferError:
            # A deserialized object still references the memory; the mapping
            # is released when that object is collected.
            pass
