"""Figures tp, tp4 and pp: the parallel layouts on one host against the uni engine on the same
requests. On a machine with few cores the question is whether the layouts' machinery (processes,
collectives, the PP hand-off) costs less than it overlaps, so PP is also set beside its ceiling:
what two perfectly overlapped stages would reach with no transfer or scheduling cost."""

from __future__ import annotations

import os
import statistics
import time

from benchmarks.harness import LLAMA_SHAPE, emit, loadavg, prompts_for, random_llama, time_engine


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
    norms, rotary and attention count beside its matmuls. (Matmuls alone misjudge it: the head's
    one big matrix weighs more layers by bytes and by the kernel's matmul time than by whole
    layers' time, which moves a layer too many onto stage 0; docs/performance.md has the case.)"""
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
    """Issue 17's PP overlap (each stage idles half the time without steps in flight, so no
    faster than uni), on a decode-bound batch (the target) and a prefill-bound one, each beside
    its half-batch ceiling."""
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
