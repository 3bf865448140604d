"""A trainer's process group, reused by an LLM for rollouts, and left intact afterwards."""

import sys

import torch
import torch.distributed as dist

from spmd_engine import LLM, SamplingParams

if __name__ == "__main__":
    dist.init_process_group("gloo")  # the trainer's world: 4 ranks
    with LLM(tensor_parallel_size=2, seed=0) as llm:  # 2 external-DP replicas inside the trainer's world
        replica = llm.replica_index
        prompt = ["Beautiful is", "Errors should"][replica]
        text = llm.generate([prompt], SamplingParams(max_tokens=12))[0].outputs[0].text
    assert dist.is_initialized(), "the LLM destroyed the trainer's group"
    total = torch.tensor([1.0])
    dist.all_reduce(total)  # the trainer carries on with its own group
    print(f"rank {dist.get_rank()} replica {replica} text {text!r} world-sum {total.item():g}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)
