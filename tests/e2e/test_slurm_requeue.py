"""A preempted sbatch job requeues itself and resumes (issue 15), on the stand-in srun.

SLURM sends the batch shell SIGTERM before preemption or the time limit
(`--signal=B:TERM@120`); the script's trap stops the step and runs `scontrol
requeue`; the requeued job (SLURM_RESTART_COUNT=1) resumes from the part files.
The SIGTERM is sent when a record reaches a part file, not after a sleep.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import uuid

import fake_slurm
import pytest
from launch import REPO, Launch, base_env, stale_segments, tagged_pids

SLURM_DIR = REPO / "scripts" / "slurm"
PROMPTS = ["Beautiful is", "Explicit is", "Simple is", "Complex is", "Flat is", "Sparse is"]
FLAGS = ["--max-tokens", "120", "--max-num-seqs", "1", "--quiet"]

SCONTROL = """#!/bin/bash
# scontrol stand-in that records requeue calls.
if [[ "$1 $2" == "show hostnames" ]]; then printf '%s\\n' $FAKE_SLURM_HOSTS; exit 0; fi
if [[ "$1" == "requeue" ]]; then echo "requeue $2" >> "$REQUEUE_LOG"; exit 0; fi
echo "scontrol stand-in: unsupported: $*" >&2; exit 1
"""


def parts_records(out) -> int:
    return sum(max(0, p.read_bytes().count(b"\n") - 1) for p in out.parent.glob(out.name + ".part-*"))


@pytest.mark.timeout(300)
def test_sigterm_requeues_and_the_requeued_job_resumes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    ref = tmp_path / "ref.jsonl"
    done = subprocess.run([sys.executable, "-m", "spmd_engine.run", "--prompts-file", str(prompts), *FLAGS,
                           "--output", str(ref)], cwd=REPO, env=base_env("requeue-ref"), capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr

    bin_dir = fake_slurm.install(tmp_path / "bin")
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    out, log = tmp_path / "out.jsonl", tmp_path / "requeue.log"
    tag = uuid.uuid4().hex[:12]
    env = base_env(tag, fake_slurm.batch_env(bin_dir, nodes=1, ntasks=2, TP=2, PROMPTS_FILE=prompts,
                                             OUTPUT=out))
    env["REQUEUE_LOG"] = str(log)
    script = ["bash", str(SLURM_DIR / "srun_direct.sbatch"), *FLAGS]
    job = subprocess.Popen(script, cwd=REPO, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        first_pids: set[int] = set()  # the first job's processes: the segments they make are checked
        while parts_records(out) < 1 and time.monotonic() < deadline and job.poll() is None:
            first_pids |= set(tagged_pids(tag))
            time.sleep(0.02)
        assert parts_records(out) >= 1, "no record streamed"
        job.send_signal(signal.SIGTERM)  # SLURM signals the batch shell (B:TERM)
        assert job.wait(timeout=60) == 143
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    stderr = job.stderr.read()
    assert log.read_text().split() == ["requeue", env["SLURM_JOB_ID"]], stderr
    deadline = time.monotonic() + 10
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tagged_pids(tag)
    assert not out.exists() and parts_records(out) >= 1

    # The requeued job: same script, SLURM_RESTART_COUNT=1, resumes by itself.
    env2 = dict(env, SLURM_RESTART_COUNT="1")
    second = Launch([script], [env2], tag, timeout=150)
    assert second.returncode == 0 and not second.timed_out, second.describe()
    assert out.read_bytes() == ref.read_bytes()
    assert not list(tmp_path.glob("out.jsonl.part-*"))
    assert not second.leftover_pids and not stale_segments(first_pids | second.seen_pids)
