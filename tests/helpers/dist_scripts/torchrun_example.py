"""vLLM's tests/distributed/test_torchrun_example.py, replayed on our engine (TP 2, torchrun).

Each rank passes its own memory settings (gpu_memory_utilization, swap_space and, since the
CPU budget is what counts here, kv_cache_memory_bytes), and no seed (vLLM's default, 0).
All ranks must agree on one KV cache configuration, read where vLLM users read it, and
print the same text. Every rank checks against rank 0 with broadcast_object_list over the
engine's world CPU group, as the vLLM test does; a mismatch exits non-zero.
"""

import random
import sys

import torch.distributed as dist

from spmd_engine import LLM, SamplingParams
from spmd_engine.distributed import get_world_group

prompts = ["Beautiful is", "Explicit is", "Simple is", "Flat is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)

rank_random = random.Random()  # unseeded: each rank draws its own settings
llm = LLM(tensor_parallel_size=2, distributed_executor_backend="external_launcher",
          gpu_memory_utilization=rank_random.uniform(0.7, 0.9), swap_space=rank_random.randint(1, 4),
          kv_cache_memory_bytes=rank_random.randint(1 << 20, 4 << 20))
outputs = llm.generate(prompts, sampling_params)
cpu_group = get_world_group().cpu_group
torch_rank = dist.get_rank(group=cpu_group)


def check_consistent_across_ranks(obj):
    container = [obj if torch_rank == 0 else None]
    dist.broadcast_object_list(container, src=0, group=cpu_group)
    assert container[0] == obj, (torch_rank, container[0], obj)


cache = llm.llm_engine.vllm_config.cache_config
check_consistent_across_ranks(cache.num_cpu_blocks)
check_consistent_across_ranks(cache.num_gpu_blocks)
for output in outputs:
    check_consistent_across_ranks(output.prompt)
    check_consistent_across_ranks(output.outputs[0].text)
    # One write per line: unbuffered, print() writes the text and its newline apart, and the
    # ranks' lines would run together in the shared pipe.
    sys.stdout.write(f"Rank {torch_rank}, Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}\n")
    sys.stdout.flush()
sys.stdout.write(f"Rank {torch_rank} blocks {cache.num_gpu_blocks} {cache.num_cpu_blocks}\n")
sys.stdout.flush()
llm.shutdown()
