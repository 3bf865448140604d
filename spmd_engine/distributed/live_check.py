"""`plan --live`: bring the groups up on a real launch and check them against the plan.

The plan is pure arithmetic; this proves the launcher (or the mp executor's
one world across DP replicas), the rendezvous and new_group agree with it. Each rank all-gathers the global ranks inside each of
its groups (membership and order) and all-reduces ones (size), compares both
with topology's table, and every rank learns every verdict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_engine import topology
from spmd_engine.config import ParallelConfig
from spmd_engine.distributed import parallel_state as ps


def check_groups() -> list[str]:
    """This rank's mismatches between its groups and the plan (collective over every group:
    every rank of the world calls it at once). Also run inside mp workers, whose one world
    across DP replicas is not a launcher's."""
    return _check_rank(ps.model_parallel_layout(), dist.get_rank())


def _check_rank(layout: topology.Layout, rank: int) -> list[str]:
    problems = []
    for axis, group in ps.model_parallel_groups().items():
        expected = topology.group_of(layout, axis, rank)
        members = group.all_gather(torch.tensor([rank], dtype=torch.int64), dim=0).tolist()
        size = int(group.all_reduce(torch.ones(1, dtype=torch.int64)).item())
        if members != expected or size != len(expected) or group.ranks != expected:
            problems.append(f"rank {rank} {axis}: expected {expected}, got {members} (size {size})")
    return problems


def run_live_check(parallel_config: ParallelConfig) -> tuple[bool, str]:
    """(ok, one verdict line), the same on every rank. Tears down what it brought up."""
    owned_env = not dist.is_initialized()
    ps.init_distributed_environment()
    owned_groups = not ps.model_parallel_is_initialized()
    try:
        if owned_groups:
            ps.initialize_model_parallel(parallel_config)
        layout = ps.model_parallel_layout()
        rank = dist.get_rank()
        verdicts = ps.get_world_group().all_gather_object(_check_rank(layout, rank))
        problems = [p for rank_problems in verdicts for p in rank_problems]
        axes = ",".join(a for a in ps.model_parallel_groups() if a != "world")
        shape = (f"edp={layout.external_dp} dp={layout.dp} pp={layout.pp} "
                 f"pcp={layout.pcp} tp={layout.tp} dcp={layout.dcp}")
        if not problems:
            return True, (f"live check passed: {layout.launched_world_size} ranks ({shape}); "
                          f"groups on {axes} match the plan")
        shown = "; ".join(problems[:4]) + (f"; ... {len(problems) - 4} more" if len(problems) > 4 else "")
        return False, f"live check FAILED: {len(problems)} mismatch(es): {shown}"
    finally:
        if owned_groups:
            ps.destroy_model_parallel()
        if owned_env:
            ps.destroy_distributed_environment()
