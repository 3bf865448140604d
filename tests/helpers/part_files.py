"""Watching a job's streamed part files, so a test can kill it once records are there
(never after a fixed sleep)."""

from __future__ import annotations

import time
from pathlib import Path


def records_in_parts(out: Path) -> int:
    n = 0
    for part in out.parent.glob(out.name + ".part-*"):
        n += max(0, part.read_bytes().count(b"\n") - 1)  # minus the header line
    return n


def wait_for_records(out: Path, k: int, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if records_in_parts(out) >= k:
            return True
        time.sleep(0.02)
    return False


def kill_after_records(args: list, out: Path, k: int, tag: str) -> int:
    """Start `python args...`, SIGKILL its whole process group once its part files hold `k`
    records, reap everything carrying `tag`; returns the records the parts hold then."""
    import os
    import signal
    import subprocess
    import sys

    from launch import REPO, base_env, tagged_pids
    job = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=base_env(tag),
                           start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for_records(out, k), f"fewer than {k} records streamed to a part file"
        os.killpg(job.pid, signal.SIGKILL)  # the whole job, mid-run
        job.wait(timeout=10)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    for pid in tagged_pids(tag):
        os.kill(pid, signal.SIGKILL)
    return records_in_parts(out)
