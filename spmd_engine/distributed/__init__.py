"""Process groups for every parallel axis, and the collectives on them.

Bring-up: `init_distributed_environment()` (or reuse of a trainer's default
group), then `initialize_model_parallel(parallel_config)`; teardown in reverse.
"""

from spmd_engine.distributed.group_coordinator import CollectiveError, GroupCoordinator
from spmd_engine.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_dcp_group,
    get_dp_group,
    get_ep_group,
    get_pcp_group,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    model_parallel_layout,
)

__all__ = [
    "CollectiveError",
    "GroupCoordinator",
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
]
