#!/usr/bin/env python
"""spmd_engine benchmarks, each figure a ratio against a baseline measured in the same run.

    .venv/bin/python scripts/bench.py [--only rpc,allreduce,decode,tp,tp4,startup,load,sampling] [--quick]

Prints one JSON line per figure: {"name", "value", "baseline", "ratio", "unit", "params"};
value and baseline are medians over --reps repetitions, interleaved so machine noise
(this box is shared) hits both. "ratio" is oriented so that > 1 means we are better
than the baseline, except where params["ratio"] says otherwise.

Figures
  rpc        MultiprocExecutor.collective_rpc("check_health"), TP=2 workers, vs a
             multiprocessing.Pipe echo (ratio = value / baseline, lower is better)
  allreduce  TP all-reduce 32 KiB, 2 ranks: shared memory vs gloo (bench_allreduce.py)
  decode     LLM.generate (uni) tokens/s vs HF transformers generate (or a plain PyTorch
             decode loop) on the same random Llama weights, fp32 and bf16; plus the
             fraction of the memory-bandwidth roofline (bandwidth measured by a tensor sum) at B=1, 8
             and 32, beside the fraction the step's weight matmuls alone reach (the ceiling here)
  capacity   paged KV: peak concurrent requests (64 x 32-token prompts + 32 new tokens) under the KV
             budget of 4 max_model_len=4096 slots, vs those 4 slots
  prefix     8 prompts of 512 tokens x 8 copies, 16 new tokens: tokens/s with prefix caching vs without
  chunked    7 running decodes + a 4096-token prompt arriving: the decodes' worst inter-token gap
             without chunked prefill vs with it (budget 256)
  tp         TP=2 mp (one thread per rank) vs uni (two threads), same model and batch
  tp4        TP=4 mp on this host (processes may outnumber cores) vs uni, tokens/s
  mixed      64 requests, prompts 32-512 tokens, 64 new tokens, default settings, uni bf16 vs
             transformers' continuous batching (generate_batch, "paged|sdpa") on the same weights,
             tokens/s; 256 requests too (one rep each)
  pp         PP=2 mp, one thread per stage, two steps in flight (batch queue) vs uni with one
             thread, 32 requests, tokens/s; same output tokens asserted; plus the ceiling of
             that design here: 2 x uni's tokens/s on half batches, over uni on the whole batch.
             Decode-bound (32-token prompts, 64 new tokens: the target) and prefill-bound
             (256-token prompts computed every run, 8 new tokens, chunks of 512 tokens)
  startup    torchrun world 8 (TP2 PP2 DP2, bundled model): launch to first token of
             `spmd_engine.run`, and phases from scripts/bench_rank.py; group creation vs
             number of groups (worlds 2, 4, 8)
  load       peak RSS per rank at TP 1, 2, 4 vs checkpoint size; load throughput vs
             reading the file
  wave       DP waves: an idle replica's wave step (a dummy forward of one token) vs a real
             decode step at batch 8, random Qwen3-MoE (16 experts top-4, hidden 512), fp32, uni
             (ratio = value / baseline, lower is cheaper)
  moe        MoE decode B=8 bf16 (uni) tokens/s vs transformers generate on the same random
             Qwen3-MoE-shaped checkpoint (16 experts top-4, hidden 512, 8 layers)
  sampling   Sampler.sample for B=256 rows x V=152,064 (fp32 logits on the device, cuda when
             present): per-row temperature 0.8 / top-k 50 / top-p 0.9 with per-request seeds
             vs all-greedy rows (argmax) in the same run (ratio = value / baseline, target <= 2);
             also temperature 1 alone (the full-vocabulary path); at 1 thread and the default
  compile    compiled forward (default) vs enforce_eager, same run: decode B=8, B=32 and a prefill
             batch, fp32 and bf16; first start's compile seconds (empty inductor cache); warm-cache
             start-up (fresh process, import + LLM()) vs eager start-up
  async      async scheduling (step k+1 scheduled while step k runs) vs the same engine without, decode
             tokens/s: uni bf16 at B=1 and 8 (the worker on a step thread) and mp TP=2 at B=8 (the
             engine process schedules while its workers run), engines in turns; same tokens asserted
  decode_attention  decode steps' attention traced into the compiled graph vs the opaque paged
             attention op, one uni bf16 engine, B=8 and B=32, in turns
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import bench_allreduce  # noqa: E402  (measurement code reused, not copied)
import bench_rpc_transport  # noqa: E402
from make_random_checkpoint import make_random_checkpoint  # noqa: E402

FIGURES = ("rpc", "allreduce", "decode", "capacity", "prefix", "chunked", "tp", "tp4", "pp", "mixed", "startup", "load",
           "moe", "wave", "sampling", "batch_invariant", "compile",
           "decode_attention", "cuda_graphs", "async")
LLAMA_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                   vocab_size=32000, max_position_embeddings=8192)
QWEN3_MOE_SHAPE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=512, num_layers=8, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=1536, vocab_size=32000,
                       max_position_embeddings=8192, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=256, norm_topk_prob=True)


def emit(name, value, baseline, ratio, unit, **params) -> None:
    r = lambda x: round(x, 4) if isinstance(x, float) else x  # noqa: E731
    params.setdefault("cpu", cpu_model())
    print(json.dumps({"name": name, "value": r(value), "baseline": r(baseline), "ratio": r(ratio),
                      "unit": unit, "params": params}), flush=True)


# The CPU's instruction sets that decide which kernels run and which dtype is native here.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """`lscpu`'s model name and the flags of CPU_FLAGS it has, e.g. "Intel(R) Xeon(R) Processor
    [avx2 avx512f avx512_bf16 amx_bf16 amx_tile]": figures from one kind of 2-core machine say
    nothing of another (bf16 was 3x slower than fp32 where it is emulated), so every figure
    carries it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return f"{model} [{' '.join(flag for flag in CPU_FLAGS if flag in flags)}]"


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


