"""The trainer job of a disaggregated RL loop (docs/weight-transfer.md): a plain torchrun
trainer whose rank 0 pushes its weights into a running generator job after every step.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/examples/disaggregated_trainer.py --port 29600 --world 5

The "optimizer step" here is a small seeded change of the bundled model's weights (the
generator prints each step's text and weight version); a real trainer pushes
`model.state_dict().items()`."""

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import spmd_engine
from spmd_engine.distributed.weight_transfer.trainer import trainer_engine

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1", help="this trainer's address the generator reaches")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--world", type=int, required=True, help="1 + every generator rank")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "ipc"])
    args = ap.parse_args()
    dist.init_process_group("gloo")  # the trainer's own world
    rank = dist.get_rank()
    weights = load_file(os.path.join(os.path.dirname(spmd_engine.__file__), "bundled", "model.safetensors"))
    sender = None
    if rank == 0:
        sender = trainer_engine(args.backend).trainer_init(
            {"master_address": args.host, "master_port": args.port, "world_size": args.world, "timeout_s": 120})
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        weights = {k: v + 0.01 * v.abs().mean() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        if sender is not None:
            sent = sender.send_weights(weights.items())
            print(f"step {step}: pushed {sent / 1e6:.1f} MB", flush=True)
        dist.barrier()
    if sender is not None:
        sender.shutdown()
    dist.destroy_process_group()
