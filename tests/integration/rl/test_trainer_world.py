"""An LLM inside a world the trainer built: it joins that world, and its shutdown leaves the
trainer's default group and subgroups working (torchtitan's teardown hung on vLLM destroying
them), whether the world came from torchrun's env or from init_process_group(tcp:// or file://)
with no launcher variables at all."""

import json

import pytest
from launch import PYTHON, REPO, run_checked, run_ranks_on_free_port, run_torchrun

SCRIPT = str(REPO / "tests" / "helpers" / "dist_scripts" / "trainer_world.py")


def _reports(launch) -> dict[int, dict]:
    assert launch.returncode == 0, launch.describe()
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in launch.stdout.splitlines()
               if line.startswith("REPORT ")]
    return {r["rank"]: r for r in reports}


def _check(reports: dict[int, dict]) -> None:
    assert sorted(reports) == [0, 1, 2, 3]
    texts = {0: " better than", 1: " never pass "}
    for rank, r in reports.items():
        replica = rank // 2
        # Both LLMs: this rank's replica, the trainer's rank as the engine's, the bundled model's text.
        assert r["first"][:3] == [replica, rank, texts[replica]], r
        assert r["second"] == r["first"], r
        # After each shutdown: the default group (1+2+3+4), the trainer's own pair {0,2} / {1,3},
        # a group made after the first LLM's teardown, the default group again.
        assert r["sums"] == [10, 4 if rank % 2 == 0 else 6, 10, 10], r
        assert r["barrier"] and r["default_alive"], r


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torchrun_trainer_world_survives_two_llms():
    launch = run_torchrun(4, [SCRIPT, "env"], timeout=130)
    _check(_reports(launch))
    assert not launch.leftover_pids and not launch.stale_segments()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_hand_made_trainer_world_without_launcher_env(scheme, tmp_path):
    """Ranks started as plain processes (no RANK / WORLD_SIZE / SLURM_*): the engine takes its
    rank from the trainer's default group, not from the (absent) environment."""
    def env(rank, port):
        init = f"tcp://127.0.0.1:{port}" if scheme == "tcp" else f"file://{tmp_path}/rendezvous"
        return dict(TRAINER_INIT=init, TRAINER_RANK=str(rank), TRAINER_WORLD="4")
    launch = run_ranks_on_free_port(4, [SCRIPT, "hand"], env, timeout=130)
    _check(_reports(launch))
    assert not launch.leftover_pids and not launch.stale_segments()


@pytest.mark.timeout(60)
def test_in_process_engine_refuses_to_replace_a_callers_default_group():
    """uni would need a default group of its own: a clear error instead of torch's 'initialize
    the default process group twice'; external_launcher shares the group and leaves it working."""
    code = (
        "import sys, tempfile, torch, torch.distributed as dist\n"
        "from spmd_engine import LLM, SamplingParams\n"
        "from spmd_engine.config import ConfigError\n"
        "dist.init_process_group('gloo', init_method=f'file://{tempfile.mkdtemp()}/r', rank=0, world_size=1)\n"
        "try:\n"
        "    LLM(seed=0)\n"
        "    sys.exit('uni started')\n"
        "except ConfigError as exc:\n"
        "    print('ERROR', exc)\n"
        "with LLM(seed=0, distributed_executor_backend='external_launcher') as llm:\n"
        "    print('TEXT', llm.generate(['Beautiful is'], SamplingParams(max_tokens=8))[0].outputs[0].text)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "print('SUM', t.item(), dist.is_initialized())\n"
        "dist.destroy_process_group()\n"
    )
    proc = run_checked([PYTHON, "-c", code], "uni-in-trainer", timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR torch.distributed's default process group already exists" in proc.stdout
    assert "external_launcher" in proc.stdout
    assert "TEXT  better \n" in proc.stdout and "SUM 1.0 True" in proc.stdout, proc.stdout


@pytest.mark.timeout(90)
def test_llm_under_srun_without_torchrun_resolves_to_external_launcher():
    """srun tasks (SLURM_* only, no RANK / WORLD_SIZE): LLM with no backend joins the step's world
    as the CLI does, instead of each task spawning a private mp engine."""
    code = (
        "import os, torch.distributed as dist\n"
        "from spmd_engine import LLM, SamplingParams\n"
        "with LLM(tensor_parallel_size=2, seed=0) as llm:\n"
        "    text = llm.generate(['Beautiful is'], SamplingParams(max_tokens=8))[0].outputs[0].text\n"
        "    worker = llm.llm_engine.model_executor.driver_worker\n"
        "    print('SRUN', os.environ['SLURM_PROCID'], worker.rank, dist.get_world_size(),\n"
        "          llm.config.parallel_config.distributed_executor_backend, repr(text), flush=True)\n"
    )

    def env(rank, port):
        return dict(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2", SLURM_STEP_ID="0",
                    SLURM_NODEID="0", SLURM_JOB_ID="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    launch = run_ranks_on_free_port(2, ["-c", code], env, timeout=70)
    assert launch.returncode == 0, launch.describe()
    lines = sorted(line for line in launch.stdout.splitlines() if line.startswith("SRUN"))
    assert lines == [f"SRUN {r} {r} 2 external_launcher ' better '" for r in range(2)], launch.describe()
    assert not launch.leftover_pids and not launch.stale_segments()
