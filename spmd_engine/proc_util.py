"""Process hygiene for the processes we spawn: a name in `ps`, death with the parent.

Linux only where it matters (prctl); elsewhere these are no-ops. setproctitle is
used when installed so the full name shows in `ps -ef`; without it the kernel's
15-character comm name (`ps -e`, `top`) carries the name.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def _prctl(option: int, value) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except OSError:
        pass


def set_process_title(name: str) -> None:
    try:
        import setproctitle  # optional
        setproctitle.setproctitle(name)
    except ImportError:
        pass
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies, so no worker outlives its engine."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before prctl took effect


def mp_context():
    """spawn by default: a forked child of a process that already ran torch ops can hang
    in the OpenMP runtime, and cannot use CUDA. Like any spawn user, a script that builds
    an mp LLM needs an `if __name__ == "__main__":` guard. SPMD_ENGINE_WORKER_MULTIPROC_METHOD
    =fork trades that safety for faster start-up."""
    import multiprocessing as mp
    return mp.get_context(os.environ.get("SPMD_ENGINE_WORKER_MULTIPROC_METHOD", "spawn"))
