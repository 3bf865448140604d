"""Figures moe and wave, on a random Qwen3-MoE-shaped checkpoint: MoE decode against
transformers, and what data parallelism's lock-step waves cost a replica with nothing to do
(its dummy step) beside a real decode step."""

from __future__ import annotations

import statistics
import time

from benchmarks.decode import hf_generator
from benchmarks.harness import QWEN3_MOE_SHAPE, emit, loadavg, prompts_for, random_qwen3_moe, time_engine


def fig_moe(args) -> None:
    """Qwen3-MoE decode, bf16, B=8: LLM (uni) vs transformers generate, interleaved reps."""
    import torch

    from spmd_engine import LLM
    path = random_qwen3_moe(args)
    batch, plen, new = 8, 32, (16 if args.quick else 64)
    prompts = prompts_for(batch, plen, QWEN3_MOE_SHAPE["vocab_size"])
    llm = LLM(model=path, dtype="bfloat16", max_model_len=plen + new + 8, max_num_seqs=batch,
              distributed_executor_backend="uni")
    ref, kind = hf_generator(path, torch.bfloat16)
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


def fig_wave(args) -> None:
    """What an idle replica pays per wave step: its dummy forward (one token through every
    layer, no KV write, no sampling), against one decode step of a busy replica at batch 8
    (from two runs differing only in new tokens, so prefill cancels out). Same process and
    model, interleaved repetitions. Under mp the step also carries the DP all-reduce and one
    RPC (tens of microseconds: the rpc figure)."""
    from spmd_engine import LLM, SamplingParams
    path = random_qwen3_moe(args)  # the moe figure's checkpoint
    batch, plen, new = 8, 32, 16 if args.quick else 48
    prompts = prompts_for(batch, plen, QWEN3_MOE_SHAPE["vocab_size"])
    llm = LLM(model=path, dtype="float32", max_model_len=plen + new + 8, max_num_seqs=batch,
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
