"""Real multi-process checks of spmd_engine.distributed (gloo on CPU).

World-8 launches are expensive on a small machine (8 torch imports), so each
launch checks several layouts: groups are torn down and rebuilt in-process.
Every launch is bounded; every test also asserts nothing was left behind.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from launch import REPO, run_ranks_on_free_port, run_ranks_with_env, run_torchrun, tagged_pids

from spmd_engine.distributed.launch_env import port_from_job_id

SCRIPT = str(REPO / "tests" / "helpers" / "dist_scripts" / "collectives_check.py")


def results(out: Path, ranks) -> dict[int, dict]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks}


def assert_clean(launch) -> None:
    """Nothing left by this launch: no process with its tag, no /dev/shm segment its processes made."""
    assert launch.leftover_pids == [] and tagged_pids(launch.tag) == [], f"processes left: {launch.leftover_pids}"
    assert launch.stale_segments() == [], f"/dev/shm segments left behind: {launch.stale_segments()}"


def assert_all_ok(launch, out: Path, world: int) -> dict[int, dict]:
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    res = results(out, range(world))
    for r, rec in res.items():
        assert rec["errors"] == [], f"rank {r}: {rec['errors'][:5]}"
        assert rec["checks"] > 50, f"rank {r} ran only {rec['checks']} checks"
    assert_clean(launch)
    return res


@pytest.mark.xdist_group("world8")
@pytest.mark.timeout(150)
def test_world8_layouts_shared_memory(tmp_path):
    """(TP,PP,DP) = (2,2,2), (2,1,4), TP=2 alone (4 external-DP replicas), and
    TP=2 DCP=2 PCP=2 PP=2 with EP; CPU all-reduce on the shared-memory path."""
    layouts = ["tp=2,pp=2,dp=2", "tp=2,dp=4", "tp=2", "tp=2,dcp=2,pcp=2,pp=2,ep=1"]
    launch = run_torchrun(8, [SCRIPT, "layouts", "--out", tmp_path, "--layouts", *layouts], timeout=130)
    res = assert_all_ok(launch, tmp_path, 8)
    assert res[3]["layouts"] == layouts
    # the start-up line of the seed's example rank, first layout
    assert res[3]["logs"][0] == "rank 3 coord (edp=0 dp=0 pp=1 pcp=0 tp=1) tp=[2, 3] dcp=[3] pcp=[3] pp=[1, 3] dp=[3, 7]"
    assert res[0]["live"].startswith("live check passed: 8 ranks")
    assert "ep=[0, 1, 2, 3]" in res[0]["logs"][3] and "dcp=[0, 1]" in res[0]["logs"][3]


@pytest.mark.xdist_group("world8")
@pytest.mark.timeout(150)
def test_world8_layouts_gloo(tmp_path):
    """(8,1,1) and (1,8,1) with the shared-memory paths disabled: gloo all-reduce and PP hand-off
    (each path has its own switch)."""
    layouts = ["tp=8", "pp=8"]
    launch = run_torchrun(8, [SCRIPT, "layouts", "--out", tmp_path, "--no-shm", "--layouts", *layouts],
                          timeout=130, env_extra={"SPMD_ENGINE_DISABLE_SHM_ALLREDUCE": "1",
                                                  "SPMD_ENGINE_DISABLE_SHM_HANDOFF": "1"})
    res = assert_all_ok(launch, tmp_path, 8)
    assert "pp=[0, 1, 2, 3, 4, 5, 6, 7]" in res[5]["logs"][1]


def _free_job_id() -> str:
    """A SLURM job id whose derived rendezvous port is free right now."""
    for job_id in range(424242, 424242 + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port_from_job_id(str(job_id))))
                return str(job_id)
            except OSError:
                continue
    raise RuntimeError("no free derived port")


@pytest.mark.timeout(60)
def test_slurm_env_without_torchrun(tmp_path):
    """srun-style variables only (no RANK): host from the nodelist, port from the job id."""
    job_id = _free_job_id()
    envs = [dict(SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2", SLURM_NODEID="0",
                 SLURM_JOB_NODELIST="localhost,node[02-03]", SLURM_TASKS_PER_NODE="2(x1)",
                 SLURM_JOB_ID=job_id, SPMD_ENGINE_TIMEOUT_S="30") for r in range(2)]
    launch = run_ranks_with_env(2, [SCRIPT, "slurm", "--out", tmp_path], envs, timeout=50)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    for r, rec in results(tmp_path, range(2)).items():
        assert rec["errors"] == [], rec["errors"]
    assert_clean(launch)


@pytest.mark.timeout(60)
def test_reuse_preinitialised_world(tmp_path):
    """The script calls init_process_group itself; we reuse it and never destroy it (c10d rendezvous)."""
    launch = run_torchrun(2, [SCRIPT, "reuse", "--out", tmp_path], timeout=50, rdzv=True)
    assert not launch.timed_out and launch.returncode == 0, launch.describe()
    for r, rec in results(tmp_path, range(2)).items():
        assert rec["errors"] == [], rec["errors"]
    assert_clean(launch)


@pytest.mark.timeout(90)
def test_dead_or_stuck_peer_fails_with_named_group(tmp_path):
    """World 6, TP=2: rank 1 dies (shm group [0, 1]), rank 3 hangs (gloo group [2, 3]),
    rank 5 dies (gloo group [4, 5]). The survivors' all_reduce must raise a
    TimeoutError naming the operation and the group, within the timeout."""
    timeout_s = 6

    def env(r, port):
        env = dict(RANK=str(r), WORLD_SIZE="6", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="6",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SPMD_ENGINE_TIMEOUT_S=str(timeout_s))
        if r >= 2:
            env["SPMD_ENGINE_DISABLE_SHM_ALLREDUCE"] = "1"
        return env
    launch = run_ranks_on_free_port(6, [SCRIPT, "dead", "--out", tmp_path], env, timeout=70)
    assert not launch.timed_out, launch.describe()
    res = results(tmp_path, [0, 2, 4])
    for r, group in ((0, "tp [0, 1]"), (2, "tp [2, 3]"), (4, "tp [4, 5]")):
        err = res[r]["error"]
        assert err is not None and err["is_timeout"], (r, res[r])
        assert f"all_reduce on group {group}" in err["msg"], (r, err)
        assert res[r]["elapsed"] < timeout_s + 3, (r, res[r]["elapsed"])
    assert res[0]["shm"] and not res[2]["shm"]
    assert f"timed out after {timeout_s}s" in res[2]["error"]["msg"]
    assert res[2]["elapsed"] >= timeout_s - 0.1  # a stuck peer: only the timeout ends the wait
    assert res[0]["elapsed"] < timeout_s / 2 and res[4]["elapsed"] < timeout_s / 2  # a dead one is noticed early
    assert_clean(launch)


HANG_LIMIT_S = 40  # the harness's own limit: well past the product's timeout below


@pytest.mark.timeout(120)
def test_hung_rank_is_ended_by_the_collective_timeout_not_the_harness(tmp_path):
    """Rank 1 hangs; rank 0's all-reduce must raise at SPMD_ENGINE_TIMEOUT_S (the product's
    timeout), fail, and torchrun must end rank 1: well inside the harness's limit, nothing left.
    Negative control: with a product timeout longer than the harness's limit the same launch
    is still hanging when the harness kills it, so the first run's end came from the product."""
    ok = tmp_path / "ok"
    ok.mkdir()
    launch = run_torchrun(2, [SCRIPT, "hang", "--out", ok], timeout=HANG_LIMIT_S,
                          env_extra={"SPMD_ENGINE_TIMEOUT_S": "4"})
    assert not launch.timed_out and launch.returncode != 0, launch.describe()
    rank0 = results(ok, [0])[0]
    assert len(rank0["errors"]) == 1 and "all_reduce on group tp [0, 1]" in rank0["errors"][0], rank0
    assert "timed out after 4s" in rank0["errors"][0] and 3.5 < rank0["elapsed"] < 8, rank0
    assert_clean(launch)

    control = tmp_path / "control"
    control.mkdir()
    launch = run_torchrun(2, [SCRIPT, "hang", "--out", control], timeout=25,
                          env_extra={"SPMD_ENGINE_TIMEOUT_S": "600"})
    assert launch.timed_out, launch.describe()
    assert (control / "ready0").exists() and (control / "ready1").exists(), launch.describe()
    assert not (control / "rank0.json").exists()  # rank 0 was still waiting
    assert_clean(launch)  # and the harness's kill leaves nothing behind either


