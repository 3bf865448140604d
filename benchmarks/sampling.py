"""Figure sampling: the sampler's cost on a large batch and vocabulary, sampling rows against
greedy rows in the same run, at one thread and the default; then its greedy choice against
torch's argmax, alone and inside the engine's decode (where the tokens must agree)."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama, time_engine


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
