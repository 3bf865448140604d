"""A hand-written AVX512-BF16 decode GEMM (scripts/kernels/vnni_gemm.cpp) against the engine's
bf16 matmul (oneDNN, packed weight), on the bench Llama's matrices: is there a faster kernel
for decode on this CPU, and does it keep the engine's bits?

    python scripts/bench_vnni_gemm.py [--prefetch 0,256] [--threads 1,2] [--rows 1,8,32] [--reps 7]

Builds the kernel with g++ (-march=native) into a temporary folder, once per --prefetch value
(bf16 elements the loop prefetches ahead; 0: none), and loads it with torch.ops.load_library:
nothing is kept. Needs a CPU with avx512_bf16 and g++. Prints one JSON line per (prefetch,
threads, shape, rows): the kernel's microseconds, the engine's call as baseline, both calls'
GB/s and how many outputs differ in bits (each output is first checked against an fp32
matmul); then per (prefetch, threads, rows) the sum over one
decode step's matrices (8 layers' qkv, o, gate_up, down and the LM head). Weights come from a
pool of copies (--pool-mib, default 64) as in scripts/bench_linear_kernels.py: a step reads
each weight once. Timing is in turns (kernel, engine, kernel, ...), medians; the machine's
speed moves within minutes, so only the same run's ratio means anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import emit, loadavg  # noqa: E402  the figures' JSON form, as bench.py prints it

from spmd_engine.model.layers.packed_weights import linear  # noqa: E402  the engine's own dispatch
from spmd_engine.model.loader import cpu_flags  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "kernels" / "vnni_gemm.cpp"
SHAPES = [(768, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]  # qkv, o, gate_up, down, LM head
LOWER_IS_BETTER = "value/baseline, lower is better"
PER_STEP = {(768, 512): 8, (512, 512): 8, (3072, 512): 8, (512, 1536): 8, (32000, 512): 1}


def build(prefetch: int, folder: Path) -> None:
    """Compile the kernel into `folder` and register its ops (torch.ops.vnni_gemm)."""
    lib = folder / f"vnni_gemm_pf{prefetch}.so"
    torch_lib = Path(torch.__file__).parent / "lib"
    cmd = ["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", f"-DPF_ELEMS={prefetch}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-o", str(lib), f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{torch_lib}", "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI))]
    subprocess.run(cmd, check=True)
    torch.ops.load_library(str(lib))


def timed_in_turns(calls: dict, reps: int, n: int) -> dict[str, float]:
    """Median over reps of the mean seconds per call of each function, the functions in turns."""
    for fn in calls.values():
        fn(0)
    samples = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(prefetch: int, threads: list[int], rows_list: list[int], reps: int, pool_mib: int) -> None:
    gen = torch.Generator().manual_seed(0)
    step = {}  # (threads, rows) -> [kernel seconds, engine seconds]
    for out_features, in_features in SHAPES:
        copies = max(2, (pool_mib << 20) // (out_features * in_features * 2))
        dense = [torch.randn(out_features, in_features, generator=gen).bfloat16() for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in dense]
        vnni = [torch.ops.vnni_gemm.pack(w) for w in dense]
        reference_weight = dense[0].float()  # a wrong kernel must not be timed
        del dense
        calls_per_rep = max(10, 100 // max(1, out_features * in_features // (1 << 20)))
        for t in threads:
            torch.set_num_threads(t)
            for rows in rows_list:
                x = torch.randn(rows, in_features, generator=gen).bfloat16()
                ours, theirs = torch.ops.vnni_gemm.linear(x, vnni[0]), linear(x, onednn[0])
                assert torch.allclose(ours.float(), x.float() @ reference_weight.T, rtol=2e-2, atol=2e-2), \
                    (out_features, in_features, rows)
                differ = int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
                got = timed_in_turns({"vnni": lambda i: torch.ops.vnni_gemm.linear(x, vnni[i % copies]),
                                      "onednn": lambda i: linear(x, onednn[i % copies])}, reps, calls_per_rep)
                weight_bytes = out_features * in_features * 2
                emit(f"vnni_gemm_{out_features}x{in_features}_m{rows}_t{t}_pf{prefetch}_us",
                     got["vnni"] * 1e6, got["onednn"] * 1e6, got["vnni"] / got["onednn"], "us", rows=rows, threads=t, prefetch_elems=prefetch,
                     value_is="scripts/kernels/vnni_gemm.cpp", baseline_is="packed_weights.linear, oneDNN packed (hint 8)",
                     value_gb_per_s=round(weight_bytes / got["vnni"] / 1e9, 2),
                     baseline_gb_per_s=round(weight_bytes / got["onednn"] / 1e9, 2),
                     outputs_differing_in_bits=differ, outputs=rows * out_features, pool_mib=pool_mib,
                     ratio_is=LOWER_IS_BETTER, loadavg_1m=loadavg())
                acc = step.setdefault((t, rows), [0.0, 0.0])
                acc[0] += PER_STEP[(out_features, in_features)] * got["vnni"]
                acc[1] += PER_STEP[(out_features, in_features)] * got["onednn"]
    for (t, rows), (ours, theirs) in sorted(step.items()):
        emit(f"vnni_gemm_decode_step_matmuls_m{rows}_t{t}_pf{prefetch}_ms", ours * 1e3, theirs * 1e3, ours / theirs,
             "ms", rows=rows, threads=t, prefetch_elems=prefetch, ratio_is=LOWER_IS_BETTER, loadavg_1m=loadavg(),
             value_is="one decode step's weight matmuls of the bench Llama (8 layers + LM head), this kernel",
             baseline_is="the same with the engine's oneDNN packed call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefetch", default="0", help="bf16 elements to prefetch ahead, comma-separated (0: none)")
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pool-mib", type=int, default=64, help="weight copies per shape, in MiB")
    args = ap.parse_args()
    if "avx512_bf16" not in cpu_flags():
        sys.exit("bench_vnni_gemm: this CPU has no avx512_bf16; the kernel needs it")
    if shutil.which("g++") is None:
        sys.exit("bench_vnni_gemm: no g++ on PATH; the kernel is built with it")
    threads = sorted({int(t) for t in args.threads.split(",")})
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="vnni_gemm_") as folder:
        for i, prefetch in enumerate(int(p) for p in args.prefetch.split(",")):
            if i:  # one op name per process: a second build needs a process of its own
                subprocess.run([sys.executable, __file__, "--prefetch", str(prefetch), "--threads", args.threads,
                                "--rows", args.rows, "--reps", str(args.reps), "--pool-mib", str(args.pool_mib)],
                               check=True)
                continue
            build(prefetch, Path(folder))
            measure(prefetch, threads, rows, args.reps, args.pool_mib)


if __name__ == "__main__":
    main()
