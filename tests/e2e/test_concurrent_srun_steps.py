"""Two srun steps of one allocation running at once each get their own rendezvous (issue 15).

Before: every step derived host and port from the job alone (first host of
SLURM_JOB_NODELIST, 15000 + SLURM_JOB_ID % 15000), so a second concurrent step
met the first one's store: address in use, or ranks of two jobs in one world.
"""

from __future__ import annotations

import json
import random
import socket
import uuid

import fake_slurm
import pytest
from launch import PYTHON, Launch, base_env

from spmd_engine.distributed.launch_env import port_from_job_id, read_launch_env


def test_step_id_and_step_nodelist_choose_the_rendezvous():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "gpu[01-04]"}
    step0 = read_launch_env(dict(base, SLURM_STEP_ID="0", SLURM_STEP_NODELIST="gpu[01-02]"))
    step1 = read_launch_env(dict(base, SLURM_STEP_ID="1", SLURM_STEP_NODELIST="gpu[03-04]"))
    assert step0.master_port == port_from_job_id("4242")  # step 0 keeps the documented port
    assert step1.master_port != step0.master_port
    assert (step0.master_addr, step1.master_addr) == ("gpu01", "gpu03")
    ports = {port_from_job_id("4242", str(s)) for s in range(8)}
    assert len(ports) == 8


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(180)
def test_two_concurrent_srun_steps_in_one_allocation(tmp_path):
    bin_dir = fake_slurm.install(tmp_path / "bin")
    tag = uuid.uuid4().hex[:12]
    env = fake_slurm.batch_env(bin_dir, nodes=1, ntasks=2)
    for _ in range(500):  # a job id whose two step ports are both free now
        job = str(random.randrange(1, 10**6))
        if _free(port_from_job_id(job, "0")) and _free(port_from_job_id(job, "1")):
            break
    env.update(SLURM_JOB_ID=job, SLURM_JOBID=job)
    outs = [tmp_path / "step0.jsonl", tmp_path / "step1.jsonl"]
    prompts = ["Errors should", "Simple is"]
    cmds = [["srun", "-N", "1", "-n", "2", PYTHON, "-m", "spmd_engine.run", "-tp", "2", "--prompt", p,
             "--max-tokens", "24", "--output", str(o), "--quiet"] for p, o in zip(prompts, outs)]
    envs = [base_env(tag, dict(env, FAKE_SLURM_STEP_ID=str(step))) for step in range(2)]
    launch = Launch(cmds, envs, tag, timeout=150)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments()
    texts = [json.loads(o.read_text())["text"] for o in outs]
    assert texts == [" never pass silently.\nUn", " better than complex.\nCo"]