@pytest.mark.timeout(60)
def test_world_of_one_in_process(monkeypatch):
    """No launcher: a private world of one, every axis a real size-1 group, clean teardown."""
    import torch
    import torch.distributed as dist

    from spmd_engine import distributed as sd
    from spmd_engine.config import ConfigError, ParallelConfig

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    sd.init_distributed_environment(timeout_s=5)
    try:
        with pytest.raises(ConfigError, match="not a multiple"):
            sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=2))
        assert not sd.model_parallel_is_initialized()
        sd.initialize_model_parallel(ParallelConfig(enable_expert_parallel=True))
        for get in (sd.get_world_group, sd.get_tp_group, sd.get_pp_group, sd.get_dp_group,
                    sd.get_pcp_group, sd.get_dcp_group, sd.get_ep_group):
            g = get()
            assert g.ranks == [0] and g.world_size == 1 and g.next_rank == g.prev_rank == 0
        x = torch.ones(3)
        assert sd.get_tp_group().all_reduce(x) is x
        d = {"t": x, "v": 1}
        assert sd.get_tp_group().broadcast_tensor_dict(d) is d
        with pytest.raises(ValueError, match="needs a peer"):
            sd.get_pp_group().send_tensor_dict(d)
    finally:
        sd.destroy_distributed_environment()
        sd.destroy_distributed_environment()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        sd.get_tp_group()
