"""The sbatch scripts in scripts/slurm/, run with bash against stand-in srun and scontrol.

Each script launches the bundled model the way it would on a cluster (srun +
torchrun on one node, srun + torchrun agents meeting through a c10d rendezvous
on two "nodes", srun alone with SLURM's variables only) and must write the same
JSONL file as one plain process given the same prompts and flags.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import fake_slurm
import pytest
from launch import PYTHON, REPO, Launch, base_env

SLURM_DIR = REPO / "scripts" / "slurm"
PROMPTS = [{"prompt": "Simple is"}, {"prompt": "Errors should"}, {"prompt_token_ids": [256, 70, 108, 97]},
           {"prompt": "Now is"}, {"prompt": "Readability"}]
# Seeded sampling (not greedy), so every launch must reproduce the seed's draws, not just argmaxes.
FLAGS = ["--max-tokens", "24", "--temperature", "2.0", "--seed", "3", "--quiet"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def reference(prompts_file, tmp_path_factory):
    """One plain process, same prompts and flags: what every launch must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    proc = subprocess.run([PYTHON, "-m", "spmd_engine.run", "--prompts-file", str(prompts_file), *FLAGS,
                           "--output", str(out)], cwd=REPO, env=base_env("slurm-ref"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    other = out.with_name("seed4.jsonl")  # negative control: another seed, other tokens
    proc = subprocess.run([PYTHON, "-m", "spmd_engine.run", "--prompts-file", str(prompts_file),
                           *[("4" if f == "3" else f) for f in FLAGS], "--output", str(other)], cwd=REPO,
                          env=base_env("slurm-ref"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and other.read_text() != out.read_text(), proc.stderr
    return out.read_text()


def run_sbatch(script: str, tmp_path, nodes: int, ntasks: int, args=(), timeout=150, **script_vars) -> Launch:
    bin_dir = fake_slurm.install(tmp_path / "bin")
    tag = uuid.uuid4().hex[:12]
    env = base_env(tag, fake_slurm.batch_env(bin_dir, nodes, ntasks, **script_vars))
    return Launch([["bash", str(SLURM_DIR / script), *map(str, args)]], [env], tag, timeout)


def check_launch(launch: Launch, out, reference) -> None:
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    assert out.read_text() == reference, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()


@pytest.mark.timeout(180)
def test_single_node_srun_torchrun(tmp_path, prompts_file, reference):
    out = tmp_path / "out.jsonl"
    launch = run_sbatch("single_node.sbatch", tmp_path, nodes=1, ntasks=1, args=FLAGS,
                        TP=2, PROMPTS_FILE=prompts_file, OUTPUT=out)
    check_launch(launch, out, reference)


@pytest.mark.timeout(180)
def test_multi_node_torchrun_c10d_rendezvous(tmp_path, prompts_file, reference):
    out = tmp_path / "out.jsonl"
    # Two "nodes" (127.0.0.1, 127.0.0.2) x 2 processes: TP=2 inside a node, DP=2 across nodes.
    launch = run_sbatch("multi_node.sbatch", tmp_path, nodes=2, ntasks=2, args=[*FLAGS[:-1]],
                        TP=2, DP=2, PROMPTS_FILE=prompts_file, OUTPUT=out)
    check_launch(launch, out, reference)
    assert "spmd_engine: 2 nodes x 2 processes, rendezvous 127.0.0.1:" in launch.stderr, launch.describe()
    starts = [line for line in launch.stderr.splitlines() if " launch: " in line]
    assert len(starts) == 4, launch.describe()
    for line in starts:  # node k holds global ranks 2k, 2k+1 as local ranks 0, 1
        fields = dict(f.split("=", 1) for f in line.split(" launch: ", 1)[1].split())
        rank, node, local = int(fields["rank"]), int(fields["node"]), int(fields["local_rank"])
        assert (fields["source"], fields["world"], node, local) == ("torchrun", "4", rank // 2, rank % 2), line


@pytest.mark.timeout(180)
def test_srun_direct_maps_slurm_variables(tmp_path, prompts_file, reference):
    out = tmp_path / "out.jsonl"
    # srun alone, 2 nodes x 2 tasks: rank/world/local rank from SLURM_*, address from the nodelist,
    # port from the job id; TP=2 x PP=2 spans both nodes.
    launch = run_sbatch("srun_direct.sbatch", tmp_path, nodes=2, ntasks=4, args=[*FLAGS[:-1]],
                        TP=2, PP=2, PROMPTS_FILE=prompts_file, OUTPUT=out)
    check_launch(launch, out, reference)
    starts = [line for line in launch.stderr.splitlines() if " launch: " in line]
    assert len(starts) == 4, launch.describe()
    for line in starts:
        fields = dict(f.split("=", 1) for f in line.split(" launch: ", 1)[1].split())
        rank = int(fields["rank"])
        assert line.startswith(f"[rank{rank}] ") and fields["source"] == "slurm", line
        assert (int(fields["node"]), int(fields["local_rank"]), fields["world"]) == (rank // 2, rank % 2, "4")
        assert fields["backend"] == "external_launcher", line


@pytest.mark.timeout(60)
def test_srun_direct_bad_flag_ends_every_task(tmp_path):
    launch = run_sbatch("srun_direct.sbatch", tmp_path, nodes=1, ntasks=2, args=["--prompt", "x"], timeout=50,
                        TP=3)
    assert not launch.timed_out and launch.returncode == 2, launch.describe()
    assert launch.stderr.count("error: tensor_parallel_size 3 must divide") == 1, launch.describe()
    assert not launch.leftover_pids


def one_task_fails(tmp_path) -> str:
    """An interpreter for the scripts' PYTHON: task 1 exits 3 at once, the others run the engine
    (and, their peer never arriving, would wait for it until --timeout)."""
    wrapper = tmp_path / "python_task1_fails"
    wrapper.write_text(f'#!/bin/bash\n[[ "$SLURM_PROCID" == 1 ]] && exit 3\nexec {PYTHON} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.timeout(120)
def test_srun_direct_one_failing_task_ends_the_step(tmp_path):
    """srun --kill-on-bad-exit=1 in the script: one task exiting 3 ends the step at once,
    although the engine's own timeout (--timeout 300) would keep task 0 waiting for minutes."""
    launch = run_sbatch("srun_direct.sbatch", tmp_path, nodes=1, ntasks=2, timeout=60,
                        args=["--prompt", "x", "--timeout", "300"], TP=2, PYTHON=one_task_fails(tmp_path))
    assert not launch.timed_out and launch.returncode == 3, launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments(), launch.describe()


@pytest.mark.timeout(120)
def test_negative_control_without_kill_on_bad_exit_the_step_hangs(tmp_path):
    """The same launch from a copy of the script without --kill-on-bad-exit: the stand-in srun,
    like the real one, lets task 0 wait on, so only the harness's limit ends it. This is what
    the test above would see if the flag were dropped from the script."""
    script = (SLURM_DIR / "srun_direct.sbatch").read_text()
    assert script.count("srun --kill-on-bad-exit=1 ") == 1
    copy = tmp_path / "srun_direct_no_kill.sbatch"
    copy.write_text(script.replace("srun --kill-on-bad-exit=1 ", "srun "))
    bin_dir = fake_slurm.install(tmp_path / "bin")
    tag = uuid.uuid4().hex[:12]
    env = base_env(tag, fake_slurm.batch_env(bin_dir, 1, 2, TP=2, PYTHON=one_task_fails(tmp_path)))
    launch = Launch([["bash", str(copy), "--prompt", "x", "--timeout", "300"]], [env], tag, timeout=20)
    assert launch.timed_out, launch.describe()
    assert not launch.leftover_pids