# ---------------------------------------------------------------- rpc
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


# ---------------------------------------------------------------- all-reduce
def fig_allreduce(args) -> None:
    ns = argparse.Namespace(iters=50 if args.quick else 200, reps=args.reps, kib=32, timeout=300, no_pin=False)
    for line in bench_allreduce.run_two_ranks(ns):
        params = dict(line["params"])
        unit = params.pop("unit")
        if line["name"].endswith("_us"):
            params["ratio_is"] = ("baseline/value (gloo time / shm time), target >= 20"
                                  + ("; >= 35 in fp32 (issue 23)" if "float32" in line["name"] else ""))
        print(json.dumps({**line, "unit": unit, "params": {**params, "cpu": cpu_model()}}), flush=True)


# ---------------------------------------------------------------- decode
def random_llama(args) -> str:
    path = Path(args.workdir) / "llama_h512_l8_p8k"
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **LLAMA_SHAPE)
    return str(path)


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[(7919 * i + 31 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch)]


def time_engine(llm, prompts, new_tokens: int) -> float:
    from spmd_engine import SamplingParams
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


def hf_generator(model_dir: str, dtype):
    """(tokens/s function, kind): transformers' generate if importable, else a plain torch loop."""
    import torch
    try:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

        def run(prompts, new_tokens):
            ids = torch.tensor(prompts)
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
            assert out.shape[1] == ids.shape[1] + new_tokens
            return len(prompts) * new_tokens / dt
        return run, "transformers.generate"
    except ImportError:
        return plain_torch_generator(model_dir, dtype), "plain PyTorch decode loop"


