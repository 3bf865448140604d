"""Figures compile, decode_attention and cuda_graphs: the engine's compiled paths against the
same engine without them (enforce_eager, the opaque attention op, the torch attention code), in
the same run. A compiled path must never be slower, and its start-up cost is part of its price,
so compile also times fresh processes: eager, an empty inductor cache, a warm one."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness import LLAMA_SHAPE, ROOT, emit, loadavg, prompts_for, random_llama, time_engine

_COMPILE_CHILD = r"""
import json, sys, time
t = time.perf_counter()
from spmd_engine import LLM
eager = sys.argv[3] == "eager"
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=128, max_num_seqs=32,
          distributed_executor_backend="uni", enforce_eager=eager, compilation_config=0 if eager else 3)
up = time.perf_counter() - t
print(json.dumps({"startup_s": up, "compile_s": llm.get_stats()[0]["runner"]["compile_seconds"]}))
llm.shutdown()
"""


def compile_startup(model_dir: str, dtype: str, mode: str, cache_dir: str) -> dict:
    """One fresh process: import spmd_engine, build a uni LLM (compiling unless eager)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, model_dir, dtype, mode], env=env,
                         capture_output=True, text=True, timeout=900, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fig_compile(args) -> None:
    """The compiled forward against eager, same run: tokens/s of decode B=1, 8 and 32 and of a
    prefill-bound batch (8 prompts x 256 tokens, 4 new), fp32 and bf16, two engines (mp, one
    worker each) timed call by call in turns; then start-up (a fresh process: import + LLM()) eager, compiled with
    an empty inductor cache (its compile seconds beside) and compiled again on that warm cache."""
    import shutil

    import torch

    from spmd_engine import LLM
    from spmd_engine.config import CompilationConfig
    defaults = CompilationConfig()
    model_dir = random_llama(args)
    new = 16 if args.quick else 64
    work = [("decode_b1", prompts_for(1, 32, LLAMA_SHAPE["vocab_size"]), new),
            ("decode_b8", prompts_for(8, 32, LLAMA_SHAPE["vocab_size"]), new),
            ("decode_b32", prompts_for(32, 32, LLAMA_SHAPE["vocab_size"]), new),
            ("prefill_8x256", prompts_for(8, 256, LLAMA_SHAPE["vocab_size"]), 4)]
    for dtype in ("float32", "bfloat16"):
        # Both engines alive at once (mp with one worker each: a process holds one uni engine),
        # timed call by call in turns, so the shared machine's bursts hit both.
        llms = {mode: LLM(model=model_dir, dtype=dtype, max_model_len=512, max_num_seqs=32,
                          distributed_executor_backend="mp", enforce_eager=mode == "eager")
                for mode in ("eager", "compiled")}
        rates = {}
        try:
            for llm in llms.values():
                time_engine(llm, work[0][1][:2], 4)  # warm-up
            for _ in range(args.reps):
                for name, prompts, n in work:
                    for mode, llm in llms.items():
                        rates.setdefault((name, mode), []).append(time_engine(llm, prompts, n))
        finally:
            for llm in llms.values():
                llm.shutdown()
        for name, prompts, n in work:
            v, b = statistics.median(rates[name, "compiled"]), statistics.median(rates[name, "eager"])
            emit(f"compile_{name}_tokens_per_s_{dtype}", v, b, v / b, "tokens/s",
                 ratio_is="compiled (default) / enforce_eager, same run; target >= 1.0 (never slower)",
                 requests=len(prompts), new_tokens=n, reps=args.reps, threads=torch.get_num_threads(),
                 min_tokens=defaults.min_tokens, layers_per_graph=defaults.layers_per_graph,
                 compiled_steps=f"steps of >= {defaults.min_tokens} tokens", loadavg_1m=loadavg())
    startup_dtype = "bfloat16"  # compiled by default (in fp32 only on request)
    cache = tempfile.mkdtemp(prefix="spmd_bench_inductor_")
    try:
        eager, cold, warm = [], [], []
        for i in range(1 if args.quick else 3):
            eager.append(compile_startup(model_dir, startup_dtype, "eager", cache)["startup_s"])
            if i == 0:
                cold.append(compile_startup(model_dir, startup_dtype, "compiled", cache))
            warm.append(compile_startup(model_dir, startup_dtype, "compiled", cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    e = statistics.median(eager)
    emit("compile_first_start_compile_s", cold[0]["compile_s"], cold[0]["startup_s"], cold[0]["compile_s"] / cold[0]["startup_s"], "s",
         ratio_is="compile seconds (empty inductor cache) / that whole start-up, for information",
         startup_eager_s=round(e, 3), dtype=startup_dtype)
    w = statistics.median(x["startup_s"] for x in warm)
    emit("compile_warm_startup_s", w, e, w / e, "s",
         ratio_is="start-up (import + LLM()) compiled on a warm inductor cache / eager; target <= 1.3",
         warm_compile_s=round(statistics.median(x["compile_s"] for x in warm), 3), dtype=startup_dtype,
         loadavg_1m=loadavg())


def fig_decode_attention(args) -> None:
    """Decode steps' attention traced into the compiled graph (attention.decode_attention)
    against the same graph kind calling the opaque paged-attention op, one uni bf16 engine,
    the two in turns: the second by making AttentionMetadata.decode_step answer None, so
    decode steps take the general graph (as before decode graphs existed)."""
    import torch

    from spmd_engine import LLM
    from spmd_engine.model.layers.attention import AttentionMetadata
    model_dir = random_llama(args)
    new = 16 if args.quick else 64
    traced = AttentionMetadata.decode_step
    try:
        for batch in (8, 32):
            prompts = prompts_for(batch, 32, LLAMA_SHAPE["vocab_size"])
            llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=32 + new + 8, max_num_seqs=batch,
                      distributed_executor_backend="uni")
            rates = {"traced": [], "op": []}
            time_engine(llm, prompts, 4)
            for _ in range(args.reps):
                for kind in ("op", "traced"):
                    AttentionMetadata.decode_step = traced if kind == "traced" else (lambda self: None)
                    rates[kind].append(time_engine(llm, prompts, new))
            AttentionMetadata.decode_step = traced
            refused = llm.get_stats()[0]["runner"]["compiled_calls_refused"]
            llm.shutdown()
            v, b = statistics.median(rates["traced"]), statistics.median(rates["op"])
            emit(f"decode_attention_traced_tokens_per_s_b{batch}", v, b, v / b, "tokens/s", batch=batch,
                 dtype="bfloat16", new_tokens=new, reps=args.reps, threads=torch.get_num_threads(),
                 compiled_calls_refused=refused, ratio_is="value/baseline, higher is better",
                 baseline_is="the same engine, decode steps through the general graph's opaque attention op",
                 loadavg_1m=loadavg())
    finally:
        AttentionMetadata.decode_step = traced
    fig_decode_attention_kernel(args)


def fig_decode_attention_kernel(args) -> None:
    """Decode steps' attention in the C++ kernel (kernels/decode_attention.py) against the
    torch code traced into the same compiled decode graph (SPMD_ENGINE_CPU_DECODE_ATTENTION=torch):
    uni bf16 engines, one of each in turns (the choice is part of the graph, and one process
    holds one uni engine at a time), each warmed up before it is timed."""
    import torch

    from spmd_engine import LLM, envs
    from spmd_engine.kernels import decode_attention
    if not decode_attention.usable("cpu"):
        print(f"decode_attention_kernel: skipped, {decode_attention.unavailable()}", file=sys.stderr)
        return
    model_dir = random_llama(args)
    new = 16 if args.quick else 64
    for batch in (8, 32):
        prompts = prompts_for(batch, 32, LLAMA_SHAPE["vocab_size"])
        rates = {"kernel": [], "torch": []}
        for _ in range(args.reps):
            for kind in rates:
                os.environ[envs.CPU_DECODE_ATTENTION] = "auto" if kind == "kernel" else "torch"
                try:
                    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=32 + new + 8,
                              max_num_seqs=batch, distributed_executor_backend="uni")
                finally:
                    os.environ.pop(envs.CPU_DECODE_ATTENTION)
                time_engine(llm, prompts, 4)
                rates[kind].append(time_engine(llm, prompts, new))
                llm.shutdown()
        v, b = statistics.median(rates["kernel"]), statistics.median(rates["torch"])
        emit(f"decode_attention_kernel_tokens_per_s_b{batch}", v, b, v / b, "tokens/s", batch=batch,
             dtype="bfloat16", new_tokens=new, reps=args.reps, threads=torch.get_num_threads(),
             ratio_is="value/baseline, higher is better",
             baseline_is="the same engine with SPMD_ENGINE_CPU_DECODE_ATTENTION=torch (attention traced into the graph)",
             loadavg_1m=loadavg())


