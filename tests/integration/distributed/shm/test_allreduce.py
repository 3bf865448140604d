"""The shared-memory all-reduce never pairs different operations silently.

Two real processes (gloo on a FileStore, no port) share one ShmAllReduce. Each
scenario makes the ranks disagree about an operation, as after one rank aborted
a step, and checks that every rank raises CollectiveError instead of returning
a sum of unrelated bytes, and that nobody drops to gloo while a peer stays on
shared memory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from spmd_engine.distributed.shm.allreduce import shm_allreduce_enabled
from spmd_engine.distributed.shm.segment import SHM_DIR

pytestmark = pytest.mark.skipif(not shm_allreduce_enabled(), reason="shared-memory all-reduce needs x86 + /dev/shm")


def _rank_main(rank: int, scenario: str, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from spmd_engine.distributed.errors import CollectiveError
    from spmd_engine.distributed.group_coordinator import GroupCoordinator  # noqa: F401 (import check)
    from spmd_engine.distributed.shm.allreduce import ShmAllReduce
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    shm = ShmAllReduce.create(dist.group.WORLD, [0, 1], "tp [0, 1]", timeout_s=1.0)
    result: dict = {"name": shm.name}
    events = []

    def attempt(what, fn):
        try:
            value = fn()
            events.append([what, "ok", value])
        except CollectiveError as exc:
            events.append([what, "error", str(exc)])

    ones = torch.ones(8)
    # A first operation that agrees: the path works.
    attempt("warm-up", lambda: shm.all_reduce(ones.clone()).tolist())
    if scenario == "size":
        # Rank 1 all-reduces 4 elements where rank 0 all-reduces 8 (before: rank 0 read 4 stale floats).
        n = 8 if rank == 0 else 4
        attempt("mismatch", lambda: shm.all_reduce(torch.full((n,), 2.0)).tolist())
    elif scenario == "op":
        # Same bytes, different operation.
        if rank == 0:
            attempt("mismatch", lambda: shm.all_reduce(torch.full((8,), 2.0)).tolist())
        else:
            attempt("mismatch", lambda: shm.all_gather(torch.full((8,), 2.0)).tolist())
    elif scenario == "dtype":
        # Same bytes (32), different dtype: summing them would mix float32 and bfloat16 bits.
        dtype, n = (torch.float32, 8) if rank == 0 else (torch.bfloat16, 16)
        attempt("mismatch", lambda: shm.all_reduce(torch.full((n,), 2.0, dtype=dtype)).tolist())
    elif scenario == "abort":
        # Rank 0 gives up on an operation rank 1 reaches late (a timeout); before, rank 1 still
        # completed it, and rank 0's next operation went to gloo while rank 1 stayed on shm.
        if rank == 1:
            time.sleep(2.0)
        attempt("late", lambda: shm.all_reduce(torch.full((8,), 3.0)).tolist())
    attempt("after", lambda: shm.all_reduce(torch.full((8,), 5.0)).tolist())
    result["events"] = events
    Path(out).write_text(json.dumps(result))
    shm.destroy()
    dist.destroy_process_group()


def run_pair(tmp_path: Path, scenario: str) -> list[dict]:
    from launch import run_spawned_pair
    results, _ = run_spawned_pair(_rank_main, tmp_path, scenario)
    assert not (Path(SHM_DIR) / results[0]["name"]).exists()
    return results


def events(result: dict) -> dict:
    return {what: (status, value) for what, status, value in result["events"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["size", "op", "dtype"])
def test_a_mismatched_operation_raises_on_every_rank(tmp_path, scenario):
    for result in run_pair(tmp_path, scenario):
        ev = events(result)
        assert ev["warm-up"] == ("ok", [2.0] * 8)
        status, message = ev["mismatch"]
        assert status == "error", f"garbage instead of an error: {message}"
        assert "operation mismatch" in message or "declared it broken" in message, message
        # The group stays broken: no later operation pairs on it, nor falls back to gloo.
        assert ev["after"][0] == "error" and "unusable" in ev["after"][1]


@pytest.mark.timeout(120)
def test_a_rank_that_timed_out_takes_its_peer_off_shared_memory(tmp_path):
    rank0, rank1 = (events(r) for r in run_pair(tmp_path, "abort"))
    assert rank0["late"][0] == "error" and "timed out" in rank0["late"][1]
    assert rank1["late"][0] == "error" and "declared it broken" in rank1["late"][1]
    for ev in (rank0, rank1):
        assert ev["after"][0] == "error" and "unusable" in ev["after"][1]


def _setup_rank_main(rank: int, store: str, marker: str) -> None:
    """Rank 1 takes 60 s to attach: rank 0 sits in set-up with the segment made, then is SIGKILLed."""
    import torch.distributed as dist

    from spmd_engine.distributed.shm.allreduce import ShmAllReduce
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1:
        real = ShmAllReduce._attach

        def slow_attach(*args):
            time.sleep(60)
            return real(*args)
        ShmAllReduce._attach = staticmethod(slow_attach)
    Path(marker + str(rank)).write_text("in set-up")
    ShmAllReduce.create(dist.group.WORLD, [0, 1], "tp [0, 1]", timeout_s=1.0)


@pytest.mark.timeout(120)
def test_a_creator_killed_mid_setup_leaves_no_name_in_dev_shm(tmp_path):
    # CI once found spmd_ar_<pid>_<token> left by a torchrun rank SIGKILLed while its TP group
    # was still setting up (the first all-reduce, just after "engine ready"): the name lived
    # until every peer had attached. Now it is unlinked at creation; peers attach by descriptor.
    from launch import mapped_segments, stale_segments
    ctx = mp.get_context("spawn")
    marker = str(tmp_path / "ready")
    procs = [ctx.Process(target=_setup_rank_main, args=(r, str(tmp_path / "store"), marker)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 60
        made: set[str] = set()
        while not made and time.monotonic() < deadline:  # rank 0 has made and mapped its segment
            made = {s for s in mapped_segments(procs[0].pid) if s.startswith("spmd_ar_")}
            time.sleep(0.05)
        assert made, "rank 0 never made its segment"
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"spmd_ar_{procs[0].pid}_")]
        procs[0].kill()
        procs[0].join()
        assert not stale_segments({procs[0].pid})
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
