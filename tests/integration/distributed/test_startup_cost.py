"""Start-up store operations: the model in spmd_engine.distributed.startup_cost against real
gloo groups, counted at the store (4 spawned ranks, a FileStore wrapped in a counting Store)."""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp

import pytest
import torch.distributed as dist

from spmd_engine import topology
from spmd_engine.distributed.startup_cost import group_store_ops, invocation_check_ops, startup_store_ops


class CountingStore(dist.Store):
    """Every operation gloo or we make, counted; the work is done by `inner`."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.ops = inner, collections.Counter()

    def set(self, key, value):
        self.ops["set"] += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.ops["get"] += 1
        return self.inner.get(key)

    def add(self, key, n):
        self.ops["add"] += 1
        return self.inner.add(key, n)

    def compare_set(self, key, expected, desired):
        self.ops["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self.ops["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self.ops["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key):
        self.ops["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def _rank_main(rank: int, world: int, store_path: str, out: str) -> None:
    import os
    os.environ["OMP_NUM_THREADS"] = "1"
    from spmd_engine.config import ParallelConfig
    from spmd_engine.distributed import parallel_state
    from spmd_engine.run.jobs import check_same_invocation
    store = CountingStore(dist.FileStore(store_path, world))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    before = sum(store.ops.values())
    parallel_state.initialize_model_parallel(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                            enable_expert_parallel=True))
    groups = sum(store.ops.values()) - before
    before = sum(store.ops.values())
    check_same_invocation(argparse.Namespace(flag=1), ["a prompt"])
    check = sum(store.ops.values()) - before
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"groups": groups, "check": check}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_counted_store_operations_match_the_model(tmp_path):
    world = 4
    ctx = mp.get_context("spawn")
    out = str(tmp_path / "ops")
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(tmp_path / "store"), out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=150)
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    layout = topology.Layout.for_world(world, tp=2, pp=2)
    measured = [json.loads(open(f"{out}.{r}").read()) for r in range(world)]
    assert [m["groups"] for m in measured] == [group_store_ops(layout, r, expert_parallel=True, default_group=False)
                                               for r in range(world)]
    assert [m["check"] for m in measured] == [invocation_check_ops(world, r) for r in range(world)]


def test_per_rank_operations_grow_linearly_with_the_world():
    # TP 8 x PP 2 replicas, 1 to 32 of them: per rank the cost is bounded by a constant times
    # the world (the two world-wide groups: 4 operations per member), never its square.
    for world in (16, 64, 512):
        ops = startup_store_ops(topology.Layout.for_world(world, tp=8, pp=2))
        assert 4 * world < ops["max_per_rank"] <= 5 * world + 64, ops  # rank 0 also reads every hash
