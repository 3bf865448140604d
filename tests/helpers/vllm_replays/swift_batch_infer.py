"""ms-swift's batch inference under torchrun (swift/pipelines/infer/infer.py): an engine seed
per data-parallel replica, the dataset sharded contiguously over the replicas, the results
gathered and written by rank 0."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from vllm_replays.common import (
    Gaps,
    Launch,
    collect,
    import_engine_classes,
)
from vllm_replays.swift_engine import swift_engine_args, swift_infer

SWIFT_INFER = {"seed": 42, "vllm_tensor_parallel_size": 1, "max_new_tokens": 6}


def contiguous_shard(items: list, num_shards: int, index: int) -> list:
    """datasets.Dataset.shard(num_shards, index, contiguous=True)."""
    div, mod = divmod(len(items), num_shards)
    start = div * index + min(index, mod)
    return items[start:start + div + (1 if index < mod else 0)]


def swift_batch_infer(cfg: dict, launch: Launch) -> dict:
    gaps = Gaps()
    EngineArgs, LLMEngine = import_engine_classes(gaps)
    args = SWIFT_INFER
    tp = args["vllm_tensor_parallel_size"]
    seed = args["seed"]
    if launch.external:  # is_dist(): a different seed for each data-parallel replica
        seed += launch.rank // tp
    engine = LLMEngine.from_engine_args(swift_engine_args(EngineArgs, cfg["orig"], launch, tp, seed, False, None, 256))
    dataset = cfg["prompts"]
    rank = launch.rank // tp if launch.external else -1
    data_parallel_size = launch.world // tp
    if rank >= 0 and data_parallel_size > 1:
        dataset = contiguous_shard(dataset, data_parallel_size, rank)
    request = {"max_tokens": args["max_new_tokens"]}  # temperature etc. unset: the generation config's
    results = swift_infer(engine, dataset, request, cfg["swift_stop"], [0])
    if launch.external and launch.rank % tp != 0:
        results = []
    written = None
    if launch.external:  # JsonlWriter.append(result, gather_obj=True): gather_object, rank 0 writes
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        results = [r for chunk in gathered for r in chunk]
    if launch.rank == 0:
        path = os.path.join(cfg["out_dir"], f"swift_infer_{launch.backend}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
        with open(path) as f:
            written = [json.loads(line) for line in f]
    engine = None
    collect()
    return {"seed": seed, "shard": dataset, "written": written, "gaps": gaps.found}
