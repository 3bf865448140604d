"""Start multi-process test launches that always end, and report what they left behind.

Every process a launch starts carries SPMD_TEST_LAUNCH=<tag> in its
environment. torchrun puts its workers in sessions of their own, so killing
torchrun's process group is not enough; the tag finds every descendant (even
one re-parented after its parent died), and only those pids are killed.
Leftover checks are scoped the same way: to the pids seen with this launch's
tag and the /dev/shm segments those pids created, never the whole machine
(other tests run in parallel).

Ports: a single-node torchrun lets its c10d store bind port 0 (no port is picked
in advance); a fixed port (multi-node launches, ranks started by hand) is retried
with a new port when the store reports EADDRINUSE.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SHM_DIR = Path("/dev/shm")
SHM_PATTERN = re.compile(r"^spmd_ar_(\d+)_[0-9a-f]+$")
PORT_IN_USE = ("EADDRINUSE", "Address already in use")
TAG_VAR = "SPMD_TEST_LAUNCH"
# Launcher variables of an outer job (pytest inside srun or torchrun) must not leak in.
_STRIP = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|NODE_RANK|"
                    r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_\w+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(tag: str, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _STRIP.match(k)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **{TAG_VAR: tag})
    env.update(env_extra or {})
    return env


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries this launch's tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def stale_segments(creators=None) -> list[str]:
    """Our /dev/shm all-reduce segments (spmd_ar_<creator pid>_<token>) whose creator is dead:
    nobody will unlink them. `creators` limits the check to segments made by those pids."""
    stale = []
    for entry in SHM_DIR.glob("spmd_ar_*") if SHM_DIR.is_dir() else []:
        match = SHM_PATTERN.match(entry.name)
        if not match or (creators is not None and int(match.group(1)) not in creators):
            continue
        if not Path(f"/proc/{match.group(1)}").exists():
            stale.append(entry.name)
    return stale


def run_spawned_pair(target, tmp_path: Path, scenario: str, timeout: float = 60) -> tuple[list[dict], list[int]]:
    """Two spawned processes `target(rank, scenario, store, out)` that meet on a FileStore in
    `tmp_path` (no port); both must exit 0 within `timeout` (stragglers are killed). Returns
    the JSON each wrote to its `out` file, and their pids (for leftover checks)."""
    import json
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=target, args=(r, scenario, str(tmp_path / "store"), str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [json.loads(o.read_text()) for o in outs], [p.pid for p in procs]


def scratch_tmpdir(tag: str) -> tempfile.TemporaryDirectory:
    """A temporary directory for one launch's TMPDIR, removed when the launch ends: torchrun
    (a torchelastic_* log folder per run) and anything else that writes under TMPDIR and never
    cleans up then leaves nothing in the machine's /tmp."""
    return tempfile.TemporaryDirectory(prefix=f"spmd_launch_{tag}_")


def with_tmpdir(env: dict[str, str], path: str) -> dict[str, str]:
    """`env` with TMPDIR at `path` (a scratch_tmpdir), unless the test set a TMPDIR of its own."""
    return env if "TMPDIR" in env else {**env, "TMPDIR": path}


def unique_tag(name: str) -> str:
    """A launch tag no other test run on this machine can share."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def run_checked(cmd: list[str], name: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of one command under a fresh tag, then the leftover check every launch gets:
    no process carrying the tag may survive it (survivors are killed and fail the test)."""
    tag = unique_tag(name)
    scratch = scratch_tmpdir(tag)
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=with_tmpdir(base_env(tag), scratch.name),
                              capture_output=True, text=True, timeout=timeout, **kwargs)
        left = _reap(tag)
    finally:
        scratch.cleanup()
    assert not left, f"processes left behind by {cmd}: {left}"
    return proc


