"""Under mp with DP > 1 every replica's workers join one torch world (vLLM's layout).

Before: each replica was its own world of TP x PP ranks, so the DP and EP groups
`plan` prints for mp were never built (every worker's DP group was itself).
"""

from __future__ import annotations

import pytest
from engine_helpers import make_tiny_checkpoint

from spmd_engine import LLM
from spmd_engine.plan.report import plan_dict
from spmd_engine.topology import Layout


def _groups(worker):
    """(global rank, {axis: group ranks}, live-check problems): the check is collective, so
    every worker of both replicas runs it at once (the front end sends to both together)."""
    import torch.distributed as dist

    from spmd_engine.distributed.live_check import check_groups
    from spmd_engine.distributed.parallel_state import model_parallel_groups
    groups = {axis: g.ranks for axis, g in model_parallel_groups().items()}
    return dist.get_rank(), dist.get_world_size(), groups, check_groups()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_dp_replicas_share_one_world_with_the_planned_groups(tmp_path, backend):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    tp = 2 if backend == "mp" else 1
    with LLM(model=str(ckpt), data_parallel_size=2, tensor_parallel_size=tp, enable_expert_parallel=True,
             distributed_executor_backend=backend) as llm:
        replies = llm.collective_rpc(_groups)  # replica 0's workers, then replica 1's
        names = [p.name for p in llm.llm_engine.engine_core.procs]
    plan = plan_dict(Layout(tp=tp, dp=2), backend)
    world = 2 * tp
    assert names == ["EngineCore_DP0", "EngineCore_DP1"]
    assert [r[0] for r in replies] == list(range(world))  # rank = dp * world_size + tp
    for rank, size, groups, problems in replies:
        assert size == world and problems == []
        for axis in ("tp", "pp", "dp", "ep"):
            expected = next(g for g in plan["groups"][axis] if rank in g)
            assert groups[axis] == expected, (rank, axis)
    assert replies[0][2]["dp"] == [0, tp]  # the DP group spans the two replicas
    assert replies[0][2]["ep"] == list(range(world))
