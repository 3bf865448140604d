"""`python -m benchmarks` (and scripts/bench.py, the command the docs give): pick figures, run
them in a fixed order, one JSON line per figure on stdout.

The order is fixed, whatever --only's order, so two runs' lines line up; figures that build a
checkpoint share it through --workdir, reused between runs, so only the first run pays for it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap

from benchmarks import (
    compilation,
    decode,
    lora,
    mixed,
    moe,
    parallel,
    sampling,
    scheduler,
    startup,
    structured,
    transport,
    weight_transfer,
)

# name: (function, what it measures, against what). The order is the run order.
FIGURES = {
    "rpc": (transport.fig_rpc, """MultiprocExecutor.collective_rpc("check_health"), TP=2 workers, vs a
multiprocessing.Pipe echo (ratio = value / baseline, lower is better)"""),
    "allreduce": (transport.fig_allreduce, "TP all-reduce 32 KiB, 2 ranks: shared memory vs gloo (bench_allreduce.py)"),
    "decode": (decode.fig_decode, """LLM.generate (uni) tokens/s vs HF transformers generate (or a plain PyTorch
decode loop) on the same random Llama weights, fp32 and bf16; plus the fraction of the
memory-bandwidth roofline (bandwidth measured by a tensor sum) at B=1, 8 and 32, beside the
fraction the step's weight matmuls alone reach (the ceiling here)"""),
    "capacity": (scheduler.fig_capacity, """paged KV: peak concurrent requests (64 x 32-token prompts + 32 new tokens)
under the KV budget of 4 max_model_len=4096 slots, vs those 4 slots"""),
    "prefix": (scheduler.fig_prefix, """8 prompts of 512 tokens x 8 copies, 16 new tokens: tokens/s with prefix
caching vs without"""),
    "chunked": (scheduler.fig_chunked, """7 running decodes + a 4096-token prompt arriving: the decodes' worst
inter-token gap without chunked prefill vs with it (budget 256)"""),
    "tp": (parallel.fig_tp, "TP=2 mp (one thread per rank) vs uni (two threads), same model and batch"),
    "tp4": (lambda args: parallel.fig_tp(args, 4), """TP=4 mp on this host (processes may outnumber cores) vs
uni, tokens/s"""),
    "pp": (parallel.fig_pp, """PP=2 mp, one thread per stage, two steps in flight (batch queue) vs uni with one
thread, 32 requests, tokens/s; same output tokens asserted; plus the ceiling of that design here:
2 x uni's tokens/s on half batches, over uni on the whole batch. Decode-bound (32-token prompts,
64 new tokens: the target) and prefill-bound (256-token prompts computed every run, 8 new tokens,
chunks of 512 tokens); and the stages' hand-off through shared memory vs gloo"""),
    "mixed": (mixed.fig_mixed, """64 requests, prompts 32-512 tokens, 64 new tokens, default settings, uni bf16 vs
transformers' continuous batching (generate_batch, "paged|sdpa") on the same weights, tokens/s;
256 requests too (one rep each)"""),
    "startup": (startup.fig_startup, """torchrun world 8 (TP2 PP2 DP2, bundled model): launch to first token of
`spmd_engine.run`, and phases from scripts/bench_rank.py; group creation vs number of groups
(worlds 2, 4, 8); launcher-store operations per rank from the layout alone"""),
    "load": (startup.fig_load, """peak RSS per rank at TP 1, 2, 4 vs checkpoint size; load throughput vs reading
the file"""),
    "moe": (moe.fig_moe, """MoE decode B=8 bf16 (uni) tokens/s vs transformers generate on the same random
Qwen3-MoE-shaped checkpoint (16 experts top-4, hidden 512, 8 layers)"""),
    "wave": (moe.fig_wave, """DP waves: an idle replica's wave step (a dummy forward of one token) vs a real
decode step at batch 8, random Qwen3-MoE (16 experts top-4, hidden 512), fp32, uni
(ratio = value / baseline, lower is cheaper)"""),
    "sampling": (sampling.fig_sampling, """Sampler.sample for B=256 rows x V=152,064 (fp32 logits on the device,
cuda when present): per-row temperature 0.8 / top-k 50 / top-p 0.9 with per-request seeds vs
all-greedy rows (argmax) in the same run (ratio = value / baseline, target <= 2); also
temperature 1 alone (the full-vocabulary path); at 1 thread and the default; then the greedy
choice vs torch's argmax, alone and in the engine"""),
    "batch_invariant": (mixed.fig_batch_invariant, """batch-invariant mode vs the default mode, uni, fp32 and
bf16: decode B=8 and the mixed 64-request batch, tokens/s (target >= 0.5)"""),
    "compile": (compilation.fig_compile, """compiled forward (default) vs enforce_eager, same run: decode B=1, 8,
32 and a prefill batch, fp32 and bf16; first start's compile seconds (empty inductor cache);
warm-cache start-up (fresh process, import + LLM()) vs eager start-up"""),
    "decode_attention": (compilation.fig_decode_attention, """decode steps' attention traced into the compiled
graph vs the opaque paged attention op, one uni bf16 engine, B=8 and B=32, in turns; then the
C++ decode-attention kernel vs the traced torch code (where the kernel is usable)"""),
    "cuda_graphs": (compilation.fig_cuda_graphs, """CUDA only: bf16 decode tokens/s with decode steps replayed as
CUDA graphs (the default) vs enforce_eager, B=1, 8 and 32"""),
    "structured": (structured.fig_structured, """structured outputs: decode B=8 bf16 (uni) with every request under a
JSON schema vs the same requests unconstrained, same engine in turns, tokens/s (target >= 0.8); the
first constrained request (grammar compiled against the 32k vocabulary) vs the same request
unconstrained, seconds"""),
    "lora": (lora.fig_lora, """LoRA adapters: decode B=8 bf16 (uni) with every request on one rank-16 adapter
(all 7 targets), and with four adapters mixed in the batch, vs the same requests on the base
model, same engine in turns, tokens/s (targets >= 0.7 and >= 0.6)"""),
    "weight_transfer": (weight_transfer.fig_weight_transfer, """seconds to push the bench model from a trainer
(a thread) into a running uni engine through the four-phase weight transfer (nccl backend: gloo on CPU,
packed buckets, applied into the engine's weights) vs a plain gloo broadcast of the same tensors, same run
(ratio = baseline / value, target >= 0.8); bytes per second of both"""),
    "async": (scheduler.fig_async, """async scheduling (step k+1 scheduled while step k runs) vs the same engine
without, decode tokens/s: uni bf16 at B=1 and 8 (the worker on a step thread) and mp TP=2 at
B=8 (the engine process schedules while its workers run), engines in turns; same tokens
asserted"""),
}


