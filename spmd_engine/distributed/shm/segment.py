"""A shared-memory segment: a file in /dev/shm, mapped, whose name lives as long as its
`Lifetime` says.

Every piece of shared memory the engine makes is one of these: the mp executor's message
queues, the all-reduce slots, the PP hand-off queues. A segment is created with O_EXCL
under ``/<prefix>[<label>_]<creator pid>_<random token>``: the token keeps two jobs on one
host apart without agreeing on names, the pid tells whose a segment is (tests scope their
leftover checks by it).

Space is reserved up front with posix_fallocate. tmpfs allocates pages lazily, so a
segment sized with ftruncate alone on a nearly full /dev/shm is created fine, and its
process dies of SIGBUS at the first store to a page that cannot be backed, possibly long
after start-up. Reserving turns a full /dev/shm into a clear error at creation
(ShmSpaceError).

Lifetime is about what a SIGKILL can leave behind. The memory lives exactly as long as the
last mapping, whatever happens; only the *name* can outlive every process. So each segment
is made with one of three lifetimes for its name:

- NAMELESS: the name is removed right after the exclusive open, before the space is
  reserved. Peers open the creator's descriptor through /proc/<creator pid>/fd/<fd>, which
  needs the same user and the same pid namespace; only a SIGKILL between those two system
  calls could leave a name (removing it after reserving, as before, left an empty one in a CI
  run whose fault tests kill processes during start-up).
- UNTIL_ATTACHED: peers attach by name (they may be in another pid namespace); the creator
  removes it once every peer has attached. A creator SIGKILLed before that leaves the name.
- TRACKED: UNTIL_ATTACHED, and the creator registers the name with multiprocessing's
  resource tracker, which removes it if the creator dies first. For processes that run a
  tracker anyway (an mp engine; its spawned workers share it).

`unlink` ends the attach window for every lifetime: the name goes, and so does the
descriptor a NAMELESS creator kept open for its peers.

Why not ``multiprocessing.shared_memory.SharedMemory``: in Python 3.11 it registers the
name with the resource tracker on *attach* too, so a peer launched outside multiprocessing
(torchrun) would unlink the segment when it exits and print "leaked shared_memory"
warnings. Here only a TRACKED creator registers, and it unregisters when it unlinks.
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker

SHM_DIR = "/dev/shm"


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the segment: a clear error at creation, never a SIGBUS later."""


class Lifetime(enum.Enum):
    """How long a segment's /dev/shm name lives (see the module docstring)."""

    NAMELESS = "nameless"
    UNTIL_ATTACHED = "until attached"
    TRACKED = "tracked"


@dataclass(frozen=True)
class SegmentRef:
    """What a peer needs to attach, small and picklable: the name, or, while a NAMELESS
    creator holds it open, the creator's descriptor."""

    name: str  # with a leading "/", as shm_open(3) spells it
    size: int
    creator_pid: int
    fd: int | None = None


class Segment:
    """One mapped segment. Build it with `create` (the creator, ``owner``) or `attach`."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, lifetime: Lifetime | None,
                 fd: int | None = None):
        self.name, self.mm, self.owner, self.lifetime = name, mm, owner, lifetime
        self._fd = fd  # a NAMELESS creator's descriptor, open until its peers have attached
        self._named = owner and lifetime is not Lifetime.NAMELESS
        # Creator: a peer can still attach (the name, or the descriptor, is there). A plain
        # attribute: the queue reads it on every call.
        self.attachable = owner

    @property
    def path(self) -> str:
        return SHM_DIR + self.name

    @classmethod
    def create(cls, size: int, prefix: str, *, lifetime: Lifetime, label: str = "",
               what: str = "a shared-memory segment") -> "Segment":
        """Create ``/<prefix>[<label>_]<pid>_<token>`` of ``size`` bytes, reserved and mapped.

        Raises ShmSpaceError (one clear line naming `what`) when /dev/shm cannot hold it.
        """
        tag = re.sub(r"[^A-Za-z0-9]", "", label)[:16]
        for _ in range(100):
            name = f"/{prefix}{tag + '_' if tag else ''}{os.getpid()}_{secrets.token_hex(8)}"
            try:
                fd = os.open(SHM_DIR + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            break
        else:  # pragma: no cover - 100 collisions of 64-bit tokens
            raise FileExistsError("could not pick a free shared-memory name")
        nameless = lifetime is Lifetime.NAMELESS
        if nameless:  # at once: a SIGKILL while reserving would otherwise leave the name
            os.unlink(SHM_DIR + name)
        try:
            _reserve(fd, size, what)
            mm = mmap.mmap(fd, size)
        except BaseException:
            if not nameless:
                os.unlink(SHM_DIR + name)
            os.close(fd)
            raise
        if nameless:
            return cls(name, mm, owner=True, lifetime=lifetime, fd=fd)
        os.close(fd)
        if lifetime is Lifetime.TRACKED:
            resource_tracker.register(name, "shared_memory")
        return cls(name, mm, owner=True, lifetime=lifetime)

    @classmethod
    def attach(cls, ref: SegmentRef) -> "Segment":
        """Map the segment `ref` names. OSError when it is gone (FileNotFoundError: the name
        was removed), when its creator is gone or closed the descriptor, or when we may not
        read the creator's descriptors (another user, another pid namespace)."""
        path = SHM_DIR + ref.name if ref.fd is None else f"/proc/{ref.creator_pid}/fd/{ref.fd}"
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != ref.size:
                raise OSError(f"{path} is not the expected {ref.size}-byte segment")
            mm = mmap.mmap(fd, ref.size)
        finally:
            os.close(fd)
        return cls(ref.name, mm, owner=False, lifetime=None)

    def ref(self) -> SegmentRef:
        return SegmentRef(self.name, len(self.mm), os.getpid(), self._fd)

    def unlink(self) -> None:
        """Creator: no peer attaches from now on. Removes the name (or closes the descriptor
        peers open); the mappings stay valid. Idempotent; a no-op for an attached end."""
        self.attachable = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._named:
            return
        self._named = False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.lifetime is Lifetime.TRACKED:
            resource_tracker.unregister(self.name, "shared_memory")

    def close(self) -> None:
        """Unlink (creator), then unmap."""
        self.unlink()
        try:
            self.mm.close()
        except BufferError:
            # Something still references the memory (a deserialized object, a tensor view);
            # the mapping goes when that is collected, or at exit.
            pass


def _reserve(fd: int, size: int, what: str) -> None:
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


def _free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
