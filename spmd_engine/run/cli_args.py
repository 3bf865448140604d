"""Flags shared by `spmd_engine.run` and `spmd_engine.plan`, with vLLM's names.

One definition serves both CLIs so a layout that `plan` prints is exactly the
layout `run` launches. Usage errors leave through `UsageParser.error`: one
`error: ...` line on stderr and exit code 2, never a usage dump or traceback.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from spmd_engine.config import BACKENDS, CacheConfig, ConfigError, ParallelConfig, SchedulerConfig
from spmd_engine.run.stderr_line import report

EXIT_USAGE = 2


MAX_INT_FLAG = 2 ** 53  # beyond it no count, size or seed means anything, and torch's int64 math overflows


def bounded_int(text: str) -> int:
    """An int flag's value, refused past MAX_INT_FLAG (a typo, never a real size)."""
    value = int(text)
    if abs(value) > MAX_INT_FLAG:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most 2**53 in size)")
    return value


def seconds(text: str) -> float:
    """A time limit: a finite number of seconds > 0 (and below a year: timedelta's range)."""
    value = float(text)
    if not 0 < value <= 365 * 86400:
        raise argparse.ArgumentTypeError(f"{text} is not a time limit (seconds, > 0, at most a year)")
    return value


class UsageParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit 2, on every rank. Every int flag is
    a bounded_int."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", int, bounded_int)  # argument groups share this registry

    def error(self, message: str) -> NoReturn:
        report(f"error: {message}")
        raise SystemExit(EXIT_USAGE)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N")
    group.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1, metavar="N")
    group.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1, metavar="N")
    group.add_argument("--enable-expert-parallel", action="store_true")
    group.add_argument("--distributed-executor-backend", choices=BACKENDS, default=None)
    group.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes the launch spans (device and local-rank mapping)")


def parallel_config_from_args(args: argparse.Namespace, data_parallel_rank: int = 0) -> ParallelConfig:
    """Build and validate the ParallelConfig; raises ConfigError on a bad layout."""
    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        data_parallel_rank=data_parallel_rank,
        nnodes=args.nnodes,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """The paged KV cache and the step's token budget (vLLM's flags)."""
    group = parser.add_argument_group("KV cache and batching")
    group.add_argument("--block-size", type=int, default=16, metavar="TOKENS")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                       help="fraction of each GPU for weights + KV cache (CUDA)")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                       help="KV cache budget per rank (CPU and CUDA); overrides --gpu-memory-utilization")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="token budget of one step (default 8192 with chunked prefill, "
                            "else max(max_model_len, 2048))")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                       help="schedule the next step while one runs (vLLM's; not with PP)")


def check_cache_args(args: argparse.Namespace) -> CacheConfig:
    """Validate the cache flags alone (before any model is read); raises ConfigError naming the flag."""
    try:
        cache = CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                            enable_prefix_caching=args.enable_prefix_caching)
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=args.enable_chunked_prefill)
    except ConfigError as exc:
        raise ConfigError(f"{_flag_of(str(exc))}: {exc}") from None
    return cache


def _flag_of(message: str) -> str:
    name = message.split(" ", 1)[0]
    return "--" + name.replace("_", "-")
