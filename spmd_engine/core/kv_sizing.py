"""How many KV cache blocks a rank gets: pure arithmetic, shared by the workers and the front end.

The front end runs it before any process starts (an explicit or CPU budget
too small for one sequence is a usage error, exit 2); each worker runs it
again with its device's real numbers, and the replica (under
external_launcher, the whole launched world) takes the minimum, so every
scheduler copy manages the same number of blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from spmd_engine.config import CacheConfig, ConfigError, EngineConfig

GiB = 1 << 30
CPU_DEFAULT_CAP = 4 * GiB
CPU_DEFAULT_FRACTION = 0.4  # of available host memory, shared by the processes on the host
CUDA_RESERVE_BYTES = 256 << 20  # CUDA context, allocator slack, collectives


def kv_bytes_per_token(num_layers: int, num_kv_heads_per_rank: int, head_dim: int, itemsize: int) -> int:
    """K and V of one token across a stage's layers, on one rank."""
    return 2 * num_layers * num_kv_heads_per_rank * head_dim * itemsize


def host_share(parallel_config) -> tuple[int, int]:
    """(available host memory in bytes, this job's processes on the host) for the CPU budget."""
    from spmd_engine import envs
    pc = parallel_config
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available, envs.local_world_size(pc.world_size * pc.data_parallel_size)


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


