"""Run under torchrun (or with launcher env vars): bring groups up and check every collective.

Each rank writes OUT/rank{R}.json = {"rank", "errors": [...], ...}; the test
reads them. Expected values are computed independently of the collectives:
rank-dependent inputs whose sums, gathers and slices have closed forms, and
topology's tables for membership.

Modes: layouts (several layouts in one launch, groups rebuilt for each),
slurm, reuse, dead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from spmd_engine import distributed as sd
from spmd_engine import topology
from spmd_engine.config import ConfigError, ParallelConfig
from spmd_engine.distributed import parallel_state as ps
from spmd_engine.distributed.live_check import run_live_check

ERRORS: list[str] = []
CHECKS = [0]


def expect(cond: bool, what: str) -> None:
    CHECKS[0] += 1
    if not cond:
        ERRORS.append(what)


def fixed_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The reference: rank 0 + rank 1 + ..., fp32 accumulation for half types."""
    acc = parts[0].float() if parts[0].dtype in (torch.bfloat16, torch.float16) else parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc.to(parts[0].dtype)


def check_group(axis: str, g: sd.GroupCoordinator, layout: topology.Layout, shm_expected: bool) -> None:
    r = dist.get_rank()
    ranks = topology.group_of(layout, axis, r)
    n = len(ranks)
    tag = f"{axis}{ranks}"
    expect(g.ranks == ranks, f"{tag}: ranks {g.ranks}")
    expect(g.world_size == n and g.rank_in_group == ranks.index(r), f"{tag}: size/rank_in_group")
    expect((g.first_rank, g.last_rank) == (ranks[0], ranks[-1]), f"{tag}: first/last")
    expect(g.is_first_rank == (r == ranks[0]) and g.is_last_rank == (r == ranks[-1]), f"{tag}: is_first/last")
    i = ranks.index(r)
    expect(g.next_rank == ranks[(i + 1) % n] and g.prev_rank == ranks[(i - 1) % n], f"{tag}: next/prev")

    # all_reduce: sum of (m + 1) over members, plus n * arange
    x = torch.full((5,), float(r + 1)) + torch.arange(5.0)
    out = g.all_reduce(x)
    expect(torch.equal(out, sum(m + 1 for m in ranks) + n * torch.arange(5.0)), f"{tag}: all_reduce {out}")
    if n > 1:
        expect(g.uses_shared_memory == shm_expected, f"{tag}: shm used={g.uses_shared_memory}")
    else:
        expect(g.all_reduce(x) is x, f"{tag}: size-1 all_reduce must return its input")

    # all_gather along both dims
    row = torch.tensor([[r, 10 * r]])
    expect(g.all_gather(row, dim=0).tolist() == [[m, 10 * m] for m in ranks], f"{tag}: all_gather dim0")
    expect(g.all_gather(row, dim=-1).tolist() == [[v for m in ranks for v in (m, 10 * m)]], f"{tag}: all_gather dim-1")

    # reduce_scatter: element j of rank m is 100*m + j; keep own third-chunk
    width = 3 * n
    rs_in = torch.stack([torch.arange(width, dtype=torch.float64) + 100 * r] * 2)
    got = g.reduce_scatter(rs_in, dim=-1)
    cols = torch.arange(3 * i, 3 * i + 3, dtype=torch.float64)
    want = torch.stack([n * cols + 100 * sum(ranks)] * 2)
    expect(torch.equal(got, want), f"{tag}: reduce_scatter {got.tolist()} != {want.tolist()}")

    # gather to the last group rank
    gathered = g.gather(torch.tensor([r, r]), dst=n - 1, dim=0)
    if i == n - 1:
        expect(gathered is not None and gathered.tolist() == [v for m in ranks for v in (m, m)], f"{tag}: gather")
    else:
        expect(gathered is None, f"{tag}: gather returned data off dst")

    # broadcast from the last group rank; broadcast_object from the first
    b = g.broadcast(torch.full((3,), float(r)), src=n - 1)
    expect(b.tolist() == [float(ranks[-1])] * 3, f"{tag}: broadcast {b.tolist()}")
    expect(g.broadcast_object({"from": r}, src=0) == {"from": ranks[0]}, f"{tag}: broadcast_object")

    # broadcast_tensor_dict: tensors of several dtypes, an empty one, plain values
    src_rank = ranks[0]
    d = {"a": torch.arange(6).reshape(2, 3) * (r + 1), "h": torch.full((4,), r + 0.5, dtype=torch.bfloat16),
         "empty": torch.empty(0, 7), "name": f"r{r}", "n": 3} if i == 0 else None
    got_d = g.broadcast_tensor_dict(d, src=0)
    expect(got_d["name"] == f"r{src_rank}" and got_d["n"] == 3, f"{tag}: btd values")
    expect(torch.equal(got_d["a"], torch.arange(6).reshape(2, 3) * (src_rank + 1)), f"{tag}: btd a")
    expect(torch.equal(got_d["h"], torch.full((4,), src_rank + 0.5, dtype=torch.bfloat16)), f"{tag}: btd h")
    expect(tuple(got_d["empty"].shape) == (0, 7), f"{tag}: btd empty")

    if n > 1 and shm_expected:
        check_shm_bitwise(g, tag, numel=300_000 if axis == "tp" else 4096)
    g.barrier()


