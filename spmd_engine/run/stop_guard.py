"""A launched rank's guard: a small child process that SIGKILLs the rank once it stays stopped.

Why (issue 55): a rank stopped for good (SIGSTOP never followed by SIGCONT, as a process
hung where no signal reaches it would be) can hold a finished job forever, and nothing
of the job can end it from inside, since every thread of a stopped process is stopped:

- torchrun's agent waits for every local rank with no bound once the others have exited 0
  (its poll acts only when all are done or one failed): a rank stopped after its share
  was handed over, or in its exit, keeps torchrun running after the output is merged;
- rank 0 waits for the replica heads' results with no deadline (replicas may be uneven),
  so a head stopped after its TP peers have finished holds rank 0 too;
- when the agent does stop a group it sends SIGTERM, which a stopped process keeps
  pending, and escalates to SIGKILL only after its own grace period.

So before torch is imported, a launched rank starts this guard. It reads the rank's state
from /proc and SIGKILLs it when the rank is stopped (state T) and either has SIGTERM or
SIGINT pending (it was asked to end and cannot) or has been stopped for longer than
--timeout (its peers' collectives would have given up on it by then). A rank that dies
is a failure torchrun (restart) and srun (--kill-on-bad-exit) handle. Never killed: a
rank under a debugger (state t), and a job suspended as a whole (SLURM's suspend stops
the guard with its rank). The guard dies with its rank (PR_SET_PDEATHSIG, whose SIGKILL
reaches it even when stopped), stays in the rank's process group (the agent's killpg
ends it too), and holds none of the job's files open.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

POLL_S = 0.2
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
ASKED_TO_END = (signal.SIGTERM, signal.SIGINT)
_started = False  # one guard per process (the module entry and the console-script entry both ask)
_guard_proc = None  # kept, so the Popen object lives as long as the rank
LAUNCHER_VARS = r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|" \
                r"ROLE_NAME|NODE_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_\w+)$"


def should_kill(state: str, pending: int, stopped_for: float, timeout_s: float) -> bool:
    """The guard's rule: `state` from /proc/PID/stat, `pending` the mask of the rank's
    pending signals (bit n-1 for signal n), `stopped_for` seconds seen stopped."""
    if state != "T":
        return False
    asked = any(pending & (1 << (int(sig) - 1)) for sig in ASKED_TO_END)
    return asked or stopped_for > timeout_s


def timeout_from_argv(argv: list[str], environ=os.environ) -> float:
    """--timeout as the rank's parser will read it (else SPMD_ENGINE_TIMEOUT_S, else 300 s),
    read before that parser, which imports torch, exists. A malformed value falls back to
    the default here; the parser then refuses it with a usage error."""
    from spmd_engine import envs
    value = None
    for i, arg in enumerate(argv):
        if arg == "--timeout" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--timeout="):
            value = arg.split("=", 1)[1]
    try:
        return float(value) if value is not None else envs.timeout_s(environ)
    except Exception:  # noqa: BLE001 - the parser reports the flag itself
        return envs.DEFAULT_TIMEOUT_S


def start(argv: list[str] | None = None) -> int | None:
    """Start the guard of this process if it runs under a launcher (torchrun, srun) on Linux;
    returns the guard's pid (None: not launched, or not Linux). Call it once, early.

    A fresh interpreter, not a fork: it carries none of the launcher's variables (RANK, ...),
    so nothing that looks for a job's ranks by their environment takes it for one."""
    global _started, _guard_proc
    from spmd_engine.config import ConfigError
    from spmd_engine.distributed.launch_env import read_launch_env
    if not sys.platform.startswith("linux") or _started:
        return None
    try:
        if read_launch_env(os.environ) is None:
            return None
    except ConfigError:
        return None  # the rank reports its launcher's variables itself
    import re
    import subprocess
    _started = True
    timeout_s = timeout_from_argv(sys.argv[1:] if argv is None else argv)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not re.match(LAUNCHER_VARS, k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    _guard_proc = subprocess.Popen([sys.executable, "-m", "spmd_engine.run.stop_guard", str(os.getpid()),
                                    repr(timeout_s)], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    return _guard_proc.pid


def _guard(rank: int, timeout_s: float) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"spmd_stop_guard"), 0, 0, 0)
    if os.getppid() != rank:
        return  # the rank is already gone
    stopped_since = None
    while True:
        state, pending = _read(rank)
        if state is None or state in "ZX":
            return
        now = time.monotonic()
        stopped_since = (stopped_since or now) if state == "T" else None
        if should_kill(state, pending, now - stopped_since if stopped_since else 0.0, timeout_s):
            os.kill(rank, signal.SIGKILL)
            return
        time.sleep(POLL_S)


def _read(pid: int) -> tuple[str | None, int]:
    """(state letter, pending-signal mask: the thread's and the process's) of `pid`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        pending = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    pending |= int(line.split(":", 1)[1], 16)
        return state, pending
    except (OSError, IndexError, ValueError):
        return None, 0


if __name__ == "__main__":  # python -m spmd_engine.run.stop_guard RANK_PID TIMEOUT_S, started by start()
    _guard(int(sys.argv[1]), float(sys.argv[2]))