def step_activation_bytes(scheduler_config, spec, tp_size: int, itemsize: int) -> int:
    """`activation_bytes` for this model at this TP size and step budget: what a CUDA rank
    reserves (its runner) and what `plan --gpu-memory` reserves for it, from one place."""
    sc = scheduler_config
    return activation_bytes(sc.max_num_batched_tokens or 8192, spec.hidden_size, spec.intermediate_size // tp_size,
                            -(-spec.vocab_size // tp_size), sc.max_num_seqs, itemsize)


def rank_budget(config: EngineConfig, spec, tp_size: int, itemsize: int,
                device_memory: tuple[int, int] | None) -> int:
    """One rank's KV budget: on a GPU (`device_memory` = its (free, total) bytes) the CUDA rule
    less a step's activations; on CPU (None) the host rule. The runner passes what its device
    reports; the plan passes a card's size less the weights it computed."""
    if device_memory is None:
        return cpu_budget(config.cache_config, *host_share(config.parallel_config))
    free, total = device_memory
    act = step_activation_bytes(config.scheduler_config, spec, tp_size, itemsize)
    return cuda_budget(config.cache_config, total, free, act)


def num_blocks_for(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    return max(0, budget_bytes) // (block_size * max(1, bytes_per_token))


def sequence_tokens(max_model_len: int, block_size: int, window: int | None = None,
                    max_num_batched_tokens: int | None = None) -> int:
    """The cache, in tokens, one sequence of max_model_len holds at its peak. With every layer's
    sliding window `window` (the KV cache manager frees blocks behind it) no more than a step's
    chunk, the W - 1 keys before it and a block each side cut part way: so a model whose windows
    are short serves sequences longer than its cache."""
    if window is None or max_num_batched_tokens is None:
        return max_model_len
    return min(max_model_len, (-(-(window - 1 + max_num_batched_tokens) // block_size) + 1) * block_size)


def check_fits(num_blocks: int, block_size: int, max_model_len: int, bytes_per_token: int,
               budget_bytes: int, window: int | None = None, max_num_batched_tokens: int | None = None) -> None:
    """One max_model_len sequence must fit, or nothing could ever finish (`sequence_tokens`)."""
    need_tokens = sequence_tokens(max_model_len, block_size, window, max_num_batched_tokens)
    if need_tokens < max_model_len and num_blocks * block_size < need_tokens:
        raise ConfigError(
            f"KV cache budget {budget_bytes} bytes per rank holds {num_blocks} blocks of {block_size} tokens, "
            f"fewer than the {need_tokens} tokens one sequence holds at once (sliding window {window}, "
            f"max_num_batched_tokens {max_num_batched_tokens}): raise --kv-cache-memory-bytes or "
            f"--gpu-memory-utilization, or lower --max-num-batched-tokens"
        )
    if need_tokens == max_model_len and num_blocks * block_size < max_model_len:
        need = -(-max_model_len // block_size) * block_size * bytes_per_token
        raise ConfigError(
            f"KV cache budget {budget_bytes} bytes per rank holds {num_blocks} blocks of {block_size} tokens "
            f"= {num_blocks * block_size} tokens, fewer than max_model_len {max_model_len} "
            f"({bytes_per_token} bytes per token; one sequence needs {need} bytes): raise "
            f"--kv-cache-memory-bytes or --gpu-memory-utilization, or lower --max-model-len "
            f"(default: the model's max_position_embeddings)"
        )


def describe(num_blocks: int, block_size: int, bytes_per_token: int) -> str:
    tokens = num_blocks * block_size
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens = {tokens} tokens, "
            f"{tokens * bytes_per_token / GiB:.3f} GiB per rank")


def describe_window(window: int | None, scheduler_config, block_size: int) -> str:
    """What `describe` leaves out for a sliding-only model: a sequence's most tokens held."""
    if window is None:
        return ""
    sc = scheduler_config
    held = sequence_tokens(sc.max_model_len, block_size, window, sc.max_num_batched_tokens)
    return f"; sliding window {window} on every layer: a sequence holds at most {held} tokens"


@dataclass
class KVPlan:
    """The KV cache a launch will get per rank, as far as it is known before any process starts."""

    bytes_per_token: int  # on the rank with the most layers
    budget_bytes: int | None  # None: known only on the device (CUDA without an explicit budget)
    block_size: int
    source: str

    @property
    def num_blocks(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return num_blocks_for(self.budget_bytes, self.block_size, self.bytes_per_token)

    def describe(self, max_model_len: int) -> str:
        head = f"KV cache: {self.bytes_per_token} bytes per token per rank"
        if self.num_blocks is None:
            return f"{head}; budget {self.source}"
        tokens = self.num_blocks * self.block_size
        if tokens < max_model_len:
            return (f"{head}; budget {self.budget_bytes} bytes per rank ({self.source}) = {tokens} tokens: "
                    f"too small for one sequence of max_model_len {max_model_len}")
        return (f"{head}; budget {self.budget_bytes / GiB:.3f} GiB per rank ({self.source}) = {self.num_blocks} "
                f"blocks of {self.block_size} tokens = {tokens} tokens = {tokens // max_model_len} sequences "
                f"of max_model_len {max_model_len}")


def plan_kv(config: EngineConfig, spec, itemsize: int, available_bytes: int, procs_on_host: int,
            layers: int) -> KVPlan:
    """From the model's shape and the layout (`layers`: the decoder layers of the fullest PP
    stage): bytes per token on that stage, and the budget when it does not depend on a device
    (explicit, or the CPU default on this host)."""
    pc, cache = config.parallel_config, config.cache_config
    tp = pc.tensor_parallel_size
    kv_heads = 1 if tp > spec.num_kv_heads else spec.num_kv_heads // tp  # TP > KV heads replicates them
    per_token = kv_bytes_per_token(layers, kv_heads, spec.head_dim, itemsize)
    if spec.mla is not None:  # DeepSeek: one latent + rotary key per token, every rank
        per_token = layers * spec.mla.cache_width * itemsize
    if cache.kv_cache_memory_bytes is not None:
        return KVPlan(per_token, cache.kv_cache_memory_bytes, cache.block_size, "--kv-cache-memory-bytes")
    if config.device != "cpu":
        return KVPlan(per_token, None, cache.block_size,
                      f"{cache.gpu_memory_utilization:g} of each GPU less weights and activations, "
                      f"measured on the device (give --gpu-memory SIZE to plan it here)")
    budget = cpu_budget(cache, available_bytes, procs_on_host)
    return KVPlan(per_token, budget, cache.block_size,
                  f"CPU default: min(4 GiB, 40% of available memory / {procs_on_host} processes)")