def check_shm_bitwise(g: sd.GroupCoordinator, tag: str, numel: int) -> None:
    """Random inputs: result identical on all ranks and equal to the fixed-order sum."""
    r = dist.get_rank()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(1234 + r)
        x = torch.randn(numel, generator=gen).to(dtype)
        parts = list(g.all_gather(x.unsqueeze(0), dim=0).unbind(0))  # everyone's input (shm)
        by_gloo = [torch.empty_like(x) for _ in parts]
        dist.all_gather(by_gloo, x, group=g.cpu_group)
        expect(all(torch.equal(a, b) for a, b in zip(parts, by_gloo)), f"{tag}: shm all_gather {dtype} != gloo's")
        want = fixed_order_sum(parts)
        got = g.all_reduce(x.clone())
        expect(torch.equal(got.view(torch.int16) if dtype != torch.float32 else got.view(torch.int32),
                           want.view(torch.int16) if dtype != torch.float32 else want.view(torch.int32)),
               f"{tag}: shm {dtype} differs from fixed-order sum")
        everyone = g.all_gather(got.unsqueeze(0), dim=0)
        expect(all(torch.equal(everyone[0], row) for row in everyone), f"{tag}: shm {dtype} not identical")


def check_pp_handoff(g: sd.GroupCoordinator) -> None:
    """Stage k sends to k+1 (defaults: next / previous rank), as the PP forward does."""
    r, i, n = dist.get_rank(), g.rank_in_group, g.world_size
    if n == 1:
        return
    if i > 0:
        got = g.recv_tensor_dict()
        prev = g.prev_rank
        expect(torch.equal(got["hidden"], torch.full((2, 4), float(prev))) and got["stage"] == i - 1
               and got["residual"].dtype == torch.bfloat16, f"pp recv from {prev}: {got}")
    if i < n - 1:
        g.send_tensor_dict({"hidden": torch.full((2, 4), float(r)), "stage": i,
                            "residual": torch.zeros(3, dtype=torch.bfloat16)})


def config_from_spec(spec: str) -> ParallelConfig:
    """'tp=2,pp=2,dp=2,ep=1' -> ParallelConfig."""
    kv = dict(item.split("=") for item in spec.split(","))
    return ParallelConfig(tensor_parallel_size=int(kv.get("tp", 1)), pipeline_parallel_size=int(kv.get("pp", 1)),
                          data_parallel_size=int(kv.get("dp", 1)),
                          prefill_context_parallel_size=int(kv.get("pcp", 1)),
                          decode_context_parallel_size=int(kv.get("dcp", 1)),
                          enable_expert_parallel=kv.get("ep") == "1")


def run_layouts(specs: list[str], shm_expected: bool) -> dict:
    sd.init_distributed_environment()
    world = dist.get_world_size()
    try:  # a world that is not a multiple fails in one line, before any collective
        sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=3))
        ERRORS.append("tp=3 at world 8 did not raise")
    except ConfigError as exc:
        expect("not a multiple" in str(exc), f"bad ConfigError text: {exc}")
    done = []
    for spec in specs:
        pc = config_from_spec(spec)
        sd.initialize_model_parallel(pc)
        layout = sd.model_parallel_layout()
        expect(layout.launched_world_size == world, f"{spec}: layout world")
        for axis, g in ps.model_parallel_groups().items():
            check_group(axis, g, layout, shm_expected)
        check_pp_handoff(sd.get_pp_group())
        sd.destroy_model_parallel()
        sd.destroy_model_parallel()  # twice is fine
        done.append(spec)
    ok, line = run_live_check(config_from_spec(specs[0]))
    expect(ok, f"live check: {line}")
    sd.destroy_distributed_environment()
    sd.destroy_distributed_environment()
    return {"layouts": done, "live": line}


