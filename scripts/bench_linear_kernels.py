"""A decode matmul's cost by kernel: oneDNN with a packed weight (what the engine runs) against
`F.linear` on the dense weight, per weight shape and row count, each weight read once per call as in a step.

    python scripts/bench_linear_kernels.py [--dtype bfloat16,float32] [--threads 1,2] [--reps 7]

Prints one JSON line per (dtype, threads, shape, rows): the packed call's microseconds, the
dense call's as baseline, and the GB/s the packed call streams its weight at. The 64 x 64
shape has almost no weight to read: its time is the call's fixed cost. Each call gets another
copy of the weight, from a pool (--pool-mib, default 64) far beyond the L2 caches, as a decode
step reads every layer's weights once (the bench model's are 81 MB in bf16). Where the last-level
cache is larger than the pool (lscpu said 480 MiB of L3 on one VM), weights, in a step as here,
may come partly from it: compare a larger --pool-mib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmd_engine.kernels.packed_weights import linear  # noqa: E402  the engine's own dispatch

# The bench Llama's (scripts/bench.py LLAMA_SHAPE) matrices, and a tiny one for the fixed cost.
SHAPES = [(64, 64), (768, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]
ROWS = (1, 8, 32)


def time_call(fn, weights, x, calls: int, reps: int) -> float:
    """Median over reps of the mean seconds per call, each call on the next weight copy."""
    for w in weights[:4]:
        fn(x, w)
    per_rep = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(x, weights[i % len(weights)])
        per_rep.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_rep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--pool-mib", type=int, default=64, help="weight copies per shape, in MiB")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for out_features, in_features in SHAPES:
            copies = max(2, (args.pool_mib << 20) // (out_features * in_features * dtype.itemsize))
            dense = [torch.randn(out_features, in_features, generator=gen).to(dtype) for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in dense]
            for threads in sorted({int(t) for t in args.threads.split(",")}):
                torch.set_num_threads(threads)
                for rows in ROWS:
                    x = torch.randn(rows, in_features, generator=gen).to(dtype)
                    assert torch.allclose(linear(x, packed[0]).float(), linear(x, dense[0]).float(),
                                          rtol=2e-2, atol=2e-2)
                    calls = max(10, args.calls // max(1, out_features * in_features // (1 << 20)))
                    v = time_call(linear, packed, x, calls, args.reps)  # packed: oneDNN; dense: F.linear
                    b = time_call(linear, dense, x, calls, args.reps)
                    weight_bytes = out_features * in_features * dtype.itemsize
                    print(json.dumps({
                        "name": f"linear_{dtype_name}_{out_features}x{in_features}_m{rows}_t{threads}_us",
                        "value": round(v * 1e6, 2), "baseline": round(b * 1e6, 2), "ratio": round(v / b, 4),
                        "unit": "us", "params": {"value_is": "packed_weights.linear, packed weight (oneDNN, hint 8)",
                                                 "baseline_is": "packed_weights.linear, dense weight (F.linear)", "rows": rows,
                                                 "threads": threads, "packed_gb_per_s": round(weight_bytes / v / 1e9, 2),
                                                 "ratio_is": "value/baseline, lower is better", "pool_mib": args.pool_mib,
                                                 "loadavg_1m": round(os.getloadavg()[0], 2)}}), flush=True)


if __name__ == "__main__":
    main()
