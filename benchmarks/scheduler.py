"""Figures capacity, prefix, chunked and async: what the scheduler buys, each against the
same engine without the feature (or, for capacity, against one max_model_len slot per sequence,
what a cache without pages must reserve). One uni engine per process at a time, so the two sides
are built, timed and shut down in turns."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama, time_engine


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
