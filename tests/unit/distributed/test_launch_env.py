"""read_launch_env is a pure function of a mapping: no processes needed."""

import pytest

from spmd_engine.config import ConfigError
from spmd_engine.distributed.launch_env import (
    PORT_BASE,
    PORT_SPAN,
    LaunchEnv,
    expand_nodelist,
    port_from_job_id,
    read_launch_env,
)


def test_nothing_launched():
    assert read_launch_env({}) is None
    assert read_launch_env({"SLURM_JOB_ID": "7"}) is None  # an allocation, but not an srun task


def test_torchrun_vars():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node01", "MASTER_PORT": "29511", "GROUP_RANK": "1"}
    assert read_launch_env(env) == LaunchEnv(5, 8, 1, 4, "node01", 29511, 1, "torchrun")


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    launch = read_launch_env(env)
    assert launch.source == "torchrun" and launch.world_size == 2 and launch.local_world_size == 2


def test_slurm_vars():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
    launch = read_launch_env(env)
    assert launch == LaunchEnv(6, 8, 2, 4, "gpu07", port_from_job_id("123456"), 1, "slurm")
    assert launch.init_method == f"tcp://gpu07:{port_from_job_id('123456')}"


def test_slurm_master_from_env_and_derived_local_world():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "3",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000", "SLURM_NODELIST": "x[1-3]"}
    launch = read_launch_env(env)
    assert (launch.master_addr, launch.master_port, launch.local_world_size) == ("10.0.0.1", 4000, 2)


def test_slurm_tasks_per_node_compressed_form():
    base = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1"}
    assert read_launch_env({**base, "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}).local_world_size == 2
    assert read_launch_env({**base, "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}).local_world_size == 1


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu[8-10]-ib", ["gpu8-ib", "gpu9-ib", "gpu10-ib"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("node[001-002],login[5]", ["node001", "node002", "login5"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_port_from_job_id_is_stable_and_unprivileged():
    ports = {port_from_job_id(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert port_from_job_id("98765") == port_from_job_id("98765")
    assert PORT_BASE <= port_from_job_id("12345_7") < PORT_BASE + PORT_SPAN  # array-job style id


def test_errors_are_one_line():
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        read_launch_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})
    with pytest.raises(ConfigError, match="MASTER_PORT or SLURM_JOB_ID"):
        read_launch_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ConfigError, match="not an integer"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match="outside world size"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_batch_or_salloc_shell_is_not_a_launch():
    """A command typed in an sbatch/salloc shell sees the allocation's variables but no
    srun step: it runs on its own instead of waiting for ranks that never come."""
    assert read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "5",
                            "SLURM_JOB_NODELIST": "n1"}) is None
