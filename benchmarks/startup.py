"""Figures startup and load: launch to first token under torchrun, its phases per rank (from
scripts/bench_rank.py) and how group creation grows with the world; each rank's peak memory and
throughput while loading a checkpoint. These run whole launches, so they compare against
launches too: torchrun starting Pythons that do nothing, and a plain read of the file."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, SCRIPTS, emit, loadavg, random_llama


def torchrun(nproc: int, argv: list[str], env: dict | None = None, timeout: float = 600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *argv]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "BENCH_LAUNCH_T": repr(time.time())}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def rank_phases(nproc: int, tp: int, pp: int, dp: int, model: str | None = None, dtype: str | None = None):
    argv = [str(SCRIPTS / "bench_rank.py"), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]
    if model:
        argv += ["--model", model]
    if dtype:
        argv += ["--dtype", dtype]
    wall, out = torchrun(nproc, argv)
    line = next(l for l in out.splitlines() if l.startswith("BENCH_RANK "))
    return wall, json.loads(line.removeprefix("BENCH_RANK "))


def emit_startup_store_ops() -> None:
    """Issue 17: launcher-store operations per rank from the layout alone (no processes; the
    model is checked against counted operations in tests/integration/distributed/test_startup_cost.py)."""
    from spmd_engine import topology
    from spmd_engine.distributed.startup_cost import startup_store_ops
    for world, tp, pp in ((8, 2, 2), (64, 8, 2), (512, 8, 2)):
        ops = startup_store_ops(topology.Layout.for_world(world, tp=tp, pp=pp))
        emit(f"startup_store_ops_world{world}", ops["max_per_rank"], world, ops["max_per_rank"] / world, "operations",
             ratio_is="max per rank / world size: constant as the world grows means O(world) per rank",
             layout=f"tp{tp} pp{pp} external dp{world // (tp * pp)}", total_all_ranks=ops["total"])


def fig_startup(args) -> None:
    emit_startup_store_ops()
    reps = 1 if args.quick else max(1, args.reps // 2)
    with tempfile.TemporaryDirectory() as tmp:
        walls = []
        for r in range(reps):
            out = os.path.join(tmp, f"out{r}.jsonl")
            wall, _ = torchrun(8, ["-m", "spmd_engine.run", "-tp", "2", "-pp", "2", "-dp", "2", "--max-tokens", "1",
                                   "--prompt", "Hello", "--output", out, "--quiet"])
            walls.append(wall)
    # Baseline: the launcher starting 8 Pythons that import torch and exit.
    base = []
    for _ in range(reps):
        base.append(torchrun(8, [str(SCRIPTS / "bench_rank.py"), "--help"])[0])
    v, b = statistics.median(walls), statistics.median(base)
    emit("startup_world8_launch_to_first_token", v, b, v / b, "s",
         ratio_is="value/baseline: whole run vs torchrun starting 8 Pythons that import argparse only",
         command="python -m torch.distributed.run --nproc-per-node 8 -m spmd_engine.run -tp 2 -pp 2 -dp 2 "
                 "--max-tokens 1", reps=reps, loadavg_1m=loadavg())
    # Phases (same layout, bench_rank.py), then group creation against the number of groups.
    by_world = {}
    for world, (tp, pp, dp) in ((2, (2, 1, 1)), (4, (2, 2, 1)), (8, (2, 2, 2))):
        runs = [rank_phases(world, tp, pp, dp)[1] for _ in range(reps)]
        def med(f):
            return statistics.median(statistics.median(f(r, rec) for rec in r["ranks"]) for r in runs)
        phases = {
            "process_start_s": med(lambda r, rec: rec["entry"] - r["launch_t"]),
            "import_s": med(lambda r, rec: rec["imported"] - rec["entry"]),
            "default_group_s": med(lambda r, rec: rec["world_joined"] - rec["imported"]),
            "group_creation_s": med(lambda r, rec: rec["groups_created"] - rec["world_joined"]),
            "weight_load_s": med(lambda r, rec: rec["loaded"] - rec["groups_created"]),
        }
        calls = runs[0]["ranks"][0]["new_group_calls"]
        by_world[world] = (calls, phases)
        emit(f"startup_world{world}_phases", phases["group_creation_s"], sum(phases.values()),
             phases["group_creation_s"] / sum(phases.values()), "s",
             ratio_is="group creation / (process start .. weights loaded), median rank", layout=f"tp{tp} pp{pp} dp{dp}",
             new_group_calls=calls, **{k: round(x, 3) for k, x in phases.items()})
    c2, p2 = by_world[2]
    c8, p8 = by_world[8]
    emit("startup_group_creation_growth_world8_vs_world2", p8["group_creation_s"], p2["group_creation_s"],
         p8["group_creation_s"] / p2["group_creation_s"], "s",
         ratio_is="value/baseline: time growth; compare new_group_calls growth",
         new_group_calls={w: c for w, (c, _) in by_world.items()},
         ms_per_new_group={w: round(1e3 * p["group_creation_s"] / max(1, c), 2) for w, (c, p) in by_world.items()})


def fig_load(args) -> None:
    model_dir = random_llama(args)
    ckpt = Path(model_dir) / "model.safetensors"
    size = ckpt.stat().st_size
    for tp in (1, 2, 4):
        runs, reads = [], []
        for _ in range(1 if args.quick else max(1, args.reps // 2)):
            runs.append(rank_phases(tp, tp, 1, 1, model_dir, "float32")[1])
            t = time.perf_counter()
            with open(ckpt, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass
            reads.append(size / (time.perf_counter() - t))
        rss = statistics.median(max(rec["peak_rss_after_load"] - rec["peak_rss_before_load"] for rec in r["ranks"])
                                for r in runs)
        shard = runs[0]["ranks"][0]["shard_param_bytes"]
        emit(f"load_tp{tp}_peak_rss_growth_per_rank", rss / 2 ** 20, size / 2 ** 20, rss / size, "MiB",
             ratio_is="value/baseline: peak RSS growth during load (worst rank) / checkpoint size",
             shard_param_mib=round(shard / 2 ** 20, 1), ideal_ratio=round(shard / size, 3))
        # Throughput: bytes this rank's shard holds / load time, vs reading the whole file.
        load_s = statistics.median(max(rec["loaded"] - rec["groups_created"] for rec in r["ranks"]) for r in runs)
        thr = size / load_s
        emit(f"load_tp{tp}_throughput", thr / 1e9, statistics.median(reads) / 1e9, thr / statistics.median(reads),
             "GB/s", ratio_is="value/baseline: checkpoint bytes / slowest rank's load time vs plain read() of the "
             "file (page cache warm)", load_s=round(load_s, 3), checkpoint_mib=round(size / 2 ** 20, 1))
