"""Run under torchrun on a GPU node: NCCL collectives through spmd_engine's groups.

Every rank takes cuda:LOCAL_RANK, joins the default group with NCCL, builds one
TP group spanning the world, and checks an all-reduce and an all-gather of CUDA
tensors against closed forms. Prints one line per rank: `rank R ok ...` or
`rank R FAILED ...`; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from spmd_engine.config import ParallelConfig
from spmd_engine.distributed import parallel_state as ps


def main() -> int:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    ps.init_distributed_environment(backend="nccl", timeout_s=120)
    world, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(ParallelConfig(tensor_parallel_size=world,
                                                distributed_executor_backend="external_launcher"))
    try:
        tp = ps.get_tp_group()
        device = torch.device("cuda", local_rank)
        problems = []
        if dist.get_backend() != "nccl":
            problems.append(f"default group backend {dist.get_backend()}")
        raw = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(raw)  # the default group: NCCL even at world size 1
        if raw.tolist() != [world * (world + 1) / 2] * 4:
            problems.append(f"default-group all_reduce gave {raw.tolist()}")
        t = torch.full((1024,), float(rank + 1), device=device)
        tp.all_reduce(t)
        if not torch.all(t == world * (world + 1) / 2):
            problems.append(f"tp all_reduce gave {t[:4].tolist()}")
        gathered = tp.all_gather(torch.tensor([rank], device=device), dim=0)
        if gathered.tolist() != list(range(world)) or gathered.device.type != "cuda":
            problems.append(f"tp all_gather gave {gathered.tolist()} on {gathered.device}")
        torch.cuda.synchronize()
        verdict = "ok" if not problems else "FAILED " + "; ".join(problems)
        # One write per line (unbuffered print writes the newline apart: lines would run together).
        sys.stdout.write(f"rank {rank} {verdict} world={world} device={device} backend={dist.get_backend()}\n")
        sys.stdout.flush()
        return 0 if not problems else 1
    finally:
        ps.destroy_distributed_environment()


if __name__ == "__main__":
    sys.exit(main())
