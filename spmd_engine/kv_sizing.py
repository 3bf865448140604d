"""How many KV cache blocks a rank gets: pure arithmetic, shared by the workers and the front end.

The front end runs it before any process starts (an explicit or CPU budget
too small for one sequence is a usage error, exit 2); each worker runs it
again with its device's real numbers, and the replica (under
external_launcher, the whole launched world) takes the minimum, so every
scheduler copy manages the same number of blocks.
"""

from __future__ import annotations

from spmd_engine.config import CacheConfig, ConfigError

GiB = 1 << 30
CPU_DEFAULT_CAP = 4 * GiB
CPU_DEFAULT_FRACTION = 0.4  # of available host memory, shared by the processes on the host
CUDA_RESERVE_BYTES = 256 << 20  # CUDA context, allocator slack, collectives


def kv_bytes_per_token(num_layers: int, num_kv_heads_per_rank: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token across a stage's layers, on one rank."""
    return 2 * num_layers * num_kv_heads_per_rank * head_dim * itemsize


def cpu_budget(cache: CacheConfig, available_bytes: int, procs_on_host: int) -> int:
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    return int(min(CPU_DEFAULT_CAP, CPU_DEFAULT_FRACTION * available_bytes / max(1, procs_on_host)))


def cuda_budget(cache: CacheConfig, total_bytes: int, free_bytes: int, activation_bytes: int) -> int:
    """gpu_memory_utilization of the device, less what is already in use (weights, other
    processes) and a reserve for one step's activations."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    in_use = total_bytes - free_bytes
    return int(cache.gpu_memory_utilization * total_bytes) - in_use - activation_bytes - CUDA_RESERVE_BYTES


def activation_bytes(max_num_batched_tokens: int, hidden_size: int, intermediate_per_rank: int,
                     vocab_per_rank: int, max_num_seqs: int, itemsize: int) -> int:
    """A step's largest live activations, estimated: the residual stream and a few hidden-sized
    temporaries per token, the MLP's gate/up product, and fp32 logits for the sampled rows."""
    per_token = (6 * hidden_size + 3 * intermediate_per_rank) * itemsize
    return max_num_batched_tokens * per_token + max_num_seqs * vocab_per_rank * 4 * 2


def num_blocks_for(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    return max(0, budget_bytes) // (block_size * max(1, bytes_per_token))


def check_fits(num_blocks: int, block_size: int, max_model_len: int, bytes_per_token: int,
               budget_bytes: int) -> None:
    """One max_model_len sequence must fit, or nothing could ever finish."""
    if num_blocks * block_size < max_model_len:
        need = -(-max_model_len // block_size) * block_size * bytes_per_token
        raise ConfigError(
            f"KV cache budget {budget_bytes} bytes per rank holds {num_blocks} blocks of {block_size} tokens "
            f"= {num_blocks * block_size} tokens, fewer than max_model_len {max_model_len} "
            f"({bytes_per_token} bytes per token; one sequence needs {need} bytes): raise "
            f"--kv-cache-memory-bytes or --gpu-memory-utilization, or lower --max-model-len"
        )


def describe(num_blocks: int, block_size: int, bytes_per_token: int) -> str:
    tokens = num_blocks * block_size
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens = {tokens} tokens, "
            f"{tokens * bytes_per_token / GiB:.3f} GiB per rank")
