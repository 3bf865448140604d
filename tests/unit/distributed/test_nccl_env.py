"""NCCL watchdog defaults: a hung NCCL collective still ends the job (issue 15)."""

from spmd_engine.distributed.launch_env import nccl_env_defaults


def test_defaults_turn_on_async_error_handling_and_the_heartbeat_monitor():
    env = nccl_env_defaults({}, timeout_s=300)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                   "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}
    # The monitor must not fire before the collective timeout itself.
    assert nccl_env_defaults({}, timeout_s=1800)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1860"


def test_a_users_setting_is_kept():
    env = nccl_env_defaults({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, timeout_s=60)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
