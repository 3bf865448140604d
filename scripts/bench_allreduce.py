"""Shared-memory CPU all-reduce vs gloo, two ranks on this host, in one run.

    .venv/bin/python scripts/bench_allreduce.py [--iters 200 --reps 7 --kib 32]
    torchrun --nproc-per-node 2 scripts/bench_allreduce.py   (same, under torchrun)

During the shared-memory reps each rank is pinned to a core of its own (as TP
ranks own cores in a deployment; on a busy 2-core box the scheduler otherwise
stacks both spinning ranks on one core part of the time); gloo runs unpinned,
its best case. --no-pin leaves both to the scheduler.

Both paths run in the same processes, interleaved rep by rep, so machine noise
hits both; the figure is the median over reps of the mean time per call.
Prints one JSON line per figure: {"name", "value", "baseline", "ratio", "params"}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmd_engine import distributed as sd  # noqa: E402
from spmd_engine.config import ParallelConfig  # noqa: E402
from spmd_engine.distributed.launch_env import read_launch_env  # noqa: E402


def time_per_call(fn, x: torch.Tensor, src: torch.Tensor, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        x.copy_(src)  # fresh input each call, same cost on both paths
        fn(x)
    return (time.perf_counter() - start) / iters


def bench(args, rank: int | None = None, world: int | None = None, port: int | None = None) -> list[dict]:
    """Run both paths in this rank; returns the figures on rank 0 (empty list elsewhere)."""
    if port is not None:
        sd.init_distributed_environment(world, rank, distributed_init_method=f"tcp://127.0.0.1:{port}")
    else:
        sd.init_distributed_environment()
    sd.initialize_model_parallel(ParallelConfig(tensor_parallel_size=dist.get_world_size(),
                                                distributed_executor_backend="mp"))
    tp, me = sd.get_tp_group(), dist.get_rank()
    all_cores = os.sched_getaffinity(0)
    pinned = not args.no_pin and len(all_cores) >= tp.world_size
    own_core = {sorted(all_cores)[me % len(all_cores)]}

    def placement(for_shm: bool) -> None:
        """shm: one core per rank, as TP ranks own cores in a deployment. gloo: unpinned,
        its best case (its transport thread needs a core; pinning doubles its latency)."""
        if pinned:
            os.sched_setaffinity(0, own_core if for_shm else all_cores)
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        numel = args.kib * 1024 // torch.tensor([], dtype=dtype).element_size()
        src = torch.randn(numel, generator=torch.Generator().manual_seed(me)).to(dtype)
        x = src.clone()

        def gloo(t):
            dist.all_reduce(t, group=tp.device_group)

        shm_times, gloo_times = [], []
        time_per_call(tp.all_reduce, x, src, 20), time_per_call(gloo, x, src, 20)  # warm-up
        assert tp.uses_shared_memory, "shared-memory path not in use"
        for _ in range(args.reps):
            placement(for_shm=True)
            tp.barrier()
            shm_times.append(time_per_call(tp.all_reduce, x, src, args.iters))
            placement(for_shm=False)
            tp.barrier()
            gloo_times.append(time_per_call(gloo, x, src, args.iters))
        out = tp.all_reduce(src.clone())
        everyone = tp.all_gather(out.unsqueeze(0), dim=0)
        parts = tp.all_gather(src.unsqueeze(0), dim=0)
        ref = parts[0].float() + parts[1].float() if dtype == torch.bfloat16 else parts[0] + parts[1]
        identical = all(torch.equal(everyone[0], row) for row in everyone)
        exact = torch.equal(out, ref.to(dtype))
        shm_us, gloo_us = statistics.median(shm_times) * 1e6, statistics.median(gloo_times) * 1e6
        name = str(dtype).replace("torch.", "")
        params = {"ranks": tp.world_size, "kib": args.kib, "dtype": name, "iters": args.iters,
                  "reps": args.reps, "shm_pinned_one_core_per_rank": pinned, "gloo_pinned": False, "unit": "us/call"}
        lines.append({"name": f"shm_allreduce_{args.kib}KiB_{name}_us", "value": round(shm_us, 2),
                      "baseline": round(gloo_us, 2), "ratio": round(gloo_us / shm_us, 1), "params": params})
        lines.append({"name": f"shm_allreduce_{args.kib}KiB_{name}_bitwise_identical",
                      "value": identical and exact, "baseline": True, "ratio": 1.0 if identical and exact else 0.0,
                      "params": {**params, "unit": "bool (same bits on all ranks, equal to rank-order sum)"}})
    sd.destroy_distributed_environment()
    return lines if me == 0 else []


def _spawned(rank: int, port: int, args, results=None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    lines = bench(args, rank, 2, port)
    if results is not None and rank == 0:
        results.put(lines)
    elif rank == 0:
        for line in lines:
            print(json.dumps(line), flush=True)


def run_two_ranks(args) -> list[dict]:
    """Spawn two ranks on this host, run `bench`, return rank 0's figures (for scripts/bench.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, port, args, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        lines = results.get(timeout=args.timeout)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--kib", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--no-pin", action="store_true", help="leave CPU placement to the scheduler")
    args = p.parse_args()
    if read_launch_env(os.environ) is not None:
        torch.set_num_threads(1)
        for line in bench(args):
            print(json.dumps(line), flush=True)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(r, port, args)) for r in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        sys.exit(f"error: benchmark ranks exited with {[proc.exitcode for proc in procs]}")


if __name__ == "__main__":
    main()
