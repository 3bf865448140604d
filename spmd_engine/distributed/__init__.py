"""Process groups for every parallel axis, and the collectives on them.

Bring-up: `init_distributed_environment()` (or reuse of a trainer's default
group), then `initialize_model_parallel(parallel_config)`; teardown in reverse.

The names below are imported on first use, so that importing a submodule that needs no
torch (the shared-memory message queue, launch_env) does not load torch.distributed.
"""

import importlib

_PARALLEL_STATE = (
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_dcp_group",
    "get_dp_group",
    "get_ep_group",
    "get_pcp_group",
    "get_pp_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "model_parallel_layout",
)
_HOME = {"CollectiveError": "errors", "GroupCoordinator": "group_coordinator",
         **{name: "parallel_state" for name in _PARALLEL_STATE}}

__all__ = ["CollectiveError", "GroupCoordinator", *_PARALLEL_STATE]


def __getattr__(name):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
