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


def die_with_parent(expected_parent: int | None = None, parent_main_thread: bool = False) -> None:
    """End this process when the parent *process* dies, so no worker outlives its engine.

    PR_SET_PDEATHSIG fires when the parent *thread* that created us exits, not the
    process: an LLM built in a short-lived thread would lose its workers when that
    thread ends. So the kernel signal is only asked for when the parent created us
    from its main thread (which lives as long as the process); in every case a
    watcher thread waits on a pidfd of the parent process (readable once every
    thread of it has exited), or polls getppid() where pidfds are missing, and
    SIGKILLs this process.
    """
    if expected_parent is None:
        expected_parent = os.getppid()
    if parent_main_thread:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    pidfd = None
    try:
        pidfd = os.pidfd_open(expected_parent)
    except (AttributeError, OSError):
        pass
    if os.getppid() != expected_parent:
        os._exit(1)  # the parent died before we started watching it
    import threading
    threading.Thread(target=_watch_parent, args=(expected_parent, pidfd), daemon=True,
                     name="parent-watch").start()


def _watch_parent(parent: int, pidfd: int | None) -> None:
    import select
    import time
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable when the whole parent process has exited
    else:
        while os.getppid() == parent:
            time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def created_from_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def mp_context():
    """spawn by default: a forked child of a process that already ran torch ops can hang
    in the OpenMP runtime, and cannot use CUDA. Like any spawn user, a script that builds
    an mp LLM needs an `if __name__ == "__main__":` guard. SPMD_ENGINE_WORKER_MULTIPROC_METHOD
    =fork trades that safety for faster start-up."""
    import multiprocessing as mp

    from spmd_engine import envs
    return mp.get_context(envs.worker_multiproc_method())
