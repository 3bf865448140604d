"""What every figure shares: the JSON line it prints, the machine it ran on, the models and
requests it runs, and the one timed call most figures are built from.

A figure is a ratio against a baseline measured in the same run, repetitions interleaved, so the
noise of a shared machine hits both sides; only the same run's ratio means anything. Every line
carries the CPU it was measured on, because figures from one kind of machine say nothing of
another (which dtype is native, which kernels run)."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path

from make_random_checkpoint import make_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"  # the measurement scripts some figures run or reuse (bench_rank.py, bench_allreduce.py)

LLAMA_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536,
                   vocab_size=32000, max_position_embeddings=8192)
QWEN3_MOE_SHAPE = dict(architecture="Qwen3MoeForCausalLM", hidden_size=512, num_layers=8, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=1536, vocab_size=32000,
                       max_position_embeddings=8192, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=256, norm_topk_prob=True)


def emit(name, value, baseline, ratio, unit, **params) -> None:
    """One figure as one JSON line, flushed at once: docs/performance.md's tables are built from
    these lines, and a run cut short keeps the figures it finished."""
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
    nothing of another (bf16 is far slower than fp32 where it is emulated), so every figure
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


def random_llama(args) -> str:
    """The bench Llama (LLAMA_SHAPE, random weights) in --workdir, written once and reused by
    every figure and every run: the figures compare engines, not checkpoints."""
    path = Path(args.workdir) / "llama_h512_l8_p8k"
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **LLAMA_SHAPE)
    return str(path)


def random_qwen3_moe(args) -> str:
    """The MoE figures' Qwen3-MoE-shaped checkpoint (QWEN3_MOE_SHAPE), as random_llama."""
    path = Path(args.workdir) / "qwen3moe_h512_l8_e16_k4"
    if not (path / "config.json").exists():
        make_random_checkpoint(path, **QWEN3_MOE_SHAPE)
    return str(path)


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Fixed prompts (no tokenizer, no randomness): the same requests in every run and engine."""
    return [[(7919 * i + 31 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch)]


def time_engine(llm, prompts, new_tokens: int) -> float:
    """Tokens/s of one greedy LLM.generate that must produce every token it was asked for
    (ignore_eos), so engines that stop early cannot look faster."""
    from spmd_engine import SamplingParams
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of 32-512 tokens, seeded: the mixed batches' uneven lengths, the same each run."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 3) for _ in range(rng.randrange(32, 513))] for _ in range(n)]