def plain_torch_generator(model_dir: str, dtype):
    """Unsharded reference decode: our CausalLM without the engine (no scheduler, no RPC)."""
    import torch

    from spmd_engine.model.layers.attention import AttentionMetadata
    from spmd_engine.model.loader import load_model
    from spmd_engine.model.solo import SoloGroup
    g = SoloGroup()
    model = load_model(model_dir, g, g, dtype=dtype)

    def run(prompts, new_tokens):
        B, T = len(prompts), len(prompts[0])
        bs = 16
        per_seq = -(-(T + new_tokens) // bs)
        model.allocate_kv_cache(B * per_seq, bs)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
        ids = prompts
        t = time.perf_counter()
        with torch.inference_mode():
            ctx, q = [0] * B, [T] * B
            for step in range(new_tokens):
                md = AttentionMetadata.build(ctx, q, tables, bs, "cpu")
                h = model.forward(torch.tensor(md.pack(ids)), md.positions, md)["hidden_states"]
                last = torch.tensor([md.row_start[i] + q[i] - 1 for i in range(B)])
                ids = model.compute_logits(h[last]).argmax(-1).view(B, 1).tolist()
                ctx, q = [c + n for c, n in zip(ctx, q)], [1] * B
        return B * new_tokens / (time.perf_counter() - t)
    return run


def read_bandwidth(mib: int = 512) -> float:
    """Bytes/s of a large tensor sum (one read pass), all threads: the roofline's bandwidth.

    The fastest of 5 passes: noise on this shared box only slows a pass (single passes
    ranged 35-68 GB/s here), and the roofline is what the memory can do, so the best pass
    is the honest (and strictest) denominator."""
    import torch
    x = torch.ones(mib * 2 ** 20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes_per_step(model_dir: str, itemsize: int) -> int:
    """Bytes of weights read per decode step: every matrix except the embedding (a gather)."""
    s = LLAMA_SHAPE
    h, v = s["hidden_size"], s["vocab_size"]
    return (layer_params(s["num_layers"]) + h + v * h) * itemsize


def matmul_seconds(llm, rows: int, reps: int = 20) -> dict[str, float]:
    """Seconds per call of each weight matmul of a uni engine's model (its own, packed,
    weights) on `rows` rows, by module name, timed in model order with nothing else running."""
    import torch

    from spmd_engine.model.layers.packed_weights import dense_shape, linear
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    weights = {name: m.weight for name, m in model.named_modules() if getattr(m, "packable_weight", False)}
    width = {name: dense_shape(w)[1] for name, w in weights.items()}  # in_features, whatever the layout
    inputs = {k: torch.randn(rows, k).to(model.dtype) for k in width.values()}
    seconds = dict.fromkeys(weights, 0.0)
    with torch.inference_mode():
        for name, w in weights.items():
            linear(inputs[width[name]], w)
        for _ in range(reps):
            for name, w in weights.items():
                t = time.perf_counter()
                linear(inputs[width[name]], w)
                seconds[name] += time.perf_counter() - t
    return {name: t / reps for name, t in seconds.items()}


def step_matmul_seconds(llm, batch: int) -> float:
    """One decode step's weight matmuls alone: every layer's qkv, o, gate_up, down and the LM
    head on `batch` rows, nothing else. The step as a whole can stream weights no faster."""
    return sum(matmul_seconds(llm, batch).values())


def fig_decode(args) -> None:
    """Decode tokens/s vs transformers at B=8 (fp32, bf16); the bf16 roofline fraction at
    B=1, 8 and 32, beside the fraction the step's matmuls alone reach (its ceiling here)."""
    import torch

    from spmd_engine import LLM
    model_dir = random_llama(args)
    plen, new = 32, (16 if args.quick else 64)
    runs = [("float32", torch.float32, 8), ("bfloat16", torch.bfloat16, 8),
            ("bfloat16", torch.bfloat16, 1), ("bfloat16", torch.bfloat16, 32)]
    for dtype_name, dtype, batch in runs:
        prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
        llm = LLM(model=model_dir, dtype=dtype_name, max_model_len=plen + new + 8, max_num_seqs=batch,
                  distributed_executor_backend="uni")
        compare = batch == 8  # transformers at the batch size only
        ref, kind = hf_generator(model_dir, dtype) if compare else (None, None)
        time_engine(llm, prompts, 4)
        if compare:
            ref(prompts, 4)  # warm-up
        ours, theirs, bws, matmuls, decode_steps = [], [], [], [], []
        for _ in range(args.reps):
            ours.append(time_engine(llm, prompts, new))
            # A decode step alone: the generation's time less one of the first token only (the
            # prompts' prefill, generate's own start and end), over the steps left.
            first_only = batch / time_engine(llm, prompts, 1)
            decode_steps.append((batch * new / ours[-1] - first_only) / (new - 1))
            if compare:
                theirs.append(ref(prompts, new))
            bws.append(read_bandwidth())
            matmuls.append(step_matmul_seconds(llm, batch))
        llm.shutdown()
        v = statistics.median(ours)
        if compare:
            b = statistics.median(theirs)
            emit(f"decode_tokens_per_s_{dtype_name}", v, b, v / b, "tokens/s", batch=batch, prompt=plen,
                 new_tokens=new, greedy=True, threads=torch.get_num_threads(), reps=args.reps, baseline_is=kind,
                 loadavg_1m=loadavg(), ratio_is="value/baseline, higher is better"
                 + ("; target >= 1.5" if dtype_name == "bfloat16" else ""))
        bw = statistics.median(bws)
        step_bytes = weight_bytes_per_step(model_dir, dtype.itemsize)
        achieved = step_bytes * v / batch  # weight bytes read per second at our step rate
        suffix = dtype_name if batch == 8 else f"{dtype_name}_b{batch}"
        emit(f"decode_roofline_fraction_{suffix}", achieved / 1e9, bw / 1e9, achieved / bw, "GB/s", batch=batch,
             ratio_is="weight bytes read per step x steps/s over measured read bandwidth (1.0 = roofline)"
             + ("; target >= 0.5" if (dtype_name, batch) == ("bfloat16", 8) else ""),
             weight_bytes_per_step=step_bytes, bandwidth_probe="torch.sum over 512 MiB fp32, all threads, fastest of 5 passes",
             step_ms=round(batch / v * 1e3, 3))
        t_mm = statistics.median(matmuls)
        emit(f"decode_matmul_ceiling_fraction_{suffix}", step_bytes / t_mm / 1e9, bw / 1e9, step_bytes / t_mm / bw,
             "GB/s", batch=batch, matmuls_ms=round(t_mm * 1e3, 3), step_ms=round(batch / v * 1e3, 3),
             ratio_is="the step's weight matmuls alone (the model's packed weights, nothing else) over the "
                      "measured read bandwidth: the most a whole step could reach with these kernels")
        step = statistics.median(decode_steps)
        emit(f"decode_step_over_matmuls_{suffix}", step * 1e3, t_mm * 1e3, step / t_mm, "ms", batch=batch,
             step_ms_with_prefill=round(batch / v * 1e3, 3), loadavg_1m=loadavg(),
             value_is=f"a decode step: (generate of {new} tokens - generate of 1) / {new - 1}",
             baseline_is="the step's weight matmuls alone (as decode_matmul_ceiling_fraction)",
             ratio_is="value/baseline, lower is better"
             + ("; target <= 1.3" if (dtype_name, batch) == ("bfloat16", 8) else ""))


def fig_moe(args) -> None:
    """Qwen3-MoE decode, bf16, B=8: LLM (uni) vs transformers generate, interleaved reps."""
    import torch

    from spmd_engine import LLM
    path = Path(args.workdir) / "qwen3moe_h512_l8_e16_k4"
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **QWEN3_MOE_SHAPE)
    batch, plen, new = 8, 32, (16 if args.quick else 64)
    prompts = prompts_for(batch, plen, QWEN3_MOE_SHAPE["vocab_size"])
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=plen + new + 8, max_num_seqs=batch,
              distributed_executor_backend="uni")
    ref, kind = hf_generator(str(path), torch.bfloat16)
    time_engine(llm, prompts, 4), ref(prompts, 4)  # warm-up
    ours, theirs = [], []
    for _ in range(args.reps):
        ours.append(time_engine(llm, prompts, new))
        theirs.append(ref(prompts, new))
    llm.shutdown()
    v, b = statistics.median(ours), statistics.median(theirs)
    emit("moe_decode_tokens_per_s_bfloat16", v, b, v / b, "tokens/s", batch=batch, prompt=plen, new_tokens=new,
         experts=16, top_k=4, hidden=512, layers=8, threads=torch.get_num_threads(), reps=args.reps,
         baseline_is=kind, loadavg_1m=loadavg(), ratio_is="value/baseline, higher is better; target >= 1.5")


# ---------------------------------------------------------------- memory model
def fig_capacity(args) -> None:
    """The budget of 4 slots of max_model_len=4096 holds how many 64-token requests at once?"""
    from spmd_engine import LLM, SamplingParams
    model_dir = random_llama(args)
    slots, max_len, per_token = 4, 4096, None
    probe = LLM(model=model_dir, max_model_len=max_len, distributed_executor_backend="uni",
                kv_cache_memory_bytes=1 << 30)
    per_token = probe.collective_rpc(lambda w: w.model_runner.model.kv_bytes_per_token())[0]
    probe.shutdown()
    budget = slots * max_len * per_token
    llm = LLM(model=model_dir, max_model_len=max_len, distributed_executor_backend="uni", kv_cache_memory_bytes=budget)
    try:
        prompts = prompts_for(64, 32, LLAMA_SHAPE["vocab_size"])
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    emit("kv_capacity_peak_running_requests", stats["peak_running"], slots, stats["peak_running"] / slots,
         "requests", ratio_is="value/baseline: paged KV vs one max_model_len slot per sequence; target >= 8",
         kv_budget_bytes=budget, kv_bytes_per_token=per_token, num_blocks=stats["num_blocks"], requests=64,
         prompt=32, new_tokens=32, max_model_len=max_len, preemptions=stats["preemptions"])


