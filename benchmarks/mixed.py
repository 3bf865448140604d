"""Figures mixed and batch_invariant, on batches of uneven prompts: the engine's continuous
batching against transformers' own, and what batch-invariant mode (the same tokens whatever the
batch) costs against the default mode."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, mixed_prompts, prompts_for, random_llama


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
