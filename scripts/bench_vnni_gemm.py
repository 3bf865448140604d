"""The engine's AVX512-BF16 decode GEMM (spmd_engine/kernels/vnni_gemm.py) against oneDNN's
packed bf16 call (what the engine used before, and uses where the kernel is unavailable), on the
bench Llama's matrices: which is faster at each row count, and do they agree in bits?

    python scripts/bench_vnni_gemm.py [--threads 1,2] [--rows 1,8,32] [--reps 7]

The kernel is built (or found) as the engine builds it, in the compile cache folder. Prints
one JSON line per (threads, shape, rows): the kernel's microseconds, oneDNN's as baseline, both
calls' GB/s and how many outputs differ in bits (each output is first checked against an fp32
matmul); then per (threads, rows) the sum over one decode step's matrices (8 layers' qkv, o,
gate_up, down and the LM head). Weights come from a pool of copies (--pool-mib, default 64)
as in scripts/bench_linear_kernels.py: a step reads each weight once. Timing is in turns
(kernel, oneDNN, kernel, ...), medians; the machine's speed moves within minutes, so only the
same run's ratio means anything. Needs a CPU with avx512_bf16 and g++.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import emit, loadavg  # noqa: E402  the figures' JSON form, as scripts/bench.py prints it
from spmd_engine.kernels import vnni_gemm  # noqa: E402
from spmd_engine.kernels.packed_weights import linear  # noqa: E402  the engine's own dispatch

SHAPES = [(768, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]  # qkv, o, gate_up, down, LM head
LOWER_IS_BETTER = "value/baseline, lower is better"
PER_STEP = {(768, 512): 8, (512, 512): 8, (3072, 512): 8, (512, 1536): 8, (32000, 512): 1}


def timed_in_turns(calls: dict, reps: int, n: int, before=lambda name: None) -> dict[str, float]:
    """Median over reps of the mean seconds per call of each function, the functions in turns
    (`before(name)` runs ahead of each function's turn, untimed)."""
    for name, fn in calls.items():
        before(name)
        fn(0)
    samples = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            before(name)
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(threads: list[int], rows_list: list[int], reps: int, pool_mib: int, paths: list[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    step = {}  # (threads, rows) -> [kernel seconds, engine seconds]
    for out_features, in_features in SHAPES:
        copies = max(2, (pool_mib << 20) // (out_features * in_features * 2))
        dense = [torch.randn(out_features, in_features, generator=gen).bfloat16() for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in dense]
        vnni = [vnni_gemm.pack(w) for w in dense]
        reference_weight = dense[0].float()  # a wrong kernel must not be timed
        del dense
        calls_per_rep = max(10, 100 // max(1, out_features * in_features // (1 << 20)))
        for t in threads:
            torch.set_num_threads(t)
            for rows in rows_list:
                x = torch.randn(rows, in_features, generator=gen).bfloat16()
                theirs = linear(x, onednn[0])
                calls = {path: (lambda i: linear(x, vnni[i % copies])) for path in paths}
                calls["onednn"] = lambda i: linear(x, onednn[i % copies])
                differ = {}
                for path in paths:
                    vnni_gemm._use_tiles(path == "amx")
                    ours = linear(x, vnni[0])
                    assert torch.allclose(ours.float(), x.float() @ reference_weight.T, rtol=2e-2, atol=2e-2), \
                        (path, out_features, in_features, rows)
                    differ[path] = int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
                got = timed_in_turns(calls, reps, calls_per_rep, before=lambda name: vnni_gemm._use_tiles(name == "amx"))
                weight_bytes = out_features * in_features * 2
                for path in paths:
                    emit(f"vnni_gemm_{path}_{out_features}x{in_features}_m{rows}_t{t}_us",
                         got[path] * 1e6, got["onednn"] * 1e6, got[path] / got["onednn"], "us", rows=rows, threads=t,
                         value_is=f"spmd_engine/kernels/vnni_gemm.cpp, {path} path",
                         baseline_is="packed_weights.linear, oneDNN packed (hint 8)",
                         value_gb_per_s=round(weight_bytes / got[path] / 1e9, 2),
                         baseline_gb_per_s=round(weight_bytes / got["onednn"] / 1e9, 2),
                         outputs_differing_in_bits=differ[path], outputs=rows * out_features, pool_mib=pool_mib,
                         ratio_is=LOWER_IS_BETTER, loadavg_1m=loadavg())
                acc = step.setdefault((t, rows), {})
                for name, seconds in got.items():
                    acc[name] = acc.get(name, 0.0) + PER_STEP[(out_features, in_features)] * seconds
    for (t, rows), acc in sorted(step.items()):
        for path in paths:
            emit(f"vnni_gemm_{path}_decode_step_matmuls_m{rows}_t{t}_ms", acc[path] * 1e3, acc["onednn"] * 1e3,
                 acc[path] / acc["onednn"], "ms", rows=rows, threads=t, ratio_is=LOWER_IS_BETTER, loadavg_1m=loadavg(),
                 value_is=f"one decode step's weight matmuls of the bench Llama (8 layers + LM head), this kernel's {path} path",
                 baseline_is="the same with the engine's oneDNN packed call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool-mib", type=int, default=64, help="weight copies per shape, in MiB")
    args = ap.parse_args()
    reason = vnni_gemm.unavailable()
    if reason is not None:
        sys.exit(f"bench_vnni_gemm: the kernel is unavailable here: {reason}")
    paths = ["avx512", "amx"] if vnni_gemm._tiles_tried() else ["avx512"]  # the AMX path where it exists
    measure(sorted({int(t) for t in args.threads.split(",")}), [int(r) for r in args.rows.split(",")],
            args.reps, args.pool_mib, paths)


if __name__ == "__main__":
    main()