def fig_prefix(args) -> None:
    from spmd_engine import LLM
    model_dir = random_llama(args)
    distinct, copies = (2, 4) if args.quick else (8, 8)  # quick: a smoke run's size
    prompts = [p for p in prompts_for(distinct, 512, LLAMA_SHAPE["vocab_size"]) for _ in range(copies)]
    new = 16
    kw = dict(model=model_dir, max_model_len=1024, distributed_executor_backend="uni")
    stats = {}

    def run(caching: bool) -> float:  # one uni engine per process at a time: build, time, shut down
        llm = LLM(enable_prefix_caching=caching, **kw)
        try:
            time_engine(llm, prompts[:2], 2)  # warm-up, then a cold cache
            llm.reset_prefix_cache()
            result = time_engine(llm, prompts, new)
            if caching:
                stats.update(llm.get_stats()[0])
            return result
        finally:
            llm.shutdown()
    v, b = [], []
    for _ in range(max(1, args.reps // 2) if not args.quick else 1):
        v.append(run(True))
        b.append(run(False))
    emit("prefix_cache_shared_prompts_tokens_per_s", statistics.median(v), statistics.median(b),
         statistics.median(v) / statistics.median(b), "tokens/s",
         ratio_is="value/baseline: prefix caching on vs off; target >= 3",
         prompts=f"{distinct} x 512 tokens, {copies} copies each",
         new_tokens=new, dtype="float32", prefix_hits_tokens=stats["prefix_hits_tokens"],
         prefix_queries_tokens=stats["prefix_queries_tokens"], loadavg_1m=loadavg())


def worst_decode_gap(llm, long_prompt: int, decodes: int = 7) -> tuple[float, int]:
    """Seconds between consecutive tokens of `decodes` running requests, worst case, over the
    steps from the long prompt's arrival to its first token; and the steps that took."""
    from spmd_engine import SamplingParams
    from spmd_engine.core.request import Request
    engine = llm.llm_engine.engine_core  # the EngineCore: its requests' tokens are read as they grow
    short = [Request(f"short{i}", ids, SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True), seed=i)
             for i, ids in enumerate(prompts_for(decodes, 32, LLAMA_SHAPE["vocab_size"]))]
    for r in short:
        engine.add_request(r)
    for _ in range(4):  # every short request is decoding
        engine.step()
    long = Request("long", prompts_for(1, long_prompt, LLAMA_SHAPE["vocab_size"])[0],
                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), seed=0)
    engine.add_request(long)
    last = {r.request_id: (time.perf_counter(), len(r.output_token_ids)) for r in short}
    worst, steps = 0.0, 0
    while not long.output_token_ids:
        engine.step()
        steps += 1
        now = time.perf_counter()
        for r in short:
            if len(r.output_token_ids) > last[r.request_id][1]:
                worst = max(worst, now - last[r.request_id][0])
                last[r.request_id] = (now, len(r.output_token_ids))
    for r in short:  # finish them off: free their blocks for the next repetition
        r.params.max_tokens = len(r.output_token_ids) + 1
    engine.run_until_done()
    return worst, steps


