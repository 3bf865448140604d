"""Stand-ins for SLURM's `srun` and `scontrol`, so the sbatch scripts run for real on one machine.

`install(bin_dir)` writes two executables; put `bin_dir` first on PATH and run an
sbatch script with `bash` and the environment sbatch would give its batch step
(`batch_env`). The stand-in srun starts each task as a local process with the
variables a real srun exports (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
SLURM_NTASKS, SLURM_TASKS_PER_NODE, ...), tasks laid out block-wise over the
job's "nodes", which are all this machine: their names (FAKE_SLURM_HOSTS) are
loopback addresses such as 127.0.0.1 and 127.0.0.2.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import sys
from pathlib import Path

SRUN = r'''#!{python}
"""Stand-in srun: -N/--nodes, -n/--ntasks, --ntasks-per-node, -K/--kill-on-bad-exit[=0|1];
other options are accepted and ignored. As with the real srun, a failing task ends the step
only with --kill-on-bad-exit (nonzero); otherwise the other tasks run on."""
import os, signal, subprocess, sys, time

argv, opts = sys.argv[1:], {{}}
names = {{"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
          "--ntasks-per-node": "ntasks_per_node"}}
kill_on_bad_exit = os.environ.get("SLURM_KILL_BAD_EXIT", "0") not in ("", "0")
while argv and argv[0].startswith("-"):
    arg = argv.pop(0)
    key, eq, value = arg.partition("=")
    if key in names:
        opts[names[key]] = int(value if eq else argv.pop(0))
    elif key in ("-K", "--kill-on-bad-exit"):
        kill_on_bad_exit = (value if eq else "1") != "0"
    elif key.startswith("-K") and key[2:].isdigit():
        kill_on_bad_exit = key[2:] != "0"
env = os.environ
hosts = env["FAKE_SLURM_HOSTS"].split()
nodes = opts.get("nodes", int(env.get("SLURM_JOB_NUM_NODES", "1")))
if "ntasks_per_node" in opts:
    ntasks = nodes * opts["ntasks_per_node"]
else:
    ntasks = opts.get("ntasks", int(env.get("SLURM_NTASKS", nodes)))
assert ntasks % nodes == 0 and nodes <= len(hosts), (ntasks, nodes, hosts)
per_node = ntasks // nodes
procs = []
for rank in range(ntasks):
    node = rank // per_node
    task_env = dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(node),
                    SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
                    SLURM_STEP_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
                    SLURM_TASKS_PER_NODE=f"{{per_node}}(x{{nodes}})", SLURM_STEP_ID=env.get("FAKE_SLURM_STEP_ID", "0"),
                    SLURMD_NODENAME=hosts[node], SLURM_STEP_NODELIST=env["SLURM_JOB_NODELIST"])
    procs.append(subprocess.Popen(argv, env=task_env))


def stop(*_):
    for p in procs:
        if p.poll() is None:
            p.terminate()


signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(143)))
def running():
    return [p for p in procs if p.poll() is None]  # polls every task: any() would stop at the first live one


rc = 0
while running():
    bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
    if bad and not rc and kill_on_bad_exit:  # one task failed: end the step
        rc = bad[0]
        stop()
        deadline = time.monotonic() + 5
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.05)
sys.exit(rc or next((p.returncode for p in procs if p.returncode), 0))
'''

SCONTROL = '''#!/bin/bash
# Stand-in scontrol: only `scontrol show hostnames [LIST]`, answered from FAKE_SLURM_HOSTS.
if [[ "$1 $2" == "show hostnames" ]]; then
    printf '%s\\n' $FAKE_SLURM_HOSTS
    exit 0
fi
echo "fake scontrol: unsupported: $*" >&2
exit 1
'''

# Variables the sbatch scripts read; the test's own environment must not leak them in.
SCRIPT_VARS = ("MODEL", "TP", "PP", "DP", "PROMPTS_FILE", "OUTPUT", "GPUS_PER_NODE", "RDZV_PORT",
               "TORCHRUN_ARGS", "PYTHON", "NTASKS")


def install(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def job_id_for_free_port() -> tuple[str, int]:
    """A job id whose derived port (15000 + id % 15000, as the scripts and launch_env compute it)
    is free now, so concurrent tests do not collide."""
    for _ in range(200):
        port = random.randrange(15000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(port - 15000 + 15000 * random.randrange(1, 60000)), port
    raise RuntimeError("no free port in 15000..29999")


def batch_env(bin_dir: Path, nodes: int, ntasks: int, **script_vars) -> dict[str, str]:
    """What sbatch gives a batch step on the first of `nodes` loopback "nodes", plus the script's variables."""
    hosts = [f"127.0.0.{i + 1}" for i in range(nodes)]
    job_id, _ = job_id_for_free_port()
    env = {name: "" for name in SCRIPT_VARS}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHON=sys.executable,
        FAKE_SLURM_HOSTS=" ".join(hosts),
        SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME="spmd-engine",
        SLURM_JOB_NODELIST=f"127.0.0.[1-{nodes}]" if nodes > 1 else hosts[0],
        SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NTASKS=str(ntasks),
        SLURM_NPROCS=str(ntasks), SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
        SLURMD_NODENAME=hosts[0],
    )
    env.update({k: str(v) for k, v in script_vars.items()})
    return env
