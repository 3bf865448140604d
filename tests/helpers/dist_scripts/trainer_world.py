"""A trainer's world shared with two LLMs in turn (TP=2 replicas, external_launcher).

The trainer builds its world first: under torchrun from the env (argv[1] == "env"), or
without any launcher variables from TRAINER_INIT (tcp:// or file://), TRAINER_RANK and
TRAINER_WORLD. It makes a subgroup of its own, then an LLM
generates and is shut down; the trainer's default group, its subgroup and a group it makes
afterwards must all still work, and a second LLM in the same process must give the same text.
One REPORT line per rank.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from spmd_engine import LLM, SamplingParams


def generate_once() -> tuple[int, int, str, int]:
    """Replica index, the engine's world rank, the greedy text, and how many groups the engine made."""
    from spmd_engine.distributed import get_world_group
    from spmd_engine.distributed.parallel_state import model_parallel_groups
    with LLM(tensor_parallel_size=2, distributed_executor_backend="external_launcher", seed=0) as llm:
        replica = llm.replica_index
        prompt = ["Beautiful is", "Errors should"][replica]
        text = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
        rank = llm.llm_engine.model_executor.driver_worker.rank
        assert rank == get_world_group().rank == dist.get_rank(), (rank, dist.get_rank())
        made = len(model_parallel_groups())
    assert not model_parallel_groups(), "shutdown left engine groups registered"
    return replica, rank, text, made


def world_sum(group=None) -> int:
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total, group=group)
    return int(total.item())


if __name__ == "__main__":
    if sys.argv[1] == "env":
        dist.init_process_group("gloo")
    else:
        assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
        dist.init_process_group("gloo", init_method=os.environ["TRAINER_INIT"],
                                rank=int(os.environ["TRAINER_RANK"]), world_size=int(os.environ["TRAINER_WORLD"]))
    rank = dist.get_rank()
    # The trainer's own subgroups (every rank makes every group, in the same order).
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    first = generate_once()
    after = [world_sum(), world_sum(mine)]
    later = dist.new_group([0, 1, 2, 3])  # a group made after the engine's teardown
    after.append(world_sum(later))
    second = generate_once()
    after.append(world_sum())
    barrier_ok = dist.barrier(group=mine) is None
    sys.stdout.write("REPORT " + json.dumps({
        "rank": rank, "first": first, "second": second, "sums": after, "barrier": barrier_ok,
        "default_alive": dist.is_initialized()}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
