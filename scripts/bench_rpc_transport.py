"""Round trip of the mp executor's transport vs a multiprocessing.Pipe echo.

Measured case (what ``MultiprocExecutor.collective_rpc`` does per call): the
engine enqueues one message on a broadcast ``MessageQueue`` read by 2 worker
processes; worker 0 (the output rank) answers on its response queue and the
engine dequeues that reply.

Baseline: a ``multiprocessing.Pipe`` echo with one child process, same
message.  For context ``params`` also carries the same 2-worker broadcast
done with one Pipe per worker (what an executor built on pipes would pay).

All cases run in the same invocation, in alternating repetitions, because
this machine is shared and noisy.  Each repetition's figure is the median of
its ``--iters`` timed round trips (robust to a preemption by an unrelated
process); the reported value is the median over ``--reps`` repetitions.
The 1-minute load average before and after goes in ``params``: with more
runnable processes than cores every transport pays scheduler wake-ups and
the shared-memory advantage shrinks.

Prints one JSON line per message size:
``{"name", "value", "baseline", "ratio", "params"}`` (value and baseline in
microseconds; ratio = value / baseline, lower is better).

    python scripts/bench_rpc_transport.py [--iters 2000] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmd_engine.distributed.shm.message_queue import MessageQueue, WaitPolicy  # noqa: E402

N_WORKERS = 2


def make_messages() -> dict:
    """A bare RPC (method name, no args) and a decode-step-sized one."""
    small = ("execute_model", (), {}, 0)
    step = ("execute_model",
            ({"req_ids": [f"req-{i}" for i in range(64)],
              "token_ids": [[i, i + 1] for i in range(64)],
              "num_scheduled_tokens": {f"req-{i}": 1 for i in range(64)}},),
            {}, 0)
    return {"small": small, "step64": step}


# ------------------------------------------------------------ child processes
def mq_worker_main(bcast_handle, resp_handle, rank: int, ppid: int,
                   wait: WaitPolicy) -> None:
    rpc = MessageQueue.attach(bcast_handle, rank, wait=wait)
    resp = MessageQueue.attach_writer(resp_handle, wait=wait)
    alive = lambda: os.getppid() == ppid  # noqa: E731  (engine still there)
    while (msg := rpc.dequeue(alive=alive)) is not None:
        if msg[3] is None or msg[3] == rank:
            resp.enqueue(("ok", msg[0]), alive=alive)
    rpc.close()
    resp.close()


def pipe_worker_main(conn, rank: int) -> None:
    while (msg := conn.recv()) is not None:
        if msg[3] is None or msg[3] == rank:
            conn.send(("ok", msg[0]))
    conn.close()


# ------------------------------------------------------------------- timing
def timed(call, iters: int) -> list:
    """Round-trip times in microseconds, one per call."""
    clock, out = time.perf_counter_ns, []
    for _ in range(iters):
        t0 = clock()
        call()
        out.append((clock() - t0) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--busy-us", type=float, default=WaitPolicy.busy_s * 1e6,
                    help="WaitPolicy.busy_s in microseconds")
    ap.add_argument("--yield-us", type=float, default=WaitPolicy.yield_s * 1e6,
                    help="WaitPolicy.yield_s in microseconds")
    args = ap.parse_args()
    wait = WaitPolicy(busy_s=args.busy_us * 1e-6, yield_s=args.yield_us * 1e-6)
    load_before = os.getloadavg()[0]

    ctx = mp.get_context("spawn")
    bcast = MessageQueue.create(N_WORKERS, label="bench_rpc", wait=wait)
    resps = [MessageQueue.create(1, reader_index=0, label=f"bench_resp{r}",
                                 wait=wait) for r in range(N_WORKERS)]
    procs = [ctx.Process(target=mq_worker_main, daemon=True,
                         args=(bcast.handle(), resps[r].handle(), r,
                               os.getpid(), wait)) for r in range(N_WORKERS)]
    echo_conn, child = ctx.Pipe()  # baseline: one echo child
    procs.append(ctx.Process(target=pipe_worker_main, args=(child, 0), daemon=True))
    bc_conns = []  # context: broadcast over one pipe per worker
    for r in range(N_WORKERS):
        conn, child = ctx.Pipe()
        bc_conns.append(conn)
        procs.append(ctx.Process(target=pipe_worker_main, args=(child, r),
                                 daemon=True))
    try:
        for p in procs:
            p.start()
        for q in [bcast] + resps:
            q.wait_attached(timeout=60)
        for name, msg in make_messages().items():
            def mq_call():
                bcast.enqueue(msg, timeout=30)
                resps[0].dequeue(timeout=30)

            def pipe_call():
                echo_conn.send(msg)
                echo_conn.recv()

            def pipe_bcast_call():
                for c in bc_conns:
                    c.send(msg)
                bc_conns[0].recv()

            cases = {"mq": mq_call, "pipe": pipe_call, "pipe_bcast": pipe_bcast_call}
            for call in cases.values():
                timed(call, 200)  # warm-up
            medians = {k: [] for k in cases}
            means = {k: [] for k in cases}
            for _ in range(args.reps):
                for k, call in cases.items():
                    rtt = timed(call, args.iters)
                    medians[k].append(statistics.median(rtt))
                    means[k].append(statistics.fmean(rtt))
            value = statistics.median(medians["mq"])
            baseline = statistics.median(medians["pipe"])
            print(json.dumps({
                "name": f"rpc_round_trip_us[{name}]",
                "value": round(value, 2),
                "baseline": round(baseline, 2),
                "ratio": round(value / baseline, 3),
                "params": {
                    "workers": N_WORKERS, "iters": args.iters, "reps": args.reps,
                    "cpus": os.cpu_count(), "busy_us": args.busy_us,
                    "yield_us": args.yield_us,
                    "value": "MessageQueue broadcast to 2 workers + 1 reply",
                    "baseline": "multiprocessing.Pipe echo, 1 child",
                    "pipe_bcast_us": round(statistics.median(medians["pipe_bcast"]), 2),
                    "rep_medians_us": {k: [round(x, 1) for x in v]
                                       for k, v in medians.items()},
                    "mean_us": {k: round(statistics.median(v), 1)
                                for k, v in means.items()},
                    "loadavg_1m": [round(load_before, 2),
                                   round(os.getloadavg()[0], 2)],
                },
            }), flush=True)
        bcast.enqueue(None)
        for c in [echo_conn] + bc_conns:
            c.send(None)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for q in [bcast] + resps:
            q.close()


if __name__ == "__main__":
    main()
