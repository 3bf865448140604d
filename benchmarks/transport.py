"""Figures rpc and allreduce: the control plane's round trip and the TP all-reduce, each
against the plain transport a hand-written runtime would use (a Pipe echo, gloo), so the engine's
own machinery is what the ratio prices. The measurement loops live in scripts/bench_rpc_transport.py
and scripts/bench_allreduce.py (reused, not copied: those scripts also run on their own)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics

import bench_allreduce
import bench_rpc_transport

from benchmarks.harness import cpu_model, emit, loadavg


def fig_rpc(args) -> None:
    from spmd_engine import LLM
    iters = 300 if args.quick else 2000
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    echo = ctx.Process(target=bench_rpc_transport.pipe_worker_main, args=(child, 0), daemon=True)
    echo.start()
    msg = ("check_health", (), None, None)
    load0 = loadavg()
    llm = LLM(tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        def rpc_call():
            llm.collective_rpc("check_health")

        def pipe_call():
            conn.send(msg)
            conn.recv()
        bench_rpc_transport.timed(rpc_call, 100), bench_rpc_transport.timed(pipe_call, 100)
        rpc_med, pipe_med = [], []
        for _ in range(args.reps):
            rpc_med.append(statistics.median(bench_rpc_transport.timed(rpc_call, iters)))
            pipe_med.append(statistics.median(bench_rpc_transport.timed(pipe_call, iters)))
    finally:
        llm.shutdown()
        conn.send(None)
        echo.join(5)
    v, b = statistics.median(rpc_med), statistics.median(pipe_med)
    emit("rpc_collective_rpc_round_trip", v, b, v / b, "us", ratio_is="value/baseline, lower is better; target <= 1.0",
         value_is="LLM(tp=2, mp).collective_rpc('check_health'): broadcast to 2 workers, 2 replies",
         baseline_is="multiprocessing.Pipe echo with one child process", iters=iters, reps=args.reps,
         rep_medians_us={"rpc": [round(x, 1) for x in rpc_med], "pipe": [round(x, 1) for x in pipe_med]},
         loadavg_1m=[load0, loadavg()])


def fig_allreduce(args) -> None:
    ns = argparse.Namespace(iters=50 if args.quick else 200, reps=args.reps, kib=32, timeout=300, no_pin=False)
    for line in bench_allreduce.run_two_ranks(ns):
        params = dict(line["params"])
        unit = params.pop("unit")
        if line["name"].endswith("_us"):
            params["ratio_is"] = ("baseline/value (gloo time / shm time), target >= 20"
                                  + ("; >= 35 in fp32 (issue 23)" if "float32" in line["name"] else ""))
        print(json.dumps({**line, "unit": unit, "params": {**params, "cpu": cpu_model()}}), flush=True)