def fig_cuda_graphs(args) -> None:
    """CUDA only: bf16 decode tokens/s with decode steps replayed as CUDA graphs (the default)
    against the same engine with enforce_eager (every kernel launched from Python), at B = 1, 8
    and 32, engines in turns (worker/decode_graphs.py)."""
    import torch

    from spmd_engine import LLM
    if not torch.cuda.is_available():
        print("cuda_graphs: no CUDA device here, nothing measured", file=sys.stderr)
        return
    model_dir = random_llama(args)
    plen, new = 32, (16 if args.quick else 64)
    for batch in (1, 8, 32):
        prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
        common = dict(model=model_dir, dtype="bfloat16", max_model_len=plen + new + 8, max_num_seqs=batch,
                      gpu_memory_utilization=0.3)
        times = {}
        for eager in (True, False):
            with LLM(enforce_eager=eager, **common) as llm:
                time_engine(llm, prompts, 4)
                times[eager] = [time_engine(llm, prompts, new) for _ in range(args.reps)]
                if not eager:
                    sizes = llm.get_stats()[0]["runner"]["cuda_graph_sizes"]
        v, b = statistics.median(times[False]), statistics.median(times[True])
        emit(f"cuda_graphs_decode_tokens_per_s_b{batch}", v, b, v / b, "tokens/s", batch=batch, prompt=plen,
             new_tokens=new, reps=args.reps, device=torch.cuda.get_device_name(), capture_sizes=sizes,
             value_is="decode steps as CUDA graphs (default)", baseline_is="enforce_eager=True",
             ratio_is="value/baseline, higher is better")
