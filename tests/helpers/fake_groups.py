"""Test-only groups: a one-rank group, and torch.distributed (gloo) behind the
GroupCoordinator attributes the model code uses, run in real processes.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, joins
them in a gloo group through a TCPStore the parent hosts on a port the OS picks, calls
`fn(rank, world_size, *args)` in each, and returns the results by rank. Every
run is bounded by a timeout and its processes are killed (by pid) if they
outlive it. Model tests use these plain gloo groups so a layer's arithmetic is
checked apart from the runtime; engine tests run the real GroupCoordinator.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from spmd_engine.model.solo import SoloGroup

__all__ = ["SoloGroup", "DistGroup", "ShardOnlyGroup", "make_grid_groups", "run_distributed"]


class DistGroup:
    """A torch.distributed process group with the GroupCoordinator attributes."""

    def __init__(self, ranks: Sequence[int], pg):
        self.ranks = list(ranks)
        self.pg = pg
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())
        self.is_first_rank = self.rank_in_group == 0
        self.is_last_rank = self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)


class ShardOnlyGroup:
    """Rank `rank` of a group of `world_size`, for code that only needs the
    coordinates (building and loading a shard); any collective is an error."""

    def __init__(self, world_size: int, rank: int):
        self.world_size = world_size
        self.rank_in_group = rank
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == world_size - 1

    def all_reduce(self, tensor):
        raise AssertionError("ShardOnlyGroup has no collectives")

    all_gather = all_reduce


def make_grid_groups(tp: int, pp: int) -> tuple[DistGroup, DistGroup] | None:
    """TP and PP groups of a tp x pp layout on world ranks 0..tp*pp-1 (rank = pp_rank * tp + tp_rank).

    Every process of the world must call this (new_group is collective); ranks
    outside the layout get None.
    """
    rank = dist.get_rank()
    mine = None, None
    for p in range(pp):
        ranks = list(range(p * tp, (p + 1) * tp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = DistGroup(ranks, pg), mine[1]
    for t in range(tp):
        ranks = list(range(t, tp * pp, tp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = mine[0], DistGroup(ranks, pg)
    return mine if rank < tp * pp else None


def _entry(fn, rank, world_size, port, results, args):
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0) -> list[Any]:
    """fn(rank, world_size, *args) in world_size gloo processes; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent hosts the rendezvous store on a port the OS picks (no bind-close-reuse race).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"timed out after {timeout}s waiting for {world_size - len(out) - len(errors)} rank(s)")
                break
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join()
    del store
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