def figure_list() -> str:
    return "figures (run in this order):\n" + "\n".join(
        textwrap.fill(" ".join(text.split()), width=100, initial_indent=f"  {name:<17} ", subsequent_indent=" " * 20)
        for name, (_, text) in FIGURES.items())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks" if sys.argv[0].endswith("__main__.py") else None,
        description=textwrap.fill(
            "spmd_engine benchmarks, each figure a ratio against a baseline measured in the same run. One JSON "
            'line per figure: {"name", "value", "baseline", "ratio", "unit", "params"}; value and baseline are '
            "medians over --reps repetitions, interleaved; ratio > 1 means better than the baseline except where "
            'params["ratio_is"] says otherwise.', width=100),
        epilog=figure_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    ap.add_argument("--quick", action="store_true", help="fewer iterations and tokens (smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 5, quick 3)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "spmd_engine_bench"),
                    help="where the random checkpoint is written (reused between runs)")
    args = ap.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 5)
    chosen = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = set(chosen) - set(FIGURES)
    if unknown:
        sys.exit(f"error: unknown figure(s) {sorted(unknown)}; choose from {','.join(FIGURES)}")
    os.makedirs(args.workdir, exist_ok=True)
    for name, (figure, _) in FIGURES.items():
        if name in chosen:
            figure(args)