def fig_chunked(args) -> None:
    from spmd_engine import LLM
    model_dir = random_llama(args)
    long_prompt = 1024 if args.quick else 4096
    kw = dict(model=model_dir, max_model_len=long_prompt + 64, distributed_executor_backend="uni")
    settings = {True: dict(enable_chunked_prefill=True, max_num_batched_tokens=256),
                False: dict(enable_chunked_prefill=False)}

    def gap(chunked: bool) -> tuple[float, int]:  # one uni engine per process at a time
        llm = LLM(**settings[chunked], **kw)
        try:
            worst_decode_gap(llm, 64)  # warm-up
            return worst_decode_gap(llm, long_prompt)
        finally:
            llm.shutdown()
    w, b, steps = [], [], 0
    for _ in range(1 if args.quick else max(1, args.reps // 2)):
        g, steps = gap(True)
        w.append(g)
        b.append(gap(False)[0])
    v, base = statistics.median(w), statistics.median(b)
    emit("chunked_prefill_worst_decode_gap", v * 1e3, base * 1e3, base / v, "ms",
         ratio_is="baseline/value: worst inter-token gap of 7 running decodes while a long prompt arrives, "
                  "without chunked prefill / with it (budget 256); target >= 4",
         long_prompt=long_prompt, decodes=7, chunked_steps_to_first_token=steps, dtype="float32",
         loadavg_1m=loadavg())


# ---------------------------------------------------------------- tp
def fig_tp(args, tp: int = 2) -> None:
    import torch

    from spmd_engine import LLM
    model_dir = random_llama(args)
    batch, plen, new = 8, 32, (8 if args.quick else 32) if tp > 2 else (16 if args.quick else 64)
    prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
    kw = dict(model=model_dir, dtype="float32", max_model_len=plen + new + 8, max_num_seqs=batch)
    uni = LLM(distributed_executor_backend="uni", **kw)
    # Workers share the cores out (cores // workers threads) only when OMP_NUM_THREADS is unset.
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        par = LLM(tensor_parallel_size=tp, distributed_executor_backend="mp", **kw)
    finally:
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
    try:
        time_engine(uni, prompts, 4), time_engine(par, prompts, 4)
        u, p = [], []
        for _ in range(args.reps if tp == 2 else max(1, args.reps // 2)):
            p.append(time_engine(par, prompts, new))
            u.append(time_engine(uni, prompts, new))
    finally:
        par.shutdown()
        uni.shutdown()
    v, b = statistics.median(p), statistics.median(u)
    emit(f"tp{tp}_mp_vs_uni_tokens_per_s", v, b, v / b, "tokens/s",
         ratio_is="value/baseline" + ("; target >= 0.8" if tp == 2 else ""), cores=len(os.sched_getaffinity(0)),
         uni_threads=torch.get_num_threads(), worker_threads="cores // workers (min 1)", batch=batch,
         prompt=plen, new_tokens=new, dtype="float32", loadavg_1m=loadavg())


def timed_pp_partition(llm, prompts, new: int) -> str:
    """Layers on stage 0 vs stage 1 that make the two stages' work closest, the LM head on the
    last: each decoder layer and the head (with greedy sampling) timed inside the uni engine's
    own decode steps on `prompts` (a stage's batch; their prompts cached first), so a layer's
    norms, rotary and attention count beside its matmuls. (Matmuls alone misjudge it: at 16
    rows in fp32 the head's one big matrix weighs 5.4 layers by bytes and 5-6 by the kernel's
    matmul time, but about 3-4 whole layers, which picks 6,2 where matmuls picked 7,1.)"""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    layers = list(model.model.layers.values())
    spent = {"layers": 0.0, "head": 0.0}
    started = {}

    def before(module, args):
        started[module] = time.perf_counter()

    def after(module, args, out):
        spent["layers"] += time.perf_counter() - started.pop(module)

    def timed(fn):
        def call(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent["head"] += time.perf_counter() - t
        return call
    time_engine(llm, prompts, new)  # the prompts' blocks into the prefix cache: timed runs are decode steps
    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(before),
                                             layer.register_forward_hook(after))]
    model.greedy_tokens, model.compute_logits = timed(model.greedy_tokens), timed(model.compute_logits)
    runs = []
    try:
        for _ in range(3):
            spent.update(layers=0.0, head=0.0)
            time_engine(llm, prompts, new)
            runs.append(dict(spent))
    finally:
        for h in hooks:
            h.remove()
        del model.greedy_tokens, model.compute_logits  # the class's methods again
    n = len(layers)
    if not all(run["layers"] for run in runs):
        raise RuntimeError("no decoder layer ran through its module (a compiled forward?): cannot time the stages")
    layer, head = (statistics.median(run[k] for run in runs) for k in ("layers", "head"))
    layer /= n
    first = min(range(1, n), key=lambda k: max(k * layer, (n - k) * layer + head))
    return f"{first},{n - first}"


def layer_params(layers: int) -> int:
    """Parameters of `layers` decoder layers of LLAMA_SHAPE."""
    s = LLAMA_SHAPE
    h, i = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_heads"]
    return layers * (h * (s["num_heads"] + 2 * s["num_kv_heads"]) * d + s["num_heads"] * d * h + 3 * h * i + 2 * h)


def pp_vs_uni(args, prompts, new: int, fresh_prefill: bool, partition: str | None, **engine_kw):
    """PP=2 mp (one thread per stage, layers split by `partition`, or by timed_pp_partition
    when None) and uni (one thread) on the same requests, interleaved reps: ({"pp", "uni",
    "uni_halves", "pp_gloo"} tokens/s lists, peak steps in flight, partition, whether the
    stages' hand-off went through shared memory). "pp_gloo" is the same PP engine with the
    hand-off on gloo (SPMD_ENGINE_DISABLE_SHM_HANDOFF). Asserts all give the same tokens.
    `fresh_prefill` empties the prefix cache before every run, so each run computes its
    prompts."""
    import torch

    from spmd_engine import LLM, SamplingParams
    from spmd_engine.envs import DISABLE_SHM_HANDOFF as DISABLE_HANDOFF
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per stage (an explicit value wins)

    def timed(llm, some):
        if fresh_prefill:
            llm.reset_prefix_cache()
        return time_engine(llm, some, new)
    try:
        uni = LLM(distributed_executor_backend="uni", **engine_kw)
        partition = partition or timed_pp_partition(uni, prompts[:len(prompts) // 2], min(new, 32))
        os.environ["SPMD_ENGINE_PP_PARTITION"] = partition  # read by the spawned workers
        par = LLM(pipeline_parallel_size=2, distributed_executor_backend="mp", **engine_kw)
        par_gloo = None
        try:
            os.environ[DISABLE_HANDOFF] = "1"
            try:
                par_gloo = LLM(pipeline_parallel_size=2, distributed_executor_backend="mp", **engine_kw)
            finally:
                os.environ.pop(DISABLE_HANDOFF)
            same = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            want = [o.outputs[0].token_ids for o in uni.generate(prompts, same)]
            for engine in (par, par_gloo):
                assert [o.outputs[0].token_ids for o in engine.generate(prompts, same)] == want, "PP changed the output"
            shared = par.collective_rpc(lambda w: w.model_runner.pp_group.uses_shared_handoff)
            assert not any(par_gloo.collective_rpc(lambda w: w.model_runner.pp_group.uses_shared_handoff))
            runs = {"pp": [], "uni": [], "uni_halves": [], "pp_gloo": []}
            half = len(prompts) // 2
            for _ in range(args.reps):
                runs["pp"].append(timed(par, prompts))
                runs["pp_gloo"].append(timed(par_gloo, prompts))
                runs["uni"].append(timed(uni, prompts))
                # The batch queue gives each step half the requests: uni on those halves, one
                # after the other, is what each stage's share costs without overlap.
                runs["uni_halves"].append(2 / (1 / timed(uni, prompts[:half]) + 1 / timed(uni, prompts[half:])))
            in_flight = par.get_stats()[0]["peak_in_flight"]
        finally:
            par.shutdown()
            if par_gloo is not None:
                par_gloo.shutdown()
            uni.shutdown()
    finally:
        torch.set_num_threads(threads)
        os.environ.pop("SPMD_ENGINE_PP_PARTITION", None)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    return runs, in_flight, partition, all(shared)


def fig_pp(args) -> None:
    """Issue 17's PP overlap (each stage idles half the time without steps in flight, ~1x), on a
    decode-bound batch (the target) and a prefill-bound one, each beside its half-batch ceiling."""
    batch = 32
    # In decode the last stage also runs the LM head on every row: an even split of layers
    # leaves stage 0 idle part of every step, so balance the stages' timed layers and head
    # (timed_pp_partition; SPMD_ENGINE_PP_PARTITION, as vLLM's VLLM_PP_LAYER_PARTITION). In prefill the head runs
    # on one row per prompt: the layers are the work, and the default even split balances them.
    layers = LLAMA_SHAPE["num_layers"]
    cases = [("", 32, 16 if args.quick else 64, False, None, {}),
             ("_prefill", 64 if args.quick else 256, 8, True, f"{layers // 2},{layers - layers // 2}",
              {"max_num_batched_tokens": 512})]
    for suffix, plen, new, fresh, partition, extra in cases:
        prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
        runs, in_flight, partition, shared = pp_vs_uni(args, prompts, new, fresh, partition, model=random_llama(args),
                                               dtype="float32", max_model_len=plen + new + 8, **extra)
        v, b, h = (statistics.median(runs[k]) for k in ("pp", "uni", "uni_halves"))
        common = dict(batch=batch, prompt=plen, new_tokens=new, dtype="float32", prefix_cache_emptied=fresh,
                      cores=len(os.sched_getaffinity(0)), threads_per_stage=1, uni_threads=1, **extra)
        emit(f"pp2_overlap{suffix}_vs_uni_tokens_per_s", v, b, v / b, "tokens/s",
             ratio_is="value/baseline" + ("; target >= 1.6" if not suffix else ""),
             peak_steps_in_flight=in_flight, pp_partition=partition, shared_memory_handoff=shared,
             loadavg_1m=loadavg(), **common)
        g = statistics.median(runs["pp_gloo"])
        emit(f"pp2{suffix}_shm_handoff_vs_gloo_tokens_per_s", v, g, v / g, "tokens/s",
             ratio_is="value/baseline: the same PP=2 engine with the stages' hand-off through shared memory "
                      "vs through gloo send/recv (SPMD_ENGINE_DISABLE_SHM_HANDOFF=1)", pp_partition=partition,
             **common)
        emit(f"pp2_overlap{suffix}_ceiling_half_batches", 2 * h, b, 2 * h / b, "tokens/s",
             ratio_is="value/baseline: two stages each as fast as uni on a half batch, perfectly overlapped "
                      "(2 x uni tokens/s at batch/2), over uni at the whole batch: the most PP=2 with two "
                      "half-batch steps in flight can reach here, with no transfer or scheduling cost",
             uni_half_batch_tokens_per_s=round(h, 1), **common)


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 3) for _ in range(rng.randrange(32, 513))] for _ in range(n)]


def fig_mixed(args) -> None:
    """Issue 17's mixed batch: continuous batching against continuous batching."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from spmd_engine import LLM, SamplingParams
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notices on CPU
    model_dir = random_llama(args)
    new = 16 if args.quick else 64
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa").eval()
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    llm = LLM(model=model_dir, dtype="bfloat16", distributed_executor_backend="uni")  # default settings
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def ours(prompts):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return len(prompts) * new / dt

    def theirs(prompts):
        t = time.perf_counter()
        with torch.inference_mode():
            outs = hf.generate_batch(prompts, generation_config=gen, warmup=False)
        dt = time.perf_counter() - t
        assert len(outs) == len(prompts) and all(len(o.generated_tokens) == new for o in outs.values())
        return len(prompts) * new / dt

    try:
        warm = mixed_prompts(4, LLAMA_SHAPE["vocab_size"], seed=1)
        ours(warm), theirs(warm)
        for n, reps in ((64, 1 if args.quick else max(1, args.reps // 2)), (256, 1)):
            if args.quick and n > 64:
                continue
            prompts = mixed_prompts(n, LLAMA_SHAPE["vocab_size"])
            o, t = [], []
            for _ in range(reps):
                o.append(ours(prompts))
                t.append(theirs(prompts))
            v, b = statistics.median(o), statistics.median(t)
            emit(f"mixed_batch_{n}_tokens_per_s_bfloat16", v, b, v / b, "tokens/s",
                 ratio_is="value/baseline" + ("; target >= 5 (issue 23)" if n == 64 else ""), requests=n,
                 prompt_tokens="32-512 uniform", new_tokens=new, reps=reps,
                 baseline_is="transformers generate_batch (continuous batching, paged|sdpa), a manager per call",
                 threads=torch.get_num_threads(), loadavg_1m=loadavg())
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- batch_invariant
def fig_batch_invariant(args) -> None:
    """Issue 24's cost: batch-invariant mode against the default mode, same model, same run, in
    float32 and bfloat16 (each machine's native one is the figure to judge by): decode B=8 x 64
    new tokens, and the mixed 64-request batch. Target: ratio >= 0.5."""
    import torch

    from spmd_engine import LLM, SamplingParams
    model_dir = random_llama(args)
    new = 16 if args.quick else 64
    decode = prompts_for(8, 32, LLAMA_SHAPE["vocab_size"])
    mixed = mixed_prompts(16 if args.quick else 64, LLAMA_SHAPE["vocab_size"])
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        rates = {}
        for invariant in (False, True):
            llm = LLM(model=model_dir, dtype=dtype, distributed_executor_backend="uni", batch_invariant=invariant)
            try:
                llm.generate(decode[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
                for name, prompts in (("decode_b8", decode), ("mixed", mixed)):
                    runs = []
                    for _ in range(1 if args.quick else args.reps):
                        t = time.perf_counter()
                        llm.generate(prompts, sp)
                        runs.append(len(prompts) * new / (time.perf_counter() - t))
                    rates[name, invariant] = statistics.median(runs)
            finally:
                llm.shutdown()
        for name in ("decode_b8", "mixed"):
            v, b = rates[name, True], rates[name, False]
            emit(f"batch_invariant_{name}_tokens_per_s_{dtype}", v, b, v / b, "tokens/s",
                 ratio_is="batch-invariant / default mode; target >= 0.5", new_tokens=new,
                 requests=len(decode if name == "decode_b8" else mixed), reps=1 if args.quick else args.reps,
                 threads=torch.get_num_threads(), loadavg_1m=loadavg())


# ---------------------------------------------------------------- compile
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
    """Decode steps' attention in the C++ kernel (model/layers/decode_attention.py) against the
    torch code traced into the same compiled decode graph (SPMD_ENGINE_CPU_DECODE_ATTENTION=torch):
    uni bf16 engines, one of each in turns (the choice is part of the graph, and one process
    holds one uni engine at a time), each warmed up before it is timed."""
    import torch

    from spmd_engine import LLM, envs
    from spmd_engine.model.layers import decode_attention
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


# ---------------------------------------------------------------- startup
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
    argv = [str(HERE / "bench_rank.py"), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp)]
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
        base.append(torchrun(8, [str(HERE / "bench_rank.py"), "--help"])[0])
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


# ---------------------------------------------------------------- load
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


# ---------------------------------------------------------------- wave
def fig_wave(args) -> None:
    """What an idle replica pays per wave step: its dummy forward (one token through every
    layer, no KV write, no sampling), against one decode step of a busy replica at batch 8
    (from two runs differing only in new tokens, so prefill cancels out). Same process and
    model, interleaved repetitions. Under mp the step also carries the DP all-reduce and one
    RPC (tens of microseconds: the rpc figure)."""
    from spmd_engine import LLM, SamplingParams
    path = Path(args.workdir) / "qwen3moe_h512_l8_e16_k4"  # the moe figure's checkpoint
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **QWEN3_MOE_SHAPE)
    batch, plen, new = 8, 32, 16 if args.quick else 48
    prompts = prompts_for(batch, plen, QWEN3_MOE_SHAPE["vocab_size"])
    llm = LLM(model=str(path), dtype="float32", max_model_len=plen + new + 8, max_num_seqs=batch,
              distributed_executor_backend="uni", enable_prefix_caching=False)
    executor = llm.llm_engine.model_executor

    def run(tokens: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t

    def dummies(n: int = 50) -> float:
        t = time.perf_counter()
        for _ in range(n):
            executor.execute_dummy_batch()
        return (time.perf_counter() - t) / n

    try:
        run(4), dummies(5)
        steps, idle = [], []
        for _ in range(args.reps):
            steps.append((run(new) - run(1)) / (new - 1))
            idle.append(dummies())
    finally:
        llm.shutdown()
    v, b = statistics.median(idle), statistics.median(steps)
    emit("wave_idle_dummy_step_vs_decode_step", v * 1e3, b * 1e3, v / b, "ms",
         ratio_is="value/baseline: idle replica's dummy forward vs a batch-8 decode step; lower is cheaper",
         model="Qwen3-MoE random, 16 experts top-4, hidden 512, 8 layers", dtype="float32", batch=batch,
         prompt=plen, new_tokens=new, loadavg_1m=loadavg())


# ---------------------------------------------------------------- sampling
def fig_sampling(args) -> None:
    import torch

    from spmd_engine.sample.sampler import Sampler
    from spmd_engine.sampling_params import SamplingParams
    batch, vocab = 256, 152064
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    logits = (torch.randn(batch, vocab) * 2).to(device)
    ids = [f"r{i}" for i in range(batch)]
    kinds = {"greedy": SamplingParams(temperature=0.0), "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
             "temperature_only": SamplingParams(temperature=1.0)}
    samplers = {}
    for kind, params in kinds.items():
        samplers[kind] = Sampler()
        for i, rid in enumerate(ids):
            samplers[kind].add_request(rid, params, seed=1000 + i)

    def once(kind):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        samplers[kind].sample(ids, logits)  # ends with .tolist(): the ids on the host
        return time.perf_counter() - t0

    iters = 5 if args.quick else 15
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads} if device == "cpu" else {default_threads}):
        # (a loaded shared box hurts threaded ops most: both are reported)
        torch.set_num_threads(threads)
        for kind in kinds:
            once(kind)
        meds = {kind: [] for kind in kinds}
        load0 = loadavg()
        for _ in range(args.reps):
            for kind in kinds:
                meds[kind].append(statistics.median(once(kind) for _ in range(iters)))
        greedy = statistics.median(meds["greedy"])
        for kind in ("top_k_top_p", "temperature_only"):
            v = statistics.median(meds[kind])
            emit(f"sampling_{kind}_step_ms", v * 1e3, greedy * 1e3, v / greedy, "ms",
                 ratio_is="value/baseline, lower is better" + ("; target <= 2" if kind == "top_k_top_p" else ""),
                 value_is=f"Sampler.sample, {batch} rows {kinds[kind]!r}, per-request seeds",
                 baseline_is="Sampler.sample, the same rows greedy (argmax)", batch=batch, vocab=vocab,
                 device=device, threads=threads, iters=iters, reps=args.reps,
                 rep_medians_ms={k: [round(x * 1e3, 2) for x in meds[k]] for k in ("greedy", kind)},
                 loadavg_1m=[load0, loadavg()])
        fig_greedy_tokens(args, threads, device)
    torch.set_num_threads(default_threads)
    if device == "cpu":
        fig_greedy_engine(args)


def fig_greedy_tokens(args, threads: int, device: str) -> None:
    """The sampler's greedy choice (greedy_tokens: chunked amax on CPU) against torch's
    argmax, at decode's batch sizes over a 32k vocabulary, fp32 logits as the sampler sees them."""
    import torch

    from spmd_engine.sample.sampler import greedy_tokens
    iters = 20 if args.quick else 200
    for batch in (8, 32):
        logits = torch.randn(batch, 32000, generator=torch.Generator().manual_seed(batch)).to(device)
        fns = {"ours": greedy_tokens, "argmax": lambda x: x.argmax(dim=-1)}
        assert torch.equal(fns["ours"](logits), fns["argmax"](logits))
        meds = {k: [] for k in fns}
        for _ in range(args.reps):
            for k, f in fns.items():
                f(logits)
                t0 = time.perf_counter()
                for _ in range(iters):
                    f(logits)
                if device == "cuda":
                    torch.cuda.synchronize()
                meds[k].append((time.perf_counter() - t0) / iters)
        v, b = statistics.median(meds["ours"]), statistics.median(meds["argmax"])
        emit(f"sampling_greedy_tokens_b{batch}_us", v * 1e6, b * 1e6, v / b, "us",
             ratio_is="value/baseline, lower is better", value_is="sampler.greedy_tokens",
             baseline_is="torch.argmax(dim=-1)", batch=batch, vocab=32000, device=device, threads=threads,
             iters=iters, reps=args.reps, loadavg_1m=loadavg())


def fig_greedy_engine(args) -> None:
    """The same choice inside a uni engine's decode: LLM.generate with greedy_tokens, then with
    torch's argmax in its place, in turns in one process; the tokens must agree."""
    from spmd_engine import LLM, SamplingParams
    from spmd_engine.sample import sampler
    model_dir = random_llama(args)
    ours, argmax = sampler.greedy_tokens, (lambda x: x.argmax(dim=-1))
    new = 16 if args.quick else 64
    try:
        for batch in (8, 32):
            prompts = prompts_for(batch, 32, LLAMA_SHAPE["vocab_size"])
            llm = LLM(model=model_dir, dtype="bfloat16", max_num_seqs=batch, distributed_executor_backend="uni")
            time_engine(llm, prompts, 4)
            rates, tokens = {"ours": [], "argmax": []}, {}
            for _ in range(args.reps):
                for kind, f in (("argmax", argmax), ("ours", ours)):
                    sampler.greedy_tokens = f
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
                    rates[kind].append(batch * new / (time.perf_counter() - t0))
                    tokens[kind] = [o.outputs[0].token_ids for o in outs]
            llm.shutdown()
            assert tokens["ours"] == tokens["argmax"]
            v, b = statistics.median(rates["ours"]), statistics.median(rates["argmax"])
            emit(f"sampling_greedy_engine_tokens_per_s_b{batch}", v, b, v / b, "tokens/s", batch=batch, dtype="bfloat16",
                 new_tokens=new, reps=args.reps, ratio_is="value/baseline, higher is better",
                 baseline_is="the same engine with torch.argmax as its greedy choice", loadavg_1m=loadavg())
    finally:
        sampler.greedy_tokens = ours


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


def fig_async(args) -> None:
    """Decode tokens/s with async scheduling against the same engine without, engines built in
    turns (one uni engine per process at a time); the greedy tokens must be equal."""
    import torch

    from spmd_engine import LLM, SamplingParams
    model_dir = random_llama(args)
    plen, new = 32, (16 if args.quick else 64)
    cases = [("uni", 1, {}), ("uni", 8, {}), ("mp_tp2", 8, dict(tensor_parallel_size=2))]
    for label, batch, layout in cases:
        prompts = prompts_for(batch, plen, LLAMA_SHAPE["vocab_size"])
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens = {}
        for _ in range(args.reps):
            for flag in (False, True):
                with LLM(model=model_dir, dtype="bfloat16", max_model_len=plen + new + 8, max_num_seqs=batch,
                         async_scheduling=flag, **layout) as llm:
                    time_engine(llm, prompts, 4)
                    times[flag].append(time_engine(llm, prompts, new))
                    tokens[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
                    peak = llm.get_stats()[0]["peak_in_flight"]
                assert peak == (2 if flag else 1), peak
        assert tokens[True] == tokens[False], "async scheduling changed the greedy tokens"
        v, b = statistics.median(times[True]), statistics.median(times[False])
        emit(f"async_scheduling_{label}_b{batch}_tokens_per_s", v, b, v / b, "tokens/s", batch=batch, prompt=plen,
             new_tokens=new, dtype="bfloat16", reps=args.reps, threads=torch.get_num_threads(),
             loadavg_1m=loadavg(), value_is="async_scheduling=True", baseline_is="async_scheduling=False",
             ratio_is="value/baseline, higher is better")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and tokens (smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 5, quick 3)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "spmd_engine_bench"),
                    help="where the random checkpoint is written (reused between runs)")
    args = ap.parse_args()
    args.reps = args.reps or (3 if args.quick else 5)
    chosen = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = set(chosen) - set(FIGURES)
    if unknown:
        sys.exit(f"error: unknown figure(s) {sorted(unknown)}; choose from {','.join(FIGURES)}")
    os.makedirs(args.workdir, exist_ok=True)
    table = {"rpc": fig_rpc, "allreduce": fig_allreduce, "decode": fig_decode, "capacity": fig_capacity,
             "prefix": fig_prefix, "chunked": fig_chunked, "tp": fig_tp,
             "tp4": lambda a: fig_tp(a, 4), "pp": fig_pp, "mixed": fig_mixed, "startup": fig_startup, "load": fig_load,
             "moe": fig_moe, "wave": fig_wave, "sampling": fig_sampling, "batch_invariant": fig_batch_invariant,
             "compile": fig_compile, "decode_attention": fig_decode_attention, "cuda_graphs": fig_cuda_graphs,
             "async": fig_async}
    for name in FIGURES:
        if name in chosen:
            table[name](args)


if __name__ == "__main__":
    main()
