"""Launcher-store operations one rank makes to build its groups, from the layout alone.

Why: at scale start-up is bounded by the launcher's one store (torchrun's TCPStore)
that every rank talks to. gloo connects the members of a group through it: each
member publishes its address once, then waits for and reads every member's,
itself included, so joining a group of s ranks costs 1 + 2s operations, and a
rank that is not a member makes none (its new_group call returns at once). A
rank therefore pays for the groups it belongs to, O(world) in all (the default
group and the world axis span every rank), and the launch O(world^2), the gloo
full mesh of the world group; nothing else grows with the world. The
same-invocation check of `spmd_engine.run` adds 2 operations per rank and
world - 1 on rank 0, which reads every rank's hash (`tests/integration/distributed/test_startup_cost.py`
counts the real operations against this model).
"""

from __future__ import annotations

from spmd_engine import topology

AXES_BUILT = ("world", "tp", "dcp", "pcp", "pp", "dp")  # plus "ep" when expert parallel is on


def gloo_connect_ops(group_size: int) -> int:
    """Store operations of one member joining a gloo group: set its address, wait + get each member's."""
    return 1 + 2 * group_size


def group_store_ops(layout: topology.Layout, rank: int, expert_parallel: bool = False,
                    default_group: bool = True) -> int:
    """Operations `rank` makes to connect its default group (if counted) and every axis group."""
    axes = AXES_BUILT + (("ep",) if expert_parallel else ())
    ops = gloo_connect_ops(layout.launched_world_size) if default_group else 0
    return ops + sum(gloo_connect_ops(len(topology.group_of(layout, axis, rank))) for axis in axes)


def invocation_check_ops(world: int, rank: int) -> int:
    """spmd_engine.run's same-invocation check: rank 0 reads every hash and sets the verdict."""
    return world if rank == 0 else 2


def startup_store_ops(layout: topology.Layout, expert_parallel: bool = False) -> dict[str, int]:
    """Per-rank maximum and the whole launch's total of start-up store operations."""
    world = layout.launched_world_size
    per_rank = [group_store_ops(layout, r, expert_parallel) + invocation_check_ops(world, r)
                for r in range(world)]
    return {"world": world, "max_per_rank": max(per_rank), "total": sum(per_rank)}