def _reap(tag: str, grace_s: float = 3.0) -> list[int]:
    """Wait briefly for tagged processes to exit, then SIGKILL survivors; returns survivors."""
    deadline = time.monotonic() + grace_s
    left = tagged_pids(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = tagged_pids(tag)
    _kill(left)
    return left


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(procs: list[subprocess.Popen], tag: str) -> None:
    """SIGTERM our direct children (torchrun then stops and reaps its workers),
    then SIGKILL the rest, grandchildren first, so a living parent can still
    reap them and no zombie is handed to an init that may never reap."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 5
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    direct = {proc.pid for proc in procs}
    _kill([pid for pid in tagged_pids(tag) if pid not in direct])
    time.sleep(0.3)
    _kill([proc.pid for proc in procs if proc.poll() is None])
    for proc in procs:
        proc.wait()


class Launch(subprocess.CompletedProcess):
    """Processes started together: a CompletedProcess (first non-zero exit code,
    joined outputs) plus per-process codes and outputs, timeout flag, leftovers."""

    def __init__(self, cmds: list[list[str]], envs: list[dict[str, str]], tag: str, timeout: float,
                 on_poll=None, cwd: Path = REPO):
        """`on_poll(launch)`, if given, runs every 0.25 s while the processes run: tests trigger
        events (a kill, a signal) on what the launch has printed so far (`output_so_far`).
        `cwd`: where the commands run (tests of the docs run them in an install of their own)."""
        self.tag, self.timed_out = tag, False
        scratch = scratch_tmpdir(tag)
        envs = [with_tmpdir(env, scratch.name) for env in envs]
        self._files = files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in cmds]
        self.procs = procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True,
                                               start_new_session=True)
                              for cmd, env, (out, err) in zip(cmds, envs, files)]
        self.seen_pids: set[int] = {proc.pid for proc in procs}  # every pid that carried the tag
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                self.timed_out = True
                break
            self.seen_pids.update(tagged_pids(tag))
            if on_poll is not None:
                on_poll(self)
            time.sleep(0.25)
        if self.timed_out:
            _stop(procs, tag)
        self.leftover_pids = _reap(tag) if not self.timed_out else _reap(tag, 0.5)
        self.returncodes = [proc.returncode for proc in procs]
        self.stdouts, self.stderrs = [], []
        for out, err in files:
            out.seek(0), err.seek(0)
            self.stdouts.append(out.read()), self.stderrs.append(err.read())
            out.close(), err.close()
        scratch.cleanup()
        rc = next((rc for rc in self.returncodes if rc != 0), 0)
        super().__init__(cmds, rc, "".join(self.stdouts), "".join(self.stderrs))

    def output_so_far(self) -> str:
        """Everything the launch's processes have written to stdout and stderr until now."""
        chunks = []
        for out, err in self._files:
            for f in (out, err):
                size = os.fstat(f.fileno()).st_size
                chunks.append(os.pread(f.fileno(), size, 0).decode(errors="replace"))
        return "".join(chunks)

    def stale_segments(self) -> list[str]:
        """/dev/shm segments created by this launch's processes and left behind."""
        return stale_segments(self.seen_pids)

    def port_in_use(self) -> bool:
        """The launcher's store could not listen on its port (taken by someone else meanwhile)."""
        return self.returncode != 0 and any(needle in self.stderr for needle in PORT_IN_USE)

    def describe(self) -> str:
        return (f"rc={self.returncodes} timed_out={self.timed_out} leftovers={self.leftover_pids}\n"
                f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}")


def run_torchrun(nproc: int, args: list[str], timeout: float, env_extra: dict[str, str] | None = None,
                 nnodes: int = 1, rdzv: bool = False, on_poll=None) -> Launch:
    """`python -m torch.distributed.run` with `nproc` workers per node, `nnodes` agents on this host.

    One node: a c10d rendezvous whose store binds port 0 (as `--standalone` does), so no
    port is chosen in advance. Several nodes need a port known to every agent: static
    rendezvous (--master-port), or c10d with `rdzv=True` as multi-node sbatch scripts do,
    retried on a new port if the store finds it taken.
    """
    for attempt in range(3):
        tag = uuid.uuid4().hex[:12]
        port = 0 if nnodes == 1 else free_port()
        cmds = []
        for node in range(nnodes):
            cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--nnodes", str(nnodes), "--monitor-interval", "0.2"]
            if rdzv or nnodes == 1:
                cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag]
            else:
                cmd += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmds.append(cmd + [str(a) for a in args])
        launch = Launch(cmds, [base_env(tag, env_extra)] * nnodes, tag, timeout, on_poll)
        if port == 0 or not launch.port_in_use():
            return launch
    return launch


def run_ranks_with_env(world: int, script_args: list[str], env_per_rank: list[dict[str, str]],
                       timeout: float) -> Launch:
    """One plain `python script_args...` per rank, each with its own launcher variables
    (RANK/WORLD_SIZE/... or SLURM_*), no torchrun agent in between."""
    assert len(env_per_rank) == world
    tag = uuid.uuid4().hex[:12]
    cmds = [[PYTHON, *[str(a) for a in script_args]] for _ in range(world)]
    return Launch(cmds, [base_env(tag, e) for e in env_per_rank], tag, timeout)


def run_ranks_on_free_port(world: int, script_args: list[str], env_for_rank, timeout: float) -> Launch:
    """`run_ranks_with_env` with MASTER_ADDR/MASTER_PORT on a port taken from the OS,
    retried on a new port if rank 0's store finds it taken. `env_for_rank(rank, port)`."""
    for attempt in range(3):
        port = free_port()
        launch = run_ranks_with_env(world, script_args, [env_for_rank(r, port) for r in range(world)], timeout)
        if not launch.port_in_use():
            return launch
    return launch


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def mapped_segments(pid: int) -> set[str]:
    """Names of spmd_engine shared-memory segments mapped by a process (unlinked ones included)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/spmd_" in line}
