"""`python -m spmd_engine.plan`: the JSON contract (DESIGN 4.2) against the seed's tables."""

import json
import os
import subprocess
import sys

import pytest
from launch import REPO

PLAN_KEYS = {
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "prefill_context_parallel_size", "decode_context_parallel_size", "world_size",
    "world_size_across_dp", "external_data_parallel_size", "distributed_executor_backend",
    "output_rank", "ranks", "groups", "processes",
}


def run_plan(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "spmd_engine.plan", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.timeout(60)
def test_seed_layout_json():
    proc = run_plan("-tp", "2", "-pp", "2", "-dp", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert set(plan) == PLAN_KEYS
    assert plan["world_size"] == 4 and plan["world_size_across_dp"] == 8
    assert plan["external_data_parallel_size"] == 1
    assert plan["distributed_executor_backend"] == "mp"
    assert plan["output_rank"] == 2
    assert plan["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan["groups"]["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["groups"]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan["groups"]["pcp"] == plan["groups"]["dcp"] == [[r] for r in range(8)]
    rank3 = plan["ranks"][3]
    assert (rank3["tp"], rank3["pp"], rank3["dp"]) == (1, 1, 0)
    assert [r["device_index"] for r in plan["ranks"]] == list(range(8))
    assert plan["processes"] == {"engine_cores": ["EngineCore_DP0", "EngineCore_DP1"],
                                 "workers_per_engine_core": 4, "dp_coordinator": True, "total": 11}


@pytest.mark.timeout(60)
def test_backend_defaults_in_json():
    assert json.loads(run_plan("--json").stdout)["distributed_executor_backend"] == "uni"
    assert json.loads(run_plan("-dp", "2", "--json").stdout)["distributed_executor_backend"] == "mp"
    # A launched world beyond the model's needs is the launcher's: external DP.
    plan = json.loads(run_plan("-tp", "2", "--world-size", "8", "--json").stdout)
    assert plan["distributed_executor_backend"] == "external_launcher"
    assert plan["external_data_parallel_size"] == 4
    assert plan["processes"]["total"] == 8
    # Under torchrun the default is external_launcher and the world is WORLD_SIZE.
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    plan = json.loads(run_plan("-tp", "2", "--json", env_extra=env).stdout)
    assert plan["distributed_executor_backend"] == "external_launcher"
    assert plan["external_data_parallel_size"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [
    (["-tp", "2", "--world-size", "7"], "world size 7 is not a multiple of TP x PP x PCP x DP"),
    (["-tp", "0"], "tensor_parallel_size must be an integer >= 1, got 0"),
    (["-tp", "2", "--world-size", "8", "--distributed-executor-backend", "mp"], "external-DP replicas need"),
    (["--distributed-executor-backend", "ray"], "invalid choice: 'ray'"),
    (["-tp", "two"], "invalid int value: 'two'"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    proc = run_plan(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


@pytest.mark.timeout(60)
def test_human_readable_plan_shows_grid_groups_processes():
    out = run_plan("-tp", "2", "-pp", "2", "-dp", "2").stdout
    assert "DP replica 1 (EngineCore_DP1)" in out
    assert "pp1      [2]       3" in out  # output rank bracketed in the grid
    assert "dp  [0, 4] [1, 5] [2, 6] [3, 7]" in out
    assert "[2, 3] / [1, 3] / [3, 7]" in out  # rank 3's three groups
    assert "EngineCore_DP1 (own process) -> 4 workers, devices 4..7" in out


@pytest.mark.xdist_group("world8")
@pytest.mark.timeout(120)
def test_live_check_under_torchrun():
    from launch import run_torchrun
    launch = run_torchrun(8, ["-m", "spmd_engine.plan", "-tp", "2", "-pp", "2", "-dp", "2", "--live"], timeout=100)
    assert launch.returncode == 0, launch.describe()
    verdicts = [line for line in launch.stdout.splitlines() if line.strip()]
    assert len(verdicts) == 1 and verdicts[0].startswith("live check passed: 8 ranks"), launch.describe()
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_live_check_fails_on_a_corrupted_group_table():
    """Negative control: TP groups built from a table with two ranks swapped ([0, 3] [1, 2]
    instead of [0, 1] [2, 3]) come up fine, and the live check must say they are wrong, exit 1."""
    from launch import run_torchrun
    script = str(REPO / "tests" / "helpers" / "dist_scripts" / "live_check_corrupt.py")
    launch = run_torchrun(4, [script, "-tp", "2", "-pp", "2", "--live"], timeout=100)
    assert not launch.timed_out and launch.returncode == 1, launch.describe()
    verdicts = [line for line in launch.stdout.splitlines() if line.strip()]
    assert len(verdicts) == 1 and verdicts[0].startswith("live check FAILED: 4 mismatch(es)"), launch.describe()
    assert "rank 0 tp: expected [0, 1], got [0, 3]" in verdicts[0], verdicts
    assert not launch.leftover_pids


@pytest.mark.timeout(120)
def test_live_check_under_srun(tmp_path):
    """srun alone (the stand-in, SLURM_* variables only, no torchrun): 2 "nodes" x 2 tasks."""
    import fake_slurm
    from launch import PYTHON, Launch, base_env

    bin_dir = fake_slurm.install(tmp_path / "bin")
    for attempt in range(3):
        tag = f"live-srun-{attempt}-{os.getpid()}"
        env = base_env(tag, fake_slurm.batch_env(bin_dir, nodes=2, ntasks=4))
        launch = Launch([[str(bin_dir / "srun"), "-N", "2", "-n", "4", PYTHON, "-m", "spmd_engine.plan", "-tp", "2", "-pp", "2",
                          "--live"]], [env], tag, timeout=100)
        if not launch.port_in_use():
            break
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    verdicts = [line for line in launch.stdout.splitlines() if line.strip()]
    assert len(verdicts) == 1 and verdicts[0].startswith("live check passed: 4 ranks"), launch.describe()
    assert not launch.leftover_pids


@pytest.mark.timeout(60)
def test_live_check_needs_a_launcher():
    proc = run_plan("-tp", "2", "--live")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --live needs a launcher: run it under torchrun or srun"