def run_slurm() -> dict:
    sd.init_distributed_environment()
    expect(dist.get_rank() == int(os.environ["SLURM_PROCID"]), "rank != SLURM_PROCID")
    expect(dist.get_world_size() == int(os.environ["SLURM_NTASKS"]), "world != SLURM_NTASKS")
    sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=dist.get_world_size()))
    tp = sd.get_tp_group()
    s = tp.all_reduce(torch.ones(2))
    expect(s.tolist() == [float(tp.world_size)] * 2, f"slurm all_reduce {s}")
    sd.destroy_distributed_environment()
    return {}


def run_reuse() -> dict:
    dist.init_process_group("gloo")  # the "trainer" made the world
    sd.init_distributed_environment()
    expect(ps.reused_default_group(), "pre-initialised world not marked as reused")
    sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=dist.get_world_size()))
    s = sd.get_tp_group().all_reduce(torch.full((3,), float(dist.get_rank())))
    expect(s.tolist() == [float(sum(range(dist.get_world_size())))] * 3, f"reuse all_reduce {s}")
    sd.destroy_distributed_environment()
    expect(dist.is_initialized(), "destroy_distributed_environment destroyed a world it did not create")
    dist.barrier()
    dist.destroy_process_group()
    return {}


def wait_for_all_started(out: str, world: int) -> None:
    """File-based start line: torch imports can be seconds apart on a busy machine,
    more than the short timeout under test allows for the rendezvous."""
    rank = int(os.environ["RANK"])
    open(os.path.join(out, f"started{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(out, f"started{r}")) for r in range(world)):
        time.sleep(0.05)


def run_dead(out: str) -> dict:
    """Ranks 1 (shm group) and 5 (gloo group) die, rank 3 (gloo group) hangs; 0, 2, 4 must fail fast."""
    wait_for_all_started(out, int(os.environ["WORLD_SIZE"]))
    sd.init_distributed_environment()
    sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=2))
    tp, r = sd.get_tp_group(), dist.get_rank()
    tp.all_reduce(torch.ones(4))  # sets up the shared-memory path where enabled
    timeout = float(os.environ["SPMD_ENGINE_TIMEOUT_S"])
    if r in (1, 5):
        os._exit(3)
    if r == 3:
        time.sleep(timeout + 4)
        os._exit(0)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
        ERRORS.append("all_reduce with a dead/stuck peer returned")
        err = None
    except Exception as exc:  # noqa: BLE001 - recording what was raised is the point
        err = {"type": type(exc).__name__, "is_timeout": isinstance(exc, TimeoutError), "msg": str(exc)}
    elapsed, shm = time.monotonic() - start, tp.uses_shared_memory
    sd.destroy_distributed_environment()
    return {"error": err, "elapsed": elapsed, "shm": shm}


def run_hang(out: str) -> dict:
    """Rank 1 never joins the second all-reduce: only the product's collective timeout
    (SPMD_ENGINE_TIMEOUT_S) can end rank 0's wait; rank 0 then fails and torchrun ends rank 1."""
    wait_for_all_started(out, int(os.environ["WORLD_SIZE"]))
    sd.init_distributed_environment()
    sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=dist.get_world_size()))
    tp = sd.get_tp_group()
    tp.all_reduce(torch.ones(4))
    open(os.path.join(out, f"ready{dist.get_rank()}"), "w").close()
    if dist.get_rank() == 1:
        time.sleep(3600)
    start = time.monotonic()
    try:
        tp.all_reduce(torch.ones(4))
    except TimeoutError as exc:
        ERRORS.append(f"TimeoutError: {exc}")
        return {"elapsed": time.monotonic() - start}
    return {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["layouts", "slurm", "reuse", "dead", "hang"])
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="*", default=[])
    p.add_argument("--no-shm", action="store_true")
    args = p.parse_args()
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    log = logging.getLogger("spmd_engine")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    result: dict = {}
    try:
        if args.mode == "layouts":
            result = run_layouts(args.layouts, shm_expected=not args.no_shm)
        elif args.mode == "hang":
            result = run_hang(args.out)
        elif args.mode == "dead":
            result = run_dead(args.out)
        else:
            result = {"slurm": run_slurm, "reuse": run_reuse}[args.mode]()
    except Exception:  # noqa: BLE001
        ERRORS.append(traceback.format_exc())
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    result.update(rank=rank, errors=ERRORS, logs=logs, checks=CHECKS[0])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(1 if ERRORS else 0)


if __name__ == "__main__":
    main()
